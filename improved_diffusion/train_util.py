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
import contextlib
import gc
import os

import torch as th
from torch.nn.parallel.distributed import DistributedDataParallel as DDP
from torch.optim import AdamW

from . import amp, dist_util, guidance, image_datasets, logger, phema, trackers, virtual_shards
from .ckpt import checkpoint, run_dir
from .ckpt.checkpointer import (PREEMPTED_EXIT_CODE, Checkpointer, NonFiniteError, ResumeError,
                                copy_into)
from .ckpt.rng import get_rng_state, seed_rngs, set_rng_state
from .infra import fsdp
from .infra.config_check import check_config_on_all_ranks, data_fingerprint, show_fingerprint
from .infra.errors import UsageError, UserError
from .nn import update_ema
from .resample import LossAwareSampler, UniformSampler
from .train_config import TrainConfig, loop_settings, parse_ema_rates, rank_flags
from .train_outputs import RunOutputs

__all__ = ["TrainLoop", "TrainConfig", "PREEMPTED_EXIT_CODE", "NonFiniteError", "ResumeError",
           "seed_rngs", "get_rng_state", "set_rng_state", "update_ema", "parse_ema_rates",
           "find_resume_checkpoint", "find_ema_checkpoint", "get_blob_logdir",
           "parse_resume_step_from_filename"]

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
        self.config = cfg = TrainConfig.from_flags(loop_settings(settings, dict(
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
            rank_flags(cfg, self.model_flags, self.schedule_sampler), fingerprint)
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
        self.checkpointer = make_checkpointer(self, data, batch_size, run_settings)
        self._resume()
        self.outputs = RunOutputs(self, sample_kwargs, self._runs)
        self.use_ddp = self.world_size > 1 and not cfg.fsdp and self.shard_plan is None
        self.ddp_model = (wrap_ddp(self.model, self.device, cfg.find_unused_parameters)
                          if self.use_ddp else self.model)
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
            if not self.outputs.at_resume(self.step, signal):
                return self.checkpointer.save_for_preemption(self.step)
            while not self._done():
                self.checkpointer.step_begins()  # all ranks exchange their flags meanwhile
                batch, cond = next(data)
                self.outputs.before_step(self.step, batch, self.step == self.resume_step,
                                         getattr(self.data, "last_indices", None))
                self.run_step(batch, cond)
                evaluated = self.outputs.after_step(self.step, batch, signal)  # False: abandoned
                if self.step % self.log_interval == 0:
                    logger.dumpkvs()
                if self.save_interval and self.step % self.save_interval == 0:
                    self.save()
                if self.checkpointer.stop_requested() or not evaluated:
                    self._flush_logs(preempted=True)
                    return self.checkpointer.save_for_preemption(self.step)
            self._flush_logs()
            if self.step == self.resume_step and self.checkpointer.last_saved_step == self.step:
                logger.log(f"already at step {self.step}; nothing to train")
            self.save(wait=True)
            self.outputs.at_end(self.step)
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
        take_shard_losses(rows, self.virtual_shards.plan, self.schedule_sampler, self.diffusion)

    def optimize(self):
        """Unscale, log grad norm, anneal lr, step. Returns False if the step was skipped (fp16
        overflow, or non-finite gradients under --nan_policy skip).

        One host sync per step: whether the gradients are finite (--nan_policy decides before
        the optimizer step; with a GradScaler, whether the scale went down). The grad norm and
        the loss scale stay on the device until the next dumpkvs()."""
        if self.grad_scaler is None:
            norm = self._log_grad_norm()
            if not grads_finite(self.model.parameters(), norm):  # one host sync (fsdp: all)
                return self._non_finite_step(float(norm))
            self._anneal_lr()
            self.opt.step()
            return True
        self.grad_scaler.unscale_(self.opt)
        self._log_grad_norm()
        self._anneal_lr()
        return amp.scaled_step(self.grad_scaler, self.opt, self.step + 1)

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
        Collective unless sync=False (after an error elsewhere). (A process that aborted at
        exit after a clean run, signal 6: dist_util.cleanup says why, and how it no longer does.)
        """
        self.checkpointer.close(sync=sync)
        self.outputs.close(ok=sync)
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
        """The data's classes against the resumed model file's class names (one line, or a
        relabelling that the files then store: image_datasets.match_resumed_classes)."""
        matched = image_datasets.match_resumed_classes(
            self.data, self._resuming, self.config.class_map, self.model_flags.get("num_classes"))
        if matched is not None:
            self.checkpointer.file_tags["class_names"] = [str(n) for n in matched[0]]
            if matched[1]:
                logger.log(f"resume: {matched[1]}")

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

    def _prime_ddp_buckets(self, micro, micro_cond):
        """DDP's buckets settled before the first step (prime_ddp_buckets). Collective."""
        prime_ddp_buckets(self.ddp_model, self.model, self.opt, micro, micro_cond,
                          self.amp_dtype)
        self._ddp_primed = True

    def _log_grad_norm(self):
        """Log and return the global L2 norm of the (all-reduced) gradients: a 0-d float32
        tensor on the device (NaN if a gradient is NaN, Inf if one is Inf), not read here."""
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(grads) if grads else th.zeros((), device=self.device)
        logger.logkv_mean_device("grad_norm", norm, 1)
        return norm

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
        """Upstream's EMA of every trained parameter (update_emas)."""
        update_emas(self.model, self.ema_params, self.ema_rate)

    def _done(self):
        if self.config.max_steps and self.step >= self.config.max_steps:
            return True
        return bool(self.lr_anneal_steps) and self.step >= self.lr_anneal_steps

    def _flush_logs(self, preempted=False):
        """Write the logs of steps since the last log_interval (before a final save). A
        preemption's row is marked and its window saved (logger.LogWindow): the resumed run's
        next row is the straight run's."""
        if self.step > self.resume_step and self.step % self.log_interval != 0:
            logger.dumpkvs(preempted=preempted)



def make_checkpointer(loop, data, batch_size, run_settings):
    """The Checkpointer of a TrainLoop (its model, optimizer, EMAs and states: the timestep
    sampler, the GradScaler, the post-hoc EMA tracker, the virtual shards), the files tagged
    with the data's class names and a latent folder's VAE. Not collective."""
    cfg = loop.config
    states = {"schedule_sampler": loop.schedule_sampler, "grad_scaler": loop.grad_scaler,
              "phema": loop.phema,
              logger.LogWindow.name: logger.LogWindow(loop.virtual_shards is not None)}
    if loop.virtual_shards is not None:
        states[virtual_shards.VirtualShards.name] = loop.virtual_shards
    checkpointer = Checkpointer(
        cfg.checkpoint, model=loop.model, optimizer=loop.opt,
        emas=dict(zip(cfg.ema_rates, loop.ema_params)), data=data, batch_size=batch_size,
        seed=cfg.seed, model_flags=loop.model_flags,
        run_flags={k: getattr(cfg, k) for k in TrainConfig.RECORDED}, settings=run_settings,
        states=states)
    names = getattr(data, "class_names", None)  # image_datasets.load_data's, in label order
    if names:
        checkpointer.file_tags["class_names"] = [str(n) for n in names]
    vae = getattr(data, "vae", None)  # a latent folder's vae.json: decode with that VAE
    if vae:
        checkpointer.file_tags["vae"] = {k: vae[k] for k in ("source", "sha256", "scale")
                                         if k in vae}
    return checkpointer


def wrap_ddp(model, device, find_unused_parameters):
    """``model`` in DDP (128 MB buckets; the device's ids on CUDA). Collective."""
    kwargs = dict(bucket_cap_mb=128, find_unused_parameters=find_unused_parameters)
    if device.type == "cuda":
        kwargs.update(device_ids=[device], output_device=device)
    return DDP(model, **kwargs)


def prime_ddp_buckets(ddp_model, model, opt, micro, micro_cond, amp_dtype):
    """One throw-away forward/backward so that DDP settles its gradient buckets now: DDP
    re-orders them after the first synchronised backward, which changes the order of the
    cross-rank sums (on 3+ ranks: the last bits), so without it the first step after a resume
    would differ from a straight run's. It changes no state: the (zero) gradients are dropped,
    buffers (BatchNorm statistics) and RNG put back (keep_model_state). Collective."""
    with keep_model_state(model):
        t = th.zeros(micro.shape[0], dtype=th.long, device=micro.device)
        with amp.autocast(micro.device, amp_dtype):
            out = ddp_model(micro, t, **micro_cond)
        (out.float().sum() * 0.0).backward()
        opt.zero_grad(set_to_none=True)


def take_shard_losses(rows, plan, sampler, diffusion):
    """A --global_batch_size step's records of all shards in shard order (``rows``: "t", "w"
    and "l:TERM" [G]; the same on every rank): the loss-aware ``sampler``'s update and the
    loss log per shard, as the step's microbatches would have. Not collective."""
    t = rows.pop("t").long()
    weights = rows.pop("w").float()
    losses = {k[2:]: v.float() for k, v in rows.items()}
    if isinstance(sampler, LossAwareSampler):
        finite = _finite_only(t, losses["loss"].double())
        sampler.update_with_all_losses(*(x.tolist() for x in finite))
    for s in plan.global_slices():
        log_loss_dict(diffusion, t[s], {k: v[s] * weights[s] for k, v in losses.items()})


def update_emas(model, ema_params, rates):
    """Upstream's EMA of every trained parameter of ``model`` into each of ``ema_params`` (one
    list per rate of ``rates``); a frozen one (requires_grad False, e.g. DiT's pos_embed) keeps
    its value (rate * x + (1 - rate) * x drifts in floating point). Under --fsdp: the local
    slices. Not collective."""
    trained = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    params = [fsdp.local(p.detach()) for p in model.parameters()]
    with th.no_grad():
        for rate, ema in zip(rates, ema_params):
            update_ema([fsdp.local(ema[i]) for i in trained], [params[i] for i in trained],
                       rate=rate)


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
