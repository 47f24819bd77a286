"""The doctor (scripts/ckpt.py) and train.py agree on a run dir (issue 43, items 9 and 12).

`ckpt.py prune RUN --keep K` keeps the newest K *resumable* steps, checked as the resume checks
its candidate (checksums), so it never deletes the step a resume would take: with a flipped byte
in the newest step (a model file, or a .distcp shard of a sharded step) the good step stays and
train.py resumes it. It refuses a run dir that a live job holds (its lock), touching nothing: the
job's save in progress finishes. `ckpt.py verify` says what train.py does with the run dir, by the
resume plan's own decision (run_dir.choose_step): with every manifest garbled both refuse.
ckpt.py runs as its main() in the test's process (the same lines and exit codes, without an
interpreter's start-up), as does the train.py run the tests start from; the train.py that must
agree with the doctor runs as a job.
"""
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import PY, REPO, child_env, resumed_step, run_script, train_here, write_images
from test_sharded_layout import _flip, copy_run, driver, saved  # noqa: F401 (a fixture)
from test_train_eval import ckpt

from improved_diffusion.ckpt import run_dir

TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
        "--batch_size", "2", "--log_interval", "100", "--num_workers", "0"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("doctor") / "img", n=8)


@pytest.fixture(scope="module")
def trained(images, tmp_path_factory):
    """A 1-rank run of 4 steps saved at 2 and 4."""
    d = tmp_path_factory.mktemp("trained") / "run"
    train_here("--data_dir", images, "--log_dir", d, *TINY, "--max_steps", "4",
               "--save_interval", "2")
    return d


def step_names(d, step):
    return sorted(n for n in os.listdir(d) if f"{step:06d}" in n)


def doctor(capsys, *args):
    """scripts/ckpt.py's main() in this process (no interpreter start-up): (exit code, its
    output, stdout then stderr)."""
    code, out, err = ckpt(capsys, *args)
    return code, out + err


@pytest.mark.timeout(600)
def test_prune_keeps_the_step_a_resume_takes_when_the_newest_step_has_a_flipped_byte(
        images, trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    _flip(run / "model000004.pt")
    code, out = doctor(capsys, "verify", run)
    assert code == 1 and "resume: step 2" in out, out
    good = step_names(run, 2)
    code, out = doctor(capsys, "prune", run, "--keep", "1")
    assert code == 0 and step_names(run, 2) == good, out  # the step a resume takes: kept
    assert "manifest000004.json" in os.listdir(run)  # the damaged one is not pruned either
    proc = run_script("train.py", "--data_dir", images, "--log_dir", run, "--max_steps", "5",
                      timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "skipping step 4" in proc.stdout and resumed_step(proc.stdout) == 2, \
        proc.stdout[-4000:]
    assert "manifest000005.json" in os.listdir(run)


@pytest.mark.timeout(600)
def test_prune_keeps_a_good_sharded_step_when_the_newest_has_a_flipped_shard_byte(
        saved, tmp_path, capsys):  # noqa: F811 (the fixture)
    log = copy_run(saved, tmp_path)
    _flip(log / "step000002.dcp" / "__1_0.distcp")
    code, out = doctor(capsys, "prune", log, "--keep", "1")
    assert code == 0, out
    assert sorted(os.listdir(log)) == ["manifest000001.json", "manifest000002.json",
                                       "step000001.dcp", "step000002.dcp"]
    plan = run_dir.plan_resume(log, "")
    assert plan.step == 1 and plan.layout == "sharded"
    out = driver(1, "load", "--log_dir", log, "--step", "1", "--ref", saved)  # kept: it loads
    assert "LOAD OK world 1" in out.stdout


BOUND_S = 300  # how long the test waits for the job to reach its save (a hang fails)


@pytest.mark.timeout(900)
def test_prune_refuses_a_run_dir_that_a_live_job_holds_and_its_save_in_progress_finishes(
        images, tmp_path, capsys):
    """A job held inside its save of step 4 (tests/slow_save_train.py: each of step 4's file
    writes pauses mid-file, its temp file in the log dir): `ckpt.py prune --keep 1` refuses in
    one line naming the job, deletes nothing (the temp file stays), and the job completes step 4."""
    run = tmp_path / "run"
    cmd = [PY, REPO / "tests" / "slow_save_train.py", "--data_dir", images, "--log_dir", run,
           *TINY, "--max_steps", "4", "--save_interval", "2", "--async_save", "False"]
    slow = {"SLOW_SAVE_S": "3", "SLOW_SAVE_STEP": "4"}  # step 2's save at full speed
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(slow),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + BOUND_S
        while not [n for n in (os.listdir(run) if run.exists() else ())
                   if "000004" in n and ".tmp-" in n]:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < end, "step 4's save never began"
            time.sleep(0.02)
        before = set(os.listdir(run))
        code, pruned = doctor(capsys, "prune", run, "--keep", "1")
        after = set(os.listdir(run))
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    errors = [ln for ln in pruned.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1, pruned
    assert f"pid {proc.pid}" in errors[0] and "nothing was pruned" in errors[0], errors[0]
    assert not {n for n in before - after if "000004" in n or "000002" in n}, before - after
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert [st.step for st in run_dir.list_steps(run, verify_checksums=True)
            if st.complete] == [4, 2]


@pytest.mark.timeout(600)
def test_verify_and_train_py_both_refuse_a_run_dir_whose_every_manifest_is_garbled(
        images, trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for step in (2, 4):
        (run / f"manifest{step:06d}.json").write_text('{"step": ')
    code, out = doctor(capsys, "verify", run)
    assert code == 1, out
    said = next(ln for ln in out.splitlines() if ln.startswith("resume:"))
    assert "train.py refuses to start" in said and "none can be resumed" in said, said
    assert "from scratch" not in out
    trained_again = run_script("train.py", "--data_dir", images, "--log_dir", run,
                               "--max_steps", "6", timeout=300, check=False)
    errors = [ln for ln in trained_again.stdout.splitlines() if ln.startswith("error:")]
    assert trained_again.returncode == 1 and len(errors) == 1, trained_again.stdout[-4000:]
    assert "none can be resumed" in errors[0]
    # the same decision, worded once: verify quotes train.py's line
    assert errors[0][len("error: "):] in said, (errors[0], said)
    assert sorted(os.listdir(run)) == sorted(os.listdir(trained))  # neither changed anything
