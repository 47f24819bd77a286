"""
The one owner of a run's checkpoint state: the resume and the save, for any loop and any model.

A training loop hands the checkpointer what it trains and calls it a few times; it holds no
checkpoint code of its own::

    with Checkpointer(CheckpointConfig.from_flags(args), model=model, optimizer=opt,
                      emas={"0.9999": ema_params}, data=loader, batch_size=args.batch_size,
                      seed=args.seed, states={"schedule_sampler": sampler}) as ckpt:
        step = ckpt.resume()                   # 0 on a fresh start
        with ckpt.watch_signals():             # SIGTERM/SIGUSR1 on any rank: save, then stop
            while step < max_steps:
                ckpt.step_begins()
                ...one optimizer step...
                step += 1
                if ckpt.step_ends(step):       # saves every save_interval; True: preempted
                    return PREEMPTED_EXIT_CODE #   and saved: requeue the job on exit 75
        ckpt.save(step, wait=True)             # the final step, complete on disk
                                               # leaving the block waits for the last save

Every method that takes part in it is collective: call it from all ranks, in the same order, with
the same arguments (docs/ARCHITECTURE.md, "Distributed rules"). What it knows nothing of: the loss,
the model's kind, diffusion. What it is given:

- ``model``: the bare module (no DDP or torch.compile wrapper). Its whole state dict is saved
  (parameters and buffers: BatchNorm statistics, frozen parameters such as DiT's pos_embed) as on
  rank 0; DDP broadcasts rank 0's buffers at every forward, so rank 0's are the run's.
- ``optimizer``: any torch optimizer over the model's parameters. Its state is saved keyed by
  parameter name (optim_state.py) and follows each name into whatever param group it sits in on
  resume; the groups' hyperparameters are the run's (built from its flags), not the file's.
- ``emas``: {rate string: [tensor, ...] in ``model.parameters()`` order} (optional). The EMA files
  keep upstream's rule: the EMA of the parameters, the buffers of the live model. On resume the
  tensors are overwritten in place, so the loop's references stay valid.
- ``data``: the loader (optional). With state_dict()/load_state_dict() (image_datasets's
  ResumableLoader) its position is restored exactly; a plain iterator (upstream's load_data) is
  recorded as not restorable and a resume reseeds the RNGs from (seed, step, rank).
- ``states``: {name: object with state_dict()/load_state_dict(), or None} for anything else the
  loop wants back exactly (the timestep sampler, the GradScaler, a user's own counters). A state
  whose saved dict carries a "name" that differs from the run's (a changed --schedule_sampler) is
  not restored, with one log line; None means "this run has none" (a GradScaler without
  --use_fp16). Such an object may also define (each optional):
  ``save_files(step)`` -> {file name: payload}: files that join the save of ``step`` (called on
  rank 0, on every rank for a sharded model; names of a checkpoint kind, checkpoint.name_info;
  written with the step's other files, whole beside the folder in the sharded layout, listed in
  its manifest, host-copied for async saves like them); ``finite_tensors()`` ->
  {label: [tensor]}: checked on every rank before every save with the weights (a NaN/Inf refuses
  the save, naming the label); ``resume_without_state(step)``: called instead of starting it
  fresh when the resumed step holds no state for it (raise a UserError to refuse the resume).
  train_util's post-hoc EMA (phema.RunTracker) is such a state.
- ``run_flags``: {flag: value} of the settings the training math depends on (--lr, ...). They are
  recorded in the trainer state, and a resume with other values logs one line for each
  (``resume: --lr A -> B``).
- ``settings``: {flag: value} of every setting of the run (train.py passes every training flag
  but the job's own, script_util.run_flag_keys: --max_steps, the intervals, ...). Each step's
  manifest records them (``run_flags``), so that a resume that leaves them out takes them back
  (train_job.take_checkpoint_flags); a resume with other values logs one line for each. In the
  manifest, not in the checkpoint files: a run with other side settings (--eval_interval,
  --async_save, ...) writes the same bytes.
- ``model_flags``: the model's flags, stored in every weights file (sampling needs no flags).
- ``model_kind``: what the model file of a step is tagged as: "model" (a diffusion model) or
  "classifier" (guided-diffusion's noised classifier, classifier_train.py); a resume takes a
  file of that kind only (an upstream raw file of the layout, or a combined dict for "model").

What a step S on disk is (docs/checkpoints.md): ``model{S}.pt``, ``ema_{rate}_{S}.pt`` for each
rate and ``opt{S}.pt`` (the optimizer, plus the trainer state: step, world size, batch sizes,
seed, the data position, every rank's RNG, each state, the run's training flags, the model
changes so far), the files the states add (save_files: train.py's post-hoc EMA snapshots),
then ``manifest{S}.json`` last; a step counts only with its manifest. Rank 0
alone writes. With ``async_save`` rank 0 copies everything to host memory and a background thread
writes while training goes on (through the writer process for large steps where a core is free
for it: ``save_writer``); the files are byte for byte those of a synchronous save.

The resume, in order (``resume()``, or the same in steps through ``begin_resume()`` for a loop
with upstream's hook names, train_util.TrainLoop):

1. rank 0 lists the log dir once and decides (run_dir.plan_resume): which model file, the EMA and
   opt files beside it, the steps of --log_dir, leftovers of interrupted saves; every rank gets
   the same plan;
2. every rank loads the model file (each reads a local file itself; checkpoint.load_file_collective)
   and learns its step; a file or run from elsewhere is refused when --log_dir holds a newer
   complete step;
3. the EMA and opt files named by the plan; a failed read stops the run on every rank; an opt
   file whose content is not this optimizer's state (a model state dict in the opt slot, as in
   the bug this project exists for) falls back to a fresh optimizer with one log line;
4. the trainer state (data position, RNG, states), then rank 0 moves newer (incomplete) steps to
   incomplete/ and removes temp files, once every file of the step was read.

A model file that does not fit the model is a one-line error naming the likely flag, unless
``allow_model_change``: then the model, every EMA and the Adam moments take the tensors whose name
and shape match (model_change.py), the log shows one summary block, and the next save records
the change.
"""
import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch as th

from . import (async_save, checkpoint, first_save, model_change, optim_state, rng, run_dir,
               sharded, state_fit, writer_process)
from .. import dist_util, logger
from ..infra import fsdp, preemption
from .async_save import BackgroundWriter, to_host
from .writer_process import WriterProcess
from ..infra.config_check import by_rank
from ..infra.errors import UsageError, UserError
from ..script_util import same_flag_value

# EX_TEMPFAIL: "try again later". A job script can requeue on it (preemption.py's).
PREEMPTED_EXIT_CODE = preemption.EXIT_CODE

# model_kind -> the kinds of file (checkpoint.classify) a resume takes as its model file.
MODEL_FILE_KINDS = {"model": ("model", "combined"), "classifier": ("classifier",)}

# --save_layout: a step as today's files written by rank 0, or one DCP checkpoint of every rank's
# shards (sharded.py).
SAVE_LAYOUTS = ("full", "sharded")

# Trainer-state keys of the checkpointer's own; a loop's ``states`` may not use them.
TRAINER_KEYS = ("step", "world_size", "batch_size", "global_batch", "seed", "data", "rng",
                "ema_rates", "lr", "flags", "model_changes")


class ResumeError(checkpoint.CheckpointError):
    """A resume that cannot go on (one-line message naming the file or flag)."""


class NonFiniteError(UserError):
    """A NaN/Inf loss, gradient or weight stopped the run (one line naming the step)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """What the checkpointer does, one field per flag (``--name`` of the same name; defaults are
    script_util.train_defaults()'s, the one home of defaults: see ``from_flags``).

    log_dir: where steps are written and auto-resumed from (a local path or a blobfile URL).
    resume_checkpoint: "" or "auto" (the newest complete step of log_dir, if any), a model file
        (modelNNNNNN.pt, an upstream file, a combined dict), or a run directory (its newest
        complete step).
    save_interval: save every this many steps (0: only the final and the preemption save).
    keep_checkpoints: keep the newest N complete steps, deleting older ones after each save
        (0: keep all).
    async_save: write in a background thread; training pauses only for the host copy.
    allow_model_change: a checkpoint that does not fit the model keeps the tensors whose name
        and shape match and starts the others fresh (else a one-line error).
    save_writer: where an async save's files are written, chosen at the run's first async save:
        "process" (the writer process, off the trainer's GIL: writer_process), "thread" (a
        thread of the trainer), "auto" (the process for a step of at least
        writer_process.PROCESS_MIN_BYTES tensor bytes when the training leaves a core free
        for it, writer_process.core_free; else the thread).
    save_layout: "full" (rank 0 writes today's model/ema/opt files; a sharded model's tensors
        are gathered to it first) or "sharded" (a sharded model only: every rank writes its
        shards of one DCP checkpoint per step, sharded.py; with async_save, DCP's thread-based
        asynchronous save on a process group of its own).
    """

    log_dir: str
    resume_checkpoint: str
    save_interval: int
    keep_checkpoints: int
    async_save: bool
    allow_model_change: bool
    save_writer: str
    save_layout: str

    def __post_init__(self):
        if not str(self.log_dir or ""):
            raise UsageError("no log directory: pass --log_dir DIR (or set OPENAI_LOGDIR)")
        for name in ("save_interval", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} must be >= 0 (got {getattr(self, name)})")
        if self.save_layout not in SAVE_LAYOUTS:
            raise UsageError(f"--save_layout must be one of {', '.join(SAVE_LAYOUTS)} "
                             f"(got {self.save_layout!r})")
        if self.save_writer not in writer_process.WRITERS:
            raise UsageError(f"--save_writer must be one of {', '.join(writer_process.WRITERS)} "
                             f"(got {self.save_writer!r})")

    @classmethod
    def from_flags(cls, flags, **overrides):
        """The config of ``flags`` (an argparse Namespace or a dict; missing names take
        script_util.train_defaults()'s values), with ``overrides`` applied."""
        return fields_from_flags(cls, flags, overrides)


def fields_from_flags(cls, flags, overrides):
    """An instance of the dataclass ``cls``, each field from ``overrides``, else ``flags`` (a
    Namespace or a dict), else script_util.train_defaults() (CheckpointConfig's and TrainConfig's
    from_flags)."""
    from ..script_util import train_defaults

    given = dict(vars(flags) if not isinstance(flags, dict) else flags)
    defaults = train_defaults()
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif f.name in given:
            values[f.name] = given[f.name]
        elif f.name in defaults:
            values[f.name] = defaults[f.name]
    return cls(**values)


class Checkpointer:
    """The resume and the save of one run (see the module docstring). Collective: construct it
    on every rank with the same arguments (it does no communication itself)."""

    def __init__(self, config: CheckpointConfig, *, model, optimizer, emas=None, data=None,
                 batch_size=None, seed=0, states=None, model_flags=None, run_flags=None,
                 settings=None, model_kind="model"):
        if model_kind not in MODEL_FILE_KINDS:
            raise ValueError(f"Checkpointer: model_kind must be one of {sorted(MODEL_FILE_KINDS)}, "
                             f"not {model_kind!r}")
        self.config = config
        self.model_kind = model_kind
        self.model = model
        self.optimizer = optimizer
        self.emas = dict(emas or {})
        self.data = data
        self.states = dict(states or {})
        reserved = set(self.states) & set(TRAINER_KEYS)
        if reserved:
            raise ValueError(f"Checkpointer: states may not be named {sorted(reserved)} (the "
                             f"trainer state's own keys)")
        self.model_flags = dict(model_flags or {})
        self.file_tags = {}  # more top-level keys of the weights files (TrainLoop: class_names)
        self.run_flags = dict(run_flags or {})
        self.settings = dict(settings or {})
        self.seed = int(seed)
        self.rank = dist_util.get_rank()
        self.world_size = dist_util.get_world_size()
        self.batch_size = batch_size
        self.global_batch = None if batch_size is None else int(batch_size) * self.world_size
        self.named_params = list(model.named_parameters())
        self.sharded = fsdp.is_sharded(model)  # FSDP: DTensor parameters, moments and EMAs
        if config.save_layout == "sharded" and not self.sharded:
            raise UsageError("--save_layout sharded needs a sharded model (--fsdp True); a "
                             "whole model per rank is saved in the full layout")
        self._pending = None  # a sharded save under way: (sharded.PendingSave, began, paused)
        self.tied = state_fit.tied_parameter_names(model)  # {second name of a shared parameter: first}
        self.resume_step = 0
        self.last_saved_step = None
        self.model_changes = []  # trainer["model_changes"]: the run's model changes so far
        self._process = None  # rank 0's WriterProcess (async saves), made at the first save
        # (a HostSnapshot, written by the thread, where writer_process.use_process says so)
        self._writer = BackgroundWriter()  # the thread that waits for the writer (or writes)
        self._save_failure = None  # rank 0: a background save's exception, until raised
        self._signal = {"set": False, "signal": None}
        self._flags_pending = None
        self._warm_writer = None  # rank 0: the writer process started before the first save
        first_save.start_writer(self)  # (the first save readied while training: first_save.py)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Leaving normally waits for the last save (collective); after an error, close(sync=
        False) (other ranks may be anywhere)."""
        self.close(sync=exc_type is None)

    # ------------------------------------------------------------------ resume

    def resume(self):
        """Resume from the plan's step (see the module docstring) or start fresh; returns the
        step (0 on a fresh start). Collective."""
        r = self.begin_resume()
        if r is None:
            return 0
        r.load_model()
        for rate, params in self.emas.items():
            copy_into(params, r.load_ema(rate))
        r.load_optimizer()
        return r.finish()

    def begin_resume(self):
        """Step 1 of a resume: the plan. Returns a ``Resume`` whose methods do the rest in order
        (load_model, load_ema for each rate, load_optimizer, finish), or None for a fresh start
        (temp files of interrupted saves are removed then). Collective."""
        plan = dist_util.run_on_rank0(
            lambda: run_dir.plan_resume(self.config.log_dir, self.config.resume_checkpoint))
        for w in plan.warnings:
            logger.warn(w)
        if plan.message:
            logger.log(plan.message)
        if plan.model is None:
            self._tidy(plan, 0)
            return None
        return Resume(self, plan)

    def _tidy(self, plan, step):
        """Rank 0 moves steps newer than ``step`` to incomplete/ and removes temp files of
        interrupted saves (nothing else writes to this log dir: the job holds its lock).
        Collective."""
        moved, removed = dist_util.run_on_rank0(lambda: run_dir.tidy_for_resume(plan, step))
        if moved:
            logger.warn(
                f"warning: moved {len(moved)} file(s) of incomplete step(s) newer than {step} to "
                f"{checkpoint.join(self.config.log_dir, run_dir.INCOMPLETE_DIR)}: "
                f"{', '.join(moved[:4])}")
        if removed:
            logger.warn(f"warning: removed {len(removed)} temp file(s) of interrupted saves: "
                        f"{', '.join(removed[:4])}")

    # ------------------------------------------------------------------ the loop's step

    @contextlib.contextmanager
    def watch_signals(self):
        """Within: SIGTERM/SIGUSR1 set this rank's preemption flag, read at step boundaries by
        step_ends/stop_requested. The flag is preemption.py's (``preemption.training()``), the
        one owner of the two signals: in a process that called ``preemption.install()`` first (the
        train scripts), a signal since then counts (one that came during the resume saves at the
        first step boundary) and later ones only set it again; otherwise the handlers are
        installed for the ``with`` alone and the previous ones restored on exit."""
        with preemption.training() as flag:
            self._signal = flag
            yield flag

    # The per-step flags: one all-reduce (MAX) of [preempted, save_failed] per step, launched
    # at the start of the step (step_begins) and waited for at its end (stop_requested), so no
    # rank blocks on it while the step runs. All ranks see the same pair after the same step and
    # act on it together. A signal that arrives during step N is seen at step N+1's launch: the
    # job saves and stops after step N+1 at the latest.

    def step_begins(self):
        """Start the exchange of this rank's [preempted, save_failed] flags (rank 0, until
        the first save is readied: first_save.ready). Collective."""
        first_save.ready(self)
        self._flags_pending = dist_util.any_rank_async(
            [bool(self._signal["set"]), bool(self._local_save_failed())])

    def stop_requested(self):
        """Whether a rank was preempted (the same answer on every rank), after the exchange that
        step_begins started (bounded by --dist_timeout). A failed background save is raised here,
        on every rank, with rank 0's one line. Collective."""
        pending, self._flags_pending = self._flags_pending, None
        if pending is None:
            raise RuntimeError("Checkpointer.stop_requested: step_begins() was not called")
        preempted, save_failed = pending.wait()
        if save_failed:
            self._raise_save_failed()
        return preempted

    def step_ends(self, step):
        """After optimizer step ``step``: save when ``step`` is a multiple of save_interval;
        then, if a rank was preempted, save ``step`` completely, log it and return True (the
        loop returns PREEMPTED_EXIT_CODE); else False. Collective."""
        if self.config.save_interval and step % self.config.save_interval == 0:
            self.save(step)
        if self.stop_requested():
            self.save_for_preemption(step)
            return True
        return False

    def save_for_preemption(self, step):
        """The preemption save: ``step`` complete on disk, one log line naming the signal(s).
        Returns PREEMPTED_EXIT_CODE. Collective."""
        names = sorted({n for n in dist_util.all_gather_object(self._signal["signal"]) if n})
        self.save(step, wait=True)
        logger.log(f"preempted ({'/'.join(names) or 'signal'} on some rank): saved step {step}; "
                   f"exiting with code {PREEMPTED_EXIT_CODE}")
        return PREEMPTED_EXIT_CODE

    # ------------------------------------------------------------------ save

    def save(self, step, wait=False):
        """Write model, EMA and opt files of ``step`` (the state after that many optimizer
        steps), manifest last. Collective.

        Every rank checks the weights (a NaN/Inf model or EMA is never written: NonFiniteError)
        and sends its RNG state to rank 0; rank 0 alone builds the payloads. With async_save,
        rank 0 copies them to host memory (buffers reused from save to save, pinned on CUDA; a
        sharded model's tensors are gathered straight into it, _prepare_gather) and
        a background thread writes the files and the manifest (run_dir.write_step), then prunes,
        while training goes on; without it rank 0 writes them now (a sharded model: one file
        at a time, each gathered to rank 0 just before, _save_streamed). A save first waits for the
        one before it, whose failure is raised here on every rank (between saves, the loop
        raises it at the next step boundary: stop_requested). ``wait``: return only once this
        save is complete on disk (the final and the preemption save). Each save logs one line:
        its duration and, when asynchronous, the pause it caused. A step already saved is not
        written again.
        """
        step = int(step)
        if self.last_saved_step == step:
            if wait:
                self.wait_for_save()
            return
        began = time.perf_counter()
        if self.config.async_save and self.config.save_layout != "sharded" and not self.sharded:
            self._save_checked_in_copy(step, began, wait)
            self.last_saved_step = step
            return
        self._refuse_non_finite_weights(step)
        if self.config.save_layout == "sharded":
            self._save_sharded(step, began, wait)
            return
        rngs = dist_util.gather_object(rng.get_rng_state(), dst=0)
        gathered = None
        if self.sharded and not self.config.async_save:
            self._save_streamed(step, rngs, began)
            self.last_saved_step = step
            return
        if self.sharded:  # every rank takes part in making each tensor whole on rank 0
            files, held = self.step_files(step, rngs or []), {}  # held: rank 0's alloc
            dist_util.run_on_rank0_unbounded(
                lambda: held.update(alloc=self._prepare_gather(files)), f"the save of step {step}")
            gathered = fsdp.gather_full(files, alloc=held.get("alloc"))
        # the other ranks wait as long as rank 0 lives: a save may outlast --dist_timeout
        dist_util.run_on_rank0_unbounded(
            lambda: self._save_on_rank0(step, rngs, began, wait, gathered),
            f"the save of step {step}")
        self.last_saved_step = step

    def _save_streamed(self, step, rngs, began):
        """save() of a sharded model in the full layout, synchronous: the step's files made whole
        on rank 0 and written one at a time (model, each EMA, opt, the states' files: the
        order of step_files), so that rank 0 holds at most one file's tensors on the host,
        never the whole state; the manifest last. Every rank takes part in each file's gather
        (fsdp.gather_full), then waits while rank 0 writes it (run_on_rank0_unbounded: a file
        may take longer than --dist_timeout); a failure of a write is raised on every rank at
        that file, the files already written removed (run_dir.StepWriter). The same bytes as
        write_step of the whole state. Collective."""
        files = self.step_files(step, rngs or [])
        what = f"the save of step {step}"
        held = {}  # rank 0: the StepWriter of this step

        def begin():
            self._collect_save(block=True)
            held["w"] = run_dir.StepWriter(self.config.log_dir, step, list(files),
                                           settings=self.settings)

        def end():
            held["w"].finish()
            self._log_saved(step, time.perf_counter() - began, None, self._prune())

        dist_util.run_on_rank0_unbounded(begin, what)
        try:
            for name in list(files):
                whole = fsdp.gather_full(files.pop(name))
                dist_util.run_on_rank0_unbounded(lambda: held["w"].add(name, whole), what)
                del whole
            dist_util.run_on_rank0_unbounded(end, what)
        except BaseException:
            if "w" in held:  # a gather that failed, an interrupt: no partial step left
                held["w"].abort()
            raise

    def _save_checked_in_copy(self, step, began, wait):
        """save() of an unsharded model with async_save, in the full layout: the weights check
        made during rank 0's host copy instead of before it (WriterProcess.pack checks each
        piece of the copy while it is in the cache; the thread's HostSnapshot checks before it
        copies), while every other rank checks its own weights. The same refusal as
        _refuse_non_finite_weights (the same line on every rank, nothing written: the copy is
        dropped before the write starts), then rank 0 starts the background write.
        Collective."""
        rngs = dist_util.gather_object(rng.get_rng_state(), dst=0)
        what = f"the save of step {step}"
        mine = None if self.rank == 0 else self._non_finite_found()  # beside rank 0's copy
        held = {}  # rank 0's host copy (not broadcast: run_on_rank0 returns found alone)

        def payloads():
            sd = self.model.state_dict()  # once for the files and the check
            return self.step_files(step, rngs, model_sd=sd), self._weights_to_check(sd)

        def copy():
            self._collect_save(block=True)
            held["packed"], found = self._host_copy(payloads)
            return found

        found = dist_util.run_on_rank0_unbounded(copy, what)
        self._refuse_non_finite_weights(step, found if self.rank == 0 else mine)  # copy dropped
        dist_util.run_on_rank0_unbounded(
            lambda: self._start_write(step, held.pop("packed"), began, wait), what)

    def _prepare_gather(self, files):
        """Rank 0, before an async save of a sharded model gathers ``files`` (step_files): wait
        for the previous save (raising its failure), choose the writer, and return the
        ``alloc`` of fsdp.gather_full: the writer process's arena memory that each whole tensor
        is copied into (WriterProcess.alloc_for_gather; the gathered step is then the host copy),
        or None (the thread's writer: the gathered tensors are new memory, the host copy as they
        are). Not collective."""
        self._collect_save(block=True)
        self._choose_writer(files)
        if isinstance(self._process, WriterProcess):
            return self._process.alloc_for_gather()
        return None

    def _choose_writer(self, files):
        """Rank 0, at the first async save (or once the first step ran: first_save.ready): the
        writer process, or the thread's HostSnapshot
        (writer_process.use_process, on the bytes of the step's ``files``: a sharded model's
        DTensors counted whole)."""
        if self._process is None:  # once a job
            use = writer_process.use_process(self.config.save_writer,
                                             async_save.tensor_bytes(files), self._core_free())
            self._process = first_save.writer(self, use)  # (the one started early, if any)

    def _save_on_rank0(self, step, rngs, began, wait, gathered=None):
        """Rank 0's part of save(): wait for the previous save (raising its failure), then write
        this step now or hand its host copy to the background writer. ``gathered``: the step's
        files already made whole on the CPU (a sharded model: fsdp.gather_full; with async_save,
        into the writer's memory by _prepare_gather: no second copy)."""
        self._collect_save(block=True)
        files = gathered if gathered is not None else self.step_files(step, rngs)
        if not self.config.async_save:
            run_dir.write_step(self.config.log_dir, step, to_host(files), settings=self.settings)
            self._log_saved(step, time.perf_counter() - began, None, self._prune())
            return
        packed, _ = self._host_copy(files, gathered=gathered is not None)
        self._start_write(step, packed, began, wait)

    def _host_copy(self, files, gathered=False):
        """Rank 0: the host copy of an async save's ``files`` (shared memory: the writer
        process's, else the thread's HostSnapshot; ``gathered``: files made whole into that
        memory already by _prepare_gather, referenced, not copied). ``files`` may be a function
        that returns (files, the _weights_to_check whose NaN/Inf are counted too), which the
        writer process calls once its copy has begun (WriterProcess.pack). Returns (the copy
        for _start_write, _non_finite_found's text of the check); the thread's copy is not
        taken (None) when that text is not empty. Not collective."""
        check = ()
        if not isinstance(self._process, WriterProcess):  # the thread's, or the first save
            files, check = files() if callable(files) else (files, check)
            self._choose_writer(files)
        if isinstance(self._process, WriterProcess):
            packed = self._process.pack(files, check, gathered=gathered)
            return packed, _found_text(self._process.non_finite)
        found = _found_text((label, count_non_finite(t)) for label, t in check)
        if found or gathered:
            return (None if found else files), found
        return self._process.copy(files), found

    def _start_write(self, step, files, began, wait):
        """Rank 0: hand the host copy of ``step`` (``files``, _host_copy's) to the background
        writer; with ``wait``, wait until it is on disk. Not collective."""
        paused = time.perf_counter() - began
        self._writer.start(lambda: self._write_in_background(step, files, began, paused))
        if wait:
            self._collect_save(block=True)

    def _save_sharded(self, step, began, wait):
        """save() in the sharded layout: collect the previous save (its failure raised on every
        rank), then every rank starts writing its shards of this step (sharded.start_save; the
        trainer state, every rank's RNG included, the same on every rank); with async_save the
        write goes on in DCP's writer thread until the next save (or wait_for_save: the end, a
        preemption) collects it. Collective."""
        rngs = dist_util.all_gather_object(rng.get_rng_state())
        self._collect_sharded()
        mode = "thread" if self.config.async_save else "sync"  # docs/checkpoints.md: why
        beside = self._write_beside(step)
        pending = sharded.start_save(self.config.log_dir, step,
                                     self.step_files(step, rngs, state_files=False),
                                     self.settings, mode=mode, flags=self.model_flags,
                                     kind="classifier" if self.model_kind == "classifier"
                                     else "model", beside=beside)
        self._pending = (pending, began, time.perf_counter() - began if mode != "sync" else None)
        self.last_saved_step = step
        if wait or mode == "sync":
            self._collect_sharded()

    def _write_beside(self, step):
        """The sharded layout: the files the states add to ``step`` (save_files: post-hoc EMA
        snapshots) as whole files beside the step's folder, the full layout's bytes, kept like
        them when the step is pruned: one at a time, gathered to rank 0 (fsdp.gather_full),
        which writes it (sharded.write_beside). Returns {name: manifest entry} (rank 0's, on
        every rank); a failure removes what was written and is raised on every rank.
        Collective."""
        entries = {}
        try:
            for name, payload in self.state_files(step).items():
                whole = fsdp.gather_full(payload)
                entries[name] = dist_util.run_on_rank0(lambda: sharded.write_beside(
                    self.config.log_dir, step, name, to_host(whole)))
                del whole
        except BaseException:
            if self.rank == 0:
                run_dir._remove_written(self.config.log_dir, list(entries))
            raise
        return entries

    def _collect_sharded(self):
        """Finish the sharded save under way, if any: wait for every rank's shards, rank 0
        writes the manifest, prunes and logs the save. Raises a failure on every rank.
        Collective."""
        if self._pending is None:
            return
        pending, began, paused = self._pending
        self._pending = None
        pending.collect()
        self._log_saved(pending.step, time.perf_counter() - began, paused, self._prune())

    @property
    def save_in_flight(self):
        """Whether a background save is still being written (rank 0; False on the others;
        the sharded layout: this rank's shards). Not collective and costs no wait."""
        if self._pending is not None:
            return not self._pending[0].done()
        return self._writer.running

    @property
    def save_writer_chosen(self):
        """Which writer --save_writer chose at this run's first async save: "process" or
        "thread" (None before it, and on ranks other than 0)."""
        if self._process is None:
            return None
        return "process" if isinstance(self._process, WriterProcess) else "thread"

    def _core_free(self):
        """writer_process.core_free for this rank: its model's device, torch's threads, the
        ranks on this host, the cores it may use."""
        on_cpu = all(p.device.type == "cpu" for p in self.model.parameters())
        return writer_process.core_free(on_cpu, th.get_num_threads(),
                                        dist_util.get_local_world_size(),
                                        dist_util.usable_cores(), os.cpu_count() or 1)

    def step_files(self, step, rngs, state_files=True, model_sd=None):
        """{file name: payload} of ``step``, with the live tensors (the caller copies them).
        ``rngs``: every rank's rng.get_rng_state(), by rank; ``state_files``: with the files
        the states add (state_files; the sharded layout writes them beside its folder);
        ``model_sd``: the model's state_dict() when the caller has it. Not collective."""
        flags = self.model_flags
        model_sd = self.model.state_dict() if model_sd is None else model_sd
        sd = {k: v.detach() for k, v in model_sd.items()}
        payload = (checkpoint.classifier_payload if self.model_kind == "classifier"
                   else checkpoint.model_payload)
        files = {checkpoint.model_filename(step): {**payload(step, sd, flags), **self.file_tags}}
        for rate, params in self.emas.items():
            ema_sd = {k: v.detach()
                      for k, v in self._params_to_state_dict(params, model_sd).items()}
            files[checkpoint.ema_filename(rate, step)] = {
                **checkpoint.ema_payload(step, rate, ema_sd, flags), **self.file_tags}
        named = optim_state.named_optimizer_state(self.optimizer, self.named_params, copy=False)
        files[checkpoint.opt_filename(step)] = checkpoint.opt_payload(
            step, named, self._trainer_state(step, rngs))
        if state_files:
            _add_files(files, self.state_files(step), "the states save files the step already has")
        return files

    def state_files(self, step):
        """{file name: payload} the states add to ``step`` (their save_files). Not
        collective."""
        files = {}
        for name, obj in self.states.items():
            if hasattr(obj, "save_files"):
                _add_files(files, obj.save_files(step),
                           f"state {name!r} saves files another state saves")
        return files

    def _params_to_state_dict(self, params, model_sd=None):
        """The model's state dict with its parameters replaced by ``params`` (upstream's rule for
        EMA files: EMA parameters, the live model's buffers), under every name of a parameter
        that layers share (state_fit.tied_parameter_names). ``model_sd``: the model's
        state_dict() when the caller has it (not changed)."""
        sd = self.model.state_dict() if model_sd is None else dict(model_sd)
        for (name, _), p in zip(self.named_params, params):
            sd[name] = p
        for alias, name in self.tied.items():  # a shared parameter's every name: its EMA
            sd[alias] = sd[name]
        return sd

    def _trainer_state(self, step, rngs):
        """The "trainer" entry of opt*.pt (docs/checkpoints.md; weights_only-loadable)."""
        state = {
            "step": int(step),
            "world_size": int(self.world_size),
            "batch_size": None if self.batch_size is None else int(self.batch_size),
            "global_batch": self.global_batch,
            "seed": self.seed,
            "data": _data_state(self.data),
            "rng": list(rngs),
            "ema_rates": list(self.emas),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "flags": dict(self.run_flags),
            "model_changes": list(self.model_changes),
        }
        for name, obj in self.states.items():
            state[name] = None if obj is None else obj.state_dict()
        return state

    def _write_in_background(self, step, files, began, paused):
        """The writer thread's job: hand the step to the writer process, which writes its files
        and manifest, then prunes; wait for it. Returns what the main thread logs (no logging
        from this thread)."""
        if not isinstance(self._process, WriterProcess):
            run_dir.write_step(self.config.log_dir, step, files, crc_threads=1,  # beside steps
                               settings=self.settings)
            return step, time.perf_counter() - began, paused, self._prune()
        done, lines = self._process.write(self.config.log_dir, step, files,
                                          self.config.keep_checkpoints, self.settings)
        return step, done - began, paused, lines

    def _collect_save(self, block):
        """Rank 0: log a finished background save and return (step, seconds, pause, log lines);
        raise its failure (``block``: wait for it, else return None at once when it still
        runs). A failure already seen by _local_save_failed is raised first. Not collective."""
        failure, self._save_failure = self._save_failure, None
        if failure is not None:
            raise failure
        if block and self._writer.running and isinstance(self._process, WriterProcess):
            self._process.hurry()  # training waits for it now: the writer at the trainer's nice
        outcome = self._writer.wait() if block else self._writer.poll()
        if outcome is None:
            return None
        kind, value = outcome
        if kind == "failed":
            raise value
        self._log_saved(*value)
        return value

    def _log_saved(self, step, took, paused, prune_lines):
        pause = "" if paused is None else f" (training paused {paused:.2f} s)"
        logger.log(f"saved step {step} to {self.config.log_dir} in {took:.2f} s{pause}")
        for line in prune_lines:
            logger.log(line)
        logger.committed(step)  # --tracker: the rows held back until a checkpoint has them

    def wait_for_save(self):
        """Wait until the background save (if any) is complete on disk; its failure is raised on
        every rank. Returns (step, seconds, pause, log lines) of the save that was waited for,
        or None when none was in flight (always None in the sharded layout). Collective."""
        if self.config.save_layout == "sharded":
            self._collect_sharded()
            return None
        return dist_util.run_on_rank0_unbounded(lambda: self._collect_save(block=True),
                                                "the background save")

    def _local_save_failed(self):
        """This rank's bit for the per-step flags: True on rank 0 once its background write has
        failed (a finished one is logged here); False on the other ranks and while a write runs.
        Not collective and costs no wait."""
        if self.rank != 0 or self._save_failure is not None:
            return self._save_failure is not None
        outcome = self._writer.poll()
        if outcome is not None and outcome[0] == "failed":
            self._save_failure = outcome[1]  # raised on every rank by _raise_save_failed
        elif outcome is not None:
            self._log_saved(*outcome[1])
        return self._save_failure is not None

    def _raise_save_failed(self):
        """Raise rank 0's background-save failure on every rank (the same one line; the last
        complete step on disk stays valid: the failed step left no manifest and no file).
        Collective."""
        def rank0():
            self._collect_save(block=True)  # raises the failure
            raise RuntimeError("a background save failed on rank 0 (bug: no error kept)")
        dist_util.run_on_rank0_unbounded(rank0, "the background save")

    def close(self, sync=True):
        """The end of the run: wait for the background save. ``sync=False`` after an error
        elsewhere (other ranks may be anywhere): rank 0 lets its save end (its files complete or
        removed, never half-written) and only reports a failure of it. Collective unless
        sync=False."""
        try:
            if sync:
                self.wait_for_save()
                return
            if self.rank != 0 or not self._writer.busy:
                return
            try:
                self._collect_save(block=True)
            except Exception as e:  # the error that ends the run is another one: only report it
                logger.warn(f"warning: the background save also failed: {e}")
        finally:
            first_save.drop(self)
            if isinstance(self._process, WriterProcess) and not self._writer.busy:
                self._process.close()  # the writer process ends with the run (a later save
                self._process = None  # starts a new one)

    def _weights_to_check(self, model_sd=None):
        """[(label, tensors)] that a save refuses to write when one holds a NaN/Inf: the model,
        each EMA, each state's finite_tensors(). ``model_sd``: the model's state_dict() when the
        caller has it. Not collective."""
        sd = self.model.state_dict() if model_sd is None else model_sd
        groups = [("model", list(sd.values()))]
        groups += [(f"EMA {rate}", list(params)) for rate, params in self.emas.items()]
        for obj in self.states.values():
            if hasattr(obj, "finite_tensors"):
                groups += [(label, list(t)) for label, t in obj.finite_tensors().items()]
        return groups

    def _non_finite_found(self):
        """This rank's part of the weights check: _found_text of count_non_finite of each group
        of _weights_to_check. Not collective."""
        return _found_text((label, count_non_finite(tensors))
                           for label, tensors in self._weights_to_check())

    def _refuse_non_finite_weights(self, step, found=None):
        """Raise NonFiniteError (same line on every rank) if the model, an EMA or a state's
        finite_tensors() hold a NaN/Inf: such a checkpoint is never written. ``found``: this
        rank's _non_finite_found(), when already counted (during the host copy). Collective
        (one all_gather_object)."""
        if found is None:
            found = self._non_finite_found()
        gathered = dist_util.all_gather_object(found)
        if not any(gathered):
            return
        where = (gathered[0] if all(g == gathered[0] for g in gathered)
                 else by_rank(gathered, show=lambda g: g or "finite"))
        last = ("no step was saved before" if self.last_saved_step is None
                else f"the last saved step is {self.last_saved_step}")
        raise NonFiniteError(
            f"step {step}: not saved: the weights hold non-finite values ({where}); {last}; "
            f"resume from a saved step with a lower --lr")

    def _prune(self):
        """Rank 0, once a synchronous save is complete: apply keep_checkpoints. Returns the
        lines to log (the writer process prunes after a background save)."""
        if self.rank != 0:
            return []
        return run_dir.prune_lines(self.config.log_dir, self.config.keep_checkpoints)


def saved_model_flags(log_dir, resume_checkpoint=""):
    """The model flags stored in the file a resume of ``log_dir`` (with ``resume_checkpoint``)
    will start from, read without its tensors; None for a fresh start or a file that stores
    none (run_dir.likely_resume_model: the step the plan chooses; checkpoint.read_flags). For
    what must be known before the model is built, e.g. the class count of a class-conditional
    resume. Collective (rank 0 reads; every rank gets the same answer)."""
    found = saved_model_file_flags(log_dir, resume_checkpoint)
    return None if found is None else found[1]


def saved_model_file_flags(log_dir, resume_checkpoint="", kinds=None):
    """``(path, flags)`` of that file (saved_model_flags), or None; ``kinds``: only a file of
    one of these kinds counts (checkpoint.read_flags). Collective."""
    found = saved_file_flags(log_dir, resume_checkpoint, kinds)
    return None if found is None else found[:2]


def saved_file_flags(log_dir, resume_checkpoint="", kinds=None):
    """``(path, model flags, run flags)`` of that file, or None when it stores no model flags;
    the run flags are the settings its step's manifest records (Checkpointer's ``settings``,
    run_dir.step_settings; {} for a step that records none: upstream's, or written before
    settings were recorded). Collective."""
    def peek():
        path = run_dir.likely_resume_model(log_dir, resume_checkpoint)
        read = sharded.read_flags if sharded.dir_step(path or "") is not None else \
            checkpoint.read_flags
        flags = None if path is None else read(path, kinds=kinds)
        return None if not flags else (path, flags, run_dir.step_settings(path))
    return dist_util.run_on_rank0(peek)


class Resume:
    """A resume in progress (made by Checkpointer.begin_resume): call ``load_model()``, then
    ``load_ema(rate)`` for each rate, ``load_optimizer()``, and ``finish()``, in this order, on
    every rank. Each step records here what it learned for the next ones (plain attributes)."""

    def __init__(self, ckpt, plan):
        self.ckpt = ckpt
        self.plan = plan  # run_dir.ResumePlan
        self.model_file = None  # checkpoint.CkptFile of the model file
        self.step: Optional[int] = None
        self.file_shapes: Dict[str, Any] = {}  # the model file's {name: shape}
        self.change: Optional[model_change.ModelChange] = None  # set when the model changed
        self.ema_loaded: List[str] = []
        self.trainer: Optional[dict] = None
        self.opt_note = ""
        self.opt_summary = ""
        self.regrouped: Dict[str, Any] = {}
        self.saved_settings: Dict[str, Any] = {}  # the step's manifest's run_flags
        self.sharded_files: Optional[dict] = None  # a sharded step: {file: payload}, loaded

    def _load(self, path):
        """checkpoint.load_file_collective(path); a file gone from a source run that a live job
        holds (pruned between the plan and the load) is said as such. Collective."""
        try:
            return checkpoint.load_file_collective(path)
        except UserError as e:
            if self.plan.source_live is None or "no such file" not in str(e):
                raise
            raise checkpoint.CheckpointReadError(  # a read, never a reason to fall back
                f"{path}: gone since the resume chose it: {checkpoint.dirname(path)} is a live "
                f"run ({self.plan.source_live} holds it) that writes and prunes steps as it "
                f"goes; resume from a copy of it, or once that job has stopped") from None

    def load_model(self):
        """Load the model weights of the resume step into the model; returns the step.
        Strict: a file that does not fit is a one-line error naming the likely flag, unless
        allow_model_change (then the tensors whose name and shape match are taken, the others
        keep the fresh model's initialisation). A file or run from elsewhere is refused when
        --log_dir holds a newer complete step. Collective."""
        ckpt, path = self.ckpt, self.plan.model
        if self.plan.layout == "sharded":
            return self._load_sharded()
        c = self._load(path)
        if c.kind not in MODEL_FILE_KINDS[ckpt.model_kind]:
            raise self._wrong_kind(path, checkpoint.describe(c))
        sd = checkpoint.model_state_from(c, want="model")  # prefixes already stripped
        if not sd:
            raise ResumeError(f"--resume_checkpoint {path}: no model weights found in the file")
        self.model_file = c
        self.saved_settings = dist_util.run_on_rank0(lambda: run_dir.step_settings(path))
        mine = ckpt.model.state_dict()
        self.file_shapes = state_fit.shapes_of(sd)
        fit = state_fit.fit_state_dict(state_fit.shapes_of(mine), self.file_shapes, c.flags,
                                       ckpt.model_flags)
        if fit.ok:
            ckpt.model.load_state_dict(fsdp.localize_state_dict(sd, ckpt.model), strict=True)
        elif not ckpt.config.allow_model_change:
            raise ResumeError(misfit_message(path, fit))
        else:
            self.change = model_change.plan_change(
                state_fit.shapes_of(mine), self.file_shapes, c.flags, ckpt.model_flags)
            if self.change.keeps_too_little:  # another model's flags, most likely
                raise ResumeError(model_change.too_little_kept_for_resume(path, self.change))
            ckpt.model.load_state_dict(
                fsdp.localize_state_dict(model_change.take_matching(mine, sd), ckpt.model),
                strict=True)
        self.step = c.step if c.step is not None else checkpoint.parse_step(path)
        if self.change is not None:
            self.change.step = self.step
        for note in c.notes:
            logger.log(f"note: {checkpoint.basename(path)}: {note}")
        if self.change is None:  # a model change lists them in its summary block
            _note_flags_differ(c.flags, ckpt.model_flags)
        self._refuse_overwrite()
        return self.step

    def _wrong_kind(self, path, holds):
        """The ResumeError of a model file or sharded step (``path``) that holds ``holds`` (a
        phrase: checkpoint.describe's) instead of this run's kind of model."""
        ckpt = self.ckpt
        classifier = ckpt.model_kind == "classifier"
        if self.plan.source == "auto":  # a run dir's newest step: --log_dir's or another's
            run = ("a diffusion model's run (train.py's)" if classifier
                   else "a noised classifier's run (classifier_train.py's)")
            flag, where = (("--log_dir", ckpt.config.log_dir) if self.plan.in_log_dir
                           else ("--resume_checkpoint", checkpoint.dirname(path)))
            return ResumeError(f"{flag} {where}: its newest step ({checkpoint.basename(path)}) "
                               f"holds {holds}: this is {run}; give another {flag}")
        want = ("a noised classifier's weights; pass a model file of a classifier run"
                if classifier else "model weights; pass a model file")
        return ResumeError(f"--resume_checkpoint {path}: holds {holds}, not {want} "
                           f"(modelNNNNNN.pt)")

    def _refuse_overwrite(self):
        """A step from elsewhere (a file, another run) never goes over --log_dir's history."""
        if not (self.plan.source == "auto" and self.plan.in_log_dir):
            run_dir.refuse_overwrite(self.plan, self.step)

    def _load_sharded(self):
        """load_model() of a sharded step (its folder, verified by the plan): its kind (the
        manifest's) must be this run's and whether it fits the model is read from its index;
        then one DCP read loads every tensor of the step this run has (weights, the EMAs of
        the rates it holds, Adam moments) in place, and its values (the trainer state). A
        sharded model's shards are resharded to this world; a whole model (--fsdp False: DDP,
        or one process) gets whole tensors, which every rank reads. Collective."""
        ckpt, folder = self.ckpt, self.plan.model
        step = self.plan.step
        name = checkpoint.model_filename(step)
        doc, held, shapes, self.saved_settings = dist_util.run_on_rank0(lambda: (
            sharded.read_manifest(folder) or {}, sharded.held_files(folder),
            sharded.state_dict_shapes(folder, name), run_dir.step_settings(folder)))
        kind = doc.get("kind")
        if kind in checkpoint.KIND_PHRASES and kind not in MODEL_FILE_KINDS[ckpt.model_kind]:
            raise self._wrong_kind(folder, checkpoint.KIND_PHRASES[kind])
        flags = doc.get("flags") if isinstance(doc.get("flags"), dict) else {}
        mine = ckpt.model.state_dict()
        fit = state_fit.fit_state_dict(state_fit.shapes_of(mine), shapes, flags,
                                       ckpt.model_flags)
        if not fit.ok:
            change = ("; a sharded step cannot go into a changed model: consolidate it "
                      "(`python scripts/ckpt.py consolidate`) and resume from its files with "
                      "--allow_model_change True" if ckpt.config.allow_model_change else "")
            raise ResumeError(misfit_message(folder, fit) + change)
        sharded.init_optim_state(ckpt.optimizer)  # moments to load into
        # the EMAs of rates the step does not hold are left out (load_ema starts them); the
        # states' files (post-hoc EMA snapshots) lie beside the folder, not in it
        template = {k: v for k, v in ckpt.step_files(step, [], state_files=False).items()
                    if k in held or getattr(checkpoint.name_info(k), "kind", None) != "ema"}
        files = sharded.read_step(folder, template)
        self.sharded_files = files
        model = files[name]
        self.model_file = checkpoint.CkptFile(
            path=folder, kind=model.get("kind", "model"), tagged=True, step=step,
            flags=model.get("flags"), state_dict=model.get("state_dict"), raw=model)
        self.file_shapes = dict(shapes)
        self.step = step
        _note_flags_differ(model.get("flags") or {}, ckpt.model_flags)
        self._refuse_overwrite()
        return self.step

    def load_ema(self, rate):
        """The EMA parameters of ``rate`` for the resume step, a list of tensors in
        ``model.parameters()`` order: from the EMA file beside the model file (or a combined
        dict's EMA entry), else a copy of the (loaded) model weights with one warning.
        Collective."""
        rate_str = str(float(rate))
        c = self.model_file
        if self.sharded_files is not None:  # loaded in place by _load_sharded (if held)
            name = next(checkpoint.ema_filename(r, self.step) for r in self.ckpt.emas
                        if float(r) == float(rate))
            if name in self.sharded_files:
                self.ema_loaded.append(f"{checkpoint.basename(str(c.path))}[ema {rate}]")
                sd = self.sharded_files[name]["state_dict"]
                return [sd[n] for n, _ in self.ckpt.named_params]
            path = None
        else:
            path = self.plan.files_of(self.step)["ema"].get(rate_str)
        if path is None and c.kind == "combined":
            sd = checkpoint.combined_ema_or_none(c)
            if sd is not None:
                self.ema_loaded.append(f"{checkpoint.basename(str(c.path))}[ema]")
                return self._params_from(sd, c.path, c.flags)
        if path is None:
            where = "in" if self.sharded_files is not None else "beside"
            logger.warn(f"no EMA file for rate {rate_str} {where} {c.path}; EMA starts from the "
                        f"model weights")
            return [p.detach().clone() for _, p in self.ckpt.named_params]
        ema = self._load(path)
        sd = checkpoint.model_state_from(ema, want="ema")
        if not sd:
            raise ResumeError(f"{path}: holds {checkpoint.describe(ema)}, not EMA weights; "
                              f"delete it or resume from another step")
        self.ema_loaded.append(checkpoint.basename(str(path)))
        return self._params_from(sd, path, ema.flags)

    def _params_from(self, sd, path, flags):
        """[tensor] in parameter order from a state dict (prefixes stripped; checked like the
        model's). With a model change, each parameter whose name and shape match is the file's,
        the others the model's current value (the fresh initialisation of new tensors)."""
        ckpt = self.ckpt
        mine = dict(ckpt.named_params)
        if self.change is not None:
            ema_change = model_change.plan_change(
                state_fit.shapes_of(mine), state_fit.shapes_of(sd))
            model_params = set(mine)
            if (set(ema_change.new), set(ema_change.reshaped)) != (
                    set(self.change.new) & model_params,
                    set(self.change.reshaped) & model_params):
                self.change.notes.append(f"{checkpoint.basename(path)}: {ema_change.counts()} "
                                         f"parameter(s), unlike the model file")
            sd = model_change.take_matching(mine, sd)
        else:
            want = state_fit.shapes_of(mine)
            have = state_fit.shapes_of({k: v for k, v in sd.items() if k in want})
            fit = state_fit.fit_state_dict(want, have, flags, ckpt.model_flags)
            if not fit.ok:
                raise ResumeError(misfit_message(path, fit))
        return [fsdp.localize(sd[n].detach().to(device=p.device, dtype=p.dtype), p).clone()
                for n, p in ckpt.named_params]

    def load_optimizer(self):
        """Load the optimizer state of the resume step, validated as a whole before the
        optimizer is touched, or leave the optimizer fresh with one warning line when the file's
        content is not this optimizer's state. A failed read is never such a reason: it stops
        the run. Every rank reads the same bytes, so the decision is the same everywhere
        (checked with an all-gather). Collective."""
        ckpt, c = self.ckpt, self.model_file
        if self.sharded_files is not None:  # the moments were loaded in place: the rest here
            opt = self.sharded_files[checkpoint.opt_filename(self.step)]
            self.trainer = opt.get("trainer")
            self.opt_note = f"{checkpoint.basename(str(self.plan.model))} (sharded)"
            self.opt_summary = self.opt_note
            logger.log(f"optimizer state from {self.plan.model}: "
                       f"{len(opt['optimizer']['state'])} parameters restored (sharded)")
            return
        opt_path = self.plan.files_of(self.step)["opt"]
        trainer, ok, why, report = None, False, None, None
        if opt_path is None and c is not None and c.optimizer is not None:
            opt_path = c.path  # a combined dict with an optimizer entry
        if opt_path is None:
            why = "no optimizer file beside the model file"
        else:
            try:
                f = (c if c is not None and opt_path == c.path
                     else self._load(opt_path))
                payload = f.optimizer
                if payload is None:
                    raise optim_state.OptimizerStateError(
                        f"{opt_path}: holds {checkpoint.describe(f)}, not optimizer state")
                if self.change is not None:  # upstream's index-keyed moments: by the file's names
                    buffers = dict(ckpt.model.named_buffers())
                    payload = model_change.optimizer_by_name(
                        payload, [(n, s) for n, s in self.file_shapes.items() if n not in buffers],
                        source=str(opt_path))
                if ckpt.sharded:  # whole moments to this rank's slices
                    payload = fsdp.localize_optimizer_state(payload, ckpt.named_params)
                report = optim_state.load_optimizer_state(
                    ckpt.optimizer, payload, ckpt.named_params, source=str(opt_path),
                    hyperparams="current")
                if self.change is None:  # else the line is part of the change's summary block
                    logger.log(report.summary())
                self.regrouped = report.regrouped
                trainer, ok = f.trainer, True
            except checkpoint.CheckpointReadError:
                raise  # a failed read is never a reason to drop the optimizer state
            except (optim_state.OptimizerStateError, checkpoint.CheckpointError) as e:
                why = str(e)  # content: the explained fallback below
        decisions = dist_util.all_gather_object(ok)
        if len(set(decisions)) != 1:
            raise RuntimeError(
                f"ranks disagree on loading {opt_path} (per rank: {decisions}); this is a bug")
        if not ok:
            logger.warn(f"warning: {why}; continuing with a fresh optimizer")
        self.trainer = trainer
        self.opt_note = checkpoint.basename(str(opt_path)) if ok else "fresh optimizer"
        self.opt_summary = (model_change.moments_text(report, self.opt_note) if ok
                            else f"fresh optimizer ({why})")

    def finish(self):
        """Restore the trainer state (data position, RNG, states), log the model change, tidy
        the log dir (only once every file of the step was read); returns the step. Collective."""
        ckpt, step = self.ckpt, self.step
        ckpt.resume_step = step
        restore_trainer_state(ckpt, self.trainer, step, self.saved_settings)
        self._record_model_change()
        ckpt._tidy(self.plan, step)
        ckpt.last_saved_step = step if self.plan.in_log_dir else None
        logger.log(f"resumed at step {step} from {self.plan.model} "
                   f"(ema: {', '.join(self.ema_loaded) or 'none'}; opt: {self.opt_note})")
        return step

    def _record_model_change(self):
        """Log the model change's summary block (or the param groups that changed alone) and
        keep the file's change history plus this change for the next save's trainer state."""
        history = (self.trainer or {}).get("model_changes")
        self.ckpt.model_changes = list(history) if isinstance(history, list) else []
        if self.change is None:
            if self.regrouped:
                logger.log("optimizer: " + model_change.regrouped_text(self.regrouped))
            return
        self.change.optimizer, self.change.regrouped = self.opt_summary, self.regrouped
        for line in self.change.lines():
            logger.log(line)
        self.ckpt.model_changes.append(self.change.record())


# ---------------------------------------------------------------------- the trainer state


def restore_trainer_state(ckpt, trainer, step, saved_settings=None):
    """Data position, RNG and states from the trainer dict (or guesses when there is none);
    ``saved_settings``: the step manifest's, for the lines of what changed. Collective (the
    RNG notes are gathered to rank 0's log)."""
    if not trainer or set(trainer) <= {"model_changes"}:  # e.g. `ckpt.py adapt` of upstream's
        position = step * (ckpt.global_batch or 0)
        _load_data_state(ckpt, _guess_data_state(ckpt.data, position), step)
        logger.log(
            f"no usable trainer state (an upstream file, or an opt file that fell back): data "
            f"position set to step*global_batch = {position}, RNG reseeded from "
            f"(seed={ckpt.seed}, step={step}, rank)")
        rng.seed_rngs(ckpt.seed, step, ckpt.rank)
        for obj in ckpt.states.values():  # the others keep their fresh state, as always
            if hasattr(obj, "resume_without_state"):
                obj.resume_without_state(step)
        return
    _log_changes(ckpt, trainer, saved_settings)
    data_state = trainer.get("data")
    if not isinstance(data_state, dict) or "position" not in data_state:
        data_state = _guess_data_state(ckpt.data, step * (ckpt.global_batch or 0))
        if _restorable(ckpt.data):
            logger.log(f"no data position in the checkpoint: assuming {data_state['position']}")
    reseed = not _load_data_state(ckpt, data_state, step)
    restore_rng(ckpt, trainer.get("rng"), trainer.get("world_size"), step)
    for name, obj in ckpt.states.items():
        _restore_state(name, obj, trainer.get(name), step)
    if reseed:
        rng.seed_rngs(ckpt.seed, step, ckpt.rank)


def _load_data_state(ckpt, state, step):
    """Restore the data position; returns False for data without load_state_dict (a plain
    iterator, which cannot be put back: noted once, and the caller reseeds the RNGs)."""
    if ckpt.data is None:
        return True
    if _restorable(ckpt.data):
        ckpt.data.load_state_dict(state)
        return True
    logger.log(
        f"resume: the data ({type(ckpt.data).__name__}, no load_state_dict) cannot be put back at "
        f"its saved position exactly; it goes on from where the iterator is, with the RNGs "
        f"reseeded from (seed={ckpt.seed}, step={step}, rank)")
    return False


def _log_changes(ckpt, trainer, saved_settings=None):
    """One log line for each setting that differs from the checkpoint's: world size and batch,
    --seed, --ema_rate, and each of the run_flags and settings that the step recorded
    (trainer["flags"], the manifest's ``saved_settings``)."""
    old_ws, old_gb = trainer.get("world_size"), trainer.get("global_batch")
    shards = ckpt.states.get("virtual_shards")  # --global_batch_size: TrainLoop's VirtualShards
    if shards is not None and old_gb == ckpt.global_batch:
        logger.log(shards.resume_line(old_ws))
    elif old_ws != ckpt.world_size:
        logger.log(
            f"resume: world size {old_ws} -> {ckpt.world_size}, global batch size "
            f"{old_gb} -> {ckpt.global_batch} (per-rank batch {trainer.get('batch_size')} -> "
            f"{ckpt.batch_size}); the data position is global and continues")
    elif old_gb != ckpt.global_batch:  # the same ranks, another --batch_size
        logger.log(
            f"resume: --batch_size {trainer.get('batch_size')} -> {ckpt.batch_size} (global "
            f"batch size {old_gb} -> {ckpt.global_batch} on {old_ws} rank(s)); the data "
            f"position is global and continues")
    if trainer.get("seed") is not None and trainer.get("seed") != ckpt.seed:
        logger.log(f"resume: --seed {trainer.get('seed')} -> {ckpt.seed}")
    old_rates = trainer.get("ema_rates")
    if old_rates is not None and list(old_rates) != list(ckpt.emas):
        logger.log(f"resume: --ema_rate {','.join(old_rates)} -> {','.join(ckpt.emas)}")
    old_flags = trainer.get("flags") if isinstance(trainer.get("flags"), dict) else {}
    old_flags = {**old_flags, **(saved_settings or {})}
    for k, v in {**ckpt.run_flags, **ckpt.settings}.items():
        if k in OWN_LINES or k not in old_flags or same_flag_value(old_flags[k], v, k):
            continue
        why = (" (a whole model per rank: --fsdp False saves the full layout)"
               if k == "save_layout" and old_flags[k] == "sharded" and not ckpt.sharded else "")
        logger.log(f"resume: --{k} {_shown(old_flags[k])} -> {_shown(v)}{why}")


# Settings that _log_changes words in lines of their own (above), not as "--k A -> B" again.
OWN_LINES = ("batch_size", "seed", "ema_rate")


def _shown(value):
    """A flag value as a log line shows it ('' for an empty string, so that a value that was
    cleared is seen)."""
    return "''" if value == "" else value


def restore_rng(ckpt, rngs, old_world_size, step):
    """Each rank's own RNG state back, when the world size is the same; else reseed from
    (seed, step, rank) with one line. A generator that could not be restored (the CUDA one on
    another device layout) is logged with its rank."""
    if rngs and old_world_size == ckpt.world_size and len(rngs) == ckpt.world_size:
        note = rng.set_rng_state(rngs[ckpt.rank])
    else:
        rng.seed_rngs(ckpt.seed, step, ckpt.rank)
        why = (f"world size changed ({old_world_size} -> {ckpt.world_size})"
               if old_world_size != ckpt.world_size else "no RNG state of every rank saved")
        # --global_batch_size: the training draws from each shard's own stream, not these (the
        # resume line said "same run"); without it the reseed changes the run: said
        if ckpt.states.get("virtual_shards") is None:
            logger.log(f"resume: {why}; RNG reseeded from (seed={ckpt.seed}, step={step}, rank)")
        note = None
    notes = dist_util.all_gather_object(note)
    for r, n in enumerate(notes):
        if n:
            logger.log(f"resume: rank {r}: {n}")


def _restore_state(name, obj, saved, step):
    """One of the loop's states back from its saved dict, or a log line saying why not (a state
    with resume_without_state decides itself when the step holds none)."""
    if obj is None:
        if saved:
            logger.log(f"resume: the checkpoint holds {name} state, which this run does not use")
        return
    if not saved:
        if hasattr(obj, "resume_without_state"):
            obj.resume_without_state(step)
            return
        logger.log(f"resume: no {name} state in the checkpoint; it starts fresh")
        return
    mine = obj.state_dict()
    if (isinstance(saved, dict) and isinstance(mine, dict) and saved.get("name") is not None
            and saved.get("name") != mine.get("name")):
        logger.log(f"resume: {name} changed ({saved.get('name')} -> {mine.get('name')}); its "
                   f"saved state is not used")
        return
    obj.load_state_dict(saved)


def _guess_data_state(loader, position):
    sd = dict(loader.state_dict()) if _restorable(loader) else {}
    sd["position"] = int(position)
    return sd


def _restorable(data):
    """Whether ``data`` can save and restore its position (a ResumableLoader can; upstream's
    load_data generator, or any plain iterator, cannot)."""
    return callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None))


def _data_state(data):
    """The data's state_dict() for the trainer dict, or, for a plain iterator, a record that its
    position cannot be restored ({"restorable": False, "iterator": type name}: no "position")."""
    if data is None:
        return None
    if _restorable(data):
        return data.state_dict()
    return {"restorable": False, "iterator": type(data).__name__}


# ---------------------------------------------------------------------- helpers


def _note_flags_differ(saved, given):
    """Log the model flags given with other values than the checkpoint's (one line, if any)."""
    changed = state_fit.differing_flags(saved, given)
    if changed:
        logger.log("note: flags differ from the checkpoint's: " + ", ".join(
            f"--{k} {a} -> {b}" for k, (a, b) in changed.items()))


def copy_into(targets, values):
    """Copy each of ``values`` into the tensor of ``targets`` at the same index, in place."""
    with th.no_grad():
        for t, v in zip(targets, values):
            t.copy_(v)


def count_non_finite(tensors):
    """How many floating-point tensors among ``tensors`` hold a NaN or Inf (one device sync per
    device and dtype).

    First one fused 2-norm per tensor (torch._foreach_norm: one pass, no temporary): a finite
    norm means every value is finite (a NaN or Inf makes it NaN or Inf). Only the tensors whose
    norm is not finite (non-finite values, or squares that overflowed) get the exact check: a
    tensor's min and max are both finite exactly when all its values are."""
    groups = {}
    for t in map(fsdp.local, tensors):  # a DTensor: this rank's slice
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    suspects = []
    for group in groups.values():
        bad = (~th.stack(th._foreach_norm(group, 2)).isfinite()).nonzero().flatten().tolist()
        suspects += [group[i] for i in bad]
    ends = [th.stack(th.aminmax(t)).double() for t in suspects]
    return int((~th.stack(ends).isfinite().all(dim=1)).sum()) if ends else 0


def _found_text(counts):
    """The weights check's text of one rank from [(label, tensors with a NaN/Inf)]: "model: 1
    tensor(s), EMA 0.9999: 2 tensor(s)" (the labels with none left out; "" when all finite)."""
    return ", ".join(f"{label}: {n} tensor(s)" for label, n in counts if n)


def misfit_message(path, fit):
    """The one line of a resume whose weights do not fit the model (a state_fit.Fit)."""
    flag = fit.likely_flags[0] if fit.likely_flags else "the model flags"
    return (f"{path}: weights do not fit the model built from the flags ({fit.summary()}); "
            f"check {flag}, or pass --allow_model_change True to keep the tensors that match "
            f"and start the others fresh")


def _add_files(files, extra, clash):
    """``files.update(extra)``; a name in both is a ValueError (``clash``: what it means), a bug
    of a loop's states, never a file overwritten."""
    taken = set(extra) & set(files)
    if taken:
        raise ValueError(f"Checkpointer: {clash}: {sorted(taken)}")
    files.update(extra)
