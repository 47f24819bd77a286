"""
A training job from parsed flags to an exit code: what scripts/train.py and
scripts/super_res_train.py share, so that no script imports another.

    args = parser.parse_args(argv)          # script_util.train_defaults() + the model's flags
    given = explicit_args(parser, argv)     # a resume takes the others from its checkpoint
    return run_training(args, build, given, check=check_train_args)  # build(args) -> Parts

The story of a job: the process group (bounded by --dist_timeout), the log dir's lock (one job per
log dir, --lock_wait), the logger, the model and data (``build``), the TrainLoop (which resumes),
the loop, then DDP and the process group are taken down and the lock is released. A preemption
signal before the loop ends the job at the next of preemption.check()'s points (after the
rendezvous, each second of the lock wait, after ``build``, after the resume) with exit 75 and
nothing new in the log dir; in the loop, the loop saves first (preemption.py).
"""
import copy
import os
import shlex
from typing import Any, Callable, NamedTuple

from .infra import cli
from . import dist_util, image_datasets, logger, train_eval, train_util, virtual_shards
from .ckpt import checkpoint, checkpointer, run_dir, run_lock
from .infra import preemption
from .infra.errors import UsageError, UserError
from .script_util import (DIFFUSION_FLAG_KEYS, JOB_FLAGS, run_flag_keys, same_flag_value,
                          train_defaults)


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


def check_job_flags(args):
    """Resolve --log_dir and check the job's own flags (script_util.JOB_FLAGS, never taken from
    a checkpoint), which the job needs before it starts (raises UsageError)."""
    args.log_dir = args.log_dir or os.environ.get("OPENAI_LOGDIR", "")
    if not args.log_dir:
        raise UsageError("no log directory: pass --log_dir DIR (or set OPENAI_LOGDIR)")
    if args.lock_wait < 0:
        raise UsageError(f"--lock_wait must be >= 0 (got {args.lock_wait})")
    if args.num_workers < -1:
        raise UsageError(f"--num_workers must be -1 (auto) or >= 0 (got {args.num_workers})")
    if getattr(args, "log_format", "progress") not in ("progress", "table"):
        raise UsageError(f"--log_format must be progress or table (got {args.log_format!r})")
    cli.check_dist_timeout(args.dist_timeout)


def check_train_args(args):
    """Check the values argparse cannot (raises UsageError): the job's flags (check_job_flags),
    then the training settings by building their TrainConfig (its one check of each). A local
    --eval_ref_batch is made absolute first: the manifests record it for a resume, which may
    run from another directory."""
    check_job_flags(args)
    from .infra import storage

    ref = getattr(args, "eval_ref_batch", "")
    if ref and not storage.is_remote(ref):
        args.eval_ref_batch = os.path.abspath(ref)
    if not args.data_dir:
        raise UsageError("--data_dir is required: a folder of images")
    if args.microbatch == 0 or args.microbatch < -1:
        raise UsageError(f"--microbatch must be -1 (off) or >= 1 (got {args.microbatch})")
    virtual_shards.resolve_batch_flags(args)  # --global_batch_size: --batch_size is G/ranks
    config = train_util.TrainConfig.from_flags(args)
    train_eval.check_inputs(config)  # its files, before the log dir is touched


def check_before_start(args, check, take=None):
    """Run ``check(args)`` (a script's flag checks) before the job touches anything. When it
    fails and the command may resume a checkpoint (run_dir.may_resume: names only, on this
    rank), the flags the command left out are the checkpoint's, not the defaults the check saw
    (a resume typing --large_size 16 is no error against the default --small_size 64): with
    ``take`` (a function that gives a Namespace the flags the resume takes, e.g.
    take_checkpoint_flags with the flags typed), they are taken now on a copy of ``args``,
    quietly and by every rank itself (no process group yet), and the check runs again on it,
    so that an error that stands with the checkpoint's flags too is raised before anything is
    written (a log.txt in a new --log_dir). The job takes them for real, logged, once it holds
    its log dir, and checks again. Raises the check's error for a fresh start; the job's own
    flags (check_job_flags) are checked first in any case. Not collective."""
    check_job_flags(args)
    try:
        check(args)
    except UsageError:
        if not run_dir.may_resume(args.log_dir, getattr(args, "resume_checkpoint", "")):
            raise
        if take is None:
            return
        resumed = copy.copy(args)
        with logger.quiet():
            take(resumed)
        check(resumed)


def run_flags(args, defaults=None):
    """{flag: value} of ``args``'s run settings: the flags of ``defaults`` (train_defaults())
    but the job's own (script_util.run_flag_keys), which the steps' manifests record for a
    resume to take back."""
    return {k: getattr(args, k) for k in run_flag_keys(defaults or train_defaults())
            if hasattr(args, k)}


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
            f"was trained with {n}: pass {flag} {len(names)} --allow_model_change True "
            f"--class_map keep to grow it (the checkpoint's labels kept by name), or train on "
            f"its {n} classes")
    logger.log(f"{who}: {flag.lstrip('-')}={n}, the checkpoint's ({len(names)} classes in "
               f"--data_dir {args.data_dir})")
    return n


class FlagClashError(UserError):
    """A flag typed with another value than the file it must agree with (exit 1)."""


def take_checkpoint_flags(args, given, kinds=("model", "ema"), resolved_later=("num_classes",)):
    """
    A resume needs no flag retyped. Each flag the command line did not give (not in ``given``,
    the names typed) takes the value the checkpoint to resume records: the model and diffusion
    flags (the ``flags`` of its file, of one of ``kinds``) and the run's settings (the
    ``run_flags`` of its step's manifest: --lr, --batch_size, --ema_rate, --max_steps, the
    intervals, ... all but script_util.JOB_FLAGS), from the step the resume will load
    (run_dir.likely_resume_model),
    logged in one line (``resume: from the checkpoint (model000100.pt): --diffusion_steps 100
    --lr 0.002 ...``). A model flag typed with another value than the file's is a
    FlagClashError naming both, unless --allow_model_change True (then the resume's change
    summary follows); a run setting typed with another value is the resume's to use, and the
    resume logs it (``resume: --lr A -> B``, Checkpointer). The class count (``resolved_later``,
    when not given) is left to num_classes() / classifier_num_classes(), which take the
    checkpoint's and check it against --data_dir. Nothing happens for a fresh start or a file
    without flags (upstream's: every flag as typed or its default, as upstream). Changes
    ``args`` in place; returns the flags taken ({name: value}) or None.
    Collective: call from all ranks with the same arguments.
    """
    found = checkpointer.saved_file_flags(args.log_dir, args.resume_checkpoint, kinds)
    if found is None:
        return None
    path, saved, saved_run = found
    if getattr(saved_run, "source", None) == "trainer":
        _check_trainer_settings(args, given, path, saved_run)
    skip = {k for k in resolved_later if k not in given}
    taken = adopt_flags(args, given, {k: v for k, v in saved.items() if k not in skip},
                        f"resume from {path}", "a resume takes its model flags from the file",
                        allow=args.allow_model_change, allow_hint=_allow_hint)
    if getattr(args, "class_cond", False) and "num_classes" not in given:
        args.num_classes = None  # num_classes(): the checkpoint's, checked against --data_dir
    for k, v in saved_run.items():
        if (k not in JOB_FLAGS and k not in given and hasattr(args, k)
                and not same_flag_value(getattr(args, k), v, k)):
            setattr(args, k, v)
            taken[k] = v
    _full_layout_without_fsdp(args, taken)  # the resume logs the change (Checkpointer)
    if getattr(args, "global_batch_size", 0):  # a run with G: the per-rank batch is G / this
        virtual_shards.resolve_batch_flags(args)  # job's ranks, derived, never typed: not listed
        taken.pop("batch_size", None)
    if taken:
        logger.log(f"resume: from the checkpoint ({checkpoint.basename(path)}): "
                   f"{flags_text(taken)}")
    if "deterministic" in taken:  # start_job applied the default: apply the run's now
        dist_util.set_deterministic(args.deterministic)
    return taken


# Run settings that a resume must not take from their defaults when the step does not record
# them: where the run ends (the default trains forever).
MUST_BE_RECORDED = ("max_steps",)


def _check_trainer_settings(args, given, path, settings):
    """A step whose manifest records no run settings (an older release's): they come from the
    trainer state of its opt file (run_dir.step_settings), logged once as such; one that it
    does not record either, of MUST_BE_RECORDED, and not typed is a UsageError naming the flag
    to type."""
    step = checkpoint.name_info(checkpoint.basename(path)).step
    missing = [k for k in MUST_BE_RECORDED if hasattr(args, k) and k not in given
               and k not in settings]
    if missing:
        raise UsageError(
            f"resume from {path}: its step's manifest records no run settings (an older "
            f"release wrote it) and its trainer state does not record "
            f"{', '.join('--' + k for k in missing)}: type {' '.join(f'--{k} N' for k in missing)}"
            f" (--max_steps 0: no end); the other settings are taken from its trainer state")
    logger.log(f"resume: {checkpoint.manifest_filename(step)} records no run settings (an older "
               f"release's): taken from the trainer state of {checkpoint.opt_filename(step)}; "
               f"the settings it does not record are as typed or their defaults")


def _full_layout_without_fsdp(args, taken):
    """A run saved in the sharded layout resumed with --fsdp False (typed, or not recorded):
    its --save_layout sharded, taken from the checkpoint, becomes full from here on (a whole
    model per rank has no shards; the sharded step itself loads into the whole model), which
    the resume logs in one line (``resume: --save_layout sharded -> full (...)``)."""
    if taken.get("save_layout") == "sharded" and not getattr(args, "fsdp", True):
        args.save_layout = "full"
        del taken["save_layout"]


def _allow_hint(clash):
    """The --allow_model_change hint of a model-flag clash ({name: (typed, file's)}): a change
    of the model's tensors, or (diffusion flags alone) of the noise process its weights train
    under, which every tensor still fits but the output layer when --learn_sigma changes (its
    channels: it starts fresh)."""
    if set(clash) <= set(DIFFUSION_FLAG_KEYS):
        fits = ("every tensor but the output layer still fits: --learn_sigma changes its "
                "channels, so it starts fresh" if "learn_sigma" in clash
                else "every tensor still fits")
        return ("--allow_model_change True to train these weights on under the new noise "
                f"process ({fits}; the change is logged and recorded)")
    return "--allow_model_change True to change the model"


def adopt_flags(args, given, saved, where, why, allow=False, allow_hint=None, sources=None):
    """Give each flag of ``saved`` ({name: value}) that ``args`` has and the command line did
    not give (``given``) the saved value; one given with another value is a FlagClashError
    naming both (``where``: the file, ``why``: the rule), unless ``allow``. ``sources``:
    {name: where its value came from} for the names in ``given`` that were not typed but taken
    from another file (a resumed checkpoint): the error names that file instead of telling to
    leave the flag out. ``allow_hint``: text, or a function of the clash ({name: (value, saved
    value)}) giving it. Returns the flags taken ({name: value}). Not collective."""
    taken, clash = {}, {}
    sources = sources or {}
    for k, v in saved.items():
        if not hasattr(args, k) or same_flag_value(getattr(args, k), v, k):
            continue
        if k in given:
            clash[k] = (getattr(args, k), v)
        else:
            taken[k] = v
    if clash and not allow:
        typed = {k: ab for k, ab in clash.items() if k not in sources}
        shown = ", ".join(
            f"--{k} {shlex.quote(str(a))}" + (f" (from {sources[k]})" if k in sources else "")
            + f" (the file's: {shlex.quote(str(b))})" for k, (a, b) in clash.items())
        hint = allow_hint(clash) if callable(allow_hint) else allow_hint
        hint = f", or pass {hint}" if hint else ""
        advice = ("leave the flag out to take the file's value" if typed
                  else "the two files disagree: give one that agrees, or start a new run in "
                       "another --log_dir")
        raise FlagClashError(f"{where}: {shown}; {advice} ({why}){hint}")
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
    """The TrainLoop of ``parts`` with the training settings of ``args`` (resumes; collective);
    its steps' manifests record the run's settings (run_flags) for a resume to take back."""
    overrides = ({} if parts.find_unused_parameters is None
                 else {"find_unused_parameters": bool(parts.find_unused_parameters)})
    config = train_util.TrainConfig.from_flags(args, **overrides)
    return train_util.TrainLoop(
        model=parts.model, diffusion=parts.diffusion, data=parts.data,
        schedule_sampler=parts.schedule_sampler, model_flags=parts.model_flags,
        sample_kwargs=parts.sample_kwargs, run_settings=run_flags(args),
        **config.flags())


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


def run_training(args, build: Callable[[Any], Parts], given=None, check=None):
    """The whole job (see the module docstring); returns 0, or 75 after a preemption save.
    ``given``: the flags typed on the command line (flags.explicit_args); then a resume
    takes the others' values from the checkpoint first (take_checkpoint_flags). ``check``: the
    script's flag checks (check_train_args, or its own), run before the job starts (see
    check_before_start) and again on the flags the resume took.

    Collective: call from all ranks with the same arguments.
    """
    if given is not None:
        virtual_shards.refuse_batch_size(args, given)
    if check is not None:
        check_before_start(args, check, None if given is None else
                           lambda resumed: take_checkpoint_flags(resumed, given))
    lock = start_job(args)
    try:
        if given is not None:
            take_checkpoint_flags(args, given)
            virtual_shards.refuse_batch_size(args, given)
        if check is not None:
            check(args)
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
