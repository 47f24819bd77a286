"""Post-hoc EMA reconstruction (`ckpt.py phema`): its peak memory against the model's size, and
its time, for N snapshots of a model of about --params float32 parameters (issue 23).

Writes the snapshots (two widths, 0.05 and 0.10, at N/2 steps) into a temp dir with
PowerFunctionEMA as a loop would, then runs `ckpt.py phema` in a fresh child process per case,
which samples its resident memory (/proc/self/statm, every 2 ms) and reports the peak above
what it held before the reconstruction began (after importing torch and the library). The
claim checked: about two models with --batch 1 (one loaded snapshot and one accumulator), about
batch + 1 models with --batch B, whatever N.

One JSON line per figure. Usage:

    python benchmarks/phema.py [--params 16e6] [--snapshots 8,32] [--stds 3] [--batch 1,3]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch as th  # noqa: E402

from improved_diffusion import phema  # noqa: E402
from improved_diffusion.ckpt import run_dir  # noqa: E402

CHILD = r"""
import io, json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from improved_diffusion.apps import ckpt_tool
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak, done = [0], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
base = rss()
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
t0 = time.perf_counter()
out, err = io.StringIO(), io.StringIO()
code = ckpt_tool.main(sys.argv[2:], out=out, err=err)
took = time.perf_counter() - t0
done.set()
watcher.join()
print(json.dumps({"code": code, "err": err.getvalue(), "seconds": took,
                  "peak_above_base_bytes": max(peak[0], rss()) - base}))
"""

def write_run(d, params, snapshots):
    width = 1024
    n = max(1, int(round(params / (width * width + width))))
    th.manual_seed(0)
    model = th.nn.Sequential(*[th.nn.Linear(width, width) for _ in range(n)])
    tracker = phema.PowerFunctionEMA(model.named_parameters(), [0.05, 0.10])
    os.makedirs(d, exist_ok=True)
    steps = max(1, snapshots // 2)
    for s in range(1, steps + 1):
        with th.no_grad():
            for p in model.parameters():
                p.add_(0.01 * th.randn_like(p))
        tracker.update(model.parameters(), 64 * s, 64)
        run_dir.write_step(d, s, tracker.snapshot_payloads(s, {}, model.state_dict()))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model_bytes, 2 * steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--snapshots", default="8,32")
    ap.add_argument("--stds", type=int, default=3, help="how many widths to reconstruct")
    ap.add_argument("--batch", default="1,3")
    args = ap.parse_args()
    stds = ",".join(f"{0.06 + 0.01 * i:.2f}" for i in range(args.stds))
    root = tempfile.mkdtemp(prefix="bench_phema_")
    try:
        for n in [int(x) for x in args.snapshots.split(",")]:
            d = os.path.join(root, f"run{n}")
            model_bytes, count = write_run(d, int(args.params), n)
            for batch in [int(x) for x in args.batch.split(",")]:
                out = os.path.join(root, f"out{n}_{batch}")
                cmd = [sys.executable, "-c", CHILD, REPO, "phema", d, "--std", stds, "--out",
                       out, "--batch", str(batch)]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                t0 = time.perf_counter()
                res = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env,
                                                check=True).stdout.strip().splitlines()[-1])
                if res["code"] != 0:
                    raise SystemExit(res["err"])
                print(json.dumps({
                    "figure": "phema_reconstruction_peak_memory_in_models",
                    "value": round(res["peak_above_base_bytes"] / model_bytes, 2),
                    "snapshots": count, "stds": args.stds, "batch": batch,
                    "model_mb": round(model_bytes / 2**20, 1),
                    "seconds": round(res["seconds"], 2),
                    "wall_with_start_seconds": round(time.perf_counter() - t0, 2),
                    "command": f"python benchmarks/phema.py --params {args.params:g} "
                               f"--snapshots {args.snapshots} --stds {args.stds} "
                               f"--batch {args.batch}"}), flush=True)
                shutil.rmtree(out)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
