r"""Like sample.py, but a noised image classifier guides the sampling towards each sample's label
(guided-diffusion's classifier guidance, with its flags).

    python scripts/classifier_sample.py --model_path RUN/ema_0.9999_010000.pt \
        --classifier_path CLS/model005000.pt --classifier_scale 3 --num_samples 100 --log_dir OUT
    mpiexec -n 4 python scripts/classifier_sample.py ...   # the same samples, a quarter each

    # guided-diffusion's published files, with its README's flags:
    python scripts/classifier_sample.py --model_path 64x64_diffusion.pt $MODEL_FLAGS \
        --classifier_path 64x64_classifier.pt --classifier_scale 1.0 --classifier_depth 4

Each step is pushed along the classifier's gradient: grad_x log p(y | x_t), times
--classifier_scale. Ancestral sampling shifts the mean by it (condition_mean), --use_ddim True
shifts the score (condition_score). Sample i's label is drawn from the classes the classifier
was trained on (or cycles through --classes); an unconditional model ignores it, a
class-conditional one is conditioned on it too, and with a model trained with
--class_dropout_prob, --guidance_scale adds classifier-free guidance (0: the null label, so the
classifier alone steers).

Files written by our trainers carry their flags (the model's and the classifier's); upstream's
raw files do not: pass the model flags and the classifier flags as with guided-diffusion's
classifier_sample.py (its published classifiers have 1000 classes, --classifier_num_classes'
default). The classifier must classify the model's --image_size and, when its file says, have
been trained on the model's noise process (--diffusion_steps, --noise_schedule); it is given the
original timestep indices, as guided-diffusion's classifiers were trained.

Output as sample.py's: ``samples_{N}x{H}x{W}x{C}.npz`` (``arr_0`` images, ``arr_1`` labels) and a
PNG grid in --log_dir. Per-sample seeds: the output does not depend on the number of ranks or on
--batch_size.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import guidance, logger, sampling  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    classifier_defaults,
    classifier_sample_defaults,
    guidance_defaults,
    model_and_diffusion_defaults,
    sample_defaults,
)
from improved_diffusion.infra.flags import create_parser  # noqa: E402


def create_argparser():
    defaults = sample_defaults()
    defaults.update(classifier_sample_defaults())
    defaults.update(guidance_defaults())
    defaults.update(model_and_diffusion_defaults())
    defaults.update(classifier_defaults())
    return create_parser(__doc__, defaults, prog="classifier_sample.py")


def main(argv=None):
    args, explicit = sampling.start_script(create_argparser(), argv)
    tags = {}
    model, diffusion, flags, names = sampling.load_model(args, explicit, tags)

    logger.log(f"loading classifier {args.classifier_path} ...")
    classifier, cflags = sampling.load_classifier(args.classifier_path, explicit, flags)
    if args.classifier_use_fp16:
        classifier.convert_to_fp16()
    num_classes = cflags["classifier_num_classes"]
    logger.log(f"classifier: {num_classes} classes, width {cflags['classifier_width']}, depth "
               f"{cflags['classifier_depth']}, pool {cflags['classifier_pool']}")
    if flags["class_cond"] and flags["num_classes"] != num_classes:
        raise sampling.SampleError(
            f"--classifier_path {args.classifier_path} has {num_classes} classes but the model "
            f"{flags['num_classes']}: the labels must mean the same to both; pass a classifier "
            "of the model's classes")
    classes = sampling.parse_classes(args.classes, num_classes)

    forward = sampling.sampling_forward(model, flags, args.guidance_scale)
    cond_fn = guidance.classifier_cond_fn(classifier, args.classifier_scale,
                                          timesteps=diffusion.original_timesteps)
    words = f"classifier scale {args.classifier_scale}"
    if args.guidance_scale != 1:
        words += f", classifier-free guidance scale {args.guidance_scale}"
    sampling.sample_to_npz(args, model, diffusion, flags, num_classes=num_classes,
                           classes=classes, forward=forward, cond_fn=cond_fn, guidance=words,
                           class_names=names if flags["class_cond"] else None,
                           vae=tags.get("vae"))
    return 0


def run(argv=None):
    """Entry point: our errors become one `error: ...` line and a non-zero exit."""
    return sampling.run_script(main, argv)


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(run())
