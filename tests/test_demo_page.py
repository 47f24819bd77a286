"""The demo's page (improved_diffusion/demo_page.py) from a fake demo folder: every part the folder
has files for, each image by a path relative to the page that exists, nothing from the network."""
import json
import re
from pathlib import Path
from urllib.parse import unquote

from PIL import Image

from improved_diffusion.demo_page import write_page


def png(path, size=(80, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def fake_demo(root):
    """What scripts/demo.py leaves in --out (data/ with its own PNGs, which the page skips)."""
    png(root / "data" / "3_0001.png", (8, 8))
    png(root / "samples" / "samples_10x8x8x3.png")
    png(root / "samples" / "loss_curve.png", (720, 440))
    for step in (20, 10, 40):
        png(root / "run" / "samples" / f"grid_{step:06d}.png", (64, 8))
    png(root / "guided" / "samples_10x8x8x3.png")
    (root / "summary.txt").write_text(
        "demo finished in 0.3 min\npreemption: SIGTERM at step 21 -> exit code 75; auto-resumed "
        "from step 21 to 40\nlabel agreement:            0.400\n")
    (root / "eval.json").write_text(json.dumps(
        {"num_samples": 10, "mean_confidence": 0.5761, "label_agreement": 0.4,
         "histogram": [0, 1, 0, 1, 1, 0, 0, 1, 6, 0], "fid_real_vs_generated": 10.107,
         "fid_real_halves": 0.106, "fid_real_subset_same_n": 8.762}))
    (root / "settings.json").write_text(json.dumps({"steps": 40, "channel_mult": "1,2"}))
    (root / "guidance.json").write_text(json.dumps([
        {"way": "classifier-free, scale 3", "label_agreement": 0.9, "mean_confidence": 0.85,
         "command": "python scripts/sample.py --guidance_scale 3 <x>"}]))
    return root


def images_of(page):
    return [unquote(src) for src in re.findall(r'<img src="([^"]+)"', page)]


def test_the_page_shows_figures_grids_curve_guidance_and_settings_by_relative_paths(tmp_path):
    out = fake_demo(tmp_path / "demo out")  # a space: paths are quoted
    path = write_page(str(out))
    assert Path(path) == out / "index.html"
    page = Path(path).read_text()
    srcs = images_of(page)
    assert all(not s.startswith(("/", "http")) and (out / s).is_file() for s in srcs), srcs
    assert srcs[:2] == ["samples/samples_10x8x8x3.png", "samples/loss_curve.png"]
    # the grids of the training, in step order, then the other images; none of data/
    assert srcs[2:5] == [f"run/samples/grid_{s:06d}.png" for s in (10, 20, 40)]
    assert srcs[5:] == ["guided/samples_10x8x8x3.png"]
    assert "step 10" in page and "step 40" in page
    assert "SIGTERM at step 21 -&gt; exit code 75" in page  # the preemption, escaped
    for shown in ("0.576", "0.400", "0 1 0 1 1 0 0 1 6 0", "10.107", "8.762",
                  "classifier-free, scale 3", "0.850",
                  "python scripts/sample.py --guidance_scale 3 &lt;x&gt;", "channel_mult"):
        assert shown in page, shown
    # small images are scaled up by a whole factor, the loss curve is left as it is
    assert re.search(r'src="samples/samples_10x8x8x3.png"[^>]* width="320" class="px"', page)
    assert not re.search(r'src="samples/loss_curve.png"[^>]* width=', page)
    # self-contained: no script, nothing fetched
    assert "<script" not in page and "http" not in page
    assert not list(out.glob("*.tmp"))


def test_a_folder_without_guidance_or_training_grids_leaves_those_parts_out(tmp_path):
    out = tmp_path / "out"
    png(out / "samples" / "samples_10x8x8x3.png")
    page = Path(write_page(str(out))).read_text()
    assert images_of(page) == ["samples/samples_10x8x8x3.png"]
    for part in ("Guidance", "Samples while training", "Loss curve", "Figures", "Other images"):
        assert f"<h2>{part}</h2>" not in page
