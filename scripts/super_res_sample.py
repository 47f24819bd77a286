r"""Upsample a batch of samples with a super-resolution model (upstream's super_res_sample.py).

    python scripts/super_res_sample.py --model_path SR_RUN/ema_0.9999_100000.pt \
        --base_samples LOW/samples_100x64x64x3.npz --log_dir OUT [--use_ddim True ...]
    mpiexec -n N python scripts/super_res_sample.py ...       # same output, work split

--base_samples is an npz as sample.py writes it (``arr_0`` uint8 NHWC at --small_size, plus
``arr_1`` labels, needed when the model is class-conditional). Output sample i is the upsampling
of base sample ``i % len(base)``, with noise from its own seed (--seed, i), gathered to rank 0 and
written as ``samples_{N}x{H}x{W}x{C}.npz`` (+ ``arr_1`` labels) and a PNG grid into --log_dir
(default $OPENAI_LOGDIR, else a fresh temporary directory, as upstream). Model flags come from the
file when it carries them (ours); pass them for upstream's raw state dicts.
"""
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch as th  # noqa: E402

from improved_diffusion import dist_util, logger, sampling  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    FlagError,
    sample_defaults,
    sr_create_model_and_diffusion,
    sr_model_and_diffusion_defaults,
)
from improved_diffusion.infra.flags import create_parser  # noqa: E402


def create_argparser():
    defaults = sample_defaults()
    defaults.update(base_samples="")
    defaults.update(sr_model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="super_res_sample.py")


def load_base_samples(path, small_size, class_cond):
    """Read --base_samples on all ranks. Collective: call from all ranks with the same arguments.

    :return: (low_res float32 [N x C x h x w] in [-1, 1], labels int64 [N] or None).
    """
    if not path:
        raise FlagError("--base_samples is required (an npz written by sample.py)")
    try:
        data = dist_util.load_bytes(path)
    except OSError as e:
        raise sampling.SampleError(f"--base_samples {path}: {e}") from None
    try:
        obj = np.load(io.BytesIO(data))
        images = obj["arr_0"]
        labels = obj["arr_1"] if "arr_1" in obj.files else None
    except Exception:  # noqa: BLE001 - any unreadable npz is one user-facing line
        raise sampling.SampleError(
            f"--base_samples {path} is not an npz with arr_0 (N x H x W x C uint8 images)"
        ) from None
    if images.ndim != 4 or images.shape[1] != small_size or images.shape[2] != small_size:
        raise FlagError(
            f"--base_samples {path} holds images of shape {tuple(images.shape)}; the model "
            f"expects N x {small_size} x {small_size} x C (--small_size {small_size})")
    if class_cond and labels is None:
        raise FlagError(
            f"--base_samples {path} has no labels (arr_1) but the model is class-conditional")
    low_res = th.from_numpy(images.astype(np.float32) / 127.5 - 1.0).permute(0, 3, 1, 2)
    return low_res.contiguous(), (None if labels is None else labels.astype(np.int64))


def main(argv=None):
    args, explicit = sampling.start_script(create_argparser(), argv)
    log_dir = logger.get_dir()

    logger.log(f"loading {args.model_path} ...")
    model, diffusion, flags, _ = sampling.load_for_sampling(
        args.model_path, explicit, defaults=sr_model_and_diffusion_defaults(),
        create=sr_create_model_and_diffusion, want=args.weights)
    logger.log("loading data...")
    low_res, base_labels = load_base_samples(args.base_samples, flags["small_size"],
                                             flags["class_cond"])
    n_base = low_res.shape[0]

    def extra_kwargs(idx):
        src = th.as_tensor(np.asarray(idx) % n_base)
        out = {"low_res": low_res[src]}
        if flags["class_cond"]:
            out["y"] = th.from_numpy(base_labels[src.numpy()])
        return out

    large = flags["large_size"]
    shape = (3, large, large)
    logger.log(f"creating {args.num_samples} samples ({'DDIM' if args.use_ddim else 'ancestral'}"
               f", {diffusion.num_timesteps} steps) from {n_base} base samples...")
    images, _ = sampling.generate(
        model, diffusion, num_samples=args.num_samples, batch_size=args.batch_size, shape=shape,
        seed=args.seed, use_ddim=args.use_ddim, clip_denoised=args.clip_denoised,
        extra_kwargs=extra_kwargs, progress=args.progress)
    labels = None if base_labels is None else base_labels[np.arange(args.num_samples) % n_base]
    sampling.write_results(log_dir, images, labels, grid=args.grid, overwrite=args.overwrite)
    return 0


def run(argv=None):
    """Entry point: our errors become one `error: ...` line and a non-zero exit."""
    return sampling.run_script(main, argv)


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(run())
