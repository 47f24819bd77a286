"""
guided-diffusion's noised-classifier training (its scripts/classifier_train.py) as a loop of its
own on the checkpointer (checkpointer.py; the pattern of examples/own_loop.py):

    args = parser.parse_args(argv)        # classifier_train_defaults() + the classifier's flags
    check_args(args)
    return run_job(args)                  # the process group, the lock, build, resume, the loop

Each step, as guided's: a batch of labelled images, noised to x_t at timesteps drawn by
--schedule_sampler (--noised True; else the clean images at t = 0), cross-entropy of the
classifier's logits, in microbatches, one AdamW step (lr annealed linearly to 0 over
--iterations with --anneal_lr). Logged as guided logs: ``train_loss``, ``train_acc@1``,
``train_acc@5`` and each by quarter of the timestep range (``_q0`` .. ``_q3``), and every
--eval_interval steps the same for a batch of --val_data_dir (``val_*``, no gradient).

Where it differs from guided's:

- Save and resume are the checkpointer's (upstream's rank-0-only load is the bug this project
  exists for): ``model{S}.pt`` tagged kind "classifier" (the weights and the classifier's and
  diffusion's flags, so classifier_sample.py needs no flags), ``opt{S}.pt`` (optimizer and
  trainer state: data positions, RNG, sampler, loss scale), manifest last; auto-resume of the
  newest complete step of --log_dir, bitwise on any rank count, elastic, SIGTERM/SIGUSR1 -> a
  complete save and exit 75, the lock, the explained fresh-optimizer fallback. guided's raw
  files (``model{S}.pt`` state dicts, their ``opt{S}.pt`` beside) resume as they are.
- ``step`` counts completed optimizer steps (the files of step S hold the state after S
  steps); the run stops at --iterations (or --max_steps, when > 0 and earlier).
- The class count comes from --data_dir (or the resumed file), not a fixed 1000.
- acc@5 is acc@k with k = min(5, classes); --classifier_use_fp16 trains in mixed precision with
  amp.py (autocast + GradScaler), not guided's hand-made fp16 master weights; images are
  resized and center-cropped as train.py's (guided's random crop is not done).
- Validation is at steps that are multiples of --eval_interval, on the bare classifier in eval
  mode; the validation loader's position is part of the trainer state, so a resumed run
  validates on the batches a straight run would.
- ``--global_batch_size G --microbatch m`` (instead of --batch_size): the step's G samples in
  G/m virtual shards (virtual_shards.py), each shard's timesteps and noise drawn in its own
  stream, the gradients summed exactly, and the train_* and val_* numbers gathered in shard
  order: the same run, logged numbers included, bit for bit on any rank count dividing G/m.
"""
import contextlib
import gc

import torch as th
import torch.nn.functional as F
from torch.nn.parallel.distributed import DistributedDataParallel as DDP

from . import amp, dist_util, image_datasets, logger, train_job, virtual_shards
from .infra import fsdp
from .ckpt import checkpoint, checkpointer
from .infra import preemption
from .ckpt.checkpointer import CheckpointConfig, Checkpointer
from .infra.config_check import check_config_on_all_ranks, data_fingerprint, show_fingerprint
from .infra.errors import UsageError
from .image_datasets import CLASS_MAPS, load_data
from .resample import create_named_schedule_sampler
from .ckpt.rng import seed_rngs
from .script_util import (
    DIFFUSION_FLAG_KEYS,
    classifier_and_diffusion_defaults,
    classifier_train_defaults,
    create_classifier_and_diffusion,
)
from .infra.flags import args_to_dict
from .train_config import NAN_POLICIES
from .train_util import (_poison_if_not_finite, grad_norm, grads_finite, keep_model_state,
                         log_loss_dict, make_adamw, non_finite_step)

# The settings of the training math that opt files record (a resume with others says so); every
# setting of the run goes to the manifests (settings).
RECORDED = ("lr", "weight_decay", "anneal_lr", "iterations", "noised", "microbatch",
            "global_batch_size", "nan_policy", "fp16_scale_growth")


def check_args(args):
    """Check the values argparse cannot (raises UsageError naming the flag): the job's own
    (train_job.check_job_flags: --log_dir resolved), then the classifier's."""
    train_job.check_job_flags(args)
    if not args.data_dir:
        raise UsageError("--data_dir is required: a folder of labelled images (the class of a "
                         "file is its name before the first '_')")
    for name in ("batch_size", "log_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    for name in ("iterations", "max_steps", "eval_interval"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if last_step(args) == 0:
        raise UsageError("--iterations 0 and --max_steps 0: nothing would stop the run; give "
                         "--iterations N")
    if args.microbatch == 0 or args.microbatch < -1:
        raise UsageError(f"--microbatch must be -1 (off) or >= 1 (got {args.microbatch})")
    virtual_shards.resolve_batch_flags(args)  # --global_batch_size: --batch_size is G/ranks
    if args.nan_policy not in NAN_POLICIES:
        raise UsageError(f"--nan_policy must be one of {', '.join(NAN_POLICIES)} "
                         f"(got {args.nan_policy!r})")
    if args.class_map not in CLASS_MAPS:
        raise UsageError(f"--class_map must be one of {', '.join(CLASS_MAPS)} "
                         f"(got {args.class_map!r})")
    CheckpointConfig.from_flags(args)  # --log_dir, --save_interval, --keep_checkpoints
    fsdp.check_layout(args.fsdp, args.save_layout)


# What --diffusion_from takes from the model the classifier will guide.
GUIDED_MODEL_FLAGS = ("image_size", *DIFFUSION_FLAG_KEYS)


def take_flags(args, given):
    """The classifier's and diffusion's flags that the command line did not give: from the
    classifier file a resume starts from (train_job.take_checkpoint_flags), then the image size
    and noise process of the model named by --diffusion_from (a model or EMA file, or a run
    dir's newest complete step), so that a classifier cannot be trained on another diffusion
    than the model it is meant to guide; a flag given or resumed with another value than that
    model's is a FlagClashError naming both. Collective: call from all ranks with the same
    arguments."""
    taken = train_job.take_checkpoint_flags(args, given, kinds=("classifier",),
                                            resolved_later=("classifier_num_classes",))
    if not args.diffusion_from:
        return
    src = args.diffusion_from
    # a model or EMA file, or a run dir's newest complete step's model file
    found = checkpointer.saved_model_file_flags(src, src, kinds=("model", "ema"))
    if found is None:
        raise UsageError(f"--diffusion_from {src}: no model or EMA file of ours with its flags "
                         f"there (a modelNNNNNN.pt / ema_*.pt, or a run dir with a complete "
                         f"step); give one, or the diffusion flags themselves")
    path, flags = found
    saved = {k: flags[k] for k in GUIDED_MODEL_FLAGS if k in flags}
    adopted = train_job.adopt_flags(
        args, set(given) | set(taken or {}), saved, f"--diffusion_from {path}",
        "the classifier must see the noise process of the model it guides",
        sources={k: "the resumed classifier's checkpoint" for k in taken or {}
                 if k not in given})
    logger.log(f"--diffusion_from {checkpoint.basename(path)}: {train_job.flags_text(saved)}"
               + (f" (taken: {', '.join('--' + k for k in adopted)})" if adopted else ""))


def last_step(args):
    """The step the run stops at: --iterations, or --max_steps when > 0 and earlier."""
    return min([n for n in (args.iterations, args.max_steps) if n > 0], default=0)


def run_job(args, given=None):
    """The whole job: the process group (bounded by --dist_timeout), the log dir's lock, the
    logger, the classifier and data, the resume, the loop; returns 0, or 75 after a preemption
    save. ``given``: the flags typed on the command line (flags.explicit_args): a resume
    then takes the others from its classifier file, and --diffusion_from the noise process of
    the model to guide (take_flags). Collective: call from all ranks with the same arguments."""
    if given is not None:
        virtual_shards.refuse_batch_size(args, given)
    train_job.check_before_start(args, check_args, None if given is None else
                                 lambda resumed: take_flags(resumed, given))
    lock = train_job.start_job(args)
    try:
        if given is not None:
            take_flags(args, given)
            virtual_shards.refuse_batch_size(args, given)  # the resumed run's G
        check_args(args)  # again: on the flags a resume took
        loop = ClassifierLoop(args)
        try:
            preemption.check()  # a signal during the build or the resume: 75, nothing saved
            code = loop.run_loop()
        except BaseException:
            loop.checkpointer.close(sync=False)  # no collective: other ranks may be elsewhere
            raise
        loop.close()
        dist_util.cleanup()
        return code
    finally:
        lock.release()


class ClassifierLoop:
    """The noised classifier's training on the checkpointer (see the module docstring).
    Construction builds the classifier, diffusion and data from ``args`` and resumes (collective:
    construct it on every rank with the same arguments)."""

    def __init__(self, args):
        self.args = args
        self.rank, self.world_size = dist_util.get_rank(), dist_util.get_world_size()
        self.device = dist_util.dev()
        self.last_step = last_step(args)
        args.classifier_num_classes = train_job.classifier_num_classes(args)
        self.flags = args_to_dict(args, classifier_and_diffusion_defaults().keys())
        seed_rngs(args.seed, 0, 0)  # the same initial weights on every rank
        self.model, self.diffusion = create_classifier_and_diffusion(**self.flags)
        self.model.to(self.device)
        dist_util.sync_params(self.model.parameters())
        self.num_classes = self.flags["classifier_num_classes"]
        self.data = self._load(args.data_dir)
        self.val_data = self._load(args.val_data_dir) if args.val_data_dir else None
        self._label_val_data()
        self.sampler = (create_named_schedule_sampler(args.schedule_sampler, self.diffusion)
                        if args.noised else None)
        fingerprint = data_fingerprint(self.data)
        digest = check_config_on_all_ranks(self._rank_flags(), fingerprint)
        logger.log(f"flags (sha256 {digest[:12]}) and data ({show_fingerprint(fingerprint)}) "
                   f"agree on all {self.world_size} rank(s)")
        seed_rngs(args.seed, 0, self.rank)  # each rank its own noise
        self.amp_dtype, self.grad_scaler = amp.make_amp(
            self.device, args.classifier_use_fp16, args.fp16_scale_growth)
        if args.fsdp:  # before the optimizer: it is made of the shards
            fsdp.shard_model(self.model, self.device, param_dtype=self.amp_dtype)
            logger.log(fsdp.active_line(self.world_size, args.save_layout))
        # --global_batch_size: the step as virtual shards, the same run on any rank count
        self.shards = virtual_shards.from_flags(args, self.model, exact=not args.fsdp)
        self.opt = make_adamw(self.model.parameters(), lr=args.lr,
                              weight_decay=args.weight_decay)
        self.checkpointer = Checkpointer(
            CheckpointConfig.from_flags(args), model=self.model, optimizer=self.opt,
            data=self.data, batch_size=args.batch_size, seed=args.seed, model_flags=self.flags,
            run_flags={k: getattr(args, k) for k in RECORDED},
            settings=train_job.run_flags(args, classifier_train_defaults()),
            model_kind="classifier",
            states={"schedule_sampler": self.sampler, "grad_scaler": self.grad_scaler,
                    "val_data": self.val_data,
                    **({} if self.shards is None else {self.shards.name: self.shards})})
        self.checkpointer.file_tags["class_names"] = list(self.data.class_names)
        self.step = self.resume_step = self._resume()
        self.microbatch = args.microbatch if args.microbatch > 0 else args.batch_size
        self.ddp_model = (self._wrap_ddp() if self.world_size > 1 and not args.fsdp
                          and self.shards is None else self.model)
        self._ddp_primed = self.ddp_model is self.model
        logger.start_progress(self.step, self.last_step)

    def _load(self, data_dir):
        a = self.args
        return load_data(data_dir=data_dir, batch_size=a.batch_size, image_size=a.image_size,
                         class_cond=True, num_classes=self.num_classes, seed=a.seed,
                         num_workers=a.num_workers)

    def _resume(self):
        """Checkpointer.resume() (the classifier has no EMA), with the class names checked
        once the model file is read, before anything of the log dir changes; returns the step
        (0 on a fresh start). Collective."""
        r = self.checkpointer.begin_resume()
        if r is None:
            return 0
        r.load_model()
        self._match_class_names(r)
        r.load_optimizer()
        return r.finish()

    def _match_class_names(self, resuming):
        """A resume whose --data_dir classes differ from the class names its classifier file
        stores stops with one line naming them, unless --class_map maps them (as train.py's,
        image_datasets.resumed_class_names); the training and validation data are relabelled
        to the names trained with, and the files store them. The same on every rank."""
        raw = resuming.model_file.raw
        names, note = image_datasets.resumed_class_names(
            raw.get("class_names") if isinstance(raw, dict) else None, self.data.class_names,
            self.args.class_map, data_dir=self.args.data_dir, source=str(resuming.plan.model),
            num_classes=self.num_classes, num_classes_flag="--classifier_num_classes")
        image_datasets.relabel(self.data, names)
        self._label_val_data()
        self.checkpointer.file_tags["class_names"] = list(names)
        if note:
            logger.log(f"resume: {note}")

    def _label_val_data(self):
        """Label --val_data_dir's images as the training data's classes, by name (its own
        sorted names would label "cherry" 1 beside a training folder where it is 2); a
        validation class the training data lacks is refused."""
        if self.val_data is None:
            return
        names = list(self.data.class_names)
        unknown = [n for n in self.val_data.class_names if n not in names]
        if unknown:
            raise image_datasets.DataError(
                f"--val_data_dir {self.args.val_data_dir}: classes the training data "
                f"(--data_dir {self.args.data_dir}) lacks: {', '.join(unknown[:5])}; give a "
                f"validation folder of the training classes")
        image_datasets.relabel(self.val_data, names)

    def _rank_flags(self):
        """What every rank must agree on (--log_dir and the data paths excepted: the data is
        compared by its fingerprint)."""
        flags = dict(self.flags)
        flags.update({k: v for k, v in vars(self.args).items()
                      if k not in ("data_dir", "val_data_dir", "num_workers")})
        return flags

    def _wrap_ddp(self):
        kwargs = dict(bucket_cap_mb=128, find_unused_parameters=False)
        if self.device.type == "cuda":
            kwargs.update(device_ids=[self.device], output_device=self.device)
        return DDP(self.model, **kwargs)

    # ------------------------------------------------------------------ the loop

    def run_loop(self):
        """Train to the last step; returns 0, or PREEMPTED_EXIT_CODE after a SIGTERM/SIGUSR1 on
        any rank (the current step saved completely first). Collective."""
        ckpt, a = self.checkpointer, self.args
        train = iter(self.data)
        val = iter(self.val_data) if self.val_data is not None else None
        with ckpt.watch_signals():
            while self.step < self.last_step:
                ckpt.step_begins()  # the ranks' [preempted, save failed] flags travel meanwhile
                self._anneal_lr()
                self.forward_backward(*next(train), prefix="train")
                self.optimize()
                self.step += 1
                logger.logkv("step", self.step)
                logger.logkv("samples", int(getattr(self.data, "position",
                                                    self.step * a.batch_size * self.world_size)))
                logger.logkv("lr", self.opt.param_groups[0]["lr"])
                if val is not None and a.eval_interval and self.step % a.eval_interval == 0:
                    self.evaluate(*next(val))
                if self.step % a.log_interval == 0:
                    logger.dumpkvs()
                if a.save_interval and self.step % a.save_interval == 0:
                    ckpt.save(self.step)
                if ckpt.stop_requested():
                    self._flush_logs()
                    return ckpt.save_for_preemption(self.step)
            self._flush_logs()
            if self.step == self.resume_step and ckpt.last_saved_step == self.step:
                logger.log(f"already at step {self.step}; nothing to train")
            ckpt.save(self.step, wait=True)
        return 0

    def forward_backward(self, batch, cond, prefix="train"):
        """Noise this rank's batch [B, C, H, W] (with --noised), then the cross-entropy of the
        logits [B, classes] against cond["y"] [B], accumulated over microbatches (DDP syncs on the
        last). With --global_batch_size: the step's virtual shards (_forward_backward_shards).
        Collective (DDP all-reduce)."""
        if self.shards is not None:
            return self._forward_backward_shards(batch, cond)
        batch, labels = batch.to(self.device), cond["y"].to(self.device)
        t = self._noise_levels(batch)
        if self.sampler is not None:
            batch = self.diffusion.q_sample(batch, t)
        if not self._ddp_primed:
            self._prime_ddp_buckets(batch[: self.microbatch], t[: self.microbatch])
        self.opt.zero_grad(set_to_none=True)
        n = batch.shape[0]
        for i in range(0, n, self.microbatch):
            sub = slice(i, i + self.microbatch)
            last = i + self.microbatch >= n
            sync = (contextlib.nullcontext() if last or self.ddp_model is self.model
                    else self.ddp_model.no_sync())
            with sync:
                with amp.autocast(self.device, self.amp_dtype):
                    logits = self.ddp_model(batch[sub], t[sub])
                loss = self._log_losses(logits.float(), labels[sub], t[sub], prefix)
                self._backward(loss.mean() * (labels[sub].shape[0] / n))

    def _backward(self, loss):
        """The backward of ``loss`` (NaN-poisoned when not finite; scaled with a GradScaler)."""
        loss = _poison_if_not_finite(loss)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def _forward_backward_shards(self, batch, cond):
        """--global_batch_size: this rank's virtual shards of the step, each noised in its own
        RNG stream, their gradients reduced alike on every rank count (virtual_shards.py); the
        ``train_*`` log from every shard's numbers in shard order (the same on every rank).
        Collective."""
        def shard(x, micro_cond):
            t, metrics = self._shard_metrics(self.ddp_model, x, micro_cond)
            self._backward(metrics["loss"].mean() * (self.shards.loss_scale or 1.0))
            return {"t": t, **{k: v.detach() for k, v in metrics.items()}}

        self._log_records(self.shards.step(self.step + 1, batch, cond, shard), "train")

    def _shard_metrics(self, model, x, cond):
        """One shard: its timesteps and noise (drawn in the shard's stream), the forward, and
        the per-sample numbers (_metrics); returns (t, metrics)."""
        x, labels = x.to(self.device), cond["y"].to(self.device)
        t = self._noise_levels(x)
        if self.sampler is not None:
            x = self.diffusion.q_sample(x, t)
        with amp.autocast(self.device, self.amp_dtype):
            logits = model(x, t)
        return t, self._metrics(logits.float(), labels)

    def _log_records(self, rows, prefix):
        """Log gathered shard records ({name: [G]}, global order) shard by shard, as the
        microbatches of a step without G are logged."""
        t = rows.pop("t").long()
        for s in self.shards.plan.global_slices():
            log_loss_dict(self.diffusion, t[s],
                          {f"{prefix}_{k}": v[s].float() for k, v in rows.items()})

    def evaluate(self, batch, cond):
        """The ``val_*`` losses and accuracies of a --val_data_dir batch: the bare classifier in
        eval mode, no gradients (its noise comes from this rank's RNG, as guided's). Not
        collective; with --global_batch_size: in virtual shards, each noised in its own stream,
        the numbers gathered as the training's, so collective)."""
        if self.shards is not None:
            def shard(x, micro_cond):
                t, metrics = self._shard_metrics(self.model, x, micro_cond)
                return {"t": t, **metrics}

            self.model.eval()
            try:
                with th.no_grad():
                    rows = self.shards.records(self.step, batch, cond, shard)
            finally:
                self.model.train()
            return self._log_records(rows, "val")
        batch, labels = batch.to(self.device), cond["y"].to(self.device)
        t = self._noise_levels(batch)
        if self.sampler is not None:
            batch = self.diffusion.q_sample(batch, t)
        self.model.eval()
        try:
            with th.no_grad(), amp.autocast(self.device, self.amp_dtype):
                for i in range(0, batch.shape[0], self.microbatch):
                    sub = slice(i, i + self.microbatch)
                    self._log_losses(self.model(batch[sub], t[sub]).float(), labels[sub], t[sub],
                                     "val")
        finally:
            self.model.train()

    def _noise_levels(self, batch):
        """Timesteps [B] (int64): drawn by the schedule sampler (--noised), else zeros."""
        if self.sampler is None:
            return th.zeros(batch.shape[0], dtype=th.long, device=self.device)
        t, _ = self.sampler.sample(batch.shape[0], self.device)  # weights unused, as guided's
        return t

    def _log_losses(self, logits, labels, t, prefix):
        """Log ``{prefix}_loss``, ``_acc@1``, ``_acc@5`` (and by timestep quarter); returns the
        per-sample cross-entropy [N]."""
        metrics = self._metrics(logits, labels)
        log_loss_dict(self.diffusion, t, {f"{prefix}_{k}": v.detach() for k, v in metrics.items()})
        return metrics["loss"]

    @staticmethod
    def _metrics(logits, labels):
        """{"loss": the cross-entropy, "acc@1", "acc@5": top_k_hits}, each per sample [N]."""
        return {"loss": F.cross_entropy(logits, labels, reduction="none"),
                "acc@1": top_k_hits(logits, labels, 1), "acc@5": top_k_hits(logits, labels, 5)}

    def optimize(self):
        """Unscale (GradScaler), log the grad norm, step. Returns False for a skipped step
        (fp16 overflow, or non-finite gradients under --nan_policy skip); raises NonFiniteError
        for them under --nan_policy stop. The same decision on every rank (all-reduced
        gradients)."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.opt)
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(grads) if grads else th.zeros((), device=self.device)
        logger.logkv_mean_device("grad_norm", norm, 1)
        if self.grad_scaler is not None:
            scale = amp.scale_tensor(self.grad_scaler).clone()
            self.grad_scaler.step(self.opt)
            self.grad_scaler.update()
            if bool(amp.scale_tensor(self.grad_scaler) < scale):
                logger.logkv_mean("fp16_skipped", 1)
                return False
            return True
        if not grads_finite(self.model.parameters(), norm):
            return non_finite_step(self.step + 1, float(norm), self.args.nan_policy, self.opt,
                                   self.checkpointer.last_saved_step)
        self.opt.step()
        return True

    def _anneal_lr(self):
        """--anneal_lr: guided's lr * (1 - completed steps / --iterations)."""
        if not self.args.anneal_lr or not self.args.iterations:
            return
        lr = self.args.lr * (1 - self.step / self.args.iterations)
        for group in self.opt.param_groups:
            group["lr"] = lr

    def _prime_ddp_buckets(self, x, t):
        """One throw-away forward/backward, so that DDP settles its gradient buckets before the
        first step of every job (a resumed one included: on 3+ ranks the order of the sums
        changes the last bits); model state and RNG are put back. Collective."""
        with keep_model_state(self.model):
            with amp.autocast(self.device, self.amp_dtype):
                out = self.ddp_model(x, t)
            (out.float().sum() * 0.0).backward()
            self.opt.zero_grad(set_to_none=True)
        self._ddp_primed = True

    def _flush_logs(self):
        if self.step > self.resume_step and self.step % self.args.log_interval != 0:
            logger.dumpkvs()

    def close(self):
        """Wait for the last save and drop the DDP wrapper (before dist_util.cleanup()), freed
        now, as TrainLoop.close does. Collective."""
        self.checkpointer.close()
        if self.ddp_model is not self.model:
            dist_util.barrier()
            self.ddp_model = self.model
            gc.collect()


def top_k_hits(logits, labels, k):
    """1.0 where the label [N] is among the ``k`` largest logits [N, classes] (k at most the
    class count), else 0.0: float [N]."""
    top = th.topk(logits, min(k, logits.shape[-1]), dim=-1).indices
    return (top == labels[:, None]).float().sum(dim=-1)

