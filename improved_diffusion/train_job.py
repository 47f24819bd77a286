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
import shlex
from typing import Any, Callable, NamedTuple

from . import cli, dist_util, image_datasets, logger, train_eval, train_util
from .ckpt import checkpoint, checkpointer, preemption, run_lock
from .errors import UsageError, UserError
from .script_util import same_flag_value


class Parts(NamedTuple):
    """What a script builds from its flags for a TrainLoop."""

    model: Any
    diffusion: Any
    data: Any
    model_flags: dict
    schedule_sampler: Any = None  # None: uniform
    # --sample_interval: indices -> the model's keyword arguments for the grid's samples (None:
    # class labels for a class_cond model; TrainLoop's sample_kwargs)
    sample_kwargs: Any = None
    # DDP's find_unused_parameters for this model (None: --find_unused_parameters decides), for
    # a model that leaves some parameters out of the loss on some steps or ranks
    find_unused_parameters: Any = None


def check_train_args(args):
    """Resolve --log_dir and check the values argparse cannot (raises UsageError): the job's
    flags here, the training settings by building their TrainConfig (its one check of each)."""
    args.log_dir = args.log_dir or os.environ.get("OPENAI_LOGDIR", "")
    if not args.log_dir:
        raise UsageError("no log directory: pass --log_dir DIR (or set OPENAI_LOGDIR)")
    if not args.data_dir:
        raise UsageError("--data_dir is required: a folder of images")
    if args.lock_wait < 0:
        raise UsageError(f"--lock_wait must be >= 0 (got {args.lock_wait})")
    if args.num_workers < -1:
        raise UsageError(f"--num_workers must be -1 (auto) or >= 0 (got {args.num_workers})")
    if getattr(args, "log_format", "progress") not in ("progress", "table"):
        raise UsageError(f"--log_format must be progress or table (got {args.log_format!r})")
    if args.microbatch == 0 or args.microbatch < -1:
        raise UsageError(f"--microbatch must be -1 (off) or >= 1 (got {args.microbatch})")
    cli.check_dist_timeout(args.dist_timeout)
    config = train_util.TrainConfig.from_flags(args)
    train_eval.check_inputs(config)  # its files, before the log dir is touched


def num_classes(args):
    """--num_classes of the job (collective: call on all ranks): as given; for --class_cond True
    without it, the class count of the class-conditional checkpoint the job resumes (an error
    when --data_dir holds more classes than it was trained with), else the number of classes in
    --data_dir (image_datasets.resolve_num_classes). Each choice is logged once."""
    if not args.class_cond or args.num_classes is not None:
        return args.num_classes
    saved = checkpointer.saved_model_flags(args.log_dir, args.resume_checkpoint)
    n = (saved or {}).get("num_classes")
    return _resumed_or_data_classes(args, n if saved and saved.get("class_cond") else None,
                                    "--num_classes", "--class_cond True")


def classifier_num_classes(args):
    """--classifier_num_classes of a classifier job (collective: call on all ranks): as given
    (not None), else the class count of the classifier file the job resumes, else the number of
    classes in --data_dir, as num_classes() does for a class-conditional model."""
    if args.classifier_num_classes is not None:
        return args.classifier_num_classes
    saved = checkpointer.saved_model_flags(args.log_dir, args.resume_checkpoint)
    return _resumed_or_data_classes(args, (saved or {}).get("classifier_num_classes"),
                                    "--classifier_num_classes", "classifier_train.py")


def _resumed_or_data_classes(args, n, flag, who):
    """``n`` (the resumed checkpoint's class count, when a positive int) after checking that
    --data_dir holds no more classes, else the count of --data_dir's classes; logged once.
    Collective."""
    if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        return image_datasets.resolve_num_classes(args.data_dir, None, log=logger.log, who=who,
                                                  flag=flag.lstrip("-"))
    names = dist_util.run_on_rank0(lambda: image_datasets.folder_class_names(args.data_dir))
    if len(names) > n:
        raise UsageError(
            f"--data_dir {args.data_dir} holds {len(names)} classes, but the checkpoint to resume "
            f"was trained with {n}: pass {flag} {len(names)} --allow_model_change True to "
            f"grow it, or train on its {n} classes")
    logger.log(f"{who}: {flag.lstrip('-')}={n}, the checkpoint's ({len(names)} classes in "
               f"--data_dir {args.data_dir})")
    return n


class FlagClashError(UserError):
    """A flag typed with another value than the file it must agree with (exit 1)."""


def take_checkpoint_flags(args, given, kinds=("model", "ema"), resolved_later=("num_classes",)):
    """
    A resume needs no model flag retyped: each model or diffusion flag that the command line did
    not give (not in ``given``, the names typed) takes the value the checkpoint to resume records
    (the ``flags`` of its file, of one of ``kinds``), logged in one line (``resume: from the
    checkpoint (model000100.pt): --diffusion_steps 100 ...``); one given with another value than
    the checkpoint's is a FlagClashError naming both, unless --allow_model_change True (then the
    resume's change summary follows). The class count (``resolved_later``, when not given) is
    left to num_classes() / classifier_num_classes(), which take the checkpoint's and check it
    against --data_dir. Nothing happens for a fresh start or a file without flags. Changes
    ``args`` in place. Collective: call from all ranks with the same arguments.
    """
    found = checkpointer.saved_model_file_flags(args.log_dir, args.resume_checkpoint, kinds)
    if found is None:
        return
    path, saved = found
    skip = {k for k in resolved_later if k not in given}
    taken = adopt_flags(args, given, {k: v for k, v in saved.items() if k not in skip},
                        f"resume from {path}", "a resume takes its model flags from the file",
                        allow=args.allow_model_change, allow_hint="--allow_model_change True to "
                        "change the model")
    if getattr(args, "class_cond", False) and "num_classes" not in given:
        args.num_classes = None  # num_classes(): the checkpoint's, checked against --data_dir
    if taken:
        logger.log(f"resume: from the checkpoint ({checkpoint.basename(path)}): "
                   f"{flags_text(taken)}")
    return taken


def adopt_flags(args, given, saved, where, why, allow=False, allow_hint=None):
    """Give each flag of ``saved`` ({name: value}) that ``args`` has and the command line did
    not give (``given``) the saved value; one given with another value is a FlagClashError
    naming both (``where``: the file, ``why``: the rule), unless ``allow``. Returns the flags
    taken ({name: value}). Not collective."""
    taken, clash = {}, {}
    for k, v in saved.items():
        if not hasattr(args, k) or same_flag_value(getattr(args, k), v):
            continue
        if k in given:
            clash[k] = (getattr(args, k), v)
        else:
            taken[k] = v
    if clash and not allow:
        shown = ", ".join(f"--{k} {shlex.quote(str(a))} (the file's: {shlex.quote(str(b))})"
                          for k, (a, b) in clash.items())
        hint = f", or pass {allow_hint}" if allow_hint else ""
        raise FlagClashError(f"{where}: {shown}; leave the flag out to take the file's value "
                             f"({why}){hint}")
    for k, v in taken.items():
        setattr(args, k, v)
    return taken


def flags_text(flags):
    """{name: value} as command-line text: ``--diffusion_steps 100 --noise_schedule cosine``."""
    return " ".join(f"--{k} {shlex.quote(str(v))}" for k, v in flags.items())


def start_job(args):
    """
    Set up the process group and take the log dir's lock (before anything touches the log dir),
    then configure the logger. Returns the lock: release it when the job ends. ``--deterministic``
    is applied first, before CUDA or the process group exist.

    Collective: call from all ranks with the same arguments.
    """
    dist_util.set_deterministic(getattr(args, "deterministic", False))
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
    """The TrainLoop of ``parts`` with the training settings of ``args`` (resumes; collective)."""
    overrides = ({} if parts.find_unused_parameters is None
                 else {"find_unused_parameters": bool(parts.find_unused_parameters)})
    config = train_util.TrainConfig.from_flags(args, **overrides)
    return train_util.TrainLoop(
        model=parts.model, diffusion=parts.diffusion, data=parts.data,
        schedule_sampler=parts.schedule_sampler, model_flags=parts.model_flags,
        sample_kwargs=parts.sample_kwargs, **config.flags())


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


def run_training(args, build: Callable[[Any], Parts], given=None):
    """The whole job (see the module docstring); returns 0, or 75 after a preemption save.
    ``given``: the flags typed on the command line (flags.explicit_args); then a resume
    takes the others' values from the checkpoint first (take_checkpoint_flags).

    Collective: call from all ranks with the same arguments.
    """
    lock = start_job(args)
    try:
        if given is not None:
            take_checkpoint_flags(args, given)
        parts = build(args)
        preemption.check()
        loop = make_loop(args, parts)
        try:
            preemption.check()
        except BaseException:
            loop.close(sync=False)
            raise
        logger.start_progress(loop.step, loop.config.last_step)
        return run_and_close(loop)
    finally:
        lock.release()
