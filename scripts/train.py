"""Train a diffusion model on images (upstream's image_train.py; resume works on any rank count).

    mpiexec -n N python scripts/train.py --data_dir D --log_dir L $MODEL_FLAGS $DIFFUSION_FLAGS \
        $TRAIN_FLAGS [--resume_checkpoint auto|L/modelNNNNNN.pt] [--max_steps N]

Exit codes: 0 done; 75 (train_util.PREEMPTED_EXIT_CODE) after a SIGTERM/SIGUSR1 save;
1 on errors (one line "error: ..." on stderr from each failing rank); 2 bad usage; 130 after a
KeyboardInterrupt (a SystemExit keeps its code) on any rank, which ends every rank.

--dist_timeout SECONDS (default 600) bounds the rendezvous and every wait between ranks: a rank or
host that dies ends the job within about that long, with a message naming the lost rank(s). Under
a multi-host mpiexec, set MASTER_ADDR to an address of rank 0's host that every host can reach
when it cannot be found (the job says so at once).
"""
import argparse
import os
import sys

import blobfile as bf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import (  # noqa: E402
    checkpoint, cli, dist_util, logger, run_lock, train_util)
from improved_diffusion.cli import UsageError  # noqa: E402
from improved_diffusion.image_datasets import load_data  # noqa: E402
from improved_diffusion.resample import create_named_schedule_sampler  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    FlagError,
    add_dict_to_argparser,
    args_to_dict,
    create_model_and_diffusion,
    model_and_diffusion_defaults,
)


def train_defaults():
    return dict(
        data_dir="",
        schedule_sampler="uniform",
        lr=1e-4,
        weight_decay=0.0,
        lr_anneal_steps=0,
        batch_size=1,
        microbatch=-1,  # -1 disables microbatches
        ema_rate="0.9999",  # comma-separated list of EMA values
        log_interval=10,
        save_interval=10000,
        resume_checkpoint="",
        use_fp16=False,
        fp16_scale_growth=1e-3,
        log_dir="",
        max_steps=0,
        seed=0,
        keep_checkpoints=0,
        num_workers=0,
        # Append this rank's dataset indices of every step to {log_dir}/sample_indices/rank{r}.csv
        # as "step,idx1,idx2,...", where step is the completed-step count after that batch.
        log_sample_indices=False,
        # A step with a NaN/Inf loss or gradient (without --use_fp16's GradScaler, which skips
        # such steps itself): "stop" ends the run (exit 1) naming the step, saving nothing for it;
        # "skip" leaves weights, optimizer and EMA unchanged for that step and goes on.
        nan_policy="stop",
        # Seconds to wait for another job that holds --log_dir (one job per log dir) before failing.
        lock_wait=300.0,
        # Seconds any wait between ranks may take (rendezvous, each collective): a dead rank or
        # host ends the job within about this long, naming it.
        dist_timeout=600.0,
    )


def create_argparser():
    defaults = train_defaults()
    defaults.update(model_and_diffusion_defaults())
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_dict_to_argparser(parser, defaults)
    return parser


def check_args(args):
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
                 "num_workers"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if args.nan_policy not in train_util.NAN_POLICIES:
        raise UsageError(f"--nan_policy must be one of {', '.join(train_util.NAN_POLICIES)} "
                         f"(got {args.nan_policy!r})")
    if args.lock_wait < 0:
        raise UsageError(f"--lock_wait must be >= 0 seconds (got {args.lock_wait})")
    if args.microbatch == 0 or args.microbatch < -1:
        raise UsageError(f"--microbatch must be -1 (off) or >= 1 (got {args.microbatch})")
    cli.check_dist_timeout(args.dist_timeout)


def build_train_loop(args):
    """Everything between flags and TrainLoop (collective: call on all ranks). Returns TrainLoop,
    holding the log dir's lock in ``loop.log_dir_lock`` (release it when the job ends)."""
    dist_util.setup_dist(timeout=args.dist_timeout)
    # One job per log dir: taken before anything touches the log dir.
    lock = run_lock.acquire_for_job(args.log_dir, args.lock_wait)
    try:
        loop = _build_train_loop(args)
    except BaseException:
        lock.release()
        raise
    loop.log_dir_lock = lock
    return loop


def _build_train_loop(args):
    logger.configure(dir=args.log_dir)
    logger.log(f"training on {dist_util.get_world_size()} rank(s), device {dist_util.dev()}")

    model_flags = args_to_dict(args, model_and_diffusion_defaults().keys())
    train_util.seed_rngs(args.seed, 0, 0)  # identical model init on every rank
    model, diffusion = create_model_and_diffusion(**model_flags)
    model.to(dist_util.dev())
    schedule_sampler = create_named_schedule_sampler(args.schedule_sampler, diffusion)

    data = load_data(
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        image_size=args.image_size,
        class_cond=args.class_cond,
        num_classes=args.num_classes if args.class_cond else None,
        seed=args.seed,
        num_workers=args.num_workers,
    )
    return train_util.TrainLoop(
        model=model,
        diffusion=diffusion,
        data=data,
        batch_size=args.batch_size,
        microbatch=args.microbatch,
        lr=args.lr,
        ema_rate=args.ema_rate,
        log_interval=args.log_interval,
        save_interval=args.save_interval,
        resume_checkpoint=args.resume_checkpoint,
        use_fp16=args.use_fp16,
        fp16_scale_growth=args.fp16_scale_growth,
        schedule_sampler=schedule_sampler,
        weight_decay=args.weight_decay,
        lr_anneal_steps=args.lr_anneal_steps,
        log_dir=args.log_dir,
        model_flags=model_flags,
        max_steps=args.max_steps,
        seed=args.seed,
        keep_checkpoints=args.keep_checkpoints,
        log_sample_indices=args.log_sample_indices,
        nan_policy=args.nan_policy,
    )


# One-line errors: usage (exit 2) and runtime (exit 1); anything else keeps its traceback.
USAGE_ERRORS = (FlagError,)
# bf.Error: remote storage (gs://, az://) refused or failed; NonFiniteError: --nan_policy stop,
# or weights that went NaN/Inf before a save.
RUNTIME_ERRORS = (dist_util.DistMismatchError, checkpoint.CheckpointError, run_lock.LockError,
                  ValueError, OSError, bf.Error, train_util.NonFiniteError)


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


def train(argv=None):
    """Parse flags, build the loop, run it; returns the exit code (0 done, 75 preempted)."""
    args = create_argparser().parse_args(argv)
    check_args(args)
    loop = build_train_loop(args)
    try:
        return run_and_close(loop)
    finally:
        loop.log_dir_lock.release()


def main(argv=None):
    return cli.run_main(train, argv, usage_errors=USAGE_ERRORS, runtime_errors=RUNTIME_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
