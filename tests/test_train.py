"""The training loop and its resume on 1, 2 and 3 ranks (issue 3), with real mpiexec and torchrun.

Multi-rank runs go through tests/train_dump.py (train.py's loop plus per-rank dumps of the loaded
and final state), so the test can compare every rank's optimizer, model and EMA tensors.
"""
import hashlib
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch as th
from PIL import Image

from conftest import FIXTURES, MPIEXEC, PY, REPO, _run, run_mpi, run_script

DUMP = "../tests/train_dump.py"  # relative to scripts/, as run_script/run_mpi expect

TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1",
]
# The flags of tests/fixtures/upstream_run_small (see tests/fixtures/README.md).
UPSTREAM = [
    "--image_size", "32", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "16", "--learn_sigma", "True", "--diffusion_steps", "100",
    "--noise_schedule", "cosine", "--batch_size", "4",
]


def random_images(folder, n, size, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
            folder / f"img_{i:03d}.png")
    return folder


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assert_tensors_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert th.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_same_on_all_ranks(dumps, what):
    first = dumps[0]
    for r, d in enumerate(dumps[1:], start=1):
        assert_tensors_equal(first["model"], d["model"], f"{what}: model on rank {r}")
        for i, (p, q) in enumerate(zip(first["ema"], d["ema"])):
            assert all(th.equal(x, y) for x, y in zip(p, q)), f"{what}: EMA {i} on rank {r}"
        assert_optimizer_state_equal(first["optimizer"], d["optimizer"], f"{what}: rank {r}")


def assert_optimizer_state_equal(saved, loaded, what):
    assert set(saved["state"]) == set(loaded["state"]), what
    for name, st in saved["state"].items():
        for k, v in st.items():
            assert th.equal(th.as_tensor(v), th.as_tensor(loaded["state"][name][k])), (
                f"{what}: {name}.{k} differs")


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: make soak
def test_resume_on_n_ranks_loads_the_saved_optimizer_state_on_every_rank(tmp_path, ranks):
    """...and on 3 ranks the resumed run ends bitwise equal to a straight one (saved on 3
    ranks; on 2, steps 1-2 are trained by one process, here: what is loaded is what was saved)."""
    data = random_images(tmp_path / "data", 12, 8)
    log = tmp_path / "log"
    common = [*TINY, "--data_dir", data, "--ema_rate", "0.9,0.99"]
    flags = [*common, "--log_dir", log]
    if ranks == 3:
        run_mpi(ranks, DUMP, tmp_path / "first", *flags, "--max_steps", "2", timeout=90)
    else:
        assert train_main(*flags, "--max_steps", "2") == 0
    saved_opt = load(log / "opt000002.pt")
    proc = run_mpi(ranks, DUMP, tmp_path / "dump", *flags, "--max_steps", "3",
                   "--resume_checkpoint", log / "model000002.pt", timeout=90)
    assert "resumed at step 2" in proc.stdout
    loaded = [load(tmp_path / "dump" / f"loaded_rank{r}.pt") for r in range(ranks)]
    for r, d in enumerate(loaded):
        assert d["step"] == 2
        assert_optimizer_state_equal(saved_opt["optimizer"], d["optimizer"], f"rank {r}")
        assert_tensors_equal(load(log / "model000002.pt")["state_dict"], d["model"], f"rank {r}")
    final = [load(tmp_path / "dump" / f"final_rank{r}.pt") for r in range(ranks)]
    assert_same_on_all_ranks(final, "after resumed training")
    assert final[0]["step"] == 3
    assert_tensors_equal(load(log / "model000003.pt")["state_dict"], final[0]["model"], "saved")
    assert load(log / "opt000003.pt")["trainer"]["world_size"] == ranks
    assert (log / "manifest000003.json").exists()
    if ranks == 3:  # (2 ranks: tests/test_resume.py) the sum over 3 ranks depends on DDP's buckets
        straight = tmp_path / "straight"
        run_mpi(ranks, "train.py", *common, "--log_dir", straight, "--max_steps", "3", timeout=90)
        for name in ("model000003.pt", "ema_0.9_000003.pt"):
            assert_tensors_equal(load(straight / name)["state_dict"],
                                 load(log / name)["state_dict"], f"straight vs resumed {name}")


def copy_upstream_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "upstream_run_small", run)
    return run


@pytest.mark.timeout(150)
def test_upstream_run_dir_resumes_on_two_ranks_and_trains_on(tmp_path):
    run = copy_upstream_run(tmp_path)
    before = {p.name: sha(p) for p in run.glob("*.pt")}
    data = random_images(tmp_path / "data", 8, 32)
    proc = run_mpi(2, DUMP, tmp_path / "dump", *UPSTREAM, "--data_dir", data, "--log_dir", run,
                   "--resume_checkpoint", run / "model000010.pt", "--max_steps", "12", timeout=120)
    assert "resumed at step 10" in proc.stdout
    assert {p.name: sha(p) for p in run.glob("*000010.pt")} == before
    for name in ("model000012.pt", "opt000012.pt", "ema_0.9999_000012.pt", "manifest000012.json"):
        assert (run / name).exists(), name
    raw = load(run / "opt000010.pt")
    names = list(load(run / "model000010.pt").keys())
    loaded = [load(tmp_path / "dump" / f"loaded_rank{r}.pt") for r in range(2)]
    for d in loaded:
        assert d["step"] == 10
        for i, name in enumerate(names):  # upstream's index-keyed state, in parameter order
            assert th.equal(raw["state"][i]["exp_avg"], d["optimizer"]["state"][name]["exp_avg"])
    assert_same_on_all_ranks([load(tmp_path / "dump" / f"final_rank{r}.pt") for r in range(2)],
                             "after resume")


@pytest.mark.timeout(150)
def test_opt_file_holding_model_weights_warns_once_and_trains_on_with_fresh_optimizer(tmp_path):
    run = copy_upstream_run(tmp_path)
    shutil.copy(run / "model000010.pt", run / "opt000010.pt")  # the seed bug's file
    data = random_images(tmp_path / "data", 8, 32)
    proc = run_mpi(2, DUMP, tmp_path / "dump", *UPSTREAM, "--data_dir", data, "--log_dir", run,
                   "--resume_checkpoint", run / "model000010.pt", "--max_steps", "11", timeout=120)
    warnings = [line for line in proc.stdout.splitlines() if "with a fresh optimizer" in line]
    assert len(warnings) == 1, proc.stdout
    assert "opt000010.pt" in warnings[0] and "model state dict" in warnings[0]
    for r in range(2):
        assert load(tmp_path / "dump" / f"loaded_rank{r}.pt")["optimizer"]["state"] == {}
    final = [load(tmp_path / "dump" / f"final_rank{r}.pt") for r in range(2)]
    assert final[0]["step"] == 11
    assert_same_on_all_ranks(final, "after fresh-optimizer resume")
    assert (run / "manifest000011.json").exists()


@pytest.mark.timeout(90)
def test_ranks_asked_to_load_different_files_fail_with_a_clear_error_on_every_rank(tmp_path):
    run = copy_upstream_run(tmp_path)
    data = random_images(tmp_path / "data", 4, 32)
    common = [*UPSTREAM, "--data_dir", data, "--log_dir", run]
    script = REPO / "scripts" / "train.py"
    cmd = [MPIEXEC, "-n", "1", PY, script, *common, "--resume_checkpoint", run / "model000010.pt",
           ":", "-n", "1", PY, script, *common,
           "--resume_checkpoint", run / "ema_0.9999_000010.pt"]
    proc = _run(cmd, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout  # the same line on every rank: printed once for the job
    assert all("differs between ranks" in e and "ema_0.9999_000010.pt" in e for e in errors)
    assert "Traceback" not in proc.stdout


# make soak: torchrun's resume on two processes is in make test through test_restarts.py (torchrun
# restarts that resume bitwise) and test_preemption.py's torchrun cases
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_resumes_and_trains_on_two_processes_like_mpiexec(tmp_path):
    data = random_images(tmp_path / "data", 8, 8)
    log = tmp_path / "log"
    flags = [*TINY, "--data_dir", data, "--log_dir", log]
    assert train_main(*flags, "--max_steps", "2") == 0  # saved by one process, here
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = _run([torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()),
                 REPO / "tests" / "train_dump.py", tmp_path / "b", *flags, "--max_steps", "4"],
                timeout=100)
    assert "auto-resume: newest complete step" in proc.stdout and "resumed at step 2" in proc.stdout
    assert "world size 1 -> 2" in proc.stdout
    assert load(log / "opt000004.pt")["trainer"]["world_size"] == 2
    saved = load(log / "opt000002.pt")["optimizer"]
    for r in range(2):
        loaded = load(tmp_path / "b" / f"loaded_rank{r}.pt")["optimizer"]
        assert_optimizer_state_equal(saved, loaded, f"rank {r}")
    assert_same_on_all_ranks([load(tmp_path / "b" / f"final_rank{r}.pt") for r in range(2)],
                             "torchrun")


@pytest.mark.timeout(90)
def test_an_error_on_one_rank_only_ends_the_job_instead_of_hanging(tmp_path):
    data = random_images(tmp_path / "data", 1, 8)
    (data / "img_bad.png").write_bytes(b"not an image")  # whichever rank reads it fails alone
    proc = run_mpi(2, "train.py", *TINY, "--batch_size", "1", "--data_dir", data, "--log_dir",
                   tmp_path / "log", "--max_steps", "5", timeout=75, check=False)
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1 and "img_bad.png" in errors[0], proc.stdout
    assert "aborting all 2 ranks" in proc.stdout


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_single_rank_loss_decreases_on_the_digits(tmp_path):
    sys.path.insert(0, str(REPO))
    from datasets.digits import write_digits_folder

    data = tmp_path / "digits"
    write_digits_folder(str(data), size=8, log=lambda *a: None)
    log = tmp_path / "log"
    run_script("train.py", "--data_dir", data, "--log_dir", log, "--image_size", "8",
               "--num_channels", "32", "--num_res_blocks", "1", "--attention_resolutions", "",
               "--diffusion_steps", "100", "--noise_schedule", "cosine", "--batch_size", "32",
               "--lr", "1e-3", "--log_interval", "1", "--max_steps", "40", timeout=120)
    import csv

    rows = list(csv.DictReader(open(log / "progress.csv")))
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 40
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10]), losses
    assert int(float(rows[-1]["step"])) == 40 and int(float(rows[-1]["samples"])) == 40 * 32


def train_main(*argv):
    """scripts/train.py's main() in this process (no interpreter start-up): the exit code."""
    main = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")["main"]
    return main([str(a) for a in argv])


@pytest.mark.timeout(120)
def test_a_file_name_without_step_and_bad_model_files_are_one_line_errors(tmp_path, capsys):
    data = random_images(tmp_path / "data", 4, 8)
    log = tmp_path / "log"
    flags = [*TINY, "--data_dir", data, "--log_dir"]
    assert train_main(*flags, log, "--max_steps", "2", "--save_interval", "1") == 0
    other = tmp_path / "elsewhere"
    other.mkdir()
    th.save(load(log / "model000001.pt")["state_dict"], other / "trained.pt")  # untagged
    (other / "model000005.pt").write_bytes(np.random.default_rng(0).bytes(1000))
    cases = {
        other / "trained.pt": "cannot read a step number",
        other / "model000005.pt": "model000005.pt",
        log / "opt000001.pt": "not model weights",
        log / "model000001.pt": "newer than the resume step 1",
    }
    for path, message in cases.items():
        out_dir = tmp_path / f"out_{path.name}"
        shutil.copytree(log, out_dir) if path.parent == log else out_dir.mkdir()
        target = out_dir / path.name if path.parent == log else path
        before = sorted(p.name for p in out_dir.iterdir())
        capsys.readouterr()
        code = train_main(*flags, out_dir, "--resume_checkpoint", target, "--max_steps", "3")
        err = capsys.readouterr().err
        assert code == 1, (path, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
        assert sorted(p.name for p in out_dir.iterdir() if p.suffix != ".csv"
                      and p.name != "log.txt") == [b for b in before if not b.endswith(".csv")
                                                   and b != "log.txt"]


@pytest.mark.timeout(60)
def test_no_log_dir_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_LOGDIR", raising=False)
    assert train_main("--data_dir", "x") == 2
    assert capsys.readouterr().err == (
        "error: no log directory: pass --log_dir DIR (or set OPENAI_LOGDIR)\n")


@pytest.mark.timeout(60)
def test_a_folder_with_more_classes_than_num_classes_is_a_one_line_error(tmp_path, capsys):
    data = tmp_path / "data"
    for label in ("0", "1", "2"):  # 2 files a class (1 each: every file its own class, refused)
        random_images(data / label, 2, 8)
        for i in range(2):
            (data / label / f"img_{i:03d}.png").rename(data / f"{label}_{i:03d}.png")
    code = train_main(*TINY, "--data_dir", data, "--log_dir", tmp_path / "log",
                      "--class_cond", "True", "--num_classes", "2", "--max_steps", "1")
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.splitlines()) == 1 and "--num_classes" in err, err


def _tree_digest(folder):
    """{relative path: sha256} of every file below `folder` (logs excluded: runs append to them)."""
    return {str(p.relative_to(folder)): sha(p) for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name not in ("log.txt", "progress.csv")}


# make soak: the corpus's one-line errors are in make test through load_file (test_checkpoint.py)
# and the doctor (test_ckpt_tool.py); through train.py by the damaged-step resume (test_resume.py)
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_bad_file_corpus_as_resume_checkpoint_is_one_line_and_only_the_opt_slot_falls_back(
        tmp_path, capsys):
    from test_ckpt_tool import bad_corpus

    marker = tmp_path / "MARKER"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    files = bad_corpus(corpus, marker)
    data = random_images(tmp_path / "data", 4, 8)
    log = tmp_path / "log"
    flags = [*TINY, "--data_dir", data]
    assert train_main(*flags, "--log_dir", log, "--max_steps", "1", "--save_interval", "1") == 0
    before = _tree_digest(corpus)

    # model slot: every bad file ends the run with one line naming it; nothing is written
    for path, expect in files.items():
        out = tmp_path / f"model_slot_{path.name}"
        capsys.readouterr()
        code = train_main(*flags, "--log_dir", out, "--resume_checkpoint", path,
                          "--max_steps", "2")
        err = capsys.readouterr().err
        assert code == 1, (path.name, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert path.name in err, err
        assert not any(out.glob("*.pt")), path.name

    # opt slot: the same files as opt000001.pt beside a good model -> one warning, fresh optimizer
    for path in files:
        if not path.is_file():
            continue
        run = tmp_path / f"opt_slot_{path.name}"
        shutil.copytree(log, run)
        shutil.copyfile(path, run / "opt000001.pt")
        capsys.readouterr()
        code = train_main(*flags, "--log_dir", run, "--resume_checkpoint", run / "model000001.pt",
                          "--max_steps", "2")
        out = capsys.readouterr().out
        assert code == 0, (path.name, out[-2000:])
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1, (path.name, out[-2000:])
        assert "opt000001.pt" in warnings[0] and "fresh optimizer" in warnings[0], warnings
        assert "opt: fresh optimizer" in out
        assert (run / "model000002.pt").exists()

    assert not marker.exists()
    assert _tree_digest(corpus) == before


def _rewrite_in_step(run, name, obj):
    """Replace `name` in a step of `run` by `obj`, tagged as it was, and update the manifest so
    the step still verifies (the file is well formed on disk; only its content is wrong)."""
    import json
    import zlib

    th.save(obj, run / name)
    manifest = next(run.glob("manifest*.json"))
    doc = json.loads(manifest.read_text())
    data = (run / name).read_bytes()
    doc["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    manifest.write_text(json.dumps(doc, indent=1) + "\n")


# make soak: test_opt_file_holding_model_weights_warns_once... keeps the fallback through train.py,
# test_optim_state.py the malformed payloads' validation
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_malformed_optimizer_payload_warns_once_and_training_finishes_with_a_fresh_optimizer(
        tmp_path, capsys):
    from improved_diffusion.ckpt.optim_state import validate_optimizer_payload

    data = random_images(tmp_path / "data", 4, 8)
    log = tmp_path / "log"
    flags = [*TINY, "--data_dir", data]
    assert train_main(*flags, "--log_dir", log, "--max_steps", "1", "--save_interval", "1") == 0
    first = next(iter(load(log / "opt000001.pt")["optimizer"]["state"]))

    def drop_exp_avg_sq(opt):
        del opt["state"][first]["exp_avg_sq"]

    def one_beta(opt):
        opt["param_groups"][0]["betas"] = (0.9,)

    cases = {drop_exp_avg_sq: "has no 'exp_avg_sq'", one_beta: "not two numbers"}
    for mutate, fault in cases.items():
        run = tmp_path / mutate.__name__
        shutil.copytree(log, run)
        tagged = load(run / "opt000001.pt")
        assert tagged["schema"] == "improved_diffusion.checkpoint" and tagged["kind"] == "opt"
        mutate(tagged["optimizer"])
        _rewrite_in_step(run, "opt000001.pt", tagged)
        capsys.readouterr()
        code = train_main(*flags, "--log_dir", run, "--resume_checkpoint", run / "model000001.pt",
                          "--max_steps", "2", "--save_interval", "1")
        captured = capsys.readouterr()
        out = captured.out
        assert code == 0, (mutate.__name__, captured.err, out[-2000:])
        assert "Traceback" not in out + captured.err
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1, (mutate.__name__, out[-2000:])
        assert "opt000001.pt holds malformed optimizer state" in warnings[0], warnings
        assert fault in warnings[0] and "fresh optimizer" in warnings[0], warnings
        assert "opt: fresh optimizer" in out
        # the fresh optimizer took step 2 only; its saved state is well formed
        saved = load(run / "opt000002.pt")["optimizer"]
        assert validate_optimizer_payload(saved) is None
        assert {float(s["step"]) for s in saved["state"].values()} == {1.0}
        assert (run / "manifest000002.json").exists()
