"""`make demo` at a tiny size, through the same Makefile target and script the real demo uses."""
import ast
import json
import re
import subprocess
from urllib.parse import unquote

import numpy as np
import pytest
from PIL import Image

from conftest import PY, REPO, child_env, hang_s

# Hang guards at several times the measured wall time, and conftest's hang_s multiplies them
# again (issue 29: 120 s, against 47 s on a quiet 2-core machine, turned into errors on a loaded
# one): the tiny demo took 47 s quiet and 68 s on 2 cores shared with three other jobs; a rerun
# on a finished --out, or a refusal, 2 s.
DEMO_TIMEOUT = 300
QUICK_TIMEOUT = 60


def _make_demo(out, *extra, timeout=DEMO_TIMEOUT):
    args = " ".join(["--tiny", "--out", str(out), *extra])
    cmd = ["make", "--no-print-directory", "demo-run", f"PY={PY}", f"DEMO_ARGS={args}"]
    try:
        return subprocess.run(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=hang_s(timeout),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out_text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"make demo-run timed out after {hang_s(timeout)}s (a hang?)\n"
                    f"{out_text[-4000:]}")


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    proc = _make_demo(out)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out, proc.stdout


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
def test_tiny_demo_trains_is_preempted_resumes_samples_and_prints_its_figures(tiny_demo):
    out, text = tiny_demo
    # its stages print with the numbers and names of demo.py's docstring
    doc = ast.get_docstring(ast.parse((REPO / "scripts" / "demo.py").read_text()))
    documented = re.findall(r"^(\d)\. (\w+) ", doc, re.M)
    printed = re.findall(r"^=== \[(\d)/6\] (\w+)", text, re.M)
    assert printed == documented == [(str(i), w) for i, w in enumerate(
        ("data", "train", "sample", "evaluate", "guidance", "summary"), 1)]
    # issue 43, item 5: its own torch threads are its children's (one, the environment's here),
    # and the post-hoc EMA sweep of the evaluate stage prints a line per width as it goes
    assert "torch threads per process: 1 (OMP_NUM_THREADS" in text
    evaluate = text[text.index("=== [4/6]"):text.index("=== [5/6]")]
    assert re.search(r"^  std 0\.\d+: FID \S+, IS \S+$", evaluate, re.M), evaluate
    # preempted with the documented exit code, then auto-resumed by the same command
    assert "[train: exit code 75" in text
    assert "auto-resume: newest complete step" in text
    assert "resumed at step" in text
    assert "[train (resumed): exit code 0" in text
    # samples and grid
    npz = out / "samples" / "samples_10x8x8x3.npz"
    with np.load(npz) as z:
        assert z["arr_0"].shape == (10, 8, 8, 3) and z["arr_0"].dtype == np.uint8
        assert z["arr_1"].tolist() == list(range(10))
    assert (out / "samples" / "samples_10x8x8x3.png").stat().st_size > 0
    # the trainer's own progress line, not tables; no progress-bar redraws in the output
    assert re.search(r"^step 20/40  loss \S+  grad_norm \S+  .*steps/s.*ETA", text, re.M), text
    assert "| loss_q" not in text and "\r" not in text
    # the last lines say where the grid and the loss curve are and what the figures are
    tail = "\n".join(text.strip().splitlines()[-10:])
    assert f"grid:    {out / 'samples' / 'samples_10x8x8x3.png'}" in tail
    curve = out / "samples" / "loss_curve.png"
    assert f"loss:    {curve}" in tail
    with Image.open(curve) as im:
        assert im.size == (720, 440)
    for figure in ("mean classifier confidence:", "label agreement:", "class histogram",
                   "Frechet distance"):
        assert figure in tail
    fig = json.loads((out / "eval.json").read_text())
    assert 0.0 <= fig["mean_confidence"] <= 1.0 and sum(fig["histogram"]) == 10
    # the page to look at: its images are files of the demo folder, by relative path
    page = out / "index.html"
    assert f"page:    {page}" in tail
    srcs = [unquote(s) for s in re.findall(r'<img src="([^"]+)"', page.read_text())]
    assert "samples/samples_10x8x8x3.png" in srcs and "samples/loss_curve.png" in srcs
    assert all((out / s).is_file() for s in srcs), srcs
    assert "SIGTERM at step" in page.read_text()
    # the grids drawn while training (--sample_interval: a quarter of the steps), on the page
    assert [s for s in srcs if s.startswith("run/samples/")] == [
        f"run/samples/grid_{step:06d}.png" for step in (10, 20, 30, 40)]
    # each of them one sample of each of the 10 digits, a column a class, as the page's others
    from improved_diffusion.sampling import grid_image
    size = json.loads((out / "settings.json").read_text())["image_size"]
    with Image.open(out / "run" / "samples" / "grid_000010.png") as im:
        assert im.size[::-1] == grid_image(np.zeros((10, size, size, 3), np.uint8), 10).shape[:2]


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
def test_tiny_demo_scores_real_digits_the_same_way_and_reports_adms_five_metrics(tiny_demo):
    out, text = tiny_demo
    fig = json.loads((out / "eval.json").read_text())
    ref = fig["reference"]  # 10 real digits held out of the reference batch, scored the same way
    with np.load(out / ref["npz"]) as z:
        assert z["arr_0"].shape == (10, 8, 8, 3) and z["arr_0"].dtype == np.uint8
        assert z["arr_1"].tolist() == list(range(10))  # the labels the samples were asked for
    assert ref["label_agreement"] >= 0.7 and ref["mean_confidence"] > fig["mean_confidence"]
    assert sum(ref["histogram"]) == 10 and ref["chance_label_agreement"] == 0.1
    assert ref["fid_floor"] == fig["fid_real_subset_same_n"] and ref["fid_floor_n"] == 10
    adm = fig["adm"]
    with np.load(out / adm["ref_batch"]) as z:
        assert len(z["arr_0"]) == 1797 - 10  # every other real digit
    for who in ("samples", "real"):
        assert set(adm[who]) >= {"fid", "sfid", "inception_score", "precision", "recall"}
        assert adm[who]["num_ref"] == 1787 and adm[who]["num_samples"] == 10
        assert 1.0 <= adm[who]["inception_score"] <= 10.0 and adm[who]["fid"] >= 0
    assert adm["real"]["precision"] == 1.0  # real digits lie inside the real digits' manifold
    assert "--features digits" in text and re.search(r"^  samples +\d+\.\d{3}", text, re.M)
    # the page: what was trained, from the demo's own record, above the figures
    record = json.loads((out / "demo.json").read_text())
    assert record["model"]["parameters"] > 0 and record["seconds"]["train"] > 0
    # each stage's printed time is demo.json's (issue 37, item 15: `[evaluate: 5 s]` was printed
    # before the post-hoc EMA sweep, and demo.json said 495 s), evaluate's after the sweep
    printed = {k: float(v) for k, v in re.findall(r"^\[(\w+) stage: ([\d.]+) s\]$", text, re.M)}
    assert printed == {k: v for k, v in record["seconds"].items() if k != "total"}, printed
    assert text.index("$ python scripts/ckpt.py phema") < text.index("[evaluate stage:")
    assert f"demo finished in {record['seconds']['total'] / 60:.1f} min" in text
    page = (out / "index.html").read_text()
    lead = page[:page.index("<h2>")]
    for said in ("class-conditional UNet", f"{record['model']['parameters'] // 1000} k param",
                 "<b>8x8 px</b>", "40 training steps", "batch 4 x 2 ranks", "10 digits, DDIM 5"):
        assert said in lead, said
    # the reference column and ADM's five figures on the page
    assert "<th>real digits</th>" in page and f"{ref['mean_confidence']:.3f}" in page
    for name in ("FID", "sFID", "Inception Score", "precision", "recall"):
        assert f"<td>{name}</td>" in page
    assert f"{adm['samples']['fid']:.3f}" in page and f"{adm['real']['fid']:.3f}" in page
    # each way's grid in the guidance table (no "Other images"); commands short, $OUT named
    rows = json.loads((out / "guidance.json").read_text())
    guidance = page[page.index("<h2>Guidance</h2>"):page.index("<h2>Loss curve</h2>")]
    guidance = re.sub(r"</?span>", "", guidance)  # the commands' words, each in a <span>
    for r in rows:
        assert (out / r["grid"]).is_file() and f'src="{r["grid"]}"' in guidance, r["way"]
    assert "<h2>Other images</h2>" not in page
    null = next(r for r in rows if r["way"] == "unconditional (null label)")
    assert null["reference_label_agreement"] == 0.1  # chance
    assert "mpiexec -n 2 python scripts/sample.py --model_path $OUT/run/ema_0.9_000040.pt" \
        in guidance and str(REPO) not in guidance


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
def test_tiny_demo_trains_a_noised_classifier_through_a_preemption_and_tables_four_guidances(
        tiny_demo):
    out, text = tiny_demo
    # the classifier: 2 ranks, preempted (exit 75), the same command auto-resumed to its end
    assert "[classifier: exit code 75" in text and "[classifier (resumed): exit code 0" in text
    manifests = sorted(p.name for p in (out / "classifier").glob("manifest*.json"))
    assert manifests[-1] == "manifest000008.json", manifests
    # the diffusion model learnt the null label (classifier-free guidance)
    assert "--class_dropout_prob 0.1" in text
    rows = json.loads((out / "guidance.json").read_text())
    ways = [r["way"] for r in rows]
    assert ways[:4] == ["unguided (class-conditional)", "classifier guidance",
                        "classifier-free guidance", "both"], ways
    by_way = {r["way"]: r for r in rows}
    for r in rows:
        assert 0.0 <= r["label_agreement"] <= 1.0 and 0.0 <= r["mean_confidence"] <= 1.0, r
    assert by_way["unguided (class-conditional)"]["label_agreement"] == json.loads(
        (out / "eval.json").read_text())["label_agreement"]  # stage 3's samples, scored once
    cg, cfg, both = (by_way[w]["command"] for w in ways[1:4])
    assert "classifier_sample.py" in cg and "--classifier_scale 4.0" in cg
    assert "--classifier_path " + str(out / "classifier" / "model000008.pt") in cg
    assert "scripts/sample.py" in cfg and "--guidance_scale 2.0" in cfg
    assert "--classifier_scale 4.0" in both and "--guidance_scale 2.0" in both
    for way, r in list(by_way.items())[1:]:  # each way's own samples, of the same labels
        npz = r["command"].split("--log_dir ")[1].split()[0] + "/samples_10x8x8x3.npz"
        with np.load(npz) as z:
            assert z["arr_1"].tolist() == list(range(10)), way
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^  classifier-free guidance +\d\.\d{3} +\d\.\d{3}$", summary, re.M), summary
    assert "auto-resumed to 8" in summary


@pytest.mark.timeout(QUICK_TIMEOUT + 10)
def test_demo_on_a_finished_out_dir_shows_its_results_and_changes_nothing(tiny_demo):
    out, _ = tiny_demo
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    proc = _make_demo(out, timeout=QUICK_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "already holds a finished demo run" in proc.stdout
    # through make, a new --out is passed in DEMO_ARGS
    assert 'pass --out NEW_DIR (through make: make demo DEMO_ARGS="--out NEW_DIR")' in proc.stdout
    assert "mean classifier confidence:" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.timeout(QUICK_TIMEOUT + 10)
def test_demo_refuses_an_unrelated_non_empty_out_dir(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    proc = _make_demo(tmp_path, timeout=QUICK_TIMEOUT)
    assert proc.returncode != 0
    assert "error: --out" in proc.stdout and "pass a new --out" in proc.stdout
    assert 'make demo DEMO_ARGS="--out NEW_DIR"' in proc.stdout
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_make_demo_installs_no_test_server_and_make_test_installs_azurite(tmp_path):
    """Issue 43, item 6: `make demo` ran `npm install azurite` (the README says it needs nothing
    but Python 3): the test servers are `make test`'s alone. Dry runs of a fresh clone's make."""
    def dry(target):
        proc = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                              env=child_env({"MAKEFLAGS": ""}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=hang_s(30))
        assert proc.returncode == 0, proc.stdout
        return proc.stdout

    assert "npm" not in dry("demo") and "pip install" in dry("demo")
    assert "npm install --no-audit --no-fund --prefix .stores azurite" in dry("test") or (
        REPO / ".stores" / ".installed").exists()
