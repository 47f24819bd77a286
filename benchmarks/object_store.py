"""A save and a resume to an object store against the same to a local disk (issue 39), one run.

One step of ``--mb`` MiB in all (a model, one EMA and an optimizer file of random float32
tensors, a third each, as run_dir.write_step writes a step: files streamed under their final
names, the manifest last), written to a local directory (--dir, temp name + fsync + rename) and
to moto's S3 server started here on 127.0.0.1 (s3://, multipart uploads); then a resume's reads:
the plan (listing, manifests, the candidate step's CRC-32s) and the three files loaded
(checkpoint.load_file). One JSON line per figure:

    {"figure": "save_s", "store": "local" | "s3", "value": ..., "unit": "s", "mb": ...}

moto keeps objects in its own process's memory and talks plain HTTP on loopback: the figures are
the cost of our storage layer and the S3 protocol on this machine, not of a cloud store's
network. Usage: python benchmarks/object_store.py [--mb 96] [--repeats 3] [--dir DIR]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch as th  # noqa: E402

import stores  # noqa: E402  (tests/stores.py: the servers the tests use)
from improved_diffusion.ckpt import checkpoint, run_dir
from improved_diffusion.infra import storage  # noqa: E402


def step_files(mb, step):
    n = (mb << 20) // 4 // 3
    g = th.Generator().manual_seed(0)
    payload = {"w": th.randn(n, generator=g)}
    return {f"model{step:06d}.pt": payload, f"ema_0.9999_{step:06d}.pt": payload,
            f"opt{step:06d}.pt": payload}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(log_dir, mb, repeats, emit, where):
    saves, plans, loads = [], [], []
    for r in range(repeats):
        step = r + 1
        files = step_files(mb, step)
        saves.append(timed(lambda: run_dir.write_step(log_dir, step, files))[0])
        plan_s, plan = timed(lambda: run_dir.plan_resume(log_dir, ""))
        assert plan.step == step, plan.step
        plans.append(plan_s)
        names = list(files)
        loads.append(timed(lambda: [checkpoint.load_file(storage.join(log_dir, n))
                                    for n in names])[0])
    for figure, values in (("save_s", saves), ("resume_plan_s", plans),
                           ("resume_load_s", loads)):
        emit(figure, where, min(values), "s", runs=[round(v, 3) for v in values])
    emit("save_mb_per_s", where, mb / min(saves), "MiB/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="local directory for the disk side")
    args = ap.parse_args()
    th.set_num_threads(1)

    def emit(figure, where, value, unit, **extra):
        print(json.dumps({"figure": figure, "store": where, "value": round(value, 4),
                          "unit": unit, "mb": args.mb, **extra}), flush=True)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.makedirs(os.path.join(tmp, "run"))  # the trainer makes it when it takes the lock
        measure(os.path.join(tmp, "run"), args.mb, args.repeats, emit, "local")
        server = stores.start("s3", tmp)
        try:
            os.environ.update(server.env)
            storage.forget_clients()
            bucket = server.make_bucket("bench")
            measure(f"{bucket}/run", args.mb, args.repeats, emit, "s3")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
