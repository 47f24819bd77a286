"""Sampling speed and memory per rank (issue 11).

Runs sampling.generate (the code of scripts/sample.py) on a model built from --config (random
weights: the speed does not depend on them), in the same run:

- ``sampling_images_per_s`` for DDIM with 50 respaced steps and for ancestral sampling with 250;
- ``peak_rss_mb`` of each rank (with ``mpiexec -n 2 ... --ranks 2``), beside the bytes of the
  output array, which only rank 0 holds (the other ranks send their batches to rank 0).

``--config`` also takes benchmarks/train.py's configs (``cifar10``: the README's CIFAR-10 UNet;
``dit-xl2``: DiT-XL/2 on 32x32x4 latents, class-conditional, its samples the latents as they
are). ``--samplers ddim50`` runs that one alone; each is timed after one untimed batch of
``--warmup`` samples (0: none), in float32 as scripts/sample.py samples.

    python benchmarks/sampling.py [--config tiny] [--num_samples 16] [--batch 8]
    python benchmarks/sampling.py --config dit-xl2 --samplers ddim50 --num_samples 64 --batch 64
    mpiexec -n 2 python benchmarks/sampling.py --config tiny

One JSON line per figure (rank 0 prints), each with the command that reproduces it.
"""
import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch as th  # noqa: E402

from improved_diffusion import dist_util, sampling  # noqa: E402
from improved_diffusion.script_util import (create_model_and_diffusion,  # noqa: E402
                                            model_and_diffusion_defaults)

CONFIGS = {
    "tiny": dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="4",
                 learn_sigma=True),
    "bench": dict(image_size=32, num_channels=64, num_res_blocks=2, attention_resolutions="16,8",
                  learn_sigma=True),
}
RUNS = (("ddim50", "ddim50", True), ("ancestral250", "250", False))


def config_flags(name):
    """The model flags of ``name``: this file's configs, else benchmarks/train.py's."""
    if name in CONFIGS:
        return dict(CONFIGS[name])
    import train as tb  # benchmarks/train.py

    flags = dict(tb.CONFIGS[name])
    flags.pop("batch_size")
    return flags


def config_names():
    import train as tb

    return sorted(set(CONFIGS) | set(tb.CONFIGS))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=config_names(), default="tiny")
    ap.add_argument("--samplers", default=",".join(r[0] for r in RUNS),
                    help=f"comma-separated, of {', '.join(r[0] for r in RUNS)}")
    ap.add_argument("--warmup", type=int, default=0,
                    help="samples of one untimed batch before each sampler's timing")
    ap.add_argument("--num_samples", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        th.set_num_threads(args.threads)
    dist_util.setup_dist()
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    cmd = ("mpiexec -n %d " % world if world > 1 else "") + \
        "python benchmarks/sampling.py " + " ".join(sys.argv[1:])
    wanted = args.samplers.split(",")
    unknown = sorted(set(wanted) - {r[0] for r in RUNS})
    if unknown:
        ap.error(f"--samplers {','.join(unknown)}: not one of {', '.join(r[0] for r in RUNS)}")
    device = dist_util.dev()
    for name, respacing, ddim in RUNS:
        if name not in wanted:
            continue
        flags = model_and_diffusion_defaults()
        flags.update(config_flags(args.config), timestep_respacing=respacing)
        th.manual_seed(0)
        model, diffusion = create_model_and_diffusion(**flags)
        model.to(device).eval()
        size, channels = flags["image_size"], flags["in_channels"]
        kwargs = dict(batch_size=args.batch, shape=(channels, size, size), use_ddim=ddim,
                      progress=False, as_images=channels == 3,
                      num_classes=flags["num_classes"] if flags["class_cond"] else None)
        if args.warmup:
            sampling.generate(model, diffusion, num_samples=args.warmup, **kwargs)
        dist_util.barrier()
        t0 = time.perf_counter()
        images, _ = sampling.generate(model, diffusion, num_samples=args.num_samples, **kwargs)
        elapsed = time.perf_counter() - t0  # (the samples are on the host: the device is done)
        if rank == 0:
            print(json.dumps({"figure": "sampling_images_per_s", "sampler": name,
                              "value": round(args.num_samples / elapsed, 3), "ranks": world,
                              "config": args.config, "num_samples": args.num_samples,
                              "batch": args.batch, "device": device.type,
                              "device_name": th.cuda.get_device_name(device)
                              if device.type == "cuda" else "cpu", "precision": "fp32",
                              "command": cmd}), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if th.cuda.is_available():
        peak = th.cuda.max_memory_allocated() / 2 ** 20
    peaks = dist_util.all_gather_object(round(peak, 1))
    holds = dist_util.all_gather_object(images is not None)
    if rank == 0:
        print(json.dumps({"figure": "sampling_peak_mb_per_rank", "value": peaks,
                          "output_array_mb_on_rank0": round(images.nbytes / 2 ** 20, 3),
                          "holds_output": holds,
                          "ranks": world, "config": args.config, "command": cmd}), flush=True)
    dist_util.cleanup()


if __name__ == "__main__":
    main()
