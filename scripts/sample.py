r"""Generate a large batch of samples from a model and save them as a large numpy array.

    python scripts/sample.py --model_path RUN/ema_0.9999_010000.pt --num_samples 100 \
        --use_ddim True --timestep_respacing ddim50 --log_dir OUT
    mpiexec -n 4 python scripts/sample.py ...        # same samples, a quarter of the work each
    python scripts/sample.py --model_path RUN/step010000.dcp ...   # a sharded step, as it is

A step of the sharded layout (--save_layout sharded) needs no consolidate: --model_path its
folder (its EMA; --weights model: the model's weights), a file it holds by its full-layout name
(RUN/step010000.dcp/ema_0.9999_010000.pt), or its manifest (RUN/manifest010000.json); it is
read in this process once its manifest matches every file of the folder.

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

Classifier-free guidance (a model trained with --class_dropout_prob > 0): --guidance_scale S
samples with eps = uncond + S * (cond - uncond), the conditional and the null-label pass in one
forward of a doubled batch. With learned sigma only the mean channels are guided and the
conditional variance is kept (DiT's choice). S = 1 (the default) is plain conditional sampling,
the very same samples; S = 0 is unconditional (the null label). Classifier guidance:
classifier_sample.py (which takes --guidance_scale too).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import sampling  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    FlagError,
    guidance_defaults,
    sample_defaults,
    model_and_diffusion_defaults,
)
from improved_diffusion.infra.flags import create_parser  # noqa: E402


def create_argparser():
    defaults = sample_defaults()
    defaults.update(guidance_defaults())
    defaults.update(model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="sample.py")


def main(argv=None):
    args, explicit = sampling.start_script(create_argparser(), argv)
    tags = {}
    model, diffusion, flags, names = sampling.load_model(args, explicit, tags)

    num_classes = flags["num_classes"] if flags["class_cond"] else None
    if args.classes and not num_classes:
        raise FlagError(
            f"--classes {args.classes}: the model is not class-conditional (class_cond=False)")
    classes = sampling.parse_classes(args.classes, num_classes) if num_classes else None
    forward = sampling.sampling_forward(model, flags, args.guidance_scale)
    sampling.sample_to_npz(
        args, model, diffusion, flags, num_classes=num_classes, classes=classes, forward=forward,
        class_names=names, vae=tags.get("vae"),
        guidance=(f"classifier-free guidance scale {args.guidance_scale}"
                  if args.guidance_scale != 1 else ""),
    )
    return 0


def run(argv=None):
    """Entry point: our errors become one `error: ...` line and a non-zero exit."""
    return sampling.run_script(main, argv)


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(run())
