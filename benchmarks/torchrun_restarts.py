"""How many of torchrun's restarts work: one JSON line per rendezvous backend.

    python benchmarks/torchrun_restarts.py [--kills 10] [--rdzv standalone,c10d,static]

For each backend, one job ``torchrun --nnodes 1 --nproc_per_node 2 --max_restarts K`` of
scripts/train.py (tiny model of tests/test_train.py, CPU/gloo, a save every 2 steps) in which a
worker is killed (``kill -9``: rank 1, rank 0, rank 1, ...) K times, each time once the workers
of the new attempt formed their process group and saved a step of their own
(tests/cluster_sim.py, ``kill_workers_repeatedly``). Figures: ``restarts_ok`` (restarted attempts
that formed their group, auto-resumed and saved; an attempt that does not within 120 s ends the
count), whether the job then ended by itself at --max_steps with exit 0, and whether its last
step equals a straight 2-rank run's (model, EMA and optimizer state, bit for bit).
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import cluster_sim as cs  # noqa: E402
from conftest import deep_diff  # noqa: E402

COMMAND = "python benchmarks/torchrun_restarts.py"


def train_args(data, log_dir, max_steps):
    return [*cs.TINY, "--seed", "0", "--data_dir", data, "--log_dir", log_dir,
            "--save_interval", "2", "--max_steps", str(max_steps), "--dist_timeout", "30"]


def same_last_step(a, b, step):
    import torch

    names = [f"model{step:06d}.pt", f"opt{step:06d}.pt", f"ema_0.9999_{step:06d}.pt"]
    try:
        return all(not deep_diff(*(torch.load(d / n, weights_only=True, map_location="cpu")
                                   for d in (a, b))) for n in names)
    except FileNotFoundError:
        return False


def one_job(work, data, rdzv, kills, max_steps):
    log_dir = work / "run"
    cmd = cs.torchrun_one_node(train_args(data, log_dir, max_steps), rdzv, max_restarts=kills)
    t0 = time.monotonic()
    proc = cs.start(cmd, work / "torchrun.out", env={"FAULT_PID_DIR": str(work / "pids")})
    records, failure = [], None
    try:
        records = cs.kill_workers_repeatedly(proc, log_dir, work / "pids", kills, timeout=120,
                                             on_kill=records.append)
        cs.wait_exit(proc, 300)
    except (TimeoutError, RuntimeError) as e:
        failure = str(e)
    finally:
        cs.kill9(cs.process_tree(proc.pid))
    out = (work / "torchrun.out").read_text()
    return {
        # attempt 0 is the first start; each kill after it was made on a restarted attempt
        "restarts_ok": max(0, len(records) - 1) + (failure is None),
        "kills": len(records), "finished": failure is None and proc.returncode == 0,
        "failure": failure, "seconds": round(time.monotonic() - t0, 1),
        "resumes": len(re.findall(r"resumed at step \d+", out)),
        "gloo_connect_errors": out.count("Connection refused"),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--rdzv", default="standalone,c10d,static")
    p.add_argument("--max_steps", type=int, default=100)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="torchrun_restarts_"))
    try:
        data = cs.random_images(base / "data", n=14)
        straight = base / "straight"
        proc = cs.start([cs.MPIEXEC, "-n", "2", cs.PY, REPO / "scripts" / "train.py",
                         *train_args(data, straight, args.max_steps)], base / "straight.out")
        cs.wait_exit(proc, 600)
        for rdzv in args.rdzv.split(","):
            work = base / rdzv
            work.mkdir()
            result = one_job(work, data, rdzv, args.kills, args.max_steps)
            result["bitwise_equal_to_straight"] = result["finished"] and same_last_step(
                straight, work / "run", args.max_steps)
            print(json.dumps({"figure": "torchrun_restarts", "rdzv": rdzv, **result,
                              "max_restarts": args.kills, "cpus": os.cpu_count(),
                              "command": f"{COMMAND} --kills {args.kills} --rdzv {rdzv}"}),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
