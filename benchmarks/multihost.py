"""Seconds from losing a host to the end of the job, on two simulated hosts; one JSON line each.

    sudo python benchmarks/multihost.py [--dist_timeout 15]      (root: network namespaces)

Two hosts from tests/multihost.py (own network stack, own disk; the log dir on host 0's disk),
`torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d`, the tiny model of
tests/cluster_sim.py with a save every step; host 1 is lost once two steps are complete:

* ``two_hosts_kill9_host0_end_s``: every process of host 1 SIGKILLed; until host 0's launcher
  exits (its rank names the lost rank).
* ``two_hosts_unplugged_host0_end_s`` / ``..._host1_rank_end_s``: host 1's link pulled (nothing
  closes, nothing answers); until host 0's launcher exits, and until host 1's rank is gone.
* reference, same run: ``one_host_two_launchers_kill9_host0_end_s``, the two launchers of
  tests/cluster_sim.py on one network stack and one disk, node 1 killed.

Each line says whether the newest complete step on disk matched its manifest afterwards.
"""
import argparse
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
import multihost as mh  # noqa: E402

COMMAND = "python benchmarks/multihost.py"


def train_args(data, log_dir):
    return [*cs.TINY, "--data_dir", data, "--log_dir", log_dir, "--save_interval", "1",
            "--max_steps", "100000"]


def intact(log_dir):
    steps = cs.complete_steps(log_dir)
    return bool(steps) and cs.step_problems(log_dir, steps[-1]) == []


def two_hosts(work, dist_timeout, fault):
    """{figure: seconds}, last step intact, for ``fault`` in ("kill9", "unplugged")."""
    with mh.Cluster() as cluster:
        h0, h1 = cluster.hosts
        data = cs.random_images(work / "data")
        procs = []
        for h in cluster.hosts:
            cmd = [cs.TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend",
                   "c10d", "--rdzv_endpoint", f"{h0.addr}:29400", "--max_restarts", "0",
                   cs.DRIVER, *train_args(data, f"{mh.DISK}/log"),
                   "--dist_timeout", str(dist_timeout)]
            procs.append(h.start(cmd, work / f"host{h.index}.out",
                                 {"FAULT_PID_DIR": str(work / "pids")}))
        cs.wait_until(lambda: len(cs.complete_steps(h0.disk("log"))) >= 2, 300, procs,
                      "two saves")
        rank1 = cs.rank_pids(work / "pids", 2)[1]
        t0 = time.monotonic()
        if fault == "kill9":
            h1.kill_all()
        else:
            h1.set_link(False)
        procs[0].wait(max(600, 3 * dist_timeout))
        out = {f"two_hosts_{fault}_host0_end_s": time.monotonic() - t0}
        if fault == "unplugged":
            if cs.all_gone([rank1], within_s=max(600, 3 * dist_timeout)):
                out[f"two_hosts_{fault}_host1_rank_end_s"] = time.monotonic() - t0
        return out, intact(h0.disk("log"))


def one_host(work, dist_timeout):
    n0, n1 = cs.two_node_torchrun(train_args(cs.random_images(work / "data"), work / "log"), work,
                                  dist_timeout)
    try:
        cs.wait_until(lambda: len(cs.complete_steps(work / "log")) >= 2, 300, (n0, n1),
                      "two saves")
        tree = cs.process_tree(n1.pid)
        t0 = time.monotonic()
        cs.signal_all(tree, signal.SIGKILL)
        n0.wait(max(600, 3 * dist_timeout))
        return {"one_host_two_launchers_kill9_host0_end_s": time.monotonic() - t0}, \
            intact(work / "log")
    finally:
        cs.kill9(cs.process_tree(n0.pid) + cs.process_tree(n1.pid))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dist_timeout", type=float, default=15.0)
    args = p.parse_args()
    reason = mh.unavailable()
    if reason:
        sys.exit(f"error: {reason}")
    runs = (("kill9", lambda w: two_hosts(w, args.dist_timeout, "kill9")),
            ("unplugged", lambda w: two_hosts(w, args.dist_timeout, "unplugged")),
            ("reference", lambda w: one_host(w, args.dist_timeout)))
    for name, fn in runs:
        work = Path(tempfile.mkdtemp(prefix=f"multihost_{name}_"))
        try:
            figures, ok = fn(work)
            for figure, seconds in figures.items():
                print(json.dumps({
                    "figure": figure, "seconds": round(seconds, 2),
                    "dist_timeout_s": args.dist_timeout, "last_step_intact": ok,
                    "cpus": os.cpu_count(),
                    "command": f"{COMMAND} --dist_timeout {args.dist_timeout:g}"}), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
