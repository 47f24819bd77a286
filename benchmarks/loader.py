"""Data loading rate (decode, resize, crop) vs what a training step consumes (issue 11).

Writes --files JPEG photos-like images (random smooth noise) at 2x the target size into a temp
dir, then, in the same run:

- ``loader_images_per_s``: the real load_data() loader (ImageDataset: decode, box-halve, bicubic
  resize, center crop; collate) at 64 and 256 px, with 0 workers and with --workers workers;
- ``step_images_per_s``: what a bare training step consumes: forward/backward/AdamW of a UNet
  (--num_channels 64, 2 res blocks, attention 16,8, learned sigma) at that size, batch --batch;
- ``loader_over_step``: the ratio; above 1 the loader keeps ahead of the step.

    python benchmarks/loader.py [--sizes 64,256] [--workers 2] [--batch 16] [--step_sizes 64]

One JSON line per figure, each with the command that reproduces it.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
from PIL import Image  # noqa: E402

from improved_diffusion.image_datasets import load_data  # noqa: E402


def write_images(d, n, size, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        small = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((size, size), Image.BICUBIC)
        img.save(os.path.join(d, f"img_{i:05d}.jpg"), quality=90)


def loader_rate(d, size, batch, workers, batches):
    data = load_data(data_dir=d, batch_size=batch, image_size=size, num_workers=workers,
                     rank=0, world_size=1)
    next(data)  # worker start-up is not the steady state
    t0 = time.perf_counter()
    for _ in range(batches):
        next(data)
    elapsed = time.perf_counter() - t0
    data.close()
    return batch * batches / elapsed


def step_rate(size, batch, steps):
    from improved_diffusion.resample import UniformSampler
    from improved_diffusion.script_util import (create_model_and_diffusion,
                                                model_and_diffusion_defaults)

    flags = model_and_diffusion_defaults()
    flags.update(image_size=size, num_channels=64, num_res_blocks=2, attention_resolutions="16,8",
                 learn_sigma=True, dropout=0.1)
    model, diffusion = create_model_and_diffusion(**flags)
    opt = th.optim.AdamW(model.parameters(), lr=1e-4)
    sampler = UniformSampler(diffusion)

    def step():
        x = th.rand(batch, 3, size, size) * 2 - 1
        opt.zero_grad(set_to_none=True)
        t, w = sampler.sample(batch, "cpu")
        (diffusion.training_losses(model, x, t)["loss"] * w).mean().backward()
        opt.step()
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256")
    ap.add_argument("--step_sizes", default="64", help="sizes whose step is measured too")
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    th.set_num_threads(args.threads)
    cmd = "python benchmarks/loader.py " + " ".join(sys.argv[1:])
    step_sizes = {int(s) for s in args.step_sizes.split(",") if s}
    for size in [int(s) for s in args.sizes.split(",")]:
        d = tempfile.mkdtemp()
        try:
            write_images(d, args.files, 2 * size)
            rates = {w: loader_rate(d, size, args.batch, w, args.batches)
                     for w in (0, args.workers)}
        finally:
            shutil.rmtree(d, ignore_errors=True)
        for w, r in rates.items():
            print(json.dumps({"figure": "loader_images_per_s", "image_size": size,
                              "source_size": 2 * size, "num_workers": w, "value": round(r, 1),
                              "batch": args.batch, "command": cmd}), flush=True)
        if size in step_sizes:
            s = step_rate(size, args.batch, args.steps)
            print(json.dumps({"figure": "step_images_per_s", "image_size": size,
                              "value": round(s, 2), "threads": args.threads,
                              "batch": args.batch, "command": cmd}), flush=True)
            for w, r in rates.items():
                print(json.dumps({"figure": "loader_over_step", "image_size": size,
                                  "num_workers": w, "value": round(r / s, 2), "command": cmd}),
                      flush=True)


if __name__ == "__main__":
    main()
