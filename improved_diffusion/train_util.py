"""The training loop: steps, EMA, mixed precision, and save/resume orchestration.

Behaviour follows upstream improved-diffusion's TrainLoop (microbatches, several EMA rates, lr
annealing, weight decay, loss logging by timestep quartile, grad-norm logging), with these fixes:

- Every rank runs the same code path; every collective is called by all ranks in the same order
  (docs/ARCHITECTURE.md, "Distributed rules"). Resume decisions are made from bytes that were read once and
  broadcast, so ranks cannot diverge.
- `step` counts completed optimizer steps; the files of step S hold the state after S steps.
- Checkpoints are schema-tagged files written by rank 0 (run_dir.save_step), with the complete
  trainer state (data position, per-rank RNG, timestep-sampler history, GradScaler) in opt*.pt.
- Mixed precision is torch.autocast + torch.amp.GradScaler, no hand-rolled master params.
- SIGTERM / SIGUSR1 on any rank: all ranks agree at a step boundary (the flag is exchanged by an
  all-reduce that runs while a step does: a signal during step N stops the job after step N+1 at
  the latest), save, and run_loop() returns PREEMPTED_EXIT_CODE.
"""
import contextlib
import gc
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import blobfile as bf
import numpy as np
import torch as th
from torch.nn.parallel.distributed import DistributedDataParallel as DDP
from torch.optim import AdamW

from . import (checkpoint, dist_util, logger, model_change, optim_state, preemption, run_dir,
               state_fit)
from .async_save import BackgroundWriter, HostSnapshot, to_host
from .errors import UsageError, UserError
from .resample import LossAwareSampler, UniformSampler

# EX_TEMPFAIL: "try again later". A job script can requeue on it.
PREEMPTED_EXIT_CODE = preemption.EXIT_CODE

# Upstream's initial fp16 loss scale was 2**20 (INITIAL_LOG_LOSS_SCALE = 20.0).
INITIAL_LOSS_SCALE = 2.0 ** 20

PREEMPT_SIGNALS = preemption.SIGNALS

# --nan_policy: what a step with a non-finite loss or gradient does (without a GradScaler).
NAN_POLICIES = ("stop", "skip")

# Training flags kept in the trainer state ("train_flags"); a resume logs one line for each that
# changed (--seed, --ema_rate, the batch size and the world size have lines of their own).
RESUME_LOGGED_FLAGS = {"lr": float, "weight_decay": float, "lr_anneal_steps": int,
                       "microbatch": int, "fp16_scale_growth": float, "nan_policy": str}


class ResumeError(checkpoint.CheckpointError):
    """A resume that cannot go on (one-line message naming the file or flag)."""


class NonFiniteError(UserError):
    """A NaN/Inf loss, gradient or weight stopped the run (one line naming the step)."""


class TrainLoop:
    """Upstream's TrainLoop (same keyword arguments), plus max_steps, seed, keep_checkpoints.

    Called with upstream's keyword arguments only, it works as upstream's did: ``log_dir``
    defaults to get_blob_logdir() (``$DIFFUSION_BLOB_LOGDIR``, else the logger's directory), where
    the files are written and where the loop auto-resumes its newest complete step from;
    ``model_flags`` (the model/diffusion flags files store) defaults to unknown: a warning is
    logged and the files then carry no flags (sampling needs the flags on the command line).
    Upstream's method names exist: run_loop, run_step, forward_backward, optimize_normal /
    optimize_fp16 (both the one optimize() step), log_step, save. Where meanings differ from
    upstream's:

    - ``self.step`` is the global step (completed optimizer steps since the run began, resumes
      included); upstream's counted steps since the resume and added ``resume_step`` when naming
      files and logging. ``self.resume_step`` is, as upstream, the step resumed from.
    - optimize_normal / optimize_fp16 return whether the step was taken; the EMA update is done
      by run_step after them (upstream did it inside them), and --use_fp16 is autocast with a
      GradScaler over float32 weights (no fp16 master-parameter copies, no ``lg_loss_scale``).
    - The loop stops at ``max_steps`` or ``lr_anneal_steps`` (global steps), saves the final step,
      and returns an exit code; upstream's ran until lr_anneal_steps without a return value.

    nan_policy ("stop" or "skip") decides what a step with a non-finite loss or gradient does
    when no GradScaler handles it (with --use_fp16 the scaler's own skip-and-back-off applies):
    "stop" raises NonFiniteError naming the step, saving nothing for it; "skip" leaves weights,
    Adam moments and EMA as they were, logs it, and goes on. A skipped step still counts: `step`
    and the data position advance past its batch, so a resumed run stays aligned with its data.
    The decision is the same on every rank: after DDP's all-reduce every rank holds the same
    gradients (a non-finite loss on one rank makes them non-finite everywhere), and it is made
    from their norm, which the loop computes anyway; no extra collective is needed.

    compile: run the model's forward/backward through torch.compile (--compile True).

    data: a ResumableLoader (exact resume of the data position), or any iterator of
    (batch, cond), e.g. upstream's load_data generator, whose position cannot be restored: its
    checkpoints record that, and a resume reseeds the RNGs from (seed, step, rank).

    Construction resolves and loads the resume checkpoint (if any): a collective, so construct it
    on every rank with the same arguments.
    """

    def __init__(
        self,
        *,
        model,
        diffusion,
        data,
        batch_size,
        microbatch,
        lr,
        ema_rate,
        log_interval,
        save_interval,
        resume_checkpoint,
        use_fp16=False,
        fp16_scale_growth=1e-3,
        schedule_sampler=None,
        weight_decay=0.0,
        lr_anneal_steps=0,
        log_dir=None,
        model_flags=None,
        max_steps=0,
        seed=0,
        keep_checkpoints=0,
        log_sample_indices=False,
        nan_policy="stop",
        allow_model_change=False,
        async_save=True,
        compile=False,
    ):
        if log_dir is None:  # upstream's TrainLoop wrote to get_blob_logdir()
            log_dir = get_blob_logdir()
        if model_flags is None:
            logger.warn(
                "warning: TrainLoop: model_flags not given (unknown): checkpoint files will "
                "carry no model flags, so sample.py/nll.py need them on the command line; pass "
                "model_flags=args_to_dict(args, model_and_diffusion_defaults().keys())")
        self.model = model
        self.diffusion = diffusion
        self.data = data
        self.batch_size = batch_size
        self.microbatch = microbatch if microbatch > 0 else batch_size
        self.lr = lr
        self.ema_rate_strs = parse_ema_rates(ema_rate)
        self.ema_rate = [float(r) for r in self.ema_rate_strs]
        self.log_interval = log_interval
        self.save_interval = save_interval
        self.resume_checkpoint = resume_checkpoint or ""
        self.use_fp16 = use_fp16
        self.fp16_scale_growth = fp16_scale_growth
        self.schedule_sampler = schedule_sampler or UniformSampler(diffusion)
        self.weight_decay = weight_decay
        self.lr_anneal_steps = lr_anneal_steps
        self.log_dir = log_dir
        self.model_flags = dict(model_flags or {})
        self.max_steps = max_steps
        self.seed = seed
        self.keep_checkpoints = keep_checkpoints
        self.log_sample_indices = log_sample_indices
        if nan_policy not in NAN_POLICIES:
            raise UsageError(f"--nan_policy {nan_policy!r}: use one of {', '.join(NAN_POLICIES)}")
        self.nan_policy = nan_policy
        self.allow_model_change = bool(allow_model_change)
        self.model_changes = []  # trainer["model_changes"]: the run's model changes so far
        self._resume_from = None  # what the resume loads (set by _resume)
        self.async_save = bool(async_save)
        self._snapshot = None  # rank 0's HostSnapshot (async saves), made at the first save
        self._writer = BackgroundWriter()
        self._save_failure = None  # rank 0: a background save's exception, until raised

        self.rank = dist_util.get_rank()
        self.world_size = dist_util.get_world_size()
        self.global_batch = self.batch_size * self.world_size
        self.device = dist_util.dev()
        self.step = 0
        self.resume_step = 0
        self.last_saved_step = None
        self._data_iter = None
        self._reseed_data = False  # set on resume when the data's position cannot be restored

        fingerprint = _data_fingerprint(data)
        digest = check_config_on_all_ranks(self._config_flags(), fingerprint)
        logger.log(f"flags (sha256 {digest[:12]}) and data ({_show_fingerprint(fingerprint)}) "
                   f"agree on all {self.world_size} rank(s)")
        seed_rngs(seed, 0, self.rank)

        self.model.to(self.device)
        dist_util.sync_params(self.model.parameters())
        self.named_params = list(self.model.named_parameters())
        self.amp_dtype, self.grad_scaler = _make_amp(
            self.device, use_fp16, fp16_scale_growth
        )
        self.opt = self._make_optimizer()
        self.ema_params = [self._copy_params() for _ in self.ema_rate]

        self._resume()
        self.use_ddp = self.world_size > 1
        self.ddp_model = self._wrap_ddp() if self.use_ddp else self.model
        if compile:  # only the forward/backward: self.model keeps its state-dict keys
            self.ddp_model = th.compile(self.ddp_model)
        self._ddp_primed = not self.use_ddp

    # ------------------------------------------------------------------ setup helpers

    def _config_flags(self):
        """The flags every rank must agree on: model, diffusion and training ({name: value}).

        Left out, since they may differ per rank: the data folder's path (its content is compared
        through the dataset's fingerprint instead: ranks may read local copies), the number of
        loader workers (not seen here) and log_sample_indices (each rank's own diagnostics).
        """
        flags = dict(self.model_flags)
        flags.update(
            log_dir=str(self.log_dir), resume_checkpoint=str(self.resume_checkpoint),
            batch_size=self.batch_size, microbatch=self.microbatch, lr=self.lr,
            weight_decay=self.weight_decay, lr_anneal_steps=self.lr_anneal_steps,
            schedule_sampler=getattr(self.schedule_sampler, "name", None)
            or type(self.schedule_sampler).__name__,
            ema_rate=",".join(self.ema_rate_strs), use_fp16=self.use_fp16,
            fp16_scale_growth=self.fp16_scale_growth, log_interval=self.log_interval,
            save_interval=self.save_interval, max_steps=self.max_steps, seed=self.seed,
            keep_checkpoints=self.keep_checkpoints, nan_policy=self.nan_policy,
        )
        return flags

    def _make_optimizer(self):
        """AdamW, fused (one kernel for all parameters) where this torch supports it on the
        device, else its foreach (multi-tensor) form; the update rule is AdamW's either way."""
        return make_adamw(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def _copy_params(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def _wrap_ddp(self):
        kwargs = dict(bucket_cap_mb=128, find_unused_parameters=False)
        if self.device.type == "cuda":
            kwargs.update(device_ids=[self.device], output_device=self.device)
        return DDP(self.model, **kwargs)

    # ------------------------------------------------------------------ resume

    def _resume(self):
        """
        The story of a resume (collective: call from all ranks). Two rank-0 round trips:

        1. rank 0 lists the log dir once and makes a plan (run_dir.plan_resume): which model file,
           the EMA/opt files beside it, the steps in --log_dir, leftovers of interrupted saves;
        2. every rank loads the model file (bytes read once, broadcast) and learns its step;
           a file or run from elsewhere is refused when --log_dir holds a newer complete step;
        3. every rank loads the EMA and opt files named by the plan and restores the trainer state;
        4. rank 0 moves newer (incomplete) steps to incomplete/ and removes temp files, once every
           file of the step was read.

        A failed read stops the run on every rank (nothing moved); content problems of the opt
        file fall back to a fresh optimizer with one warning line. A model file that does not fit
        the model is an error, unless --allow_model_change True: then the model, every EMA and
        the Adam moments take the tensors whose name and shape match (model_change.py), the log
        shows one summary block, and the next save records the change.

        Steps 2 and 3 use upstream's method names (a subclass may override them):
        `_load_and_sync_parameters()`, `_load_ema_parameters(rate)`, `_load_optimizer_state()`;
        they read what to load from `self._resume_from` (a `_ResumeFrom`).
        """
        plan = dist_util.run_on_rank0(
            lambda: run_dir.plan_resume(self.log_dir, self.resume_checkpoint))
        for w in plan.warnings:
            logger.warn(w)
        if plan.message:
            logger.log(plan.message)
        if plan.model is None:
            self._tidy(plan, 0)
            return
        r = self._resume_from = _ResumeFrom(plan)
        self._load_and_sync_parameters()  # sets r.model_ckpt, r.step, r.change
        step = r.step
        if not (plan.source == "auto" and plan.in_log_dir):  # a file or run from elsewhere
            run_dir.refuse_overwrite(plan, step)  # never over --log_dir's newer history
        self.step = self.resume_step = step
        self.ema_params = [self._load_ema_parameters(rate) for rate in self.ema_rate]
        self._load_optimizer_state()  # sets r.trainer, r.opt_note
        self._restore_trainer_state(r.trainer)
        self._record_model_change(r)
        self._tidy(plan, step)  # only once every file of the step was read
        self.last_saved_step = step if plan.in_log_dir else None
        logger.log(
            f"resumed at step {step} from {plan.model} "
            f"(ema: {', '.join(r.ema_loaded) or 'none'}; opt: {r.opt_note})"
        )

    def _tidy(self, plan, step):
        """Rank 0 moves steps newer than ``step`` to incomplete/ and removes temp files of
        interrupted saves (nothing else writes to this log dir: the job holds its lock). Collective.
        """
        moved, removed = dist_util.run_on_rank0(lambda: run_dir.tidy_for_resume(plan, step))
        if moved:
            logger.warn(
                f"warning: moved {len(moved)} file(s) of incomplete step(s) newer than {step} to "
                f"{checkpoint.join(self.log_dir, run_dir.INCOMPLETE_DIR)}: {', '.join(moved[:4])}"
            )
        if removed:
            logger.warn(f"warning: removed {len(removed)} temp file(s) of interrupted saves: "
                        f"{', '.join(removed[:4])}")

    def _load_and_sync_parameters(self):
        """Upstream's name: load the model weights of the resume step (collective).

        The file's bytes are read once on rank 0 and broadcast, so every rank loads the same
        weights and takes the same decision (no sync of parameters afterwards is needed). Strict:
        a file that does not fit is a one-line error naming the likely flag, unless
        --allow_model_change True (then the tensors whose name and shape match are taken, the
        others keep the fresh model's initialisation). Sets `_resume_from.model_ckpt`, `.step`,
        `.change` and `.file_shapes`.
        """
        r = self._resume_from
        path = r.plan.model
        ckpt = checkpoint.load_file_collective(path)
        if ckpt.kind not in ("model", "combined"):
            raise ResumeError(
                f"--resume_checkpoint {path}: holds {checkpoint.describe(ckpt)}, not model "
                f"weights; pass a model file (modelNNNNNN.pt)"
            )
        sd = checkpoint.model_state_from(ckpt, want="model")  # prefixes already stripped
        if not sd:
            raise ResumeError(f"--resume_checkpoint {path}: no model weights found in the file")
        r.model_ckpt = ckpt
        mine = self.model.state_dict()
        r.file_shapes = state_fit.shapes_of(sd)
        fit = state_fit.fit_state_dict(state_fit.shapes_of(mine), r.file_shapes, ckpt.flags,
                                       self.model_flags)
        if fit.ok:
            self.model.load_state_dict(sd, strict=True)
        elif not self.allow_model_change:
            raise ResumeError(_misfit_message(path, fit))
        else:
            r.change = model_change.plan_change(
                state_fit.shapes_of(mine), r.file_shapes, ckpt.flags, self.model_flags)
            self.model.load_state_dict(model_change.take_matching(mine, sd), strict=True)
        r.step = ckpt.step if ckpt.step is not None else checkpoint.parse_step(path)
        if r.change is not None:
            r.change.step = r.step
        for note in ckpt.notes:
            logger.log(f"note: {checkpoint.basename(path)}: {note}")
        changed = [k for k in self.model_flags
                   if ckpt.flags and k in ckpt.flags and ckpt.flags[k] != self.model_flags[k]]
        if changed and r.change is None:  # a model change lists them in its summary block
            logger.log("note: flags differ from the checkpoint's: " + ", ".join(
                f"--{k} {ckpt.flags[k]} -> {self.model_flags[k]}" for k in changed))

    def _load_ema_parameters(self, rate):
        """Upstream's name and contract: the EMA parameters of ``rate`` for the resume step, a list
        of tensors in `model.parameters()` order: from the EMA file beside the model file (or a
        combined dict's EMA entry), else a copy of the (loaded) model weights with one warning.
        Collective (a file is read once and broadcast).
        """
        r = self._resume_from
        rate_str = str(float(rate))
        path = r.plan.files_of(r.step)["ema"].get(rate_str)
        model_ckpt = r.model_ckpt
        if path is None and model_ckpt.kind == "combined":
            sd = _combined_ema(model_ckpt)
            if sd is not None:
                r.ema_loaded.append(f"{os.path.basename(str(model_ckpt.path))}[ema]")
                return self._params_from(sd, model_ckpt.path, model_ckpt.flags)
        if path is None:
            logger.warn(
                f"no EMA file for rate {rate_str} beside {model_ckpt.path}; "
                f"EMA starts from the model weights"
            )
            return self._copy_params()
        ckpt = checkpoint.load_file_collective(path)
        sd = checkpoint.model_state_from(ckpt, want="ema")
        if not sd:
            raise ResumeError(f"{path}: holds {checkpoint.describe(ckpt)}, not EMA weights; "
                              f"delete it or resume from another step")
        r.ema_loaded.append(os.path.basename(str(path)))
        return self._params_from(sd, path, ckpt.flags)

    def _params_from(self, sd, path, flags):
        """[tensor] in parameter order from a state dict (prefixes stripped; checked like the
        model's). With a model change, each parameter whose name and shape match is the file's,
        the others the model's current value (the fresh initialisation of new tensors)."""
        r = self._resume_from
        if r is not None and r.change is not None:
            mine = dict(self.named_params)
            ema_change = model_change.plan_change(
                state_fit.shapes_of(mine), state_fit.shapes_of(sd))
            model_params = set(mine)
            if (set(ema_change.new), set(ema_change.reshaped)) != (
                    set(r.change.new) & model_params, set(r.change.reshaped) & model_params):
                r.change.notes.append(f"{checkpoint.basename(path)}: {ema_change.counts()} "
                                      f"parameter(s), unlike the model file")
            sd = model_change.take_matching(mine, sd)
        else:
            _check_state_dict_matches(self.model, sd, path, flags, self.model_flags,
                                      params_only=True)
        return [sd[n].detach().to(device=self.device, dtype=p.dtype).clone()
                for n, p in self.named_params]

    def _load_optimizer_state(self):
        """Upstream's name: load the optimizer state of the resume step, validated as a whole
        before the optimizer is touched, or fall back to a fresh optimizer with one warning line.

        The state follows each parameter's name, into whatever param group it sits in now (the
        log names parameters that changed group); the groups' hyperparameters are the run's (as
        `_make_optimizer` built them from the flags). With a model change the moments follow the
        same rule as the weights (matching name and shape kept, the rest fresh). Sets
        `_resume_from.trainer` (the file's trainer dict or None) and `.opt_note`. Collective:
        every rank reads the same broadcast bytes, so the decision is the same everywhere
        (checked with an all-gather).
        """
        r = self._resume_from
        model_ckpt = r.model_ckpt
        opt_path = r.plan.files_of(r.step)["opt"]
        trainer, ok, why = None, False, None
        if opt_path is None and model_ckpt is not None and model_ckpt.optimizer is not None:
            opt_path = model_ckpt.path  # a combined dict with an optimizer entry
        if opt_path is None:
            why = "no optimizer file beside the model file"
        else:
            try:
                ckpt = (model_ckpt if model_ckpt is not None and opt_path == model_ckpt.path
                        else checkpoint.load_file_collective(opt_path))
                payload = ckpt.optimizer
                if payload is None:
                    raise optim_state.OptimizerStateError(
                        f"{opt_path}: holds {checkpoint.describe(ckpt)}, not optimizer state"
                    )
                if r.change is not None:  # upstream's index-keyed moments: by the file's names
                    buffers = dict(self.model.named_buffers())
                    payload = model_change.optimizer_by_name(
                        payload, [(n, s) for n, s in r.file_shapes.items() if n not in buffers],
                        source=str(opt_path))
                report = optim_state.load_optimizer_state(
                    self.opt, payload, self.named_params, source=str(opt_path),
                    hyperparams="current")
                if r.change is None:  # else the line is part of the change's summary block
                    logger.log(report.summary())
                r.regrouped = report.regrouped
                trainer, ok = ckpt.trainer, True
            except checkpoint.CheckpointReadError:
                raise  # a failed read is never a reason to drop the optimizer state
            except (optim_state.OptimizerStateError, checkpoint.CheckpointError) as e:
                why = str(e)  # content: the explained fallback below
        decisions = dist_util.all_gather_object(ok)
        if len(set(decisions)) != 1:
            raise RuntimeError(
                f"ranks disagree on loading {opt_path} (per rank: {decisions}); this is a bug"
            )
        if not ok:
            self.opt = self._make_optimizer()
            logger.warn(f"warning: {why}; continuing with a fresh optimizer")
        r.trainer = trainer
        r.opt_note = os.path.basename(str(opt_path)) if ok else "fresh optimizer"
        r.opt_summary = (model_change.moments_text(report, r.opt_note) if ok
                         else f"fresh optimizer ({why})")

    def _record_model_change(self, r):
        """Log the model change's summary block (or the param groups that changed alone) and
        keep the file's change history plus this change for the next save's trainer state."""
        history = (r.trainer or {}).get("model_changes")
        self.model_changes = list(history) if isinstance(history, list) else []
        if r.change is None:
            if r.regrouped:
                logger.log("optimizer: " + model_change.regrouped_text(r.regrouped))
            return
        r.change.optimizer, r.change.regrouped = r.opt_summary, r.regrouped
        for line in r.change.lines():
            logger.log(line)
        self.model_changes.append(r.change.record())

    def _restore_trainer_state(self, trainer):
        """Data position, RNG, timestep sampler, GradScaler from the trainer dict (or guesses)."""
        step = self.resume_step
        if not trainer or set(trainer) <= {"model_changes"}:  # e.g. `ckpt.py adapt` of upstream's
            self._load_data_state(_guess_data_state(self.data, step * self.global_batch))
            logger.log(
                f"no usable trainer state (an upstream file, or an opt file that fell back): "
                f"data position set to "
                f"step*global_batch = {step * self.global_batch}, RNG reseeded from "
                f"(seed={self.seed}, step={step}, rank)"
            )
            seed_rngs(self.seed, step, self.rank)
            return
        self._log_changes(trainer)
        data_state = trainer.get("data")
        if not isinstance(data_state, dict) or "position" not in data_state:
            data_state = _guess_data_state(self.data, step * self.global_batch)
            if _restorable(self.data):
                logger.log(f"no data position in the checkpoint: assuming "
                           f"{data_state['position']}")
        self._load_data_state(data_state)
        self._restore_rng(trainer.get("rng"), trainer.get("world_size"))
        self._restore_sampler(trainer.get("schedule_sampler"))
        self._restore_scaler(trainer.get("grad_scaler"))
        if self._reseed_data:
            seed_rngs(self.seed, step, self.rank)

    def _load_data_state(self, state):
        """Restore the data position; for data without load_state_dict (a plain iterator), note
        once that it cannot be, and have the RNGs reseeded from (seed, step, rank)."""
        if _restorable(self.data):
            self.data.load_state_dict(state)
            return
        self._reseed_data = True
        logger.log(
            f"resume: the data ({type(self.data).__name__}, no load_state_dict) cannot be put back "
            f"at its saved position exactly; it goes on from where the iterator is, with the RNGs "
            f"reseeded from (seed={self.seed}, step={self.resume_step}, rank)"
        )

    def _log_changes(self, trainer):
        old_ws, old_gb = trainer.get("world_size"), trainer.get("global_batch")
        if old_ws != self.world_size or old_gb != self.global_batch:
            logger.log(
                f"resume: world size {old_ws} -> {self.world_size}, global batch size "
                f"{old_gb} -> {self.global_batch} (per-rank batch {trainer.get('batch_size')} -> "
                f"{self.batch_size}); the data position is global and continues"
            )
        if trainer.get("seed") is not None and trainer.get("seed") != self.seed:
            logger.log(f"resume: --seed {trainer.get('seed')} -> {self.seed}")
        old_rates = trainer.get("ema_rates")
        if old_rates is not None and list(old_rates) != self.ema_rate_strs:
            logger.log(f"resume: --ema_rate {','.join(old_rates)} -> "
                       f"{','.join(self.ema_rate_strs)}")
        saved = trainer.get("train_flags")  # absent in older files
        for name, kind in RESUME_LOGGED_FLAGS.items() if isinstance(saved, dict) else ():
            now = kind(getattr(self, name))
            if name in saved and saved[name] != now:
                logger.log(f"resume: --{name} {saved[name]} -> {now}")

    def _restore_rng(self, rng, old_world_size):
        if rng and old_world_size == self.world_size and len(rng) == self.world_size:
            set_rng_state(rng[self.rank])
            return
        seed_rngs(self.seed, self.resume_step, self.rank)
        logger.log(
            f"resume: world size changed ({old_world_size} -> {self.world_size}); RNG reseeded "
            f"from (seed={self.seed}, step={self.resume_step}, rank)"
        )

    def _restore_sampler(self, state):
        if not state:
            return
        mine = self.schedule_sampler.state_dict()
        if state.get("name") is not None and state.get("name") != mine.get("name"):
            logger.log(
                f"resume: --schedule_sampler changed ({state.get('name')} -> {mine.get('name')}); "
                f"its saved history is not used"
            )
            return
        self.schedule_sampler.load_state_dict(state)

    def _restore_scaler(self, state):
        if self.grad_scaler is None:
            if state:
                logger.log("resume: the checkpoint has a loss scale but --use_fp16 is off")
            return
        if state:
            self.grad_scaler.load_state_dict(state)
        else:
            logger.log(f"resume: no loss scale in the checkpoint; starting at {INITIAL_LOSS_SCALE}")

    # ------------------------------------------------------------------ loop

    def run_loop(self):
        """Train until max_steps / lr_anneal_steps (or forever); returns an exit code.

        0 when done; PREEMPTED_EXIT_CODE after a SIGTERM/SIGUSR1 on any rank (a complete checkpoint
        of the current step is saved first). Collective: call from all ranks.
        """
        self._data_iter = iter(self.data)
        with _preemption_flag() as flag:
            self._signal_flag = flag
            while not self._done():
                self._launch_flags()  # all ranks exchange their flags while the step runs
                batch, cond = next(self._data_iter)
                self._record_indices()
                self.run_step(batch, cond)
                if self.step % self.log_interval == 0:
                    logger.dumpkvs()
                if self.save_interval and self.step % self.save_interval == 0:
                    self.save()
                preempted, save_failed = self._sync_flags()
                if save_failed:
                    self._raise_save_failed()
                if preempted:
                    names = dist_util.all_gather_object(flag["signal"])
                    return self._preempt(sorted({n for n in names if n}))
            if self._pending_logs:
                logger.dumpkvs()
            if self.step > self.resume_step or self.last_saved_step is None:
                self.save(wait=True)
            else:
                logger.log(f"already at step {self.step}; nothing to train")
        return 0

    def close(self, sync=True):
        """Drop the DDP wrapper (call before dist_util.cleanup()). Collective unless sync=False.

        Destroying the process group while a DDP wrapper is still alive sporadically aborts the
        process at exit ("terminate called without an active exception", signal 6).
        """
        if not sync:
            self._finish_save_quietly()
        if self.use_ddp and self.ddp_model is not self.model:
            if sync:
                dist_util.barrier()
            self.ddp_model = self.model
            gc.collect()

    # The per-step flags: one all-reduce (MAX) of [preempted, save_failed] per step, launched
    # at the start of the step (_launch_flags) and waited for at its end (_sync_flags), so no
    # rank blocks on it while the step runs. All ranks see the same pair after the same step and
    # act on it together. A signal that arrives during step N is seen at step N+1's launch: the
    # job saves and stops after step N+1 at the latest.

    def _launch_flags(self):
        """Start the exchange of this rank's [preempted, save_failed] flags. Collective."""
        flag = getattr(self, "_signal_flag", None) or {"set": False}
        self._flags_pending = dist_util.any_rank_async(
            [bool(flag["set"]), bool(self._local_save_failed())])

    def _sync_flags(self):
        """(preempted, save_failed) on any rank, the same on every rank: waits for the exchange
        started by _launch_flags (bounded by the process group's timeout, --dist_timeout).
        Collective: call from all ranks after _launch_flags."""
        pending, self._flags_pending = self._flags_pending, None
        preempted, save_failed = pending.wait()
        return preempted, save_failed

    def _done(self):
        if self.max_steps and self.step >= self.max_steps:
            return True
        return bool(self.lr_anneal_steps) and self.step >= self.lr_anneal_steps

    @property
    def _pending_logs(self):
        return self.step > self.resume_step and self.step % self.log_interval != 0

    def _preempt(self, signame):
        if self._pending_logs:
            logger.dumpkvs()
        self.save(wait=True)
        logger.log(
            f"preempted ({'/'.join(signame) or 'signal'} on some rank): saved step {self.step}; "
            f"exiting with code {PREEMPTED_EXIT_CODE}"
        )
        return PREEMPTED_EXIT_CODE

    def _record_indices(self):
        if not self.log_sample_indices:
            return
        idx = getattr(self.data, "last_indices", None)
        if idx is None:
            return
        d = bf.join(self.log_dir, "sample_indices")
        bf.makedirs(d)
        line = ",".join([str(self.step + 1)] + [str(int(i)) for i in np.asarray(idx).ravel()])
        with open(os.path.join(d, f"rank{self.rank}.csv"), "a") as f:
            f.write(line + "\n")

    def run_step(self, batch, cond):
        """One optimizer step on this rank's batch [B, C, H, W]. Collective (DDP all-reduce)."""
        self.forward_backward(batch, cond)
        took_step = self.optimize_fp16() if self.use_fp16 else self.optimize_normal()
        self.step += 1
        if took_step is not False:  # an upstream-style override returning None took its step
            self._update_ema()
        self.log_step()

    def forward_backward(self, batch, cond):
        """Accumulate gradients over microbatches; DDP syncs only on the last one."""
        for i in range(0, batch.shape[0], self.microbatch):
            micro = batch[i : i + self.microbatch].to(self.device)
            micro_cond = {k: v[i : i + self.microbatch].to(self.device) for k, v in cond.items()}
            if not self._ddp_primed:
                self._prime_ddp_buckets(micro, micro_cond)
            if i == 0:
                self.opt.zero_grad(set_to_none=True)
            last = i + self.microbatch >= batch.shape[0]
            t, weights = self.schedule_sampler.sample(micro.shape[0], self.device)
            sync = (contextlib.nullcontext() if last or not self.use_ddp
                    else self.ddp_model.no_sync())
            with sync:
                with self._autocast():
                    losses = self.diffusion.training_losses(
                        self.ddp_model, micro, t, model_kwargs=micro_cond
                    )
                losses = {k: v.float() for k, v in losses.items()}
                if isinstance(self.schedule_sampler, LossAwareSampler):
                    self.schedule_sampler.update_with_local_losses(
                        *_finite_only(t, losses["loss"].detach()))
                loss = (losses["loss"] * weights).mean()
                if self.grad_scaler is None:
                    loss = _poison_if_not_finite(loss)
                log_loss_dict(self.diffusion, t, {k: v * weights for k, v in losses.items()})
                self._backward(loss)

    def _prime_ddp_buckets(self, micro, micro_cond):
        """One throw-away forward/backward so that DDP settles its gradient buckets now.

        DDP re-orders its buckets after the first synchronised backward, which changes the order
        in which gradient elements are summed across ranks (on 3+ ranks: the last bits of the
        result). Priming here makes the first step after a resume use the same buckets as every
        other step, so a resumed run equals a straight one bitwise on any number of ranks. RNG
        states are restored and the (zero) gradients dropped. Collective (a DDP all-reduce).
        """
        rng = get_rng_state()
        t = th.zeros(micro.shape[0], dtype=th.long, device=self.device)
        with self._autocast():
            out = self.ddp_model(micro, t, **micro_cond)
        (out.float().sum() * 0.0).backward()
        self.opt.zero_grad(set_to_none=True)
        set_rng_state(rng)
        self._ddp_primed = True

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return th.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _backward(self, loss):
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimize(self):
        """Unscale, log grad norm, anneal lr, step. Returns False if the step was skipped (fp16
        overflow, or non-finite gradients under --nan_policy skip).

        One host sync per step: whether the gradients are finite (--nan_policy decides before
        the optimizer step; with a GradScaler, whether the scale went down). The grad norm and
        the loss scale stay on the device until the next dumpkvs()."""
        if self.grad_scaler is None:
            norm = self._log_grad_norm()
            if not self._grads_finite(norm):
                return self._non_finite_step(float(norm))
            self._anneal_lr()
            self.opt.step()
            return True
        self.grad_scaler.unscale_(self.opt)
        self._log_grad_norm()
        self._anneal_lr()
        scale = _scale_tensor(self.grad_scaler).clone()
        self.grad_scaler.step(self.opt)
        self.grad_scaler.update()
        new_scale = _scale_tensor(self.grad_scaler)
        logger.logkv_device("loss_scale", new_scale)
        if bool(new_scale < scale):
            logger.logkv_mean("fp16_skipped", 1)
            logger.log(f"step {self.step + 1} skipped: NaN/inf float16 gradients at loss scale "
                       f"{float(scale):g} (now {float(new_scale):g}; usual in the first steps)")
            return False
        return True

    def optimize_normal(self):
        """Upstream's name for the optimizer step without --use_fp16: the one optimize() step.
        Returns whether the step was taken (the EMA update follows in run_step)."""
        return self.optimize()

    def optimize_fp16(self):
        """Upstream's name for the optimizer step with --use_fp16: the one optimize() step
        (GradScaler unscale/step/update). Returns whether the step was taken."""
        return self.optimize()

    def _log_grad_norm(self):
        """Log and return the global L2 norm of the (all-reduced) gradients: a 0-d float32
        tensor on the device (NaN if a gradient is NaN, Inf if one is Inf), not read here."""
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(grads) if grads else th.zeros((), device=self.device)
        logger.logkv_mean_device("grad_norm", norm, 1)
        return norm

    def _grads_finite(self, norm):
        """False if a gradient is NaN/Inf (the step's one host sync). `norm` decides unless it
        is inf, which large finite gradients can also give: then they are looked at one by one."""
        if bool(th.isfinite(norm)):
            return True
        if bool(th.isnan(norm)):
            return False
        return all(bool(th.isfinite(p.grad).all())
                   for p in self.model.parameters() if p.grad is not None)

    def _non_finite_step(self, norm):
        """--nan_policy for a step with non-finite gradients: raise, or skip it (returns False)."""
        step = self.step + 1
        if self.nan_policy == "stop":
            last = ("none saved" if self.last_saved_step is None
                    else f"the last saved step is {self.last_saved_step}")
            raise NonFiniteError(
                f"step {step}: the loss or gradients are not finite (grad norm {norm}); stopped "
                f"(--nan_policy stop) without saving it ({last}); lower --lr, resume from a "
                f"saved step, or pass --nan_policy skip to skip such steps")
        self.opt.zero_grad(set_to_none=True)
        logger.logkv_mean("nan_skipped", 1)
        logger.log(f"step {step}: the loss or gradients are not finite (grad norm {norm}); "
                   f"optimizer step skipped (--nan_policy skip): weights, Adam moments and EMA "
                   f"unchanged")
        return False

    def _anneal_lr(self):
        """Upstream: lr * (1 - completed_steps / lr_anneal_steps)."""
        if not self.lr_anneal_steps:
            return
        lr = self.lr * (1 - self.step / self.lr_anneal_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr

    def _update_ema(self):
        params = [p.detach() for p in self.model.parameters()]
        with th.no_grad():
            for rate, ema in zip(self.ema_rate, self.ema_params):
                update_ema(ema, params, rate=rate)

    def log_step(self):
        """Log the step's key/values (upstream's name; run_step calls it, it calls _log_step)."""
        self._log_step()

    def _log_step(self):
        logger.logkv("step", self.step)
        logger.logkv("samples", int(getattr(self.data, "position", self.step * self.global_batch)))
        logger.logkv("lr", self.opt.param_groups[0]["lr"])
        logger.logkv("world_size", self.world_size)
        logger.logkv("global_batch", self.global_batch)

    # ------------------------------------------------------------------ save

    def save(self, wait=False):
        """Write model, EMA and opt files of the current step, manifest last. Collective.

        Every rank checks the weights (_refuse_non_finite_weights) and sends its RNG state to rank
        0 (dist_util.gather_object); rank 0 alone builds the payloads. With async_save, rank 0
        copies them to host memory (buffers reused from save to save, pinned on CUDA) and a
        background thread writes the files and the manifest (run_dir.write_step), then prunes,
        while training goes on; without it rank 0 writes them now. A save first waits for the
        one before it, whose failure is raised here on every rank (between saves, the loop
        raises it at the next step: _local_save_failed / _raise_save_failed). ``wait``: return
        only once this save is complete on disk (the final and the preemption save). Each save
        logs one line: its duration and, when asynchronous, the pause it caused.
        """
        if self.last_saved_step == self.step:
            if wait:
                self._wait_for_save()
            return
        began = time.perf_counter()
        step = self.step
        self._refuse_non_finite_weights(step)
        rng = dist_util.gather_object(get_rng_state(), dst=0)
        dist_util.run_on_rank0(lambda: self._save_on_rank0(step, rng, began, wait))
        self.last_saved_step = step

    def _save_on_rank0(self, step, rng, began, wait):
        """Rank 0's part of save(): wait for the previous save (raising its failure), then write
        this step now or hand its host copy to the background writer."""
        self._collect_save(block=True)
        files = {checkpoint.model_filename(step): self._model_file(step)}
        for rate_str, params in zip(self.ema_rate_strs, self.ema_params):
            files[checkpoint.ema_filename(rate_str, step)] = self._ema_file(step, rate_str, params)
        files[checkpoint.opt_filename(step)] = self._opt_file(step, rng)
        if not self.async_save:
            run_dir.write_step(self.log_dir, step, to_host(files))
            self._log_saved(step, time.perf_counter() - began, None, self._prune())
            return
        if self._snapshot is None:
            self._snapshot = HostSnapshot()
        files = self._snapshot.copy(files)
        paused = time.perf_counter() - began
        self._writer.start(lambda: self._write_in_background(step, files, began, paused))
        if wait:
            self._collect_save(block=True)

    def _write_in_background(self, step, files, began, paused):
        """The writer thread's job: the step's files and manifest, then the prune. Returns what
        the main thread logs (no logging from this thread)."""
        run_dir.write_step(self.log_dir, step, files)
        took = time.perf_counter() - began
        return step, took, paused, self._prune()

    def _collect_save(self, block):
        """Rank 0: log a finished background save and return (step, seconds, pause, log lines);
        raise its failure (``block``: wait for it, else return None at once when it still
        runs). A failure already seen by _local_save_failed is raised first. Not collective."""
        failure, self._save_failure = self._save_failure, None
        if failure is not None:
            raise failure
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
        logger.log(f"saved step {step} to {self.log_dir} in {took:.2f} s{pause}")
        for line in prune_lines:
            logger.log(line)

    def _wait_for_save(self):
        """Wait until the background save (if any) is complete on disk; its failure is raised on
        every rank. Returns _collect_save's (step, seconds, pause, log lines), or None when no
        save was in flight. Collective."""
        return dist_util.run_on_rank0(lambda: self._collect_save(block=True))

    def _local_save_failed(self):
        """This rank's bit for the loop's per-step flags: True on rank 0 once its background
        write has failed (a finished one is logged here); False on the other ranks and while a
        write runs. Not collective and costs no wait: the loop folds it into the all-reduce it
        does anyway (with the preemption flag), so that every rank sees it at the same step and
        calls _raise_save_failed together."""
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
        Collective: call from all ranks at the same step, once a rank's _local_save_failed was
        seen (the loop's per-step flags)."""
        def rank0():
            self._collect_save(block=True)  # raises the failure
            raise RuntimeError("a background save failed on rank 0 (bug: no error kept)")
        dist_util.run_on_rank0(rank0)

    def _finish_save_quietly(self):
        """After an error elsewhere: let rank 0's background save end (its files complete or
        removed, never half-written) and log how it went. Not collective."""
        if self.rank != 0 or not self._writer.busy:
            return
        try:
            self._collect_save(block=True)
        except Exception as e:  # the error that ends the run is another one: only report this
            logger.warn(f"warning: the background save also failed: {e}")

    def _refuse_non_finite_weights(self, step):
        """Raise NonFiniteError (same line on every rank) if the model or an EMA holds a NaN/Inf:
        such a checkpoint is never written. Collective (one all_gather_object)."""
        found = []
        n = _count_non_finite(self.model.state_dict().values())
        if n:
            found.append(f"model: {n} tensor(s)")
        for rate_str, params in zip(self.ema_rate_strs, self.ema_params):
            n = _count_non_finite(params)
            if n:
                found.append(f"EMA {rate_str}: {n} tensor(s)")
        gathered = dist_util.all_gather_object(", ".join(found))
        if not any(gathered):
            return
        where = (gathered[0] if all(g == gathered[0] for g in gathered)
                 else _by_rank(gathered, show=lambda g: g or "finite"))
        last = ("no step was saved before" if self.last_saved_step is None
                else f"the last saved step is {self.last_saved_step}")
        raise NonFiniteError(
            f"step {step}: not saved: the weights hold non-finite values ({where}); {last}; "
            f"resume from a saved step with a lower --lr")

    def _prune(self):
        """Rank 0, once a save is complete: apply --keep_checkpoints. Returns the lines to log
        (it may run in the writer thread, which does not log)."""
        if self.rank != 0 or not self.keep_checkpoints:
            return []
        try:
            deleted = run_dir.prune(self.log_dir, self.keep_checkpoints)
        except (checkpoint.CheckpointError, OSError) as e:  # a failed delete must not kill a run
            # that just saved (a bug still raises)
            return [f"warning: --keep_checkpoints {self.keep_checkpoints}: prune failed: {e}"]
        return [f"pruned {len(deleted)} old checkpoint file(s)"] if deleted else []

    def _model_file(self, step):
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        return checkpoint.model_payload(step, sd, self.model_flags)

    def _ema_file(self, step, rate_str, params):
        sd = {k: v.detach() for k, v in self._params_to_state_dict(params).items()}
        return checkpoint.ema_payload(step, rate_str, sd, self.model_flags)

    def _opt_file(self, step, rng):
        """The opt payload with the optimizer's own tensors (the caller copies them)."""
        named = optim_state.named_optimizer_state(self.opt, self.named_params, copy=False)
        return checkpoint.opt_payload(step, named, self._trainer_state(rng))

    def _params_to_state_dict(self, params):
        sd = self.model.state_dict()
        for (name, _), p in zip(self.named_params, params):
            sd[name] = p
        return sd

    def _trainer_state(self, rng):
        """The "trainer" entry of opt*.pt (docs/checkpoints.md; weights_only-loadable).

        ``rng``: every rank's get_rng_state(), by rank (gathered to rank 0 by save())."""
        return {
            "step": int(self.step),
            "world_size": int(self.world_size),
            "batch_size": int(self.batch_size),
            "global_batch": int(self.global_batch),
            "seed": int(self.seed),
            "data": _data_state(self.data),
            "rng": list(rng),
            "schedule_sampler": self.schedule_sampler.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "ema_rates": list(self.ema_rate_strs),
            "lr": float(self.opt.param_groups[0]["lr"]),
            "model_changes": list(self.model_changes),
            "train_flags": {name: kind(getattr(self, name))
                            for name, kind in RESUME_LOGGED_FLAGS.items()},
        }


# ---------------------------------------------------------------------- helpers


def parse_ema_rates(ema_rate):
    """"0.9999,0.999" (or a float, or a list) -> ["0.9999", "0.999"] as upstream names files."""
    if isinstance(ema_rate, (list, tuple)):
        items = list(ema_rate)
    elif isinstance(ema_rate, float):
        items = [ema_rate]
    else:
        items = [x for x in str(ema_rate).split(",") if x.strip()]
    out = []
    for x in items:
        try:
            r = float(x)
        except ValueError:
            raise UsageError(f"--ema_rate: {x!r} is not a number; pass e.g. 0.9999 or "
                             f"0.9999,0.999") from None
        if not 0.0 <= r <= 1.0:
            raise UsageError(f"--ema_rate: {x} is not in [0, 1]")
        out.append(str(r))
    return out


def parse_resume_step_from_filename(filename):
    """
    The step in a checkpoint file name: ``path/to/model000100.pt`` -> 100 (upstream's contract),
    also ``ema_0.9999_000100.pt`` and ``opt000100.pt`` (checkpoint.parse_step). Unlike upstream,
    which returned 0 for a name without a step (and so silently restarted the step count), a
    name without one raises checkpoint.CheckpointError naming the file.
    """
    return checkpoint.parse_step(filename)


def get_blob_logdir():
    """Where checkpoints go by default (upstream): ``$DIFFUSION_BLOB_LOGDIR``, else the logger's
    directory."""
    return os.environ.get("DIFFUSION_BLOB_LOGDIR") or logger.get_dir()


def find_resume_checkpoint(log_dir=None):
    """
    The model file of the newest complete step in ``log_dir`` (default get_blob_logdir()), or
    None when it holds none. Upstream's returned None always ("override this to discover the
    latest checkpoint on your blob storage"); this is that discovery: the step TrainLoop's
    auto-resume would choose (run_dir: manifest present and its checksums verified; newer
    incomplete steps are skipped with a warning). Not collective: it reads the directory; in a
    job, let TrainLoop decide (rank 0 reads once and broadcasts).
    """
    log_dir = get_blob_logdir() if log_dir is None else log_dir
    if not log_dir:
        return None
    st = run_dir.latest_complete_step(log_dir, warn=logger.warn, verify_checksums=True)
    return None if st is None else st.model_path


def find_ema_checkpoint(main_checkpoint, step, rate):
    """
    ``ema_{rate}_{step:06d}.pt`` beside ``main_checkpoint`` if that file exists, else None (also
    for ``main_checkpoint`` None), as upstream. ``rate``: a float (0.9999) or its string.
    """
    if main_checkpoint is None:
        return None
    rate_str = parse_ema_rates(rate)[0]
    path = checkpoint.join(checkpoint.dirname(main_checkpoint),
                           checkpoint.ema_filename(rate_str, step))
    return path if checkpoint.exists(path) else None


def update_ema(target_params, source_params, rate=0.99):
    """targ = rate * targ + (1 - rate) * src, in place (upstream's formula and rounding: the
    same two operations, each applied to all tensors at once by torch's foreach kernels)."""
    targets = [t.detach() for t in target_params]
    sources = [s.detach() for s in source_params]
    if not targets:
        return
    th._foreach_mul_(targets, rate)
    th._foreach_add_(targets, sources, alpha=1 - rate)


def grad_norm(grads):
    """The global L2 norm of `grads` (a 0-d float32 tensor on their device; NaN/Inf propagate),
    from torch's foreach per-tensor norms: no host sync."""
    norms = th._foreach_norm([g.float() if g.dtype != th.float32 else g for g in grads])
    return th.linalg.vector_norm(th.stack(norms))


def make_adamw(params, *, lr, weight_decay):
    """AdamW, fused where this torch supports it for the parameters' device, else foreach."""
    params = list(params)
    for impl in ({"fused": True}, {"foreach": True}):
        try:
            return AdamW(params, lr=lr, weight_decay=weight_decay, **impl)
        except RuntimeError:  # this torch has no fused kernel for the device
            continue
    return AdamW(params, lr=lr, weight_decay=weight_decay)


def log_loss_dict(diffusion, ts, losses):
    """Log mean losses and their means per timestep quartile (`{key}_q0`..`_q3`), as upstream.

    The sums stay on the device (logger.logkv_mean_device) until the next dumpkvs(): no host
    sync per step. The written numbers are upstream's: the mean of each microbatch's mean, and
    per quartile the mean of the per-sample losses whose timestep falls in it."""
    if not losses:
        return
    keys = list(losses)
    values = th.stack([losses[k].detach().float() for k in keys])  # [K, N]
    quartile = (4 * ts.to(values.device).long()) // diffusion.num_timesteps  # [N] in 0..3
    per_q = th.zeros(len(keys), 4, dtype=values.dtype, device=values.device)
    per_q.index_add_(1, quartile, values)
    counts = th.bincount(quartile, minlength=4)[None].expand(len(keys), 4)
    ones = th.ones(len(keys), 1, dtype=counts.dtype, device=counts.device)
    names = [name for k in keys for name in (k, *(f"{k}_q{q}" for q in range(4)))]
    logger.logkv_mean_device(names, th.cat([values.mean(1, keepdim=True), per_q], 1),
                             th.cat([ones, counts], 1))


def _make_amp(device, use_fp16, fp16_scale_growth):
    """(autocast dtype or None, GradScaler or None) for --use_fp16 on `device`.

    fp16 + GradScaler on CUDA. On a CPU with bfloat16 units (cpu_has_fast_bf16), bf16 without a
    scaler (native there, and no overflow-skipped steps; not measured on the development machine,
    which has no such units); on other CPUs fp16 as asked, with a one-line warning that it is
    slower than fp32 there (benchmarks/amp_cpu.py: bf16 4.8x, fp16 57x the fp32 step time); bf16
    where this torch has no fp16 autocast. Upstream raised log2(loss scale) by fp16_scale_growth per
    good step; GradScaler doubles the scale after 1/fp16_scale_growth good steps, which is the
    same rate in steps of 2x.
    """
    if not use_fp16:
        return None, None
    if device.type == "cpu" and cpu_has_fast_bf16():
        logger.log("--use_fp16: bfloat16 autocast (this CPU has bfloat16 units; no loss scaling)")
        return th.bfloat16, None
    if device.type == "cpu":
        logger.log("warning: --use_fp16 True: this CPU has no float16/bfloat16 units, so mixed "
                   "precision is slower than fp32 here (benchmarks/amp_cpu.py); using float16 "
                   "autocast as asked (--use_fp16 False trains faster)")
    interval = max(1, int(round(1.0 / fp16_scale_growth))) if fp16_scale_growth > 0 else 10 ** 9
    try:
        scaler = th.amp.GradScaler(
            device.type, init_scale=INITIAL_LOSS_SCALE, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=interval,
        )
        with th.autocast(device_type=device.type, dtype=th.float16):
            th.nn.functional.conv2d(th.zeros(1, 1, 3, 3, device=device),
                                    th.zeros(1, 1, 1, 1, device=device))
        return th.float16, scaler
    except (RuntimeError, AssertionError, ValueError):
        logger.log(f"--use_fp16: float16 autocast unsupported on {device.type}; using bfloat16")
        return th.bfloat16, None


def cpu_has_fast_bf16(cpuinfo="/proc/cpuinfo"):
    """True when this CPU computes in bfloat16 natively (x86 AVX512-BF16 or AMX, Arm BF16); False
    elsewhere, where bf16 is emulated and slower than fp32 (benchmarks/amp_cpu.py)."""
    try:
        with open(cpuinfo) as f:
            words = set(f.read().split())
    except OSError:  # no /proc (macOS, Windows): do not guess
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def _scale_tensor(scaler):
    """The GradScaler's current scale as a device tensor (not read to the host)."""
    get = getattr(scaler, "_get_scale_async", None)
    return get() if callable(get) else th.tensor(scaler.get_scale())


def _poison_if_not_finite(loss):
    """`loss` unchanged (times 1.0) if finite, else times NaN, so that its gradients are NaN too
    (a NaN loss can have finite gradients, e.g. from log of a negative number). No sync."""
    scale = th.where(th.isfinite(loss), 1.0, float("nan")).to(loss.dtype).detach()
    return loss * scale


def _finite_only(ts, losses):
    """(ts [N], losses [N]) without the entries whose loss is NaN/Inf (for a LossAwareSampler,
    whose history a NaN would poison for good)."""
    keep = th.isfinite(losses)
    if bool(keep.all()):
        return ts, losses
    return ts[keep], losses[keep]


def _count_non_finite(tensors):
    """How many floating-point tensors among `tensors` hold a NaN or Inf (one device sync).

    A tensor's min and max are both finite exactly when all its values are (a NaN makes both
    NaN): one pass per tensor without a temporary (isfinite().all() writes a bool tensor as large
    as the weights, then reads it)."""
    ends = [th.stack(th.aminmax(t.detach())).double() for t in tensors
            if t.is_floating_point() and t.numel()]
    return int((~th.stack(ends).isfinite().all(dim=1)).sum()) if ends else 0




def _check_state_dict_matches(model, sd, path, file_flags, my_flags, params_only=False):
    """Raise ResumeError (one line) naming missing/unexpected/reshaped keys and the likely flag.
    ``params_only``: compare the parameters only (EMA weights; buffers are the model's)."""
    mine = dict(model.named_parameters()) if params_only else model.state_dict()
    want = state_fit.shapes_of(mine)
    have = state_fit.shapes_of({k: v for k, v in sd.items() if k in want} if params_only else sd)
    fit = state_fit.fit_state_dict(want, have, file_flags, my_flags)
    if not fit.ok:
        raise ResumeError(_misfit_message(path, fit))


def _misfit_message(path, fit):
    """The one line of a resume whose weights do not fit the model (a state_fit.Fit)."""
    flag = fit.likely_flags[0] if fit.likely_flags else "the model flags"
    return (f"{path}: weights do not fit the model built from the flags ({fit.summary()}); "
            f"check {flag}, or pass --allow_model_change True to keep the tensors that match "
            f"and start the others fresh")


@dataclass
class _ResumeFrom:
    """What a resume loads, shared by `TrainLoop._resume`'s steps (upstream's method names take
    no arguments): the plan, then what each step learned."""

    plan: Any  # run_dir.ResumePlan
    model_ckpt: Any = None  # checkpoint.CkptFile of the model file
    step: Optional[int] = None
    file_shapes: Dict[str, Any] = field(default_factory=dict)  # the model file's {name: shape}
    change: Optional[model_change.ModelChange] = None  # set when the model changed
    ema_loaded: List[str] = field(default_factory=list)
    trainer: Optional[dict] = None
    opt_note: str = ""
    opt_summary: str = ""
    regrouped: Dict[str, Any] = field(default_factory=dict)


def check_config_on_all_ranks(flags, data_fingerprint=None):
    """Fail on every rank, with the same one-line message, if ranks were started differently.

    `flags` ({name: value}: model, diffusion and training flags) and `data_fingerprint` (the
    dataset's {"num_files", "sha256"}, or None for data that has none) are gathered from every
    rank in one all_gather_object; the message names each differing flag with the ranks that had
    each value, and the dataset's size and hash per rank. Called before sync_params, so ranks with
    different model flags stop here instead of in a broadcast of mismatched tensors.
    Returns the sha256 of the flags (the same on every rank). Collective: call from all ranks.
    """
    digest = _config_digest(flags)
    gathered = dist_util.all_gather_object((digest, flags, data_fingerprint))
    problems = []
    if any(g[0] != digest for g in gathered):
        for key in sorted({k for g in gathered for k in g[1]}):
            seen = [g[1].get(key, "(not set)") for g in gathered]
            if any(v != seen[0] for v in seen):
                problems.append(f"--{key} differs between ranks {_by_rank(seen)}")
    if problems:
        problems.append("start every rank with the same flags")
    fps = [g[2] for g in gathered]
    if any(fp != fps[0] for fp in fps):
        problems.append("the dataset differs between ranks " + _by_rank(
            fps, show=_show_fingerprint) + "; give every rank the same image files in --data_dir "
            "(their relative paths and sizes are compared)")
    if problems:
        raise dist_util.DistMismatchError("; ".join(problems))
    return digest


def _config_digest(flags):
    text = json.dumps({k: repr(v) for k, v in flags.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _by_rank(values, show=repr):
    """"(32 on ranks 0-2,5; 64 on ranks 3-4)": each distinct value with the ranks that had it."""
    groups = {}
    for rank, v in enumerate(values):
        groups.setdefault(show(v), []).append(rank)
    return "(" + "; ".join(f"{k} on {_ranks_text(r)}" for k, r in groups.items()) + ")"


def _ranks_text(ranks):
    """[0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    runs = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _show_fingerprint(fp):
    if not fp:
        return "no fingerprint"
    return f"{fp.get('num_files')} files, sha256 {str(fp.get('sha256'))[:12]}"


def _data_fingerprint(data):
    """The data's fingerprint() ({"num_files", "sha256"}), or None if it has none."""
    fn = getattr(data, "fingerprint", None)
    return fn() if callable(fn) else None





def _combined_ema(ckpt):
    """The EMA weights of a combined dict ({"model", "ema", ...}), or None."""
    try:
        return checkpoint.model_state_from(ckpt, want="ema")
    except checkpoint.CheckpointError:
        return None


def _guess_data_state(loader, position):
    sd = dict(loader.state_dict()) if _restorable(loader) else {}
    sd["position"] = int(position)
    return sd


def _restorable(data):
    """Whether `data` can save and restore its position (a ResumableLoader can; upstream's
    load_data generator, or any plain iterator, cannot)."""
    return callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None))


def _data_state(data):
    """The data's state_dict() for the trainer dict, or, for a plain iterator, a record that its
    position cannot be restored ({"restorable": False, "iterator": type name}: no "position")."""
    if _restorable(data):
        return data.state_dict()
    return {"restorable": False, "iterator": type(data).__name__}


# ---------------------------------------------------------------------- RNG


def _derived_seed(seed, step, rank):
    return int(np.random.SeedSequence([int(seed), int(step), int(rank)]).generate_state(1)[0])


def seed_rngs(seed, step=0, rank=0):
    """Seed python, numpy and torch (and CUDA) from (seed, step, rank)."""
    s = _derived_seed(seed, step, rank)
    random.seed(s)
    np.random.seed(s)
    th.manual_seed(s)


def get_rng_state():
    """This process's RNG states as weights_only-loadable data (lists, ints, tensors)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, pystate, gauss_next = random.getstate()
    return {
        "torch": th.get_rng_state(),
        "numpy": {"name": str(name), "keys": th.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": [int(x) for x in pystate],
                   "gauss_next": None if gauss_next is None else float(gauss_next)},
        "cuda": th.cuda.get_rng_state_all() if th.cuda.is_available() else None,
    }


def set_rng_state(state):
    """Inverse of get_rng_state()."""
    th.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if state.get("cuda") is not None and th.cuda.is_available():
        if len(state["cuda"]) == th.cuda.device_count():
            th.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- signals


def _preemption_flag():
    """The preemption flag ({"set", "signal"}) in its training phase, for a ``with`` around the
    loop: the process-wide flag of preemption.install() when a script installed it (a signal
    since start-up counts; later ones only set it again), else handlers for the loop alone."""
    return preemption.training()
