"""The demo's page (improved_diffusion/apps/demo_page.py) from a fake demo folder: every part the folder
has files for, each image by a path relative to the page that exists, nothing from the network."""
import json
import re
from pathlib import Path
from urllib.parse import unquote

from PIL import Image

from improved_diffusion.apps.demo_page import write_page


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


def fake_demo_with_records(root, repo="/opt/repo"):
    """fake_demo plus what the demo now records: demo.json (what was trained, times, programs),
    eval.json's reference and ADM's figures, guidance rows with their grid and reference."""
    fake_demo(root)
    (root / "demo.json").write_text(json.dumps({
        "data": {"name": "scikit-learn's handwritten digits", "images": 1797, "classes": 10,
                 "source_px": 8, "image_size": 16},
        "model": {"kind": "UNet", "class_cond": True, "parameters": 412345, "num_channels": 32,
                  "channel_mult": "1,2,2", "num_res_blocks": 1, "diffusion_steps": 200,
                  "noise_schedule": "cosine", "ema_rate": "0.995"},
        "training": {"steps": 1000, "batch_size": 32, "ranks": 2,
                     "command": f"/opt/venv/bin/mpiexec -n 2 /opt/venv/bin/python3.11 "
                                f"{repo}/scripts/train.py --data_dir {root}/data --log_dir "
                                f"{root}/run --max_steps 1000",
                     "preemption": {"preempted": True, "preempted_at": 500, "preempt_exit": 75}},
        "sampling": {"num_samples": 100, "sample_steps": "25"},
        "seconds": {"train": 252.0, "total": 371.0},
        "programs": {"repo": repo, "python": "/opt/venv/bin/python3.11",
                     "mpiexec": "/opt/venv/bin/mpiexec"}}))
    fig = json.loads((root / "eval.json").read_text())
    fig["reference"] = {"num_samples": 10, "mean_confidence": 0.9871, "label_agreement": 0.97,
                        "histogram": [1] * 10, "fid_floor": 8.762, "fid_floor_n": 10,
                        "chance_label_agreement": 0.1}
    fig["adm"] = {"samples": {"fid": 12.345, "sfid": 23.456, "inception_score": 4.567,
                              "precision": 0.612, "recall": 0.534, "num_ref": 1787,
                              "num_samples": 10},
                  "real": {"fid": 1.234, "sfid": 2.345, "inception_score": 9.123,
                           "precision": 0.955, "recall": 0.944, "num_ref": 1787,
                           "num_samples": 10},
                  "ref_batch": "eval/ref_digits.npz"}
    (root / "eval.json").write_text(json.dumps(fig))
    out = str(root)
    (root / "guidance.json").write_text(json.dumps([
        {"way": "unguided (class-conditional)", "label_agreement": 0.4, "mean_confidence": 0.5,
         "grid": "samples/samples_10x8x8x3.png", "reference_label_agreement": 0.97,
         "reference_what": "real digits",
         "command": f"/opt/venv/bin/mpiexec -n 2 /opt/venv/bin/python3.11 {repo}/scripts/sample.py"
                    f" --model_path {out}/run/ema_0.995_001000.pt --log_dir {out}/samples"},
        {"way": "unconditional (null label)", "label_agreement": 0.1234, "mean_confidence": 0.6,
         "grid": "guided/samples_10x8x8x3.png", "reference_label_agreement": 0.1,
         "reference_what": "chance (1 / classes)",
         "command": f"/opt/venv/bin/python3.11 {repo}/scripts/sample.py --guidance_scale 0"}]))
    return root


def images_of(page):
    return [unquote(src) for src in re.findall(r'<img src="([^"]+)"', page)]


def test_the_page_shows_figures_grids_curve_guidance_and_settings_by_relative_paths(tmp_path):
    out = fake_demo(tmp_path / "demo out")  # a space: paths are quoted
    path = write_page(str(out))
    assert Path(path) == out / "index.html"
    page = Path(path).read_text()
    srcs = images_of(page)
    page = re.sub(r"</?span>", "", page)  # the commands' words, each in a <span>
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


def test_the_page_says_what_was_trained_above_the_figures_from_the_demos_own_record(tmp_path):
    out = fake_demo_with_records(tmp_path / "out")
    page = Path(write_page(str(out))).read_text()
    lead = page[:page.index("<h2>")]  # above the first section: what a reader sees first
    for said in ("class-conditional UNet", "412 k parameters", "handwritten digits",
                 "1797 real digits", "8x8 px upscaled to <b>16x16 px</b>",
                 "1000 training steps", "batch 32 x 2 ranks", "200-step cosine", "4.2 min",
                 "100 digits, DDIM 25 steps", "6.2 min"):
        assert said in lead, said
    # the sample grid and the figures come before anything else
    assert page.index("samples/samples_10x8x8x3.png") < page.index("<h2>Figures</h2>") \
        < page.index("<h2>Guidance</h2>")


def test_the_figures_stand_beside_the_real_digits_reference_and_adms_five_metrics(tmp_path):
    out = fake_demo_with_records(tmp_path / "out")
    page = Path(write_page(str(out))).read_text()
    figures = page[page.index("<h2>Figures</h2>"):page.index("<h2>ADM")]
    assert "<th>real digits</th>" in figures
    row = lambda name: re.search(  # noqa: E731
        rf"<td>{re.escape(name)}[^<]*</td><td class=\"num\">([^<]*)</td><td class=\"num\">"
        rf"([^<]*)</td>", figures).groups()
    assert row("mean classifier confidence") == ("0.576", "0.987")
    assert row("label agreement") == ("0.400", "0.970")
    assert row("Frechet distance") == ("10.107", "8.762")  # the floor for 10 samples
    assert "the floor for 10 samples" in figures and "0.100 (1 in 10 classes)" in figures
    assert "10 of the training images, held out" in figures
    adm = page[page.index("<h2>ADM"):page.index("<h2>Guidance</h2>")]
    for name, mine, real in (("FID", "12.345", "1.234"), ("sFID", "23.456", "2.345"),
                             ("Inception Score", "4.567", "9.123"),
                             ("precision", "0.612", "0.955"), ("recall", "0.534", "0.944")):
        assert re.search(rf"<td>{name}</td><td class=\"num\">{mine}</td><td class=\"num\">"
                         rf"{real}</td>", adm), name
    assert "--features digits" in adm and "1787 real digits" in adm


def test_guidance_grids_sit_in_their_rows_and_commands_are_short(tmp_path):
    out = fake_demo_with_records(tmp_path / "out", repo=str(tmp_path))  # --out in the repo
    page = Path(write_page(str(out))).read_text()
    guidance = page[page.index("<h2>Guidance</h2>"):page.index("<h2>Loss curve</h2>")]
    guidance = re.sub(r"</?span>", "", guidance)  # the commands' words, each in a <span>
    # each way's grid in its own row, beside its figures and reference (chance for the null)
    rows = guidance.split("<tr>")[2:]
    assert "unguided" in rows[0] and 'src="samples/samples_10x8x8x3.png"' in rows[0]
    assert "0.970" in rows[0]
    null = next(r for r in rows if "null label" in r)
    assert 'src="guided/samples_10x8x8x3.png"' in null and "0.100" in null and "chance" in null
    assert "<h2>Other images</h2>" not in page  # every image has its place
    # the commands as typed in the repository: relative, the demo folder relative to it
    assert ("mpiexec -n 2 python scripts/sample.py --model_path out/run/ema_0.995_001000.pt "
            "--log_dir out/samples") in guidance
    assert str(tmp_path) not in guidance and "/opt/venv" not in guidance
    # a demo folder outside the repository: $OUT, said once
    page = Path(write_page(str(fake_demo_with_records(tmp_path / "elsewhere")))).read_text()
    page = re.sub(r"</?span>", "", page)
    assert "--model_path $OUT/run/ema_0.995_001000.pt" in page
    assert f"<code>$OUT</code> is <code>{tmp_path / 'elsewhere'}</code>" in page


def test_fid_while_training_and_the_post_hoc_ema_sweep_stand_with_the_curve(tmp_path):
    repo = "/opt/repo"
    out = fake_demo_with_records(tmp_path / "out", repo)
    for step, fid in ((10, 40.5), (20, 31.25)):
        path = out / "run" / "eval" / f"fid_{step:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": step, "fid_ema_0.9": fid, "is_ema_0.9": 2.5}))
    png(out / "eval" / "phema_sweep.png", (600, 400))
    (out / "phema_sweep.json").write_text(json.dumps({
        "step": 40, "plot": "eval/phema_sweep.png",
        "table": [{"std": 0.05, "fid": 30.125, "inception_score": 2.4},
                  {"std": 0.1, "fid": 28.5, "inception_score": 2.6}],
        "best": {"std": 0.1, "fid": 28.5},
        "command": ["python", f"{repo}/scripts/ckpt.py", "phema", f"{out}/run", "--evaluate",
                    f"{out}/eval/ref_digits.npz", "--features", "digits"]}))
    page = Path(write_page(str(out))).read_text()
    assert "<h2>FID while training and the post-hoc EMA</h2>" in page
    assert images_of(page).count("eval/phema_sweep.png") == 1  # not again under other images
    section = page[page.index("FID while training and"):page.index("<h2>Guidance</h2>")]
    for text in ("31.25", "40.50", "0.100 (best)", "28.50", "Post-hoc EMA by FID (step 40)",
                 "python scripts/ckpt.py phema $OUT/run --evaluate $OUT/eval/ref_digits.npz"):
        assert text in section, text


def test_the_page_shows_the_training_command_and_links_each_image_to_its_file(tmp_path):
    """Issue 43, item 7: the page showed the sampling commands but not the training one, and
    no image linked to its file."""
    out = fake_demo_with_records(tmp_path / "out")
    page = Path(write_page(str(out))).read_text()
    lead = re.sub(r"</?span>", "", page[:page.index("<h2>")])
    assert (f"mpiexec -n 2 python scripts/train.py --data_dir $OUT/data --log_dir $OUT/run "
            f"--max_steps 1000") in lead, lead
    assert f"<code>$OUT</code> is <code>{out}</code>" in lead
    srcs = images_of(page)
    hrefs = [unquote(h) for h in re.findall(r'<a href="([^"]+)"><img ', page)]
    assert srcs and hrefs == srcs, (hrefs, srcs)
    captioned = [unquote(h) for h in re.findall(r'<a href="([^"]+)"><code>', page)]
    assert "samples/samples_10x8x8x3.png" in captioned and set(captioned) <= set(srcs)
    assert all((out / h).is_file() for h in hrefs)


def test_a_command_without_programs_names_the_demo_folder_relative_to_the_repository():
    """The evaluate command of the page is made without the demo's programs: its default
    repository is the checkout's root (the module lies in improved_diffusion/apps/)."""
    from improved_diffusion.apps.demo_page import short_command

    repo = Path(__file__).resolve().parent.parent
    cmd, used_out = short_command(f"python scripts/evaluate.py {repo}/demo_out/ref.npz",
                                  repo / "demo_out")
    assert (cmd, used_out) == ("python scripts/evaluate.py demo_out/ref.npz", False)


def test_the_summary_wraps_its_long_lines_at_the_pages_width(tmp_path):
    """summary.txt's lines (paths, commands) are longer than a page is wide: its block wraps
    them (white-space: pre-wrap) instead of cutting them off at the page's edge."""
    root = fake_demo(tmp_path / "demo")
    long_line = "page:    " + "/a/rather/long/path" * 20 + "/index.html"
    (root / "summary.txt").write_text(f"demo finished in 0.3 min\n{long_line}\n")
    html = Path(write_page(str(root))).read_text()
    block = re.search(r'<h2>Summary</h2><pre class="([^"]*)">(.*?)</pre>', html, re.S)
    assert block and long_line in block.group(2)
    rules = {sel.strip(): body for sel, body in re.findall(r"([^{}]+)\{([^}]*)\}", html)}
    wrap = [body for sel, body in rules.items() if sel == f"pre.{block.group(1)}"]
    assert wrap and "white-space: pre-wrap" in wrap[0] and "overflow-wrap: anywhere" in wrap[0]
