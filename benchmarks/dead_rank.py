"""Seconds from `kill -9` (or SIGSTOP) of one rank to the end of the job, one JSON line per figure.

    python benchmarks/dead_rank.py [--dist_timeout 20] [--repeats 1]

Figures (tiny model of tests/test_train.py, CPU/gloo, training with a save every 2 steps; the
rank is killed once two steps are complete on disk):

* ``mpiexec_one_host_kill9``: `mpiexec -n 2` on this host, rank 1 killed; the job ends when mpiexec
  exits (the launcher itself ends the other rank).
* ``torchrun_two_nodes_kill9``: two `torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d`
  launchers ("two hosts" on one machine); node 1 (its launcher and its worker) killed; the job ends
  when node 0's launcher exits, after its rank names the lost rank (heartbeat, dist_util).
* ``torchrun_two_nodes_sigstop``: the same with node 1 frozen (SIGSTOP) instead: no socket closes,
  as when a host loses power or network; the collective fails after --dist_timeout.

Each line also says whether the newest complete step on disk matched its manifest afterwards.
"""
import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import cluster_sim as cs  # noqa: E402

COMMAND = "python benchmarks/dead_rank.py"


def train_args(work):
    return [*cs.TINY, "--data_dir", cs.random_images(work / "data"), "--log_dir", work / "log",
            "--save_interval", "2", "--max_steps", "100000"]


def wait_two_saves(work, procs):
    cs.wait_until(lambda: len(cs.complete_steps(work / "log")) >= 2, 300, procs, "two saves")


def intact(work):
    steps = cs.complete_steps(work / "log")
    return bool(steps) and cs.step_problems(work / "log", steps[-1]) == []


def mpiexec_one_host(work, dist_timeout):
    job = cs.mpiexec(2, train_args(work), work, dist_timeout,
                     env={"FAULT_PID_DIR": str(work / "pids")})
    try:
        wait_two_saves(work, (job,))
        pid = cs.rank_pids(work / "pids", 2)[1]
        t0 = time.monotonic()
        cs.kill9([pid])
        job.wait(max(600, 3 * dist_timeout))
        return time.monotonic() - t0
    finally:
        cs.kill9(cs.process_tree(job.pid))


def torchrun_two_nodes(work, dist_timeout, sig=signal.SIGKILL):
    n0, n1 = cs.two_node_torchrun(train_args(work), work, dist_timeout,
                                  env={"FAULT_PID_DIR": str(work / "pids")})
    try:
        wait_two_saves(work, (n0, n1))
        tree = cs.process_tree(n1.pid)
        t0 = time.monotonic()
        cs.signal_all(tree, sig)
        n0.wait(max(600, 3 * dist_timeout))
        return time.monotonic() - t0
    finally:
        cs.kill9(cs.process_tree(n0.pid) + cs.process_tree(n1.pid))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dist_timeout", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    frozen = functools.partial(torchrun_two_nodes, sig=signal.SIGSTOP)
    for name, fn in (("mpiexec_one_host_kill9", mpiexec_one_host),
                     ("torchrun_two_nodes_kill9", torchrun_two_nodes),
                     ("torchrun_two_nodes_sigstop", frozen)):
        for i in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix=f"dead_rank_{name}_"))
            try:
                seconds = fn(work, args.dist_timeout)
                print(json.dumps({
                    "figure": f"{name}_to_job_end_s", "seconds": round(seconds, 2),
                    "repeat": i, "dist_timeout_s": args.dist_timeout,
                    "last_step_intact": intact(work), "cpus": os.cpu_count(),
                    "command": f"{COMMAND} --dist_timeout {args.dist_timeout:g}"}), flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
