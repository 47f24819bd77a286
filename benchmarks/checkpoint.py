"""Checkpoint cost: the training pause per save, the whole save, the load (issue 11).

For UNets of about 10M, 60M and 250M parameters (model + one EMA + AdamW state, as the trainer
saves them), measured side by side in the same run, on the same disk (--dir):

- ``save_async_pause_s``: how long TrainLoop.save() holds training with --async_save True (the
  weights check, the RNG gather, the host copy into reused buffers; ``save_async_first_pause_s``:
  the first save, which allocates the buffers); ``save_async_total_s``: until
  its files and manifest are on disk (fsync'd);
- ``save_sync_s``: TrainLoop.save() with --async_save False (pause = total);
- ``raw_write_fsync_s``: the reference: writing the same number of bytes, in as many files, from
  memory with plain write() + fsync (+ the directory's fsync), in the same directory;
- ``step_s_during_async_save`` vs ``step_s``: one training step while the writer runs, and alone;
- ``load_2ranks_s``: checkpoint.load_file_collective of the step's opt file (its largest) on 2 ranks
  (mpiexec -n 2), every rank timed from a barrier to the end; ``load_broadcast_2ranks_s``: the same
  through the fallback (rank 0 reads, broadcasts the bytes); ``load_1rank_s``: load_file in one
  process (the CRC-checking reader alone); ``torch_load_s``: the reference, one
  plain torch.load(weights_only=True) of the same file in one process (warm page cache for all);
  each in a fresh process, with its peak RSS over what the process held before the load
  (VmHWM - VmRSS before; ``peak_rss_over_file``: that peak in units of the file's size).

One JSON line per figure, each with the command that reproduces it. Usage:

    python benchmarks/checkpoint.py [--sizes 10M,60M,250M] [--dir DIR] [--repeat 2]

250M needs ~10 GB of free memory and ~10 GB of disk: leave it out with --sizes 10M,60M.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# name -> UNet flags (learn_sigma, as the CIFAR-10/ImageNet-64 recipes)
SIZES = {
    "10M": dict(image_size=32, num_channels=64, num_res_blocks=2, attention_resolutions="16,8"),
    "60M": dict(image_size=64, num_channels=96, num_res_blocks=3, attention_resolutions="16,8"),
    "250M": dict(image_size=64, num_channels=192, num_res_blocks=3,
                 attention_resolutions="32,16,8"),
}


def vm(field):
    """This process's /proc/self/status field in bytes (VmHWM: peak RSS; VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def emit(figure, value, unit, cmd, **extra):
    print(json.dumps({"figure": figure, "value": round(value, 4), "unit": unit, **extra,
                      "command": cmd}), flush=True)


# ------------------------------------------------------------------------------------ saving


def build_loop(size, log_dir):
    import torch as th

    from improved_diffusion import train_util
    from improved_diffusion.script_util import (create_model_and_diffusion,
                                                model_and_diffusion_defaults)

    flags = model_and_diffusion_defaults()
    flags.update(SIZES[size], learn_sigma=True, diffusion_steps=100)
    train_util.seed_rngs(0)
    model, diffusion = create_model_and_diffusion(**flags)
    n = flags["image_size"]
    batch = (th.randn(1, 3, n, n), {})
    loop = train_util.TrainLoop(
        model=model, diffusion=diffusion, data=iter(lambda: batch, None), batch_size=1,
        microbatch=-1, lr=1e-4, ema_rate="0.9999", log_interval=10 ** 9,
        save_interval=0, resume_checkpoint="", log_dir=log_dir, model_flags=flags)
    return loop, batch


def raw_write(d, sizes, buf):
    """Write len(sizes) new files of these sizes from ``buf`` with fsync, then fsync ``d``."""
    t0 = time.perf_counter()
    for i, n in enumerate(sizes):
        with open(os.path.join(d, f"raw{i}.bin"), "wb") as f:
            view = memoryview(buf)
            left = n
            while left:
                k = min(left, len(buf))
                f.write(view[:k])
                left -= k
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    took = time.perf_counter() - t0
    for i in range(len(sizes)):
        os.unlink(os.path.join(d, f"raw{i}.bin"))
    return took


def timed_save(loop, step, async_save):
    """Seconds TrainLoop.save() held the caller for a save of ``step``."""
    loop.step = step
    loop.checkpointer.config = dataclasses.replace(loop.checkpointer.config,
                                                 async_save=async_save)
    t0 = time.perf_counter()
    loop.save()
    return time.perf_counter() - t0


def step_files(d, step):
    return [n for n in os.listdir(d) if n.endswith(f"{step:06d}.pt")]


def drop_step(d, step):
    for n in os.listdir(d):
        if f"{step:06d}." in n:
            os.unlink(os.path.join(d, n))


def bench_save(size, d, repeat, cmd, keep_path):
    """The save figures of one size (in this process); leaves the last step's opt file at
    ``keep_path`` for the load figures."""
    import numpy as np
    import torch as th

    from improved_diffusion import logger

    logger.configure(dir=d, format_strs=["log"])
    loop, batch = build_loop(size, d)
    params = sum(p.numel() for p in loop.model.parameters())
    loop.run_step(*batch)  # Adam moments exist, as in any saved run
    step_alone = []
    for _ in range(2):
        t0 = time.perf_counter()
        loop.run_step(*batch)
        step_alone.append(time.perf_counter() - t0)
    buf = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    rows = {k: [] for k in ("pause", "total", "sync", "raw", "step_during", "first_pause")}
    step = 100
    for r in range(repeat + 1):  # the first async save allocates its buffers: not counted
        step += 1
        pause = timed_save(loop, step, async_save=True)
        t1 = time.perf_counter()
        loop.run_step(*batch)  # a training step while the writer runs
        during = time.perf_counter() - t1
        loop.step = step  # run_step counted one
        _, total, _, _ = loop.checkpointer.wait_for_save()  # from the save's start until the step is on disk
        sizes = [os.path.getsize(os.path.join(d, n)) for n in step_files(d, step)]
        drop_step(d, step)
        rows["first_pause" if r == 0 else "pause"].append(pause)
        step += 1
        sync = timed_save(loop, step, async_save=False)
        if r < repeat:
            drop_step(d, step)
        if r:
            rows["total"].append(total)
            rows["step_during"].append(during)
            rows["sync"].append(sync)
            rows["raw"].append(raw_write(d, sizes, buf))
    for n in step_files(d, step):
        if n.startswith("opt"):
            shutil.move(os.path.join(d, n), keep_path)
    drop_step(d, step)
    nbytes = sum(sizes)
    med = {k: statistics.median(v) for k, v in rows.items()}
    common = dict(size=size, params=params, step_bytes=nbytes, repeats=repeat)
    raw = med["raw"]
    emit("save_async_pause_s", med["pause"], "s", cmd, **common,
         over_raw_write=round(med["pause"] / raw, 4))
    emit("save_async_first_pause_s", med["first_pause"], "s", cmd, **common,
         over_raw_write=round(med["first_pause"] / raw, 4))
    emit("save_async_total_s", med["total"], "s", cmd, **common,
         over_raw_write=round(med["total"] / raw, 4))
    emit("save_sync_s", med["sync"], "s", cmd, **common,
         bandwidth_over_raw_write=round(raw / med["sync"], 4))
    emit("raw_write_fsync_s", raw, "s", cmd, **common, mb_per_s=round(nbytes / raw / 1e6, 1))
    emit("step_s", statistics.median(step_alone), "s", cmd, **common)
    emit("step_s_during_async_save", med["step_during"], "s", cmd, **common,
         over_step=round(med["step_during"] / statistics.median(step_alone), 4))
    th.cuda.empty_cache() if th.cuda.is_available() else None


# ------------------------------------------------------------------------------------ loading


def load_once(path, mode):
    """One load in this fresh process: prints {"seconds", "peak_over_before"} (rank 0 prints the
    slowest rank's time and the largest peak)."""
    import torch as th

    from improved_diffusion import checkpoint, dist_util

    dist_util.setup_dist()
    with open(path, "rb") as f:  # warm page cache, as for the reference
        while f.read(64 << 20):
            pass
    before = vm("VmRSS")
    dist_util.barrier()
    t0 = time.perf_counter()
    if mode == "torch":
        th.load(path, weights_only=True, map_location="cpu")
    elif mode == "collective":
        checkpoint.load_file_collective(path)
    elif mode == "broadcast":
        checkpoint._load_broadcast(path)
    elif mode == "single":
        checkpoint.load_file(path)
    took = time.perf_counter() - t0
    peak = vm("VmHWM") - before
    got = dist_util.all_gather_object((took, peak))
    if dist_util.get_rank() == 0:
        print(json.dumps({"seconds": max(g[0] for g in got), "peaks": [g[1] for g in got]}))
    dist_util.cleanup()


def run_load(path, mode, ranks):
    py = [sys.executable, os.path.abspath(__file__), "--_load", path, "--mode", mode]
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        py = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks)] + py
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(py, check=True, stdout=subprocess.PIPE, text=True, env=env,
                         timeout=1200).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_load(size, path, repeat, cmd):
    nbytes = os.path.getsize(path)
    res = {}
    for _ in range(repeat):  # interleaved, side by side
        for mode, ranks in (("torch", 1), ("collective", 2), ("broadcast", 2), ("single", 1)):
            res.setdefault(mode, []).append(run_load(path, mode, ranks))
    ref = statistics.median(r["seconds"] for r in res["torch"])
    for mode, figure in (("torch", "torch_load_s"), ("collective", "load_2ranks_s"),
                         ("broadcast", "load_broadcast_2ranks_s"), ("single", "load_1rank_s")):
        secs = statistics.median(r["seconds"] for r in res[mode])
        peaks = [max(r["peaks"][i] for r in res[mode]) for i in range(len(res[mode][0]["peaks"]))]
        emit(figure, secs, "s", cmd, size=size, file="opt", file_bytes=nbytes,
             over_torch_load=round(secs / ref, 4), peak_rss_bytes_per_rank=peaks,
             peak_rss_over_file=[round(p / nbytes, 3) for p in peaks], repeats=repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,60M,250M")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--_save", help=argparse.SUPPRESS)
    ap.add_argument("--_load", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--keep", help=argparse.SUPPRESS)
    ap.add_argument("--cmd", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._load:
        return load_once(args._load, args.mode)
    if args._save:
        return bench_save(args._save, args.dir, args.repeat, args.cmd, args.keep)
    cmd = "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:])
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt")
    try:
        for size in args.sizes.split(","):
            d = os.path.join(root, size)
            os.makedirs(d)
            keep = os.path.join(root, f"opt_{size}.pt")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--_save", size, "--dir", d,
                            "--repeat", str(args.repeat), "--keep", keep, "--cmd", cmd],
                           check=True, timeout=3600)
            bench_load(size, keep, args.repeat, cmd)
            shutil.rmtree(d)
            os.unlink(keep)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
