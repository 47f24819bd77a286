"""FID while training and the post-hoc EMA chosen by FID (issue 30, parts 3 and 4): train.py
--eval_interval logs fid_ema_RATE / is_ema_RATE without changing the training by a bit, on one
and two ranks, with the digits features and the random-weights Inception on tiny images; an
evaluation cut short by SIGTERM is done once after the resume; bad input is one line and
nothing written; `ckpt.py phema --evaluate` scores reconstructed widths and plots the sweep."""
import csv
import json
import shutil

import numpy as np
import pytest
import torch

import redraw
from conftest import (MPIEXEC, PY, REPO, _run, deep_diff, run_script, train_here,
                      write_class_folder, write_images, write_digits_and_ref)

from improved_diffusion import evaluation, sampling
from improved_diffusion.apps import ckpt_tool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "10", "--noise_schedule", "cosine",
        "--batch_size", "2", "--log_interval", "2", "--sample_steps", "3", "--max_steps", "4",
        "--save_interval", "2"]
FID, IS = "fid_ema_0.9999", "is_ema_0.9999"


@pytest.fixture(scope="module")
def digits_data(tmp_path_factory):
    """The real 8x8 digits as a training folder, and 40 of them as a reference batch."""
    return write_digits_and_ref(tmp_path_factory.mktemp("digits"))


def evals(ref, features="digits", n=8, every=2):
    return ["--eval_interval", str(every), "--eval_ref_batch", str(ref), "--eval_num_samples",
            str(n), "--eval_features", features]


def rows(log):
    with open(log / "progress.csv") as f:
        return list(csv.DictReader(f))


def checkpoint_files(log):
    return sorted(p.name for p in log.iterdir() if p.suffix == ".pt"
                  or p.name.startswith("manifest"))


def differences(a, b):
    """The checkpoint files of two runs: .pt byte for byte, manifests but for their time and
    their record of the run's settings (``run_flags``: one run names the evaluation's flags)."""
    names = checkpoint_files(a)
    assert names == checkpoint_files(b)
    differ = [n for n in names if n.endswith(".pt") and (a / n).read_bytes() != (b / n).read_bytes()]
    differ += [f"{n}{d}" for n in names if n.endswith(".json") for d in deep_diff(
        *({k: v for k, v in json.loads((x / n).read_text()).items() if k != "run_flags"}
          for x in (a, b)))]
    return differ


def offline_fid(ema_file, ref, n=8, steps=3):
    """sample.py's recipe on the EMA file (per-sample seeds, DDIM) scored in this process."""
    model, diffusion, _, _ = sampling.load_for_sampling(
        str(ema_file), {"timestep_respacing": str(steps)}, device=torch.device("cpu"))
    images, _ = sampling.generate(model, diffusion, num_samples=n, batch_size=3,
                                  shape=(3, 8, 8), use_ddim=True, progress=False)
    features = evaluation.digits_features()
    ref_acts = features(np.load(ref)["arr_0"])
    pool, _, logits = features(images)
    fid = evaluation.compute_statistics(pool).frechet_distance(
        evaluation.compute_statistics(ref_acts[0]), method="auto")
    return fid, evaluation.compute_inception_score(logits)


# ------------------------------------------------------------------------ while training


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, digits_data):
    """A one-rank run of 4 steps that logs the digits FID at steps 2 and 4 (saves at 2 and 4),
    started in the reference's folder with `--eval_ref_batch ref.npz` as typed there: (its log
    dir, its output)."""
    data, ref = digits_data
    log = tmp_path_factory.mktemp("eval_run") / "eval"
    out = _run([PY, REPO / "scripts" / "train.py", "--data_dir", data, "--log_dir", log, *TINY,
                *evals(ref.name)], 150, cwd=ref.parent).stdout
    return log, out


@pytest.mark.timeout(180)
def test_a_run_with_evaluations_is_bitwise_the_run_without_them(tmp_path, digits_data, eval_run):
    data, ref = digits_data
    logs = {"plain": tmp_path / "plain", "eval": eval_run[0]}
    run_script("train.py", "--data_dir", data, "--log_dir", logs["plain"], *TINY, timeout=150)
    out = eval_run[1]
    assert not differences(logs["plain"], logs["eval"]), "the evaluation changed the training"
    plain, evaluated = rows(logs["plain"]), rows(logs["eval"])
    assert [r["step"] for r in evaluated] == [r["step"] for r in plain] == ["2", "4"]
    for p, e in zip(plain, evaluated):  # the same losses; the figures in the step's own row
        assert {k: v for k, v in e.items() if k in p} == p
        assert float(e[FID]) > 0 and float(e[IS]) >= 1
    assert "step 4/4  loss" in out and f"{FID} " in out  # the progress line shows them
    records = sorted(p.name for p in (logs["eval"] / "eval").iterdir())
    assert records == ["fid_000002.json", "fid_000004.json"]
    assert (ref.parent / "ref.digits.acts.npz").exists()  # the reference's, computed once


@pytest.mark.timeout(180)
def test_a_flagless_resume_from_elsewhere_finds_the_relative_ref_and_logs_no_evaluation_again(
        tmp_path, digits_data, eval_run):
    """A job killed after logging step 4's figures but before step 4 was saved resumes at step
    2: neither step 2's evaluation (at_resume) nor step 4's (at_step) is done again, and each
    step's figures are in progress.csv once (the killed job's row of step 4 is dropped by the
    resume, the recorded figures go into the resumed job's row).
    Issue 43, item 17: `--eval_ref_batch ref.npz` typed in the reference's folder went into the
    manifests as typed, and a flagless resume from another directory could not find it (the
    resume checks the file before it starts)."""
    data, ref = digits_data
    manifest = json.loads((eval_run[0] / "manifest000002.json").read_text())
    assert manifest["run_flags"]["eval_ref_batch"] == str(ref)
    log, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(eval_run[0], log)
    for name in ("model000004.pt", "ema_0.9999_000004.pt", "opt000004.pt",
                 "manifest000004.json"):
        (log / name).unlink()
    records = {p.name: p.read_bytes() for p in (log / "eval").iterdir()}
    before = rows(log)
    proc = _run([PY, REPO / "scripts" / "train.py", "--data_dir", data, "--log_dir", log], 150,
                cwd=elsewhere, check=False)  # flagless: every flag from the checkpoint
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "resumed at step 2" in out and "evaluation of step" not in out, out[-3000:]
    assert "step 4/4" in out, out[-3000:]  # the run's --max_steps, taken
    assert {p.name: p.read_bytes() for p in (log / "eval").iterdir()} == records
    figures = [(r["step"], r[FID]) for r in rows(log) if r.get(FID)]
    assert figures == [(r["step"], r[FID]) for r in before], rows(log)  # each step's once
    for name in ("model000004.pt", "ema_0.9999_000004.pt", "opt000004.pt"):  # and the
        assert not deep_diff(*(torch.load(d / name, weights_only=True)  # straight run's tensors
                               for d in (eval_run[0], log))), name


@pytest.mark.timeout(240)
def test_sigterm_on_one_of_two_ranks_during_an_evaluation_saves_and_the_resume_logs_it_once(
        tmp_path, digits_data):
    data, ref = digits_data
    log, marker = tmp_path / "log", tmp_path / "sigterm_sent"
    cmd = [MPIEXEC, "-n", "2", PY, REPO / "tests" / "train_eval_preempt.py", "1", marker,
           "--data_dir", data, "--log_dir", log, *TINY, "--save_interval", "4", *evals(ref)]
    first = _run(cmd, 150, check=False)
    assert first.returncode == 75, first.stdout[-3000:]
    assert marker.exists() and "evaluation of step 2: abandoned" in first.stdout
    assert checkpoint_files(log) == ["ema_0.9999_000002.pt", "manifest000002.json",
                                     "model000002.pt", "opt000002.pt"]
    assert FID not in rows(log)[0] and not (log / "eval").exists()  # nothing half-logged
    second = _run(cmd, 150)
    assert "resumed at step 2" in second.stdout
    figures = [(r["step"], bool(r[FID])) for r in rows(log) if r.get(FID)]
    assert figures == [("2", True), ("4", True)], rows(log)  # each step's once
    assert sorted(p.name for p in (log / "eval").iterdir()) == ["fid_000002.json",
                                                                  "fid_000004.json"]
    # the figures of two ranks are those of sample.py's samples of the EMA file, scored here
    fid, score = offline_fid(log / "ema_0.9999_000004.pt", ref)
    last = rows(log)[-1]
    assert abs(float(last[FID]) - fid) <= 1e-6 * fid
    assert abs(float(last[IS]) - score) <= 1e-6 * score


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """A random-weights Inception file in the published layout (test_evaluation.py's)."""
    path = tmp_path_factory.mktemp("weights") / "inception_random.pt"
    torch.save(redraw.inception_state_dict(), path)
    return path


def test_loading_the_inception_draws_nothing_from_torchs_generator(weights_file):
    """The root of issue 37's item 2: the layers' random initialisation (the weights are loaded
    over it) moved torch's global generator, and with it a job's training noise."""
    from improved_diffusion import inception

    torch.manual_seed(5)
    state = torch.get_rng_state()
    inception.check_weights_file(weights_file)
    net = inception.load_inception(weights_file)
    assert torch.equal(torch.get_rng_state(), state)
    tensors = list(net.state_dict().values())
    assert not any(t.is_meta for t in tensors) and not any(p.requires_grad
                                                          for p in net.parameters())


@pytest.mark.timeout(420)
def test_the_inception_evaluation_on_two_ranks_leaves_training_bitwise_and_labels_i_mod_classes(
        tmp_path, weights_file):
    """The users' path (issue 37, item 2), with a loader worker: setting up the Inception drew
    from torch's global generator, so the step-1 noise, and every tensor after, differed from the
    run without it. And sample i of a class-conditional model's evaluation is labelled i %
    num_classes, on any rank and in any batch: the labels (and images) of sample.py --classes
    0,1,2 of the EMA (tests/train_eval_labels.py records what each rank draws)."""
    data = write_class_folder(tmp_path / "data", classes=("ant", "bee", "cat"), per_class=3)
    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), np.uint8))
    logs = {k: tmp_path / k for k in ("plain", "eval")}
    drawn, n = tmp_path / "drawn", 7  # rank 0: [0 2] [4 6], 1: [1 3] [5]
    flags = [*TINY, "--max_steps", "3", "--num_workers", "1",  # trains after an evaluation
             "--class_cond", "True"]
    for name, script, extra in (
            ("plain", REPO / "scripts" / "train.py", []),
            ("eval", REPO / "tests" / "train_eval_labels.py",
             [*evals(ref, "inception", n=n), "--inception_weights", weights_file])):
        _run([MPIEXEC, "-n", "2", PY, script, *([drawn] if name == "eval" else []),
              "--data_dir", data, "--log_dir", logs[name], *flags, *extra], 200)
    assert not differences(logs["plain"], logs["eval"]), "the evaluation changed the training"
    plain, evaluated = rows(logs["plain"]), rows(logs["eval"])
    assert [r["step"] for r in evaluated] == [r["step"] for r in plain] == ["2", "3"]
    for p, e in zip(plain, evaluated):  # the same losses
        assert {k: v for k, v in e.items() if k in p} == p
    row = evaluated[0]
    assert np.isfinite(float(row[FID])) and float(row[IS]) >= 1 and not evaluated[1][FID]
    assert (tmp_path / "ref.acts.npz").exists()
    record = json.loads((logs["eval"] / "eval" / "fid_000002.json").read_text())
    assert record["features"]["weights_sha256"] and record[FID] == float(row[FID])
    # the labels: i % 3 for sample i, whichever rank and batch drew it, as sample.py's
    got = [np.load(drawn / f"rank{r}.npz") for r in range(2)]
    indices = np.concatenate([g["indices"] for g in got])
    order = np.argsort(indices)
    assert indices[order].tolist() == list(range(n))
    labels = np.concatenate([g["labels"] for g in got])[order]
    assert labels.tolist() == [i % 3 for i in range(n)]
    out = tmp_path / "sampled"
    run_script("sample.py", "--model_path", logs["eval"] / "ema_0.9999_000002.pt",
               "--num_samples", n, "--batch_size", 3, "--use_ddim", "True",
               "--timestep_respacing", 3, "--classes", "0,1,2", "--log_dir", out,
               "--progress", "False", timeout=120)
    with np.load(out / f"samples_{n}x8x8x3.npz") as z:
        assert z["arr_1"].tolist() == labels.tolist()
        images = np.concatenate([g["images"] for g in got])[order]
        assert np.abs(z["arr_0"].astype(int) - images).max() <= 1


# ------------------------------------------------------------------------ bad input


def _train_main(script="train.py"):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _bad_batches(d):
    d.mkdir()
    np.savez(d / "float.npz", arr_0=np.zeros((4, 8, 8, 3), np.float32))
    np.savez(d / "gray.npz", arr_0=np.zeros((4, 8, 8, 1), np.uint8))
    np.savez(d / "other.npz", images=np.zeros((4, 8, 8, 3), np.uint8))
    np.savez(d / "one.npz", arr_0=np.zeros((1, 8, 8, 3), np.uint8))
    torch.save({"conv.weight": torch.zeros(3)}, d / "other_keys.pt")
    return d


@pytest.mark.timeout(120)
def test_bad_eval_flags_and_files_are_one_line_before_anything_is_written(
        tmp_path, digits_data, capsys, monkeypatch):
    data, ref = digits_data
    bad = _bad_batches(tmp_path / "bad")
    monkeypatch.delenv("ID_INCEPTION_WEIGHTS", raising=False)
    main = _train_main()
    cases = [
        (["--eval_interval", "2"], 2, "--eval_ref_batch"),
        (evals(ref, n=1), 2, "--eval_num_samples 1"),
        (evals(ref, every=3), 2, "--log_interval"),
        (evals(ref, features="clip"), 2, "--eval_features clip"),
        (evals(tmp_path / "missing.npz"), 1, "missing.npz: no such file"),
        (evals(bad / "float.npz"), 1, "float.npz: arr_0 is float32"),
        (evals(bad / "gray.npz"), 1, "3 channels"),
        (evals(bad / "other.npz"), 1, "other.npz: holds no arr_0"),
        (evals(bad / "one.npz"), 1, "one.npz: holds 1 image"),
        (evals(ref, "inception"), 1, "weights-inception-2015-12-05-6726825d.pth"),
        (evals(ref, "inception") + ["--inception_weights", bad / "other_keys.pt"], 1,
         "other_keys.pt: not the FID Inception weights"),
    ]
    for extra, code, words in cases:
        log = tmp_path / "log"
        capsys.readouterr()
        assert main([str(a) for a in ["--data_dir", data, "--log_dir", log, *TINY, *extra]]) \
            == code, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (extra, err)
        assert not log.exists(), extra  # nothing written
    assert sorted(p.name for p in bad.iterdir()) == ["float.npz", "gray.npz", "one.npz",
                                                     "other.npz", "other_keys.pt"]
    # super_res_train.py takes train.py's flags, but its samples need low-resolution inputs
    capsys.readouterr()
    log = tmp_path / "sr_log"
    assert _train_main("super_res_train.py")(
        [str(a) for a in ["--data_dir", data, "--log_dir", log, "--large_size", 16,
                          "--small_size", 8, *evals(ref)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.py's" in err[0] and "scripts/evaluate.py" in err[0], err
    assert not log.exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [
    # make soak: a missing reference (the same check, train_eval._check_files, run on rank 0 for
    # the job: the Inception weights case here, the file's own words in the one-process test above)
    pytest.param("missing-ref", marks=pytest.mark.slow), "bad-inception-weights"])
def test_bad_eval_files_on_two_ranks_are_one_line_for_the_job(tmp_path, digits_data, case):
    """Issue 37, item 10: each rank checked the files before the ranks met and printed its own
    line; the job's verdict is rank 0's, printed once."""
    _, ref = digits_data
    data = write_images(tmp_path / "data", n=8)
    bad = _bad_batches(tmp_path / "bad")
    extra, words = {
        "missing-ref": (evals(tmp_path / "missing.npz"), "--eval_ref_batch"),
        "bad-inception-weights": (
            evals(ref, "inception") + ["--inception_weights", bad / "other_keys.pt"],
            "other_keys.pt: not the FID Inception weights"),
    }[case]
    proc = _run([MPIEXEC, "-n", "2", PY, REPO / "scripts" / "train.py", "--data_dir", data,
                 "--log_dir", tmp_path / "log", *TINY, *extra], 120, check=False)
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, (extra, proc.stdout[-3000:])
    assert words in errors[0] and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert not [p for p in (tmp_path / "log").glob("*") if p.suffix in (".pt", ".json")]


# ------------------------------------------------------------------------ the post-hoc EMA


@pytest.fixture(scope="module")
def phema_run(tmp_path_factory, digits_data):
    data, _ = digits_data
    log = tmp_path_factory.mktemp("phema") / "run"
    train_here("--data_dir", data, "--log_dir", log, *TINY, "--phema_stds", "0.05,0.1")
    return log


def ckpt(capsys, *args):
    capsys.readouterr()
    code = ckpt_tool.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(180)
def test_phema_evaluate_scores_each_width_names_the_best_and_plots_the_sweep(
        phema_run, digits_data, capsys, tmp_path):
    _, ref = digits_data
    code, out, err = ckpt(capsys, "phema", phema_run, "--std", "0.05,0.07,0.1", "--evaluate",
                          ref, "--num_samples", 8, "--features", "digits", "--sample_steps", 3,
                          "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert [r["std"] for r in rep["table"]] == [0.05, 0.07, 0.1] and rep["step"] == 4
    fids = [r["fid"] for r in rep["table"]]
    assert all(np.isfinite(fids)) and all(r["inception_score"] >= 1 for r in rep["table"])
    assert rep["best"]["std"] == rep["table"][int(np.argmin(fids))]["std"]
    plot = phema_run / "phema_sweep.png"
    assert rep["plot"] == str(plot) and plot.stat().st_size > 1000
    # the table in words, the same figures; --out puts the plot elsewhere
    code, out, err = ckpt(capsys, "phema", phema_run, "--std", "0.05,0.07,0.1", "--evaluate",
                          ref, "--num_samples", 8, "--features", "digits", "--sample_steps", 3,
                          "--out", tmp_path / "sweep")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["std", "FID", "IS"]
    assert [float(line.split()[1]) for line in lines[1:4]] == pytest.approx(fids, rel=1e-5)
    assert f"best: std {rep['best']['std']:.3f}" in out
    assert (tmp_path / "sweep" / "phema_sweep.png").exists()


@pytest.mark.timeout(60)
def test_phema_evaluate_bad_input_is_one_line_and_writes_nothing(phema_run, digits_data,
                                                                 capsys, tmp_path):
    _, ref = digits_data
    bad = _bad_batches(tmp_path / "bad")
    before = sorted(p.name for p in phema_run.iterdir())
    for extra, code, words in [
        (["--evaluate", ref, "--num_samples", 1], 2, "--num_samples 1"),
        (["--evaluate", bad / "float.npz"], 1, "float.npz: arr_0 is float32"),
        (["--evaluate", tmp_path / "missing.npz"], 1, "missing.npz: no such file"),
        (["--num_samples", 8], 2, "--evaluate"),
        (["--evaluate", ref, "--features", "inception", "--inception_weights",
          bad / "other_keys.pt"], 1, "not the FID Inception weights"),
    ]:
        got, out, err = ckpt(capsys, "phema", phema_run, "--std", "0.05", "--features",
                             "digits", *extra)
        assert got == code, (extra, err)
        assert len(err.strip().splitlines()) == 1 and words in err, (extra, err)
    assert sorted(p.name for p in phema_run.iterdir()) == before
