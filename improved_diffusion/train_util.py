"""
The training loop: upstream improved-diffusion's TrainLoop (microbatches, several EMA rates, lr
annealing, weight decay, loss logging by timestep quartile, grad-norm logging), with save and
resume left to the checkpointer (checkpointer.py), which it calls in a handful of places:

    run_loop -> run_step -> forward_backward -> optimize, then the EMA and the log
    construction: checkpointer.begin_resume() and its steps (upstream's hook names below)
    every step:   checkpointer.step_begins() ... checkpointer.stop_requested()
    every save_interval, at the end, on preemption:   checkpointer.save(step)

Where it differs from upstream's:

- Every rank runs the same code path; every collective is called by all ranks in the same order
  (docs/ARCHITECTURE.md, "Distributed rules").
- ``step`` counts completed optimizer steps since the run began (resumes included); the files of
  step S hold the state after S steps. Upstream counted steps since the resume.
- Mixed precision is torch.autocast + GradScaler (amp.py), no hand-rolled master params.
- The trainer changes model state only inside a training step: the DDP bucket-priming pass
  leaves parameters, buffers (BatchNorm statistics) and RNG as they were.
- SIGTERM / SIGUSR1 on any rank: all ranks agree at a step boundary, save, and run_loop()
  returns PREEMPTED_EXIT_CODE (75).
- The settings are one TrainConfig, checked when it is built.
"""
import atexit
import contextlib
import dataclasses
import gc
import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch as th
from torch.nn.parallel.distributed import DistributedDataParallel as DDP
from torch.optim import AdamW

from . import amp, dist_util, guidance, image_datasets, logger, phema, trackers, virtual_shards
from .infra import fsdp
from .ckpt import checkpoint, run_dir
from .infra import storage as bf  # blobfile's names, for local paths and s3:// gs:// az://
from .ckpt.checkpointer import (PREEMPTED_EXIT_CODE, CheckpointConfig, Checkpointer, NonFiniteError,
                                ResumeError, copy_into, fields_from_flags)
from .infra.config_check import check_config_on_all_ranks, data_fingerprint, show_fingerprint
from .infra.errors import UsageError, UserError
from .nn import update_ema
from .resample import LossAwareSampler, UniformSampler
from .ckpt.rng import get_rng_state, seed_rngs, set_rng_state
from .sample_grids import SampleGrids
from .train_eval import TrainEval, check_flags as check_eval_flags

__all__ = ["TrainLoop", "TrainConfig", "PREEMPTED_EXIT_CODE", "NonFiniteError", "ResumeError",
           "seed_rngs", "get_rng_state", "set_rng_state", "update_ema", "parse_ema_rates",
           "find_resume_checkpoint", "find_ema_checkpoint", "get_blob_logdir",
           "parse_resume_step_from_filename"]

# --nan_policy: what a step with a non-finite loss or gradient does (without a GradScaler).
NAN_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class TrainConfig:
    """The training settings of a TrainLoop, one field per flag of the same name (defaults are
    script_util.train_defaults()'s: see ``from_flags``). Checked when built (UsageError naming
    the flag).

    batch_size: samples per rank per optimizer step (the global batch is this times the ranks).
    microbatch: split each batch into pieces of this size, accumulating gradients (<= 0: off).
    global_batch_size: G > 0: the step is G samples over all ranks in virtual shards of
        microbatch (virtual_shards.py; batch_size must then be G / ranks): the same run bit for
        bit on any rank count. 0: off.
    lr: AdamW's learning rate. weight_decay: AdamW's decoupled weight decay.
    ema_rate: comma-separated EMA rates ("0.9999,0.999"); one EMA of the parameters each.
    log_interval: log (progress line, progress.csv) every this many steps.
    use_fp16: mixed precision (amp.py: fp16 + GradScaler on CUDA, bf16 on CPUs with bf16 units).
    fp16_scale_growth: upstream's log2 loss-scale growth per good step (GradScaler's interval).
    lr_anneal_steps: linear decay of lr to 0 over this many steps, and stop there (0: off).
    max_steps: stop after this many steps (0: no limit but lr_anneal_steps).
    seed: the seed of model init, data order, noise and dropout (with the step and rank).
    log_sample_indices: append each step's dataset indices to log_dir/sample_indices/ (per rank).
    nan_policy: a step with a NaN/Inf loss or gradient, without a GradScaler: "stop" or "skip".
    compile: run the forward/backward through torch.compile.
    fsdp: shard parameters, gradients, Adam moments and EMAs over the ranks (FSDP2: fsdp.py)
        instead of DDP's whole copy on every rank; checkpoints are the same files.
    find_unused_parameters: DDP's, for a model that leaves parameters out of the loss on some
        steps or ranks (train_job.Parts can ask for it too).
    sample_interval: rank 0 writes a grid of EMA samples every this many steps and at the end
        (0: off; sample_grids.py). sample_count: images per grid. sample_steps: their DDIM steps.
    tensorboard: rank 0 also logs the scalars and the grids to log_dir/tb/ (TensorBoard).
    tracker: comma-separated trackers rank 0 also logs them to: wandb, mlflow (trackers.py).
    phema_stds: comma-separated post-hoc EMA widths ("0.05,0.1", EDM2's sigma_rel; "": off): one
        power-function EMA each (phema.RunTracker), its snapshots written with saves.
    phema_interval: snapshots every this many steps, a multiple of save_interval (snapshots are
        part of a step's save); 0: at every save_interval save. The run's last step has them too.
    eval_interval: every this many steps (a multiple of log_interval), all ranks sample
        eval_num_samples images of the EMA (DDIM, sample_steps) and rank 0 logs their FID and
        IS against eval_ref_batch (0: off; train_eval.py). eval_features: "inception" (the FID
        Inception, weights from inception_weights or $ID_INCEPTION_WEIGHTS) or "digits".
    class_map: how a resume's class labels meet the class names its checkpoint stores: "check"
        (refuse a difference), "keep" (the checkpoint's labels, by name), "data" (the folder's);
        image_datasets.CLASS_MAPS, TrainLoop._match_class_names.
    checkpoint: the checkpointer's settings (log_dir, resume, saving; CheckpointConfig).
    """

    batch_size: int
    microbatch: int
    global_batch_size: int
    lr: float
    ema_rate: str
    log_interval: int
    use_fp16: bool
    fp16_scale_growth: float
    weight_decay: float
    lr_anneal_steps: int
    max_steps: int
    seed: int
    log_sample_indices: bool
    nan_policy: str
    compile: bool
    fsdp: bool
    find_unused_parameters: bool
    sample_interval: int
    sample_count: int
    sample_steps: int
    tensorboard: bool
    tracker: str
    phema_stds: str
    phema_interval: int
    eval_interval: int
    eval_ref_batch: str
    eval_num_samples: int
    eval_features: str
    inception_weights: str
    class_map: str
    checkpoint: CheckpointConfig

    # Settings that may differ between ranks (each rank's own diagnostics).
    PER_RANK = ("log_sample_indices",)
    # Settings of the training math that the trainer state records, so that a resume with other
    # values says so (seed, ema_rate and the batch size have lines of their own). Every setting
    # of the run (run_settings) goes to the manifests, not to the checkpoint files: runs that
    # differ in where to write, how to save or what to log write the same bytes.
    RECORDED = ("lr", "weight_decay", "lr_anneal_steps", "microbatch", "global_batch_size",
                "use_fp16",
                "fp16_scale_growth", "nan_policy")

    def __post_init__(self):
        for name in ("batch_size", "log_interval", "sample_count", "sample_steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("max_steps", "lr_anneal_steps", "sample_interval"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} must be >= 0 (got {getattr(self, name)})")
        if self.nan_policy not in NAN_POLICIES:
            raise UsageError(f"--nan_policy must be one of {', '.join(NAN_POLICIES)} "
                             f"(got {self.nan_policy!r})")
        parse_ema_rates(self.ema_rate)
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise UsageError("--tensorboard True needs the tensorboard package: "
                             "pip install tensorboard (or the project's extra, "
                             "pip install -e '.[tensorboard]')")
        trackers.parse(self.tracker)
        phema.check_flags(self.phema_stds, self.phema_interval, self.checkpoint.save_interval)
        check_eval_flags(self)
        if self.fsdp:
            fsdp.check_flags(self)
        fsdp.check_layout(self.fsdp, self.checkpoint.save_layout)
        if self.class_map not in image_datasets.CLASS_MAPS:
            raise UsageError(f"--class_map must be one of {', '.join(image_datasets.CLASS_MAPS)} "
                             f"(got {self.class_map!r})")

    @classmethod
    def from_flags(cls, flags, **overrides):
        """The config of ``flags`` (an argparse Namespace or a dict; missing names take
        script_util.train_defaults()'s values), with ``overrides`` applied."""
        ckpt = CheckpointConfig.from_flags(flags, **overrides)
        return fields_from_flags(cls, flags, dict(overrides, checkpoint=ckpt))

    @property
    def last_step(self):
        """The step the run stops at (max_steps or lr_anneal_steps, the earlier); 0: none."""
        return min([n for n in (self.max_steps, self.lr_anneal_steps) if n > 0], default=0)

    @property
    def phema_std_list(self):
        """The post-hoc EMA widths, sorted ([] when off)."""
        text = str(self.phema_stds).strip()
        return phema.parse_stds([text], "--phema_stds") if text else []

    @property
    def phema_every(self):
        """Snapshots every this many steps: --phema_interval, else --save_interval."""
        return self.phema_interval or self.checkpoint.save_interval

    @property
    def ema_rates(self):
        """The EMA rates as upstream names files: ["0.9999", "0.999"]."""
        return parse_ema_rates(self.ema_rate)

    def flags(self):
        """{flag: value} of every setting (the checkpointer's included), as on the command
        line: what ranks compare and what checkpoints record."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "checkpoint"}
        out.update(dataclasses.asdict(self.checkpoint))
        return out


class TrainLoop:
    """Upstream's TrainLoop: the same keyword arguments, plus ``log_dir``, ``model_flags`` and
    any other TrainConfig setting by name (``max_steps=``, ``seed=``, ``keep_checkpoints=``, ...).

    Called with upstream's keyword arguments only, it works as upstream's did: ``log_dir``
    defaults to get_blob_logdir() (``$DIFFUSION_BLOB_LOGDIR``, else the logger's directory), where
    the files are written and where the loop auto-resumes its newest complete step from;
    ``model_flags`` (the model/diffusion flags files store) defaults to unknown: a warning is
    logged and the files then carry no flags (sampling needs the flags on the command line).
    Upstream's method names exist and are called (a subclass may override them): run_loop,
    run_step, forward_backward, optimize_normal / optimize_fp16 (both the one optimize() step),
    log_step, save, and the resume's _load_and_sync_parameters, _load_ema_parameters(rate),
    _load_optimizer_state. Where meanings differ from upstream's:

    - ``self.step`` is the global step; ``self.resume_step`` is, as upstream, the step resumed
      from.
    - optimize_normal / optimize_fp16 return whether the step was taken; the EMA update is done
      by run_step after them (upstream did it inside them).
    - The loop stops at ``max_steps`` or ``lr_anneal_steps`` (global steps), saves the final step,
      and returns an exit code; upstream's ran until lr_anneal_steps without a return value.
    - nan_policy: "stop" raises NonFiniteError naming the step, saving nothing for it; "skip"
      leaves weights, Adam moments and EMA as they were, logs it, and goes on (the step and the
      data position still advance, so a resumed run stays aligned with its data). The decision
      is the same on every rank: it is made from the all-reduced gradients' norm.

    data: a ResumableLoader (exact resume of the data position), or any iterator of
    (batch, cond), e.g. upstream's load_data generator, whose position cannot be restored: its
    checkpoints record that, and a resume reseeds the RNGs from (seed, step, rank).
    model: any nn.Module called as ``model(x, t, **cond)`` (buffers and frozen parameters are
    fine: they are saved and restored as they are).
    sample_kwargs: for --sample_interval, ``indices (int64 [n]) -> {name: tensor [n, ...]}``, the
    keyword arguments of the model for the grid's samples (default: the labels ``i % num_classes``
    when model_flags say class_cond, else none).
    run_settings: {flag: value} of the run's settings as on the command line (train_job passes
    every training flag but the job's own: script_util.run_flag_keys); each step's manifest
    records them, so that a resume which leaves them out takes them back (Checkpointer's
    ``settings``).

    Construction resolves and loads the resume checkpoint (if any): a collective, so construct it
    on every rank with the same arguments.
    """

    def __init__(self, *, model, diffusion, data, batch_size, microbatch, lr, ema_rate,
                 log_interval, save_interval, resume_checkpoint, use_fp16=False,
                 fp16_scale_growth=1e-3, schedule_sampler=None, weight_decay=0.0,
                 lr_anneal_steps=0, log_dir=None, model_flags=None, sample_kwargs=None,
                 run_settings=None, **settings):
        if log_dir is None:  # upstream's TrainLoop wrote to get_blob_logdir()
            log_dir = get_blob_logdir()
        self.config = cfg = TrainConfig.from_flags(_settings(settings, dict(
            batch_size=batch_size, microbatch=microbatch, lr=lr, ema_rate=ema_rate,
            log_interval=log_interval, save_interval=save_interval,
            resume_checkpoint=resume_checkpoint or "", use_fp16=use_fp16,
            fp16_scale_growth=fp16_scale_growth, weight_decay=weight_decay,
            lr_anneal_steps=lr_anneal_steps, log_dir=log_dir)))
        if model_flags is None:
            logger.warn(
                "warning: TrainLoop: model_flags not given (unknown): checkpoint files will "
                "carry no model flags, so sample.py/nll.py need them on the command line; pass "
                "model_flags=args_to_dict(args, model_and_diffusion_defaults().keys())")
        # upstream's attribute names
        self.model, self.diffusion, self.data = model, diffusion, data
        self.batch_size, self.lr, self.weight_decay = batch_size, lr, weight_decay
        self.microbatch = microbatch if microbatch > 0 else batch_size
        self.ema_rate = [float(r) for r in cfg.ema_rates]
        self.log_interval, self.save_interval = log_interval, save_interval
        self.resume_checkpoint = cfg.checkpoint.resume_checkpoint
        self.use_fp16, self.fp16_scale_growth = use_fp16, fp16_scale_growth
        self.lr_anneal_steps = lr_anneal_steps
        self.schedule_sampler = schedule_sampler or UniformSampler(diffusion)
        self.model_flags = dict(model_flags or {})
        self.rank, self.world_size = dist_util.get_rank(), dist_util.get_world_size()
        self.global_batch = batch_size * self.world_size
        self.shard_plan = virtual_shards.plan_from_flags(cfg.global_batch_size, microbatch)
        if self.shard_plan is not None and batch_size != self.shard_plan.rank_batch:
            raise UsageError(f"--global_batch_size {cfg.global_batch_size} on {self.world_size} "
                             f"rank(s): the per-rank batch (and the loader's) must be "
                             f"{self.shard_plan.rank_batch}, not {batch_size}")
        self.device = dist_util.dev()
        self.step = self.resume_step = 0

        fingerprint = data_fingerprint(data)
        digest = check_config_on_all_ranks(
            _rank_flags(cfg, self.model_flags, self.schedule_sampler), fingerprint)
        logger.log(f"flags (sha256 {digest[:12]}) and data ({show_fingerprint(fingerprint)}) "
                   f"agree on all {self.world_size} rank(s)")
        seed_rngs(cfg.seed, 0, self.rank)
        self.model.to(self.device)
        dist_util.sync_params(self.model.parameters())
        # --fsdp: torch's GradScaler unscales DTensor gradients with one overflow flag for all
        # ranks (each skips the same steps; FSDP's ShardedGradScaler breaks fused AdamW)
        self.amp_dtype, self.grad_scaler = amp.make_amp(self.device, use_fp16, fp16_scale_growth)
        if cfg.fsdp:  # before the optimizer and the EMAs: they are made of the shards
            fsdp.shard_model(self.model, self.device, param_dtype=self.amp_dtype)
            logger.log(fsdp.active_line(self.world_size, cfg.checkpoint.save_layout))
        self.named_params = list(self.model.named_parameters())
        self.virtual_shards = (None if self.shard_plan is None else virtual_shards.VirtualShards(
            self.shard_plan, self.model, cfg.seed, exact=not cfg.fsdp))
        self.opt = self._make_optimizer()
        self.ema_params = [[p.detach().clone() for p in self.model.parameters()]
                           for _ in self.ema_rate]
        self.phema = (phema.RunTracker(self.model, cfg.phema_std_list, cfg.phema_every,
                                       cfg.last_step, self.model_flags)
                      if cfg.phema_std_list else None)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, model=self.model, optimizer=self.opt,
            emas=dict(zip(cfg.ema_rates, self.ema_params)), data=data, batch_size=batch_size,
            seed=cfg.seed, model_flags=self.model_flags,
            run_flags={k: getattr(cfg, k) for k in TrainConfig.RECORDED},
            settings=run_settings,
            states={"schedule_sampler": self.schedule_sampler, "grad_scaler": self.grad_scaler,
                    "phema": self.phema,
                    **({} if self.virtual_shards is None else
                       {virtual_shards.VirtualShards.name: self.virtual_shards})})
        names = getattr(data, "class_names", None)  # image_datasets.load_data's, in label order
        if names:
            self.checkpointer.file_tags["class_names"] = [str(n) for n in names]
        vae = getattr(data, "vae", None)  # a latent folder's vae.json: decode with that VAE
        if vae:
            self.checkpointer.file_tags["vae"] = {k: vae[k] for k in ("source", "sha256", "scale")
                                                  if k in vae}
        self._resume()
        self.evaluator = (TrainEval.of_training(cfg, self.model, self.ema_params, self.diffusion,
                                                self.model_flags, sample_kwargs)
                          if cfg.eval_interval else None)
        self.grids = (SampleGrids.of_training(cfg, self.model, self.ema_params, self.diffusion,
                                              self.model_flags, sample_kwargs)
                      if cfg.sample_interval else None)
        self._tensorboard = self._trackers = None
        if cfg.tensorboard and self.rank == 0:  # purge: steps a killed job logged past its save
            self._tensorboard = logger.add_tensorboard(
                os.path.join(cfg.checkpoint.log_dir, "tb"), purge_step=self.step + 1)
        if self.rank == 0:  # each step once: progress.csv's rows past the save, the trackers'
            logger.drop_rows_after(self.step)  # held back until saved (trackers.py)
            self._trackers = trackers.start(
                cfg.tracker, cfg.checkpoint.log_dir, step=self.step, settings=self.checkpointer
                .settings, config={**self.model_flags, **cfg.flags()}, resumed=self._runs)
        self.use_ddp = self.world_size > 1 and not cfg.fsdp and self.shard_plan is None
        self.ddp_model = self._wrap_ddp() if self.use_ddp else self.model
        if cfg.compile:  # only the forward/backward: self.model keeps its state-dict keys
            self.ddp_model = th.compile(self.ddp_model)
        self._ddp_primed = not self.use_ddp

    # ------------------------------------------------------------------ the loop

    def run_loop(self):
        """Train until max_steps / lr_anneal_steps (or forever); returns an exit code.

        0 when done; PREEMPTED_EXIT_CODE after a SIGTERM/SIGUSR1 on any rank (a complete checkpoint
        of the current step is saved first). Collective: call from all ranks.
        """
        data = iter(self.data)
        with self.checkpointer.watch_signals() as signal:
            if self.evaluator is not None and not self.evaluator.at_resume(self.step, signal):
                return self.checkpointer.save_for_preemption(self.step)
            while not self._done():
                self.checkpointer.step_begins()  # all ranks exchange their flags meanwhile
                batch, cond = next(data)
                if self.grids is not None:  # the state after self.step steps
                    self.grids.at_step(self.step, batch.shape[1:],
                                       resumed=self.step == self.resume_step)
                if self.config.log_sample_indices:
                    record_indices(self.config.checkpoint.log_dir, self.rank, self.step + 1,
                                   getattr(self.data, "last_indices", None))
                self.run_step(batch, cond)
                evaluated = (self.evaluator is None  # False: a preemption abandoned it
                             or self.evaluator.at_step(self.step, batch.shape[1:], signal))
                if self.step % self.log_interval == 0:
                    logger.dumpkvs()
                if self.save_interval and self.step % self.save_interval == 0:
                    self.save()
                if self.checkpointer.stop_requested() or not evaluated:
                    self._flush_logs()
                    return self.checkpointer.save_for_preemption(self.step)
            self._flush_logs()
            if self.step == self.resume_step and self.checkpointer.last_saved_step == self.step:
                logger.log(f"already at step {self.step}; nothing to train")
            self.save(wait=True)
            if self.grids is not None:
                self.grids.at_end(self.step)
        return 0

    def run_step(self, batch, cond):
        """One optimizer step on this rank's batch [B, C, H, W]. Collective (DDP all-reduce)."""
        with unused_parameters_named(self.step + 1):
            self.forward_backward(batch, cond)
        if self.use_ddp and not self.config.find_unused_parameters:
            check_every_parameter_used(self.named_params, self.step + 1)
        took_step = self.optimize_fp16() if self.use_fp16 else self.optimize_normal()
        self.step += 1
        if took_step is not False:  # an upstream-style override returning None took its step
            self._update_ema()
            if self.phema is not None:
                self.phema.update(self.global_batch)
        self.log_step()

    def forward_backward(self, batch, cond):
        """Accumulate gradients over microbatches; DDP syncs only on the last one. With
        --global_batch_size: the step's virtual shards (_forward_backward_shards)."""
        if self.virtual_shards is not None:
            return self._forward_backward_shards(batch, cond)
        for i in range(0, batch.shape[0], self.microbatch):
            micro = batch[i : i + self.microbatch].to(self.device)
            micro_cond = {k: v[i : i + self.microbatch].to(self.device) for k, v in cond.items()}
            micro_cond = guidance.drop_labels_in(micro_cond, self.model_flags)  # CFG training
            if not self._ddp_primed:
                self._prime_ddp_buckets(micro, micro_cond)
            if i == 0:
                self.opt.zero_grad(set_to_none=True)
            last = i + self.microbatch >= batch.shape[0]
            sync = (contextlib.nullcontext() if last or not self.use_ddp
                    else self.ddp_model.no_sync())
            with sync:
                t, weights, losses = self._microbatch_backward(micro, micro_cond)
                if isinstance(self.schedule_sampler, LossAwareSampler):
                    self.schedule_sampler.update_with_local_losses(
                        *_finite_only(t, losses["loss"].detach()))
                log_loss_dict(self.diffusion, t, {k: v * weights for k, v in losses.items()})

    def _microbatch_backward(self, micro, micro_cond, loss_scale=None):
        """One microbatch's timesteps, forward and backward (into .grad; the loss times
        ``loss_scale`` if given): returns (t, weights, {term: per-sample loss [n]})."""
        t, weights = self.schedule_sampler.sample(micro.shape[0], self.device)
        with amp.autocast(self.device, self.amp_dtype):
            losses = self.diffusion.training_losses(self.ddp_model, micro, t,
                                                    model_kwargs=micro_cond)
        losses = {k: v.float() for k, v in losses.items()}
        loss = (losses["loss"] * weights).mean()
        if loss_scale is not None:
            loss = loss * loss_scale
        if self.grad_scaler is None:
            loss = _poison_if_not_finite(loss)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()
        return t, weights, losses

    def _forward_backward_shards(self, batch, cond):
        """--global_batch_size: this rank's virtual shards of the step, each in its own RNG
        stream, their gradients reduced alike on every rank count (virtual_shards.py); then the
        loss-aware sampler and the loss log from every shard's numbers in shard order (the same
        on every rank). Collective."""
        def shard(micro, micro_cond):
            micro_cond = guidance.drop_labels_in(
                {k: v.to(self.device) for k, v in micro_cond.items()}, self.model_flags)
            t, weights, losses = self._microbatch_backward(
                micro.to(self.device), micro_cond, self.virtual_shards.loss_scale)
            return {"t": t, "w": weights, **{f"l:{k}": v.detach() for k, v in losses.items()}}

        rows = self.virtual_shards.step(self.step + 1, batch, cond, shard)
        t = rows.pop("t").long()
        weights = rows.pop("w").float()
        losses = {k[2:]: v.float() for k, v in rows.items()}
        if isinstance(self.schedule_sampler, LossAwareSampler):
            self.schedule_sampler.update_with_all_losses(
                *(x.tolist() for x in _finite_only(t, losses["loss"].double())))
        for s in self.virtual_shards.plan.global_slices():
            log_loss_dict(self.diffusion, t[s], {k: v[s] * weights[s] for k, v in losses.items()})

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
        scale = amp.scale_tensor(self.grad_scaler).clone()
        self.grad_scaler.step(self.opt)
        self.grad_scaler.update()
        new_scale = amp.scale_tensor(self.grad_scaler)
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

    def log_step(self):
        """Log the step's key/values (upstream's name; run_step calls it)."""
        logger.logkv("step", self.step)
        logger.logkv("samples", int(getattr(self.data, "position", self.step * self.global_batch)))
        logger.logkv("lr", self.opt.param_groups[0]["lr"])
        logger.logkv("world_size", self.world_size)
        logger.logkv("global_batch", self.global_batch)

    def save(self, wait=False):
        """Save the current step (model, EMA and opt files, manifest last: Checkpointer.save).
        ``wait``: return once it is complete on disk. Collective."""
        self.checkpointer.save(self.step, wait=wait)

    def close(self, sync=True):
        """Let the last save end and drop the DDP wrapper (call before dist_util.cleanup()).
        Collective unless sync=False (after an error elsewhere).

        Destroying the process group while a DDP wrapper is still alive sporadically aborts the
        process at exit ("terminate called without an active exception", signal 6).
        """
        self.checkpointer.close(sync=sync)
        for spool in _INDEX_SPOOLS.values():  # --log_sample_indices' rows of a bucket log dir,
            spool.sync(True)  # put now: at exit a store's client may be gone (adlfs)
        if self._tensorboard is not None:
            logger.remove_output(self._tensorboard)
            self._tensorboard = None
        if self._trackers is not None:
            self._trackers.ok = sync
            logger.remove_output(self._trackers)
            self._trackers = None
        if self.use_ddp and self.ddp_model is not self.model:
            if sync:
                dist_util.barrier()
            self.ddp_model = self.model
            gc.collect()

    # ------------------------------------------------------------------ resume (upstream's hooks)

    def _resume(self):
        """The resume (Checkpointer's story, module docstring there), through upstream's hook
        names so that a subclass's overrides are called. Collective."""
        self._resuming = self.checkpointer.begin_resume()
        self._runs = None  # the resumed step's tracker runs (trackers.py)
        if self._resuming is None:
            return
        self._load_and_sync_parameters()
        self._runs = self._resuming.saved_settings.get(trackers.MANIFEST_KEY)
        self._match_class_names()  # before anything of the log dir changes
        if self.phema is not None:
            self.phema.check_resume(self._resuming)
        self.step = self.resume_step = self._resuming.step
        for ema, rate in zip(self.ema_params, self.ema_rate):
            copy_into(ema, self._load_ema_parameters(rate))
        self._load_optimizer_state()
        self._resuming.finish()
        self._resuming = None

    def _match_class_names(self):
        """A class-conditional resume whose --data_dir classes differ from the class names its
        model file stores stops here with one line naming the differences, unless --class_map
        maps them (image_datasets.resumed_class_names); the data is relabelled to the names
        trained with, and the files store them. Every rank decides alike: the same file, the
        same data (its fingerprint was compared)."""
        names = getattr(self.data, "class_names", None)
        if not names:
            return
        raw = self._resuming.model_file.raw
        label_names, note = image_datasets.resumed_class_names(
            raw.get("class_names") if isinstance(raw, dict) else None, names,
            self.config.class_map, data_dir=getattr(getattr(self.data, "dataset", None), "root",
                                                    None),
            source=str(self._resuming.plan.model),
            num_classes=self.model_flags.get("num_classes"))
        image_datasets.relabel(self.data, label_names)
        self.checkpointer.file_tags["class_names"] = [str(n) for n in label_names]
        if note:
            logger.log(f"resume: {note}")

    def _load_and_sync_parameters(self):
        """Upstream's name: load the model weights of the resume step (collective; every rank
        loads the same file, so no sync of parameters afterwards is needed)."""
        self._resuming.load_model()

    def _load_ema_parameters(self, rate):
        """Upstream's name and contract: the EMA parameters of ``rate`` for the resume step, a
        list of tensors in model.parameters() order (collective)."""
        return self._resuming.load_ema(rate)

    def _load_optimizer_state(self):
        """Upstream's name: load the optimizer state of the resume step, or keep the optimizer
        fresh with one explained line when the file holds something else (collective)."""
        self._resuming.load_optimizer()

    # ------------------------------------------------------------------ helpers

    def _make_optimizer(self):
        """AdamW over the model's parameters (a subclass may build its own param groups)."""
        return make_adamw(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def _wrap_ddp(self):
        kwargs = dict(bucket_cap_mb=128,
                      find_unused_parameters=self.config.find_unused_parameters)
        if self.device.type == "cuda":
            kwargs.update(device_ids=[self.device], output_device=self.device)
        return DDP(self.model, **kwargs)

    def _prime_ddp_buckets(self, micro, micro_cond):
        """One throw-away forward/backward so that DDP settles its gradient buckets now: DDP
        re-orders them after the first synchronised backward, which changes the order of the
        cross-rank sums (on 3+ ranks: the last bits), so without it the first step after a resume
        would differ from a straight run's. It changes no state: the (zero) gradients are dropped,
        buffers (BatchNorm statistics) and RNG put back (keep_model_state). Collective."""
        with keep_model_state(self.model):
            t = th.zeros(micro.shape[0], dtype=th.long, device=self.device)
            with amp.autocast(self.device, self.amp_dtype):
                out = self.ddp_model(micro, t, **micro_cond)
            (out.float().sum() * 0.0).backward()
            self.opt.zero_grad(set_to_none=True)
        self._ddp_primed = True

    def _log_grad_norm(self):
        """Log and return the global L2 norm of the (all-reduced) gradients: a 0-d float32
        tensor on the device (NaN if a gradient is NaN, Inf if one is Inf), not read here."""
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(grads) if grads else th.zeros((), device=self.device)
        logger.logkv_mean_device("grad_norm", norm, 1)
        return norm

    def _grads_finite(self, norm):
        """False if a gradient is NaN/Inf (the step's one host sync; grads_finite). Collective
        under --fsdp."""
        return grads_finite(self.model.parameters(), norm)

    def _non_finite_step(self, norm):
        """--nan_policy for a step with non-finite gradients: raise, or skip it (returns False)."""
        return non_finite_step(self.step + 1, norm, self.config.nan_policy, self.opt,
                               self.checkpointer.last_saved_step)

    def _anneal_lr(self):
        """Upstream: lr * (1 - completed_steps / lr_anneal_steps)."""
        if not self.lr_anneal_steps:
            return
        lr = self.lr * (1 - self.step / self.lr_anneal_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr

    def _update_ema(self):
        """Upstream's EMA of every trained parameter; a frozen one (requires_grad False, e.g.
        DiT's pos_embed) keeps its value (rate * x + (1 - rate) * x drifts in floating point)."""
        trained = [i for i, p in enumerate(self.model.parameters()) if p.requires_grad]
        params = [fsdp.local(p.detach()) for p in self.model.parameters()]  # --fsdp: the slices
        with th.no_grad():
            for rate, ema in zip(self.ema_rate, self.ema_params):
                update_ema([fsdp.local(ema[i]) for i in trained], [params[i] for i in trained],
                           rate=rate)

    def _done(self):
        if self.config.max_steps and self.step >= self.config.max_steps:
            return True
        return bool(self.lr_anneal_steps) and self.step >= self.lr_anneal_steps

    def _flush_logs(self):
        """Write the logs of steps since the last log_interval (before a final save)."""
        if self.step > self.resume_step and self.step % self.log_interval != 0:
            logger.dumpkvs()



def _rank_flags(config, model_flags, schedule_sampler):
    """The flags every rank must agree on: model, diffusion and training ({name: value}). Left
    out, since they may differ per rank: the data folder's path (its content is compared through
    the dataset's fingerprint: ranks may read local copies), the number of loader workers (not
    seen here) and TrainConfig.PER_RANK."""
    flags = dict(model_flags)
    flags.update({k: v for k, v in config.flags().items() if k not in TrainConfig.PER_RANK})
    flags["schedule_sampler"] = (getattr(schedule_sampler, "name", None)
                                 or type(schedule_sampler).__name__)
    return flags


# --log_sample_indices with a log dir in an object store: this process's local spool of
# sample_indices/ (logger._Mirror, as log.txt's), by the URL of that folder
_INDEX_SPOOLS = {}


def record_indices(log_dir, rank, step, indices):
    """--log_sample_indices: append "step,i1,i2,..." (this rank's dataset indices of the batch of
    ``step``) to log_dir/sample_indices/rank{rank}.csv; nothing for data that has none. A log dir
    in an object store (no append): the rows go to a local spool of that folder (logger._Mirror:
    the object downloaded first, so a resumed run continues it) and the whole file is put back
    at most every _Mirror.EVERY_S seconds, at TrainLoop.close, and at the process's exit (a hook
    of its own, for a run that ends without close; adlfs' client may be gone by then). Not collective: each rank
    writes its own file."""
    if indices is None:
        return
    d = bf.join(log_dir, "sample_indices")
    name = f"rank{rank}.csv"
    line = ",".join([str(step)] + [str(int(i)) for i in np.asarray(indices).ravel()])
    spool = None
    if bf.is_remote(d):
        spool = _INDEX_SPOOLS.get(d)
        if spool is None:
            spool = _INDEX_SPOOLS[d] = logger._Mirror(d)
            spool.fetch(name)  # makes the store's client: the exit hook below runs before its
            # own clean-up (atexit runs last in, first out; logger's runs after it, too late
            # for adlfs)
            atexit.register(spool.sync, True)
        path = os.path.join(spool.local, name)
    else:
        bf.makedirs(d)
        path = os.path.join(d, name)
    with open(path, "a") as f:
        f.write(line + "\n")
    if spool is not None:
        spool.sync()


def _settings(settings, given):
    """TrainLoop's keyword arguments as TrainConfig's flags: upstream's ``given`` plus ours by
    name (a TypeError for a name that is no setting, as for any unknown keyword)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} | {
        f.name for f in dataclasses.fields(CheckpointConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"TrainLoop() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(settings: {', '.join(sorted(known - {'checkpoint'}))})")
    return dict(given, **settings)


# DDP's words, at the next forward, for a parameter that got no gradient in a step on every rank
# (find_unused_parameters=False). Left out on some ranks only, the ranks would instead wait for
# each other's different collectives until --dist_timeout: check_every_parameter_used() says it
# first, on the rank itself.
_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


class UnusedParametersError(UserError):
    """A parameter took no part in the loss of a step on some rank, without
    --find_unused_parameters True (exit 1, one line naming the flag)."""

    def __init__(self, step, names=()):
        which = f" ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})" if names else ""
        super().__init__(
            f"a parameter of the model{which} got no gradient on some rank by step {step}, and "
            f"DDP needs every parameter in every loss: pass --find_unused_parameters True for a "
            f"model that leaves parameters out on some steps (or train_job.Parts("
            f"find_unused_parameters=True) in a build() of one's own)")


def check_every_parameter_used(named_params, step):
    """After the backward of ``step`` under DDP without find_unused_parameters: raise
    UnusedParametersError on this rank if a trained parameter got no gradient (before any
    collective, which the other ranks would wait in for ever). Not collective."""
    unused = [n for n, p in named_params if p.requires_grad and p.grad is None]
    if unused:
        raise UnusedParametersError(step, unused)


@contextlib.contextmanager
def unused_parameters_named(step):
    """Within: training step ``step``; DDP's error at its forward for a parameter left unused in
    the pass before (on every rank) becomes UnusedParametersError. Not collective."""
    try:
        yield
    except RuntimeError as e:
        if _DDP_UNUSED not in str(e):
            raise
        raise UnusedParametersError(step) from None


@contextlib.contextmanager
def keep_model_state(model):
    """Within: anything may run through ``model``; on exit its buffers (BatchNorm running
    statistics, counters) and the RNG states are what they were on entry (parameters are not
    touched by a forward/backward). For passes that are no training step, such as DDP's
    bucket priming."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    state = get_rng_state()
    try:
        yield
    finally:
        with th.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        set_rng_state(state)


# ---------------------------------------------------------------------- module functions


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
    job, let TrainLoop decide (rank 0 decides, every rank follows).
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


def grad_norm(grads):
    """The global L2 norm of ``grads`` (a 0-d float32 tensor on their device; NaN/Inf propagate),
    from torch's foreach per-tensor norms: no host sync. Sharded gradients (--fsdp): over all
    slices (fsdp.grad_norm; collective)."""
    return fsdp.grad_norm(list(grads))


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
    """Log mean losses and their means per timestep quartile (``{key}_q0``..``_q3``), as upstream.

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


def grads_finite(params, norm):
    """False if a gradient of ``params`` is NaN/Inf (one host sync). ``norm``, their global norm
    (grad_norm), decides unless it is inf, which large finite gradients can also give: then they
    are looked at one by one."""
    if bool(th.isfinite(norm)):
        return True
    if bool(th.isnan(norm)):
        return False
    grads = [p.grad for p in params if p.grad is not None]
    if any(fsdp.is_dtensor(g) for g in grads):  # each rank sees its slices: decide together
        return not fsdp.any_non_finite(grads)
    return all(bool(th.isfinite(g).all()) for g in grads)


def non_finite_step(step, norm, nan_policy, opt, last_saved_step):
    """--nan_policy for optimizer step ``step``, whose gradients are not finite (grad norm
    ``norm``): "stop" raises NonFiniteError naming the step and the last saved one; "skip" drops
    the gradients, logs it and returns False (the step is not taken)."""
    if nan_policy == "stop":
        last = ("none saved" if last_saved_step is None
                else f"the last saved step is {last_saved_step}")
        raise NonFiniteError(
            f"step {step}: the loss or gradients are not finite (grad norm {norm}); stopped "
            f"(--nan_policy stop) without saving it ({last}); lower --lr, resume from a "
            f"saved step, or pass --nan_policy skip to skip such steps")
    opt.zero_grad(set_to_none=True)
    logger.logkv_mean("nan_skipped", 1)
    logger.log(f"step {step}: the loss or gradients are not finite (grad norm {norm}); "
               f"optimizer step skipped (--nan_policy skip): weights, Adam moments and EMA "
               f"unchanged")
    return False


def _poison_if_not_finite(loss):
    """``loss`` unchanged (times 1.0) if finite, else times NaN, so that its gradients are NaN too
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
