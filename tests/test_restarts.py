"""torchrun's own restarts (issue 19, point 2): ``torchrun --nproc_per_node 2 --max_restarts N``
with a worker killed (``kill -9``) mid-run, again and again in one job.

Each time, torchrun stops the other worker and starts both again: the new workers must form
their process group (not read the dead attempt's rendezvous keys: dist_util's per-restart
store prefix), take the log dir's lock (the dead attempt's lock must not block them) and
auto-resume the newest complete step. The job then ends at --max_steps with files equal bit for
bit to those of a straight run. benchmarks/torchrun_restarts.py runs the same with 10 kills per
rendezvous backend and prints how many restarts worked.
"""
import re

import pytest
import torch

import cluster_sim as cs
from conftest import deep_diff, hang_s, run_mpi, write_images

MAX_STEPS = 20  # two kills, each after a step of its own attempt (the soak: 10 kills, 100)
RATES = "0.9999"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


def train_args(images, log_dir, max_steps=MAX_STEPS):
    return [*cs.TINY, "--seed", "0", "--data_dir", images, "--log_dir", log_dir,
            "--save_interval", "2", "--max_steps", max_steps, "--dist_timeout", "30"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, images):
    """The log dir of a straight 2-rank run to MAX_STEPS."""
    d = tmp_path_factory.mktemp("straight") / "run"
    run_mpi(2, "train.py", *map(str, train_args(images, d)), timeout=180)
    return d


def step_files(step, rates=RATES):
    return [f"model{step:06d}.pt", f"opt{step:06d}.pt",
            *(f"ema_{r}_{step:06d}.pt" for r in rates.split(","))]


def differences(a, b, step):
    """Where the files of ``step`` in log dirs ``a`` and ``b`` differ (content, not bytes: the
    files hold times)."""
    out = []
    for name in step_files(step):
        load = lambda d: torch.load(d / name, weights_only=True, map_location="cpu")  # noqa: E731
        out += [f"{name}{p}" for p in deep_diff(load(a), load(b))]
    return out


def run_with_kills(images, work, rdzv, kills, max_steps=MAX_STEPS, timeout=120):
    """A torchrun job of 2 workers with ``kills`` restarts allowed, a worker killed ``kills``
    times (cluster_sim.kill_workers_repeatedly); returns (exit code, kill records, output)."""
    log_dir = work / "run"
    cmd = cs.torchrun_one_node(train_args(images, log_dir, max_steps), rdzv,
                               max_restarts=kills)
    proc = cs.start(cmd, work / "torchrun.out", env={"FAULT_PID_DIR": str(work / "pids")})
    try:
        records = cs.kill_workers_repeatedly(proc, log_dir, work / "pids", kills,
                                             timeout=hang_s(timeout))
        cs.wait_exit(proc, hang_s(timeout))
    finally:
        cs.kill9(cs.process_tree(proc.pid))
    return proc.returncode, records, (work / "torchrun.out").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rdzv,kills", [("standalone", 2),
                                        pytest.param("c10d", 1, marks=pytest.mark.slow)])
def test_workers_killed_mid_run_restart_resume_and_end_bitwise_like_a_straight_run(
        tmp_path, images, straight, rdzv, kills):
    rc, records, out = run_with_kills(images, tmp_path, rdzv, kills)
    assert rc == 0, f"exit {rc} after kills {records}:\n{out[-4000:]}"
    assert len(records) == kills
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", out)]
    assert len(resumed) == kills and all(s > 0 for s in resumed), (resumed, out[-4000:])
    assert "connectFullMesh" not in out and "Connection refused" not in out, out[-4000:]
    log_dir = tmp_path / "run"
    assert cs.step_problems(log_dir, MAX_STEPS) == []
    assert not differences(straight, log_dir, MAX_STEPS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rdzv", ["standalone", "c10d", "static"])
def test_ten_kills_in_one_torchrun_job_each_restart_resumes_and_the_end_is_bitwise(
        tmp_path, images, rdzv):
    rc, records, out = run_with_kills(images, tmp_path, rdzv, 10, max_steps=100)
    assert rc == 0 and len(records) == 10, f"exit {rc} after kills {records}:\n{out[-4000:]}"
    straight_dir = tmp_path / "straight"
    run_mpi(2, "train.py", *map(str, train_args(images, straight_dir, 100)), timeout=300)
    assert len(re.findall(r"resumed at step (\d+)", out)) == 10, out[-4000:]
    assert not differences(straight_dir, tmp_path / "run", 100)
