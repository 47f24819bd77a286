r"""Train a super-resolution model (upstream's super_res_train.py, with our resumable loop).

    mpiexec -n N python scripts/super_res_train.py --data_dir D --log_dir L \
        --large_size 256 --small_size 64 $MODEL_FLAGS $DIFFUSION_FLAGS $TRAIN_FLAGS

The model learns p(high-res | low-res): each training batch of --large_size images is paired with
its own --small_size version (area downsampling), passed to the model as ``low_res``. Training
flags, checkpoints, auto-resume, preemption (exit 75) and exit codes are those of scripts/train.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # first, before torch is imported: SIGTERM/SIGUSR1 from here on
    from improved_diffusion.infra import preemption  # end the job with exit 75 (preemption.py)

    preemption.install()

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, logger, train_job, train_util  # noqa: E402
from improved_diffusion.infra.errors import UsageError  # noqa: E402
from improved_diffusion.image_datasets import load_data  # noqa: E402
from improved_diffusion.resample import create_named_schedule_sampler  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    sr_create_model_and_diffusion,
    sr_model_and_diffusion_defaults,
    train_defaults,
)
from improved_diffusion.infra.flags import args_to_dict, create_parser, explicit_args  # noqa: E402


class SuperResLoader:
    """Wraps a ResumableLoader: yields (large batch [B,C,H,W], cond + {"low_res": [B,C,h,w]}).

    Everything else (position, state_dict, load_state_dict, last_indices, ...) is the wrapped
    loader's, so the training loop resumes it exactly as a plain loader.
    """

    def __init__(self, loader, small_size):
        self.__dict__["_loader"] = loader
        self.__dict__["_small_size"] = int(small_size)

    def __iter__(self):
        return self

    def __next__(self):
        large_batch, model_kwargs = next(self._loader)
        model_kwargs = dict(model_kwargs)
        model_kwargs["low_res"] = F.interpolate(large_batch, self._small_size, mode="area")
        return large_batch, model_kwargs

    def __getattr__(self, name):
        return getattr(self.__dict__["_loader"], name)

    def __setattr__(self, name, value):
        setattr(self._loader, name, value)


def load_superres_data(data_dir, batch_size, large_size, small_size, class_cond=False, seed=0,
                       num_workers=0, num_classes=None):
    """Upstream's load_superres_data, resumable: a SuperResLoader over load_data(large_size)."""
    data = load_data(data_dir=data_dir, batch_size=batch_size, image_size=large_size,
                     class_cond=class_cond, seed=seed, num_workers=num_workers,
                     num_classes=num_classes if class_cond else None,
                     log=logger.warn)  # a resume's data warnings: one line, once for the job
    return SuperResLoader(data, small_size)


def low_res_of(dataset, small_size):
    """--sample_interval's model arguments: grid sample i upsamples image i (modulo the count) of
    ``dataset`` in its fixed file order, at --small_size (+ its class "y" for class_cond data):
    indices [n] -> {"low_res": [n, C, h, w], ("y": [n])}."""
    def kwargs(indices):
        items = [dataset[int(i) % len(dataset)] for i in indices]
        large = th.from_numpy(np.stack([arr for arr, _ in items]))
        out = {"low_res": F.interpolate(large, small_size, mode="area")}
        if "y" in items[0][1]:
            out["y"] = th.tensor([int(cond["y"]) for _, cond in items], dtype=th.long)
        return out
    return kwargs


def create_argparser():
    defaults = train_defaults()
    defaults.update(sr_model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="super_res_train.py")


def build(args):
    """Flags -> the super-res model, diffusion and data of a TrainLoop (collective)."""
    logger.log(f"super-res {args.small_size}->{args.large_size}")
    args.num_classes = train_job.num_classes(args)
    model_flags = args_to_dict(args, sr_model_and_diffusion_defaults().keys())
    train_util.seed_rngs(args.seed, 0, 0)  # identical model init on every rank
    model, diffusion = sr_create_model_and_diffusion(**model_flags)
    model.to(dist_util.dev())
    data = load_superres_data(args.data_dir, args.batch_size, args.large_size, args.small_size,
                              class_cond=args.class_cond, seed=args.seed,
                              num_workers=args.num_workers, num_classes=args.num_classes)
    sampler = create_named_schedule_sampler(args.schedule_sampler, diffusion)
    return train_job.Parts(model, diffusion, data, model_flags, sampler,
                           sample_kwargs=low_res_of(data.dataset, args.small_size))


def train(argv=None):
    parser = create_argparser()
    args = parser.parse_args(argv)
    given = explicit_args(parser, argv)  # a resume takes the others from the checkpoint
    if args.class_cond and "num_classes" not in given:
        args.num_classes = None  # build(): the resumed checkpoint's, else --data_dir's
    return train_job.run_training(args, build, given, check=check_args)


def check_args(args):
    """train.py's checks and the super-resolution ones (raises UsageError); run on the flags as
    typed and again on those a resume took (train_job.run_training)."""
    if args.eval_interval:
        raise UsageError(
            f"--eval_interval {args.eval_interval}: FID while training is train.py's (a "
            f"super-resolution model's samples need their low-resolution inputs); sample with "
            f"super_res_sample.py and score the npz with scripts/evaluate.py")
    train_job.check_train_args(args)
    if args.small_size >= args.large_size:
        raise UsageError(
            f"--small_size {args.small_size} must be smaller than --large_size {args.large_size}")


def main(argv=None):
    return cli.run_main(train, argv)


if __name__ == "__main__":
    cli.exit_process(main())
