r"""Approximate the bits/dimension of an image folder under a model (upstream's image_nll.py).

    python scripts/nll.py --model_path RUN/ema_0.9999_010000.pt --data_dir IMAGES \
        --num_samples 1000 --batch_size 8 --log_dir OUT
    mpiexec -n 4 python scripts/nll.py ...          # each rank evaluates its share

The first --num_samples images of the folder (sorted file order) are evaluated, each exactly once,
batches dealt out to the ranks ``batches[rank::world_size]``. Image i's noise comes from its own
generator seeded from (--seed, i), so the figures do not depend on --batch_size or the ranks. The
model's flags come from the file when it carries them (ours); pass them for upstream's raw state
dicts, as with sample.py. --model_path takes a sharded step as sample.py does (RUN/step010000.dcp,
a file in it by name, or its manifest).

Logged as upstream ("done N samples: bpd=..."), then the means of total_bpd, prior_bpd, vb (the
per-timestep terms summed over timesteps), mse and xstart_mse (per-timestep terms averaged) as
key/values, and ``{vb,mse,xstart_mse}_terms.npz`` (per-timestep means) in --log_dir.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch as th  # noqa: E402

from improved_diffusion import dist_util, logger, sampling  # noqa: E402
from improved_diffusion.image_datasets import (  # noqa: E402
    collate,
    load_data,
)
from improved_diffusion.script_util import model_and_diffusion_defaults, nll_defaults  # noqa: E402
from improved_diffusion.infra.flags import create_parser  # noqa: E402

TERMS = ("vb", "mse", "xstart_mse")


def create_argparser():
    defaults = nll_defaults()
    defaults.update(model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="nll.py")


def main(argv=None):
    args, explicit = sampling.start_script(create_argparser(), argv)
    rank, world = dist_util.get_rank(), dist_util.get_world_size()

    logger.log("creating model and diffusion...")
    model, diffusion, flags, _ = sampling.load_for_sampling(
        args.model_path, explicit, want=args.weights)

    logger.log("creating data loader...")
    loader = load_data(data_dir=args.data_dir, batch_size=max(1, args.batch_size),
                       image_size=flags["image_size"], class_cond=flags["class_cond"],
                       deterministic=True, rank=0, world_size=1,
                       num_classes=flags["num_classes"] if flags["class_cond"] else None,
                       in_channels=flags["in_channels"])
    dataset = loader.dataset
    n = min(args.num_samples, len(dataset))
    batches = sampling.shard_batches(n, args.batch_size, rank, world)

    logger.log(f"evaluating {n} images on {world} rank(s)...")
    th.manual_seed(args.seed)
    device = dist_util.dev()
    per_sample = {k: np.zeros((n,), np.float64) for k in ("total_bpd", "prior_bpd")}
    terms = {k: np.zeros((n, diffusion.num_timesteps), np.float64) for k in TERMS}
    seen = np.zeros((n,), bool)
    done = 0
    for idx in batches:
        part = (idx, None)
        if len(idx):
            # Image i's noise comes from its own generator seeded from (seed, i): the result
            # does not depend on --batch_size or the number of ranks.
            randn = sampling.PerSampleRandn(
                [sampling.sample_seed(args.seed, int(i), stream=2) for i in idx], device=device)
            batch, cond = collate([dataset[int(i)] for i in idx])
            model_kwargs = {k: v.to(device) for k, v in cond.items()}
            m = diffusion.calc_bpd_loop(model, batch.to(device), clip_denoised=args.clip_denoised,
                                        model_kwargs=model_kwargs, randn_like=randn)
            part = (idx, {k: m[k].detach().cpu().double().numpy()
                          for k in ("total_bpd", "prior_bpd") + TERMS})
        for g_idx, g in dist_util.all_gather_object(part):
            if g is None:
                continue
            for k in per_sample:
                per_sample[k][g_idx] = g[k]
            for k in TERMS:
                terms[k][g_idx] = g[k]
            done += len(g_idx)
            seen[g_idx] = True
        logger.log(f"done {done} samples: bpd={per_sample['total_bpd'][seen].mean()}")

    logger.logkv("total_bpd", float(per_sample["total_bpd"].mean()))
    logger.logkv("prior_bpd", float(per_sample["prior_bpd"].mean()))
    logger.logkv("vb", float(terms["vb"].sum(axis=1).mean()))
    logger.logkv("mse", float(terms["mse"].mean()))
    logger.logkv("xstart_mse", float(terms["xstart_mse"].mean()))
    logger.logkv("num_samples", n)
    logger.dumpkvs()
    def write_terms():  # rank 0 writes; an error there reaches every rank
        for name in TERMS:
            out_path = os.path.join(logger.get_dir(), f"{name}_terms.npz")
            logger.log(f"saving {name} terms to {out_path}")
            np.savez(out_path, terms[name].mean(axis=0))

    dist_util.run_on_rank0(write_terms)
    logger.log("evaluation complete")
    return 0


def run(argv=None):
    """Entry point: our errors become one `error: ...` line and a non-zero exit."""
    return sampling.run_script(main, argv)


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(run())
