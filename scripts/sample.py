r"""Generate a large batch of samples from a model and save them as a large numpy array.

    python scripts/sample.py --model_path RUN/ema_0.9999_010000.pt --num_samples 100 \
        --use_ddim True --timestep_respacing ddim50 --log_dir OUT
    mpiexec -n 4 python scripts/sample.py ...        # same samples, a quarter of the work each

Model files written by our train.py carry their flags: no model flags need repeating, and a model
flag given explicitly that contradicts the file is an error. Upstream's raw state dicts carry no
flags: pass the model and diffusion flags as with upstream's image_sample.py.

Output (rank 0) into --log_dir (default $OPENAI_LOGDIR; when neither is set, a fresh temporary
directory, as upstream; its path is printed): ``samples_{N}x{H}x{W}x{C}.npz`` with ``arr_0``
uint8 NHWC (and ``arr_1`` the labels for a class-conditional model) and ``samples_...png``, a
grid a person can look at. An existing npz is never replaced unless --overwrite True. A latent
model (--in_channels other than 3, e.g. a DiT trained on VAE latents) writes
``samples_{N}x{C}x{H}x{W}.npz`` with ``arr_0`` the float32 latents and no grid (decode them with
the VAE; pass --clip_denoised False, as DiT samples, since latents are not in [-1, 1]).

Sample i's label, initial noise and per-step noise come from its own generator seeded from
(--seed, i): the output does not depend on the number of ranks or on --batch_size.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import dist_util, logger  # noqa: E402
from improved_diffusion import sampling  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    FlagError,
    sample_defaults,
    create_parser,
    model_and_diffusion_defaults,
)


def create_argparser():
    defaults = sample_defaults()
    defaults.update(model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="sample.py")


def main(argv=None):
    args, explicit = sampling.start_script(create_argparser(), argv)
    log_dir = logger.get_dir()

    logger.log(f"loading {args.model_path} ...")
    model, diffusion, flags, ckpt = sampling.load_for_sampling(
        args.model_path, explicit, want=args.weights)
    if args.use_fp16:  # guided-diffusion's --use_fp16: the torso in float16, as its script did
        if not hasattr(model, "convert_to_fp16"):
            raise FlagError(f"--use_fp16 True: float16 sampling is the UNet's (guided-diffusion's "
                            f"convert_to_fp16); --arch {flags['arch']} samples in float32")
        model.convert_to_fp16()
    source = "flags stored in the file" if isinstance(ckpt.flags, dict) else "command-line flags"
    logger.log(
        f"model: {ckpt.kind} weights"
        + (f" at step {ckpt.step}" if ckpt.step is not None else "")
        + f", {source}; arch={flags['arch']} image_size={flags['image_size']} "
        f"class_cond={flags['class_cond']} "
        f"diffusion_steps={flags['diffusion_steps']} "
        f"timestep_respacing={flags['timestep_respacing'] or '(none)'}"
        + (" (float16 torso: --use_fp16)" if args.use_fp16 else "")
    )

    num_classes = flags["num_classes"] if flags["class_cond"] else None
    if args.classes and not num_classes:
        raise FlagError(
            f"--classes {args.classes}: the model is not class-conditional (class_cond=False)")
    classes = sampling.parse_classes(args.classes, num_classes) if num_classes else None

    shape = (flags["in_channels"], flags["image_size"], flags["image_size"])
    as_images = shape[0] == 3
    out_shape = ((args.num_samples, shape[1], shape[2], shape[0]) if as_images
                 else (args.num_samples,) + shape)
    npz_path, _ = sampling.sample_paths(log_dir, out_shape)
    exists = dist_util.broadcast_object(
        dist_util.get_rank() == 0 and os.path.exists(npz_path) and not args.overwrite)
    if exists:
        raise sampling.SampleError(
            f"{npz_path} already exists; pass another --log_dir or --overwrite True")

    logger.log(
        f"sampling {args.num_samples} images ({'DDIM' if args.use_ddim else 'ancestral'}, "
        f"{diffusion.num_timesteps} steps) on {dist_util.get_world_size()} rank(s), "
        f"batch size {args.batch_size}, seed {args.seed} ...")
    images, labels = sampling.generate(
        model, diffusion,
        num_samples=args.num_samples, batch_size=args.batch_size, shape=shape, seed=args.seed,
        use_ddim=args.use_ddim, clip_denoised=args.clip_denoised, num_classes=num_classes,
        classes=classes, progress=args.progress, as_images=as_images,
    )
    ncol = len(classes) if classes and len(classes) > 1 else None
    sampling.write_results(log_dir, images, labels, ncol=ncol, grid=args.grid and as_images,
                           overwrite=args.overwrite)
    return 0


def run(argv=None):
    """Entry point: our errors become one `error: ...` line and a non-zero exit."""
    return sampling.run_script(main, argv)


if __name__ == "__main__":
    sys.exit(run())
