"""Each guard that ends the writer process with its trainer, alone (issue 43, item 21).

writer_process.py has three: the kernel's SIGKILL as the trainer ends (PR_SET_PDEATHSIG), the
copy of the job's lock descriptor the writer holds (the log dir's lock stays held while the
writer lives), and the check before each file is put in place (the trainer gone: put nothing in
place). Each hides the others' absence in tests/test_writer_process.py, so each test here turns
the others off inside the writer (tests/writer_mechanisms_train.py) and kill -9's the trainer
while its writer writes step 4; each test fails when its own guard is removed.
"""
import os
import signal
import subprocess
import time

import pytest

from conftest import PY, REPO, child_env
from test_writer_process import BOUND_S, TINY, alive, finish, images, state  # noqa: F401
from test_writer_process import wait_for_write_of

from improved_diffusion.ckpt import run_lock

DRIVER = REPO / "tests" / "writer_mechanisms_train.py"


def start(log_dir, images, off):  # noqa: F811 (the fixture's value)
    cmd = [PY, DRIVER, *TINY, "--data_dir", images, "--log_dir", log_dir, "--max_steps", "50"]
    env = child_env({"SLOW_SAVE_S": "0.5", "WRITER_GUARDS_OFF": ",".join(off)})
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_trainer(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=BOUND_S)  # dead and reaped (the writer shares its stdout: not read here)


def wait_gone(writer):
    end = time.monotonic() + BOUND_S
    while alive(writer):
        assert time.monotonic() < end, "the writer process outlived its trainer"
        time.sleep(0.05)


def put_in_place_after(log_dir, at_death):
    return sorted(n for n in set(os.listdir(log_dir)) - at_death if ".tmp" not in n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("guard, off", [("pdeathsig", ["watch", "guard"]),
                                        ("check_before_rename", ["pdeathsig", "watch"])])
def test_one_guard_alone_puts_nothing_in_place_after_the_trainer_was_killed(
        images, tmp_path, guard, off):
    """With the other guards off (``off``), one alone stops the writer from putting step 4's
    files (its manifest at least) in place after its trainer was killed: the kernel's signal
    (pdeathsig), or the check before each file is put in place (the writer goes on writing
    step 4 and ends there)."""
    log_dir = tmp_path / "run"
    proc = start(log_dir, images, off)
    try:
        writer = wait_for_write_of(proc, log_dir, 4)
        kill_trainer(proc)
        at_death = set(os.listdir(log_dir))
    finally:
        finish(proc)
    wait_gone(writer)
    assert not put_in_place_after(log_dir, at_death), put_in_place_after(log_dir, at_death)
    assert "manifest000004.json" not in os.listdir(log_dir)


@pytest.mark.timeout(600)
def test_the_lock_copy_alone_keeps_the_log_dir_locked_while_the_writer_lives(images, tmp_path):
    """No kernel signal, no poll of the parent: the writer, frozen across the kill of its
    trainer (SIGSTOP), outlives it; the log dir's lock stays held as long as it lives."""
    log_dir = tmp_path / "run"
    proc = start(log_dir, images, ["pdeathsig", "watch"])
    writer = None
    try:
        writer = wait_for_write_of(proc, log_dir, 4)
        os.kill(writer, signal.SIGSTOP)
        kill_trainer(proc)
        holder = run_lock.live_holder(log_dir)
        assert state(writer) in ("T", "t")  # alive (stopped) when the lock was looked at
        assert holder is not None, "the log dir's lock is free while its writer lives"
    finally:
        if writer is not None and alive(writer):
            os.kill(writer, signal.SIGCONT)
        finish(proc)
    wait_gone(writer)  # its check before a rename ends it: the trainer is gone
    assert run_lock.live_holder(log_dir) is None  # the copy went with it
