"""
A training job from parsed flags to an exit code: what scripts/train.py and
scripts/super_res_train.py share, so that no script imports another.

    args = parser.parse_args(argv)          # script_util.train_defaults() + the model's flags
    check_train_args(args)
    return run_training(args, build)        # build(args) -> Parts(model, diffusion, data, flags)

The story of a job: the process group (bounded by --dist_timeout), the log dir's lock (one job per
log dir, --lock_wait), the logger, the model and data (``build``), the TrainLoop (which resumes),
the loop, then DDP and the process group are taken down and the lock is released. A preemption
signal before the loop ends the job at the next of preemption.check()'s points (after the
rendezvous, each second of the lock wait, after ``build``, after the resume) with exit 75 and
nothing new in the log dir; in the loop, the loop saves first (preemption.py).
"""
import os
from typing import Any, Callable, NamedTuple

from . import cli, dist_util, logger, preemption, run_lock, train_util
from .errors import UsageError


class Parts(NamedTuple):
    """What a script builds from its flags for a TrainLoop."""

    model: Any
    diffusion: Any
    data: Any
    model_flags: dict
    schedule_sampler: Any = None  # None: uniform


def check_train_args(args):
    """Resolve --log_dir and check the values argparse cannot (raises UsageError)."""
    args.log_dir = args.log_dir or os.environ.get("OPENAI_LOGDIR", "")
    if not args.log_dir:
        raise UsageError("no log directory: pass --log_dir DIR (or set OPENAI_LOGDIR)")
    if not args.data_dir:
        raise UsageError("--data_dir is required: a folder of images")
    for name in ("batch_size", "log_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    for name in ("save_interval", "max_steps", "keep_checkpoints", "lr_anneal_steps",
                 "lock_wait"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if args.num_workers < -1:
        raise UsageError(f"--num_workers must be -1 (auto) or >= 0 (got {args.num_workers})")
    if args.nan_policy not in train_util.NAN_POLICIES:
        raise UsageError(f"--nan_policy must be one of {', '.join(train_util.NAN_POLICIES)} "
                         f"(got {args.nan_policy!r})")
    if getattr(args, "log_format", "progress") not in ("progress", "table"):
        raise UsageError(f"--log_format must be progress or table (got {args.log_format!r})")
    if args.microbatch == 0 or args.microbatch < -1:
        raise UsageError(f"--microbatch must be -1 (off) or >= 1 (got {args.microbatch})")
    cli.check_dist_timeout(args.dist_timeout)


def start_job(args):
    """
    Set up the process group and take the log dir's lock (before anything touches the log dir),
    then configure the logger. Returns the lock: release it when the job ends.

    Collective: call from all ranks with the same arguments.
    """
    dist_util.setup_dist(timeout=args.dist_timeout)
    preemption.check()
    lock = run_lock.acquire_for_job(args.log_dir, args.lock_wait)
    try:
        logger.configure(dir=args.log_dir, stdout_format=getattr(args, "log_format", "progress"))
        logger.log(f"training on {dist_util.get_world_size()} rank(s), device {dist_util.dev()}")
    except BaseException:
        lock.release()
        raise
    return lock


def make_loop(args, parts):
    """The TrainLoop of ``parts`` with the training flags of ``args`` (resumes; collective)."""
    return train_util.TrainLoop(
        model=parts.model, diffusion=parts.diffusion, data=parts.data,
        batch_size=args.batch_size, microbatch=args.microbatch, lr=args.lr,
        ema_rate=args.ema_rate, log_interval=args.log_interval,
        save_interval=args.save_interval, resume_checkpoint=args.resume_checkpoint,
        use_fp16=args.use_fp16, fp16_scale_growth=args.fp16_scale_growth,
        schedule_sampler=parts.schedule_sampler, weight_decay=args.weight_decay,
        lr_anneal_steps=args.lr_anneal_steps, log_dir=args.log_dir,
        model_flags=parts.model_flags, max_steps=args.max_steps, seed=args.seed,
        keep_checkpoints=args.keep_checkpoints,
        log_sample_indices=getattr(args, "log_sample_indices", False),
        nan_policy=args.nan_policy,
        allow_model_change=getattr(args, "allow_model_change", False),
        async_save=getattr(args, "async_save", True),
        compile=getattr(args, "compile", False),
    )


def run_and_close(loop):
    """Run a TrainLoop, then take down DDP and the process group; returns the loop's exit code."""
    try:
        code = loop.run_loop()
    except BaseException:
        loop.close(sync=False)  # no collective here: other ranks may be elsewhere
        raise
    loop.close()
    dist_util.cleanup()
    return code


def run_training(args, build: Callable[[Any], Parts]):
    """The whole job (see the module docstring); returns 0, or 75 after a preemption save.

    Collective: call from all ranks with the same arguments.
    """
    lock = start_job(args)
    try:
        parts = build(args)
        preemption.check()
        loop = make_loop(args, parts)
        try:
            preemption.check()
        except BaseException:
            loop.close(sync=False)
            raise
        logger.start_progress(loop.step, min(
            [n for n in (args.max_steps, args.lr_anneal_steps) if n > 0], default=0))
        return run_and_close(loop)
    finally:
        lock.release()
