"""TrainConfig: the training settings of a TrainLoop, one field per flag, checked when built
(a UsageError naming the flag); what ranks must agree on (rank_flags); TrainLoop's keyword
arguments as settings (loop_settings)."""
import dataclasses
import importlib.util
from dataclasses import dataclass

from . import image_datasets, phema, trackers
from .ckpt.checkpointer import CheckpointConfig, fields_from_flags
from .infra import fsdp
from .infra.errors import UsageError
from .train_eval import check_flags as check_eval_flags

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


def rank_flags(config, model_flags, schedule_sampler):
    """The flags every rank must agree on: model, diffusion and training ({name: value}). Left
    out, since they may differ per rank: the data folder's path (its content is compared through
    the dataset's fingerprint: ranks may read local copies), the number of loader workers (not
    seen here) and TrainConfig.PER_RANK."""
    flags = dict(model_flags)
    flags.update({k: v for k, v in config.flags().items() if k not in TrainConfig.PER_RANK})
    flags["schedule_sampler"] = (getattr(schedule_sampler, "name", None)
                                 or type(schedule_sampler).__name__)
    return flags


def loop_settings(settings, given):
    """TrainLoop's keyword arguments as TrainConfig's flags: upstream's ``given`` plus ours by
    name (a TypeError for a name that is no setting, as for any unknown keyword)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} | {
        f.name for f in dataclasses.fields(CheckpointConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"TrainLoop() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(settings: {', '.join(sorted(known - {'checkpoint'}))})")
    return dict(given, **settings)


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
