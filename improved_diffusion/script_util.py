"""The one place where flags become a model and a diffusion.

Flag names and defaults are upstream improved-diffusion's, plus guided-diffusion's
``num_head_channels``, ``resblock_updown``, ``use_new_attention_order`` and ``channel_mult``, and
``num_classes``, ``class_dropout_prob`` (classifier-free guidance), and ``arch`` (the UNet, or
one of DiT's models: dit.py) with ``in_channels`` and DiT's width overrides. The dict of these
flags is what checkpoint files store as "flags". guided-diffusion's noised classifier has its
own flags (``classifier_defaults()``, ``create_classifier``).

``channel_mult=""`` picks the channel multipliers from ``image_size``:

* the sizes upstream knows use upstream's choice: 32 -> (1, 2, 2, 2), 64 -> (1, 2, 3, 4),
  256 -> (1, 1, 2, 2, 4, 4); guided-diffusion's 128 -> (1, 1, 2, 3, 4) and
  512 -> (0.5, 1, 1, 2, 2, 4, 4);
* any other size gets one level per exact halving that keeps the feature map at least 4 pixels
  wide (at most 6 halvings): (1,) followed by 2, 2, 2, 4, 4, 4 for the levels below the top.
  So 8 -> (1, 2), 16 -> (1, 2, 2), 28 -> (1, 2, 2), 48 -> (1, 2, 2, 2), 96 -> (1, 2, 2, 2, 4),
  and a size that cannot be halved (odd, or below 8) -> (1,): no downsampling.
"""
import inspect

from .dit import DIT_CONFIGS, DiT
from .unet import ENCODER_POOLS, EncoderUNetModel, SuperResModel, UNetModel
from .infra.errors import UsageError
# upstream's names for its argparse helpers, kept for upstream's scripts (their home: flags.py)
from .infra.flags import add_dict_to_argparser, args_to_dict, str2bool  # noqa: F401
from .old_names import moved_attribute


def __getattr__(name):  # the command line's names that moved to infra/flags.py, with a warning
    return moved_attribute(__name__, name)


NUM_CLASSES = 1000
# --arch: upstream's UNet, or one of DiT's models (DiT's table: dit.DIT_CONFIGS).
ARCHS = ("unet",) + tuple(DIT_CONFIGS)

# Upstream's (and guided-diffusion's) channel multipliers for the sizes they support.
KNOWN_CHANNEL_MULT = {
    32: (1, 2, 2, 2),
    64: (1, 2, 3, 4),
    128: (1, 1, 2, 3, 4),
    256: (1, 1, 2, 2, 4, 4),
    512: (0.5, 1, 1, 2, 2, 4, 4),
}
_DEFAULT_LOWER_MULTS = (2, 2, 2, 4, 4, 4)


class FlagError(UsageError):
    """A flag has a bad value; the one-line message names the flag and says what to do (exit 2)."""


def model_and_diffusion_defaults():
    """Defaults for the model and diffusion flags (upstream's, plus the additive new ones)."""
    return dict(
        image_size=64,
        num_channels=128,
        num_res_blocks=2,
        num_heads=4,
        num_heads_upsample=-1,
        attention_resolutions="16,8",
        dropout=0.0,
        learn_sigma=False,
        sigma_small=False,
        class_cond=False,
        diffusion_steps=1000,
        noise_schedule="linear",
        timestep_respacing="",
        use_kl=False,
        predict_xstart=False,
        rescale_timesteps=True,
        rescale_learned_sigmas=True,
        use_checkpoint=False,
        use_scale_shift_norm=True,
        num_head_channels=-1,
        resblock_updown=False,
        use_new_attention_order=False,
        channel_mult="",
        num_classes=NUM_CLASSES,
        arch="unet",
        in_channels=3,
        # DiT only: 0 = the value of --arch's row in DiT's table.
        dit_depth=0,
        dit_hidden_size=0,
        dit_num_heads=0,
        # Classifier-free guidance: a class-conditional model gets the null label (index
        # num_classes), which training puts in place of each label with this probability.
        class_dropout_prob=0.0,
    )


MODEL_FLAG_KEYS = tuple(model_and_diffusion_defaults().keys())


def train_defaults():
    """Defaults of the training flags (upstream's image_train.py plus ours); every training script
    takes these with the model and diffusion flags."""
    return dict(
        data_dir="",
        schedule_sampler="uniform",
        lr=1e-4,
        weight_decay=0.0,
        lr_anneal_steps=0,
        batch_size=1,
        microbatch=-1,  # -1 disables microbatches
        # Samples per step over all ranks, in virtual shards of --microbatch (virtual_shards.py):
        # the run is then the same bit for bit on any rank count dividing G/microbatch. 0: off.
        global_batch_size=0,
        ema_rate="0.9999",  # comma-separated list of EMA values
        log_interval=10,
        log_format="progress",  # stdout: one progress line per log_interval, or "table"
        save_interval=10000,
        resume_checkpoint="",
        # On resume, a checkpoint whose tensors do not fit the model (flags or code changed):
        # take the tensors whose name and shape match (model, EMAs, Adam moments), start the
        # others fresh, log a summary and record it in the trainer state. Off: a one-line error.
        allow_model_change=False,
        use_fp16=False,
        fp16_scale_growth=1e-3,
        log_dir="",
        max_steps=0,
        seed=0,
        keep_checkpoints=0,
        # Post-hoc EMA (EDM2; phema.py): comma-separated relative widths, e.g. "0.05,0.1"; one
        # power-function EMA each, tracked every step, snapshots written with saves ("": off).
        phema_stds="",
        # Snapshots every this many steps (a multiple of save_interval); 0: at every
        # save_interval save. The run's last step (max_steps / lr_anneal_steps) has them too.
        phema_interval=0,
        # Write checkpoints in a background thread: a save pauses training only to copy the state
        # to host memory (False: write them before training goes on).
        async_save=True,
        # Where async saves are written (writer_process.use_process): "process", "thread", or
        # "auto" (the process for steps of writer_process.PROCESS_MIN_BYTES or more).
        save_writer="auto",
        # How a step is written: "full" (rank 0 writes model/ema/opt files that every tool reads;
        # under --fsdp the shards are gathered to it) or "sharded" (--fsdp only: every rank writes
        # its shards of one torch.distributed.checkpoint folder per step; ckpt.py consolidate).
        save_layout="full",
        num_workers=-1,  # data-loading worker processes; -1: image_datasets.auto_num_workers()
        # torch.compile the model's forward/backward (off by default; see benchmarks/train.py).
        compile=False,
        # Shard the model, its gradients, Adam moments and EMAs over the ranks (FSDP2, fsdp.py)
        # instead of holding them whole on each (DDP): for models larger than one device.
        fsdp=False,
        # DDP's find_unused_parameters: for a model that leaves some parameters out of the loss
        # on some steps or ranks (each step then walks the autograd graph: a little slower).
        find_unused_parameters=False,
        # Deterministic kernels (dist_util.set_deterministic): a GPU run resumed from a checkpoint
        # equals a straight one bit for bit; slower, so off by default (the CPU needs none).
        deterministic=False,
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
        # Every this many steps and at the end, rank 0 writes LOG_DIR/samples/grid_{step}.png:
        # --sample_count EMA samples by DDIM with --sample_steps steps (0: off).
        sample_interval=0,
        sample_count=8,
        sample_steps=25,
        # Also log the progress scalars and the sample grids to TensorBoard, LOG_DIR/tb/.
        tensorboard=False,
        # Also log them to these trackers (comma-separated: wandb, mlflow; trackers.py).
        tracker="",
        # FID while training (train_eval.py): every this many steps, all ranks sample
        # --eval_num_samples images of the EMA (DDIM, --sample_steps) and rank 0 logs
        # fid_ema_RATE / is_ema_RATE against --eval_ref_batch (an npz, arr_0 uint8 NHWC); 0: off.
        eval_interval=0,
        eval_ref_batch="",
        eval_num_samples=1000,
        eval_features="inception",  # or "digits" (the demo's classifier, datasets/digits.py)
        inception_weights="",  # the FID Inception's weights; "": $ID_INCEPTION_WEIGHTS
        # A resume whose --data_dir classes differ from the class names of its checkpoint: "check"
        # refuses it, "keep" keeps the checkpoint's labels by name, "data" takes the folder's
        # (image_datasets.CLASS_MAPS).
        class_map="check",
    )


def sample_defaults():
    """Defaults of the sampling flags (upstream's image_sample.py plus ours)."""
    return dict(
        clip_denoised=True,
        num_samples=10000,
        batch_size=16,
        use_ddim=False,
        model_path="",
        log_dir="",
        seed=0,
        classes="",
        weights="auto",
        grid=True,
        overwrite=False,
        progress=True,
        dist_timeout=600.0,  # seconds any wait between ranks may take (see dist_util)
        # guided-diffusion's flag (in its MODEL_FLAGS): run the model's torso in float16
        # (UNetModel.convert_to_fp16) while sampling.
        use_fp16=False,
    )

def guidance_defaults():
    """The classifier-free guidance flag of the sampling scripts (sample.py, classifier_sample.py).
    """
    return dict(
        # eps = uncond + S * (cond - uncond); 1: plain conditional sampling, 0: unconditional
        # (the null label). Needs a model trained with --class_dropout_prob > 0.
        guidance_scale=1.0,
    )


# The diffusion flags among model_and_diffusion_defaults(): guided-diffusion's
# diffusion_defaults(), plus sigma_small.
DIFFUSION_FLAG_KEYS = ("learn_sigma", "sigma_small", "diffusion_steps", "noise_schedule",
                       "timestep_respacing", "use_kl", "predict_xstart", "rescale_timesteps",
                       "rescale_learned_sigmas")


def diffusion_defaults():
    """Defaults of the diffusion flags (guided-diffusion's name; the values are this project's,
    improved-diffusion's, as in model_and_diffusion_defaults())."""
    defaults = model_and_diffusion_defaults()
    return {k: defaults[k] for k in DIFFUSION_FLAG_KEYS}


def classifier_defaults():
    """Defaults of guided-diffusion's noised-classifier flags (its classifier_defaults(), commit
    22e0df8), plus ours: ``classifier_channel_mult`` ('' = the UNet's choice for ``image_size``,
    which is guided's for 64-512) and ``classifier_num_classes`` (guided's fixed 1000)."""
    return dict(
        image_size=64,
        classifier_use_fp16=False,
        classifier_width=128,
        classifier_depth=2,
        classifier_attention_resolutions="32,16,8",
        classifier_use_scale_shift_norm=True,
        classifier_resblock_updown=True,
        classifier_pool="attention",
        classifier_channel_mult="",
        classifier_num_classes=NUM_CLASSES,
    )


CLASSIFIER_FLAG_KEYS = tuple(classifier_defaults().keys())


def classifier_and_diffusion_defaults():
    """The classifier's flags and the diffusion's (guided-diffusion's name): what a classifier
    file stores as its flags."""
    res = classifier_defaults()
    res.update(diffusion_defaults())
    return res


def classifier_sample_defaults():
    """classifier_sample.py's own flags (guided-diffusion's names and defaults)."""
    return dict(
        classifier_path="",
        # The classifier's gradient is multiplied by this (guided-diffusion's classifier_scale).
        classifier_scale=1.0,
    )


# The flags classifier_train.py shares with train.py (train_defaults()'s values): where to write,
# how to save and resume, and how the job runs.
CLASSIFIER_TRAIN_SHARED_FLAGS = (
    "log_dir", "max_steps", "seed", "keep_checkpoints", "async_save", "save_writer",
    "save_layout", "allow_model_change", "nan_policy", "lock_wait", "dist_timeout",
    "num_workers", "log_format", "fp16_scale_growth", "class_map", "fsdp",
    "global_batch_size")


def classifier_train_defaults():
    """Defaults of classifier_train.py's own flags: guided-diffusion's (its classifier_train.py's
    create_argparser(), commit 22e0df8) plus the job flags it shares with train.py; the script
    adds classifier_and_diffusion_defaults()."""
    shared = train_defaults()
    res = dict(
        data_dir="",
        val_data_dir="",
        # The diffusion model the classifier will guide (a model/EMA file or its run dir): the
        # classifier takes its image size and noise process ("": the flags as given).
        diffusion_from="",
        noised=True,
        iterations=150000,
        lr=3e-4,
        weight_decay=0.0,
        anneal_lr=False,
        batch_size=4,
        microbatch=-1,
        schedule_sampler="uniform",
        resume_checkpoint="",
        log_interval=10,
        eval_interval=5,
        save_interval=10000,
    )
    res.update({k: shared[k] for k in CLASSIFIER_TRAIN_SHARED_FLAGS})
    return res


def nll_defaults():
    """Defaults of nll.py's own flags (bits/dim of an image folder under a model)."""
    return dict(data_dir="", clip_denoised=True, num_samples=1000, batch_size=1, model_path="",
                log_dir="", seed=0, weights="auto", dist_timeout=600.0)


# Flags of one job rather than of the run: where its data and log dir are, which checkpoint to
# start from, how long to wait for ranks and for a held log dir, this machine's loader workers,
# how this job's terminal shows progress, one-time permissions (a model change, a class map),
# per-rank diagnostics, the model a classifier is checked against. A resume never takes these
# from a checkpoint; every other training flag it does (run_flag_keys).
JOB_FLAGS = ("data_dir", "log_dir", "resume_checkpoint", "allow_model_change", "lock_wait",
             "dist_timeout", "num_workers", "log_format", "log_sample_indices",
             "diffusion_from", "class_map")


def run_flag_keys(defaults):
    """The training flags of a script's ``defaults`` (train_defaults(), classifier_train_
    defaults()) that are the run's settings: every one but JOB_FLAGS. Checkpoints record them
    ("run_flags"), and a resume takes back each one the command line leaves out.

    >>> "lr" in run_flag_keys(train_defaults()), "log_dir" in run_flag_keys(train_defaults())
    (True, False)
    """
    return tuple(k for k in defaults if k not in JOB_FLAGS)


def model_flag_keys():
    """The keys of model_and_diffusion_defaults(): the flags a checkpoint stores as "flags"."""
    return list(MODEL_FLAG_KEYS)


# Flags whose comma-separated values are a set: their order means nothing (the UNet asks "is
# this resolution in it"), so "16,8" and "8,16" are the same value.
SET_FLAGS = ("attention_resolutions", "classifier_attention_resolutions")


def normalize_flag_value(v, key=None):
    """
    A comparable form of a flag value, however it was written: ``True`` / ``"true"`` / ``"yes"``,
    ``16`` / ``"16"`` / ``16.0``, ``"16, 8"`` / ``"16,8"`` / ``(16, 8)``, ``"1,2"`` /
    ``"1.0,2.0"`` compare equal; for a flag of SET_FLAGS (``key``) the order of the list does
    not count either (``"8,16"`` == ``"16,8"``).
    """
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        low = s.lower()
        if low in ("true", "yes", "t", "y"):
            return True
        if low in ("false", "no", "f", "n"):
            return False
        try:
            return float(s)
        except ValueError:
            pass
        if "," not in s:
            return s
        v = s.split(",")
    if isinstance(v, (list, tuple)):
        parts = [str(normalize_flag_value(p.strip() if isinstance(p, str) else p)) for p in v]
        return ",".join(sorted(parts) if key in SET_FLAGS else parts)
    return v


def same_flag_value(a, b, key=None):
    """True when two values of flag ``key`` mean the same (``True`` == ``"True"``, ``16`` ==
    ``16.0``, ``"1,2"`` == ``"1.0,2.0"``; a set flag's ``"16,8"`` == ``"8,16"``)."""
    return normalize_flag_value(a, key) == normalize_flag_value(b, key)


def _check_image_size(image_size, flag="--image_size"):
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise FlagError(f"{flag} must be a positive integer, got {image_size!r}")


def parse_channel_mult(channel_mult, image_size, flag="--channel_mult"):
    """Turn the ``--channel_mult`` flag into a tuple of per-level channel multipliers.

    :param channel_mult: "" for the default for ``image_size`` (see the module docstring), or a
        comma-separated list of positive numbers such as "1,2,2" or "0.5,1,2".
    :param image_size: the image side length in pixels.
    :param flag: the flag's name in error messages (``--classifier_channel_mult``).
    :return: a tuple of ints (floats only where a multiplier is fractional).
    :raises FlagError: for a malformed list, or when ``image_size`` cannot be halved
        ``len(channel_mult) - 1`` times exactly.
    """
    _check_image_size(image_size)
    if isinstance(channel_mult, (tuple, list)):
        text = ",".join(str(m) for m in channel_mult)
    else:
        text = str(channel_mult).strip()
    if not text:
        if image_size in KNOWN_CHANNEL_MULT:
            return KNOWN_CHANNEL_MULT[image_size]
        size, halvings = image_size, 0
        while size % 2 == 0 and size // 2 >= 4 and halvings < len(_DEFAULT_LOWER_MULTS):
            size //= 2
            halvings += 1
        return (1,) + _DEFAULT_LOWER_MULTS[:halvings]
    mults = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise FlagError(
                f"{flag} {text!r} must be a comma-separated list of positive numbers, "
                f"e.g. {flag} 1,2,2 (or \"\" for the default for --image_size)"
            )
        mults.append(int(value) if value.is_integer() else value)
    factor = 2 ** (len(mults) - 1)
    if image_size % factor != 0:
        raise FlagError(
            f"{flag} {text} has {len(mults)} levels (downsamples {factor}x), but "
            f"--image_size {image_size} is not divisible by {factor}; use fewer levels in "
            f"{flag} or a different --image_size"
        )
    return tuple(mults)


def parse_attention_resolutions(attention_resolutions, image_size,
                                flag="--attention_resolutions"):
    """Turn ``--attention_resolutions`` (resolutions, e.g. "16,8") into downsample rates.

    As upstream, each resolution ``res`` becomes the rate ``image_size // res``; rates that no
    level of the UNet has are ignored (upstream behaviour, so default flags work at any size).

    :param flag: the flag's name in error messages.
    :return: a tuple of ints.
    :raises FlagError: when an entry is not a positive integer.
    """
    if isinstance(attention_resolutions, (tuple, list)):
        parts = [str(r) for r in attention_resolutions]
    else:
        text = str(attention_resolutions).strip()
        parts = text.split(",") if text else []
    rates = []
    for part in parts:
        try:
            res = int(part)
        except ValueError:
            res = 0
        if res <= 0:
            raise FlagError(
                f"{flag} {attention_resolutions!r} must be a comma-separated "
                "list of positive integers (feature-map sizes such as 16,8), or \"\" for none"
            )
        rates.append(image_size // res)
    return tuple(rates)


def _level_widths(num_channels, channel_mult, flag, mult_flag):
    """The channels of each level, [int]; FlagError (naming ``flag``) unless each is a positive
    multiple of 32 (GroupNorm uses 32 groups)."""
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels <= 0:
        raise FlagError(f"{flag} must be a positive integer, got {num_channels!r}")
    widths = []
    for mult in channel_mult:
        width = mult * num_channels
        if width != int(width) or int(width) % 32 != 0:
            raise FlagError(
                f"{flag} {num_channels} times {mult_flag} entry {mult} gives {width} "
                "channels, which is not a multiple of 32 (GroupNorm uses 32 groups); use a "
                f"multiple of 32 for {flag}"
            )
        widths.append(int(width))
    return widths


def _check_class_dropout(class_dropout_prob, class_cond):
    """FlagError unless ``--class_dropout_prob`` is in [0, 1) and, when above 0, the model is
    class-conditional."""
    p = class_dropout_prob
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise FlagError(f"--class_dropout_prob must be in [0, 1), got {p!r}")
    if p > 0 and not class_cond:
        raise FlagError(
            f"--class_dropout_prob {p} replaces class labels by the null label, but the model is "
            "not class-conditional; add --class_cond True (or use --class_dropout_prob 0)"
        )


def _check_model_flags(
    num_channels, channel_mult, attention_ds, num_heads, num_head_channels, num_heads_upsample,
    class_cond, num_classes,
):
    """Raise FlagError for flag combinations the UNet cannot be built with."""
    widths = _level_widths(num_channels, channel_mult, "--num_channels", "--channel_mult")
    # Attention sits at levels whose downsample rate is listed, and always in the middle block.
    att_widths = {widths[-1]} | {w for level, w in enumerate(widths) if 2**level in attention_ds}
    heads_up = num_heads if num_heads_upsample == -1 else num_heads_upsample
    for width in sorted(att_widths):
        if num_head_channels != -1:
            if num_head_channels <= 0 or width % num_head_channels != 0:
                raise FlagError(
                    f"--num_head_channels {num_head_channels} does not divide the {width} "
                    "channels of an attention layer; use a divisor of it, or -1 to use --num_heads"
                )
            continue
        for flag, heads in (("--num_heads", num_heads), ("--num_heads_upsample", heads_up)):
            if heads <= 0 or width % heads != 0:
                raise FlagError(
                    f"{flag} {heads} does not divide the {width} channels of an attention "
                    "layer; use a divisor of it"
                )
    if class_cond and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                       or num_classes <= 0):
        raise FlagError(f"--num_classes must be a positive integer, got {num_classes!r}")


def create_model_and_diffusion(
    image_size,
    class_cond,
    learn_sigma,
    num_channels,
    num_res_blocks,
    num_heads,
    num_heads_upsample,
    attention_resolutions,
    dropout,
    diffusion_steps,
    noise_schedule,
    timestep_respacing,
    use_kl,
    predict_xstart,
    rescale_timesteps,
    rescale_learned_sigmas,
    use_checkpoint,
    use_scale_shift_norm,
    num_head_channels=-1,
    resblock_updown=False,
    use_new_attention_order=False,
    channel_mult="",
    num_classes=NUM_CLASSES,
    sigma_small=False,
    use_fp16=False,
    arch="unet",
    in_channels=3,
    dit_depth=0,
    dit_hidden_size=0,
    dit_num_heads=0,
    class_dropout_prob=0.0,
):
    """Build (model, diffusion) from the flags of model_and_diffusion_defaults().

    Also takes guided-diffusion's keyword set, which has ``use_fp16`` and no ``sigma_small``
    (both default to False here). ``use_fp16`` is recorded on the model and converts nothing:
    call ``model.convert_to_fp16()`` to run its torso in float16, as guided's scripts do. It is not
    a model flag of ours (checkpoints do not store it): training in mixed precision is the
    training flag ``--use_fp16`` (autocast over float32 weights).

    ``arch`` "unet" builds the UNet (create_model), a DiT name the DiT (create_dit; the UNet's
    width/attention flags are then unused). ``class_dropout_prob`` (classifier-free guidance's
    label dropout, null label at index num_classes) is passed to the DiT; 0 when not given.
    """
    if arch != "unet":
        model = create_dit(
            arch, image_size, in_channels=in_channels, learn_sigma=learn_sigma,
            class_cond=class_cond, num_classes=num_classes,
            class_dropout_prob=class_dropout_prob, depth=dit_depth, hidden_size=dit_hidden_size,
            num_heads=dit_num_heads,
        )
    else:
        model = create_model(
            image_size,
            num_channels,
            num_res_blocks,
            learn_sigma=learn_sigma,
            class_cond=class_cond,
            use_checkpoint=use_checkpoint,
            attention_resolutions=attention_resolutions,
            num_heads=num_heads,
            num_heads_upsample=num_heads_upsample,
            use_scale_shift_norm=use_scale_shift_norm,
            dropout=dropout,
            num_head_channels=num_head_channels,
            resblock_updown=resblock_updown,
            use_new_attention_order=use_new_attention_order,
            channel_mult=channel_mult,
            num_classes=num_classes,
            use_fp16=use_fp16,
            in_channels=in_channels,
            class_dropout_prob=class_dropout_prob,
        )
    diffusion = create_gaussian_diffusion(
        steps=diffusion_steps,
        learn_sigma=learn_sigma,
        sigma_small=sigma_small,
        noise_schedule=noise_schedule,
        use_kl=use_kl,
        predict_xstart=predict_xstart,
        rescale_timesteps=rescale_timesteps,
        rescale_learned_sigmas=rescale_learned_sigmas,
        timestep_respacing=timestep_respacing,
    )
    return model, diffusion


def create_model(
    image_size,
    num_channels,
    num_res_blocks,
    learn_sigma=False,
    class_cond=False,
    use_checkpoint=False,
    attention_resolutions="16,8",
    num_heads=1,
    num_heads_upsample=-1,
    use_scale_shift_norm=False,
    dropout=0.0,
    num_head_channels=-1,
    resblock_updown=False,
    use_new_attention_order=False,
    channel_mult="",
    num_classes=NUM_CLASSES,
    use_fp16=False,
    in_channels=3,
    class_dropout_prob=0.0,
):
    """Build the UNet for ``image_size`` x ``image_size`` inputs of ``in_channels`` channels (3:
    RGB images, as upstream; 4: VAE latents).

    Output channels are 2 x in_channels (mean and variance) when ``learn_sigma``, else
    in_channels: 6 and 3 for images, as upstream.
    ``use_fp16``: guided-diffusion's flag, recorded on the model (see UNetModel).
    ``class_dropout_prob`` > 0 (class-conditional models only) adds the null label of
    classifier-free guidance: a label embedding row at index ``num_classes`` (UNetModel's
    ``use_null_label``); the dropout itself happens in training (guidance.drop_labels).
    :raises FlagError: for flag values the UNet cannot be built with.
    """
    mults = parse_channel_mult(channel_mult, image_size)
    attention_ds = parse_attention_resolutions(attention_resolutions, image_size)
    _check_model_flags(
        num_channels, mults, attention_ds, num_heads, num_head_channels, num_heads_upsample,
        class_cond, num_classes,
    )
    _check_in_channels(in_channels)
    _check_class_dropout(class_dropout_prob, class_cond)
    return UNetModel(
        in_channels=in_channels,
        model_channels=num_channels,
        out_channels=(in_channels if not learn_sigma else 2 * in_channels),
        num_res_blocks=num_res_blocks,
        attention_resolutions=attention_ds,
        dropout=dropout,
        channel_mult=mults,
        num_classes=(num_classes if class_cond else None),
        use_checkpoint=use_checkpoint,
        num_heads=num_heads,
        num_head_channels=num_head_channels,
        num_heads_upsample=num_heads_upsample,
        use_scale_shift_norm=use_scale_shift_norm,
        resblock_updown=resblock_updown,
        use_new_attention_order=use_new_attention_order,
        use_fp16=use_fp16,
        use_null_label=class_dropout_prob > 0,
    )


def _check_in_channels(in_channels):
    if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels <= 0:
        raise FlagError(f"--in_channels must be a positive integer (3 for images, 4 for VAE "
                        f"latents), got {in_channels!r}")


def dit_config(arch, depth=0, hidden_size=0, num_heads=0):
    """(depth, hidden_size, patch_size, num_heads) of ``--arch`` in DiT's table, each of the
    first, second and fourth replaced by its --dit_* override when that is not 0.

    :raises FlagError: for an unknown --arch or an override that is not a positive integer (0
        excepted).
    """
    if arch not in DIT_CONFIGS:
        raise FlagError(f"--arch {arch!r} is unknown; use one of {', '.join(ARCHS)}")
    table = DIT_CONFIGS[arch]
    chosen = []
    for flag, value, default in (("--dit_depth", depth, table[0]),
                                 ("--dit_hidden_size", hidden_size, table[1]),
                                 ("--dit_num_heads", num_heads, table[3])):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FlagError(f"{flag} must be a positive integer, or 0 for {arch}'s {default}; "
                            f"got {value!r}")
        chosen.append(value or default)
    return chosen[0], chosen[1], table[2], chosen[2]


def create_dit(arch, image_size, *, in_channels=3, learn_sigma=False, class_cond=False,
               num_classes=NUM_CLASSES, class_dropout_prob=0.0, depth=0, hidden_size=0,
               num_heads=0):
    """Build DiT ``arch`` (e.g. "DiT-S/2") for ``image_size`` x ``image_size`` inputs of
    ``in_channels`` channels (pixels, or the latent side for VAE latents).

    Without ``class_cond`` the DiT is unconditional: num_classes 0 (its label table is the one
    null row, and the trainer calls it without y). ``depth`` / ``hidden_size`` / ``num_heads``:
    the --dit_* overrides of DiT's table (0 = the table's).
    :raises FlagError: for flag values DiT cannot be built with.
    """
    _check_image_size(image_size)
    _check_in_channels(in_channels)
    depth, hidden_size, patch_size, num_heads = dit_config(arch, depth, hidden_size, num_heads)
    if image_size % patch_size:
        raise FlagError(f"--image_size {image_size} is not a multiple of {arch}'s patch size "
                        f"{patch_size}; use a multiple of it or another --arch")
    if hidden_size % 4 or hidden_size % num_heads:
        raise FlagError(f"--dit_hidden_size {hidden_size} must be a multiple of 4 and of the "
                        f"{num_heads} heads (--dit_num_heads)")
    if class_cond and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                       or num_classes <= 0):
        raise FlagError(f"--num_classes must be a positive integer, got {num_classes!r}")
    if not 0.0 <= float(class_dropout_prob) < 1.0:
        raise FlagError(f"--class_dropout_prob must be in [0, 1), got {class_dropout_prob!r}")
    return DiT(
        input_size=image_size, patch_size=patch_size, in_channels=in_channels,
        hidden_size=hidden_size, depth=depth, num_heads=num_heads, mlp_ratio=4.0,
        class_dropout_prob=float(class_dropout_prob) if class_cond else 0.0,
        num_classes=num_classes if class_cond else 0, learn_sigma=learn_sigma,
        drop_labels=False,  # the trainer drops them (guidance.drop_labels_in), as for the UNet
    )


# guided-diffusion's classifier has a fixed 64 channels per attention head.
CLASSIFIER_HEAD_CHANNELS = 64


def create_classifier(
    image_size,
    classifier_use_fp16,
    classifier_width,
    classifier_depth,
    classifier_attention_resolutions,
    classifier_use_scale_shift_norm,
    classifier_resblock_updown,
    classifier_pool,
    classifier_channel_mult="",
    classifier_num_classes=NUM_CLASSES,
):
    """Build guided-diffusion's noised image classifier (an EncoderUNetModel) from the flags of
    classifier_defaults(); guided's keyword names, order and module layout.

    Unlike guided's, any ``image_size`` works: ``classifier_channel_mult`` "" takes the UNet's
    multipliers for the size (parse_channel_mult: guided's for 64, 128, 256 and 512; e.g.
    (1, 2) for 8), or give them explicitly. ``classifier_num_classes``: the number of logits
    (guided fixes 1000). Attention heads have 64 channels, as guided's.
    ``classifier_use_fp16`` is recorded on the model; ``convert_to_fp16()`` converts.

    :raises FlagError: for flag values the classifier cannot be built with.
    """
    mults = parse_channel_mult(classifier_channel_mult, image_size, "--classifier_channel_mult")
    attention_ds = parse_attention_resolutions(
        classifier_attention_resolutions, image_size, "--classifier_attention_resolutions")
    _check_classifier_flags(image_size, classifier_width, mults, attention_ds, classifier_pool,
                            classifier_num_classes)
    return EncoderUNetModel(
        image_size=image_size,
        in_channels=3,
        model_channels=classifier_width,
        out_channels=classifier_num_classes,
        num_res_blocks=classifier_depth,
        attention_resolutions=attention_ds,
        channel_mult=mults,
        use_fp16=classifier_use_fp16,
        num_head_channels=CLASSIFIER_HEAD_CHANNELS,
        use_scale_shift_norm=classifier_use_scale_shift_norm,
        resblock_updown=classifier_resblock_updown,
        pool=classifier_pool,
    )


def _check_classifier_flags(image_size, width, mults, attention_ds, pool, num_classes):
    """Raise FlagError for classifier flags the EncoderUNetModel cannot be built with."""
    if pool not in ENCODER_POOLS:
        raise FlagError(f"--classifier_pool {pool!r} is unknown; use one of "
                        f"{', '.join(ENCODER_POOLS)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0:
        raise FlagError(f"--classifier_num_classes must be a positive integer, got "
                        f"{num_classes!r}")
    widths = _level_widths(width, mults, "--classifier_width", "--classifier_channel_mult")
    bottom = image_size // 2 ** (len(widths) - 1)
    for level, w in enumerate(widths):
        if 2 ** level in attention_ds and w % CLASSIFIER_HEAD_CHANNELS:
            res = image_size // 2 ** level
            raise FlagError(
                f"--classifier_attention_resolutions has {res} ({res}x{res} features), where "
                f"the classifier has {w} channels: not a multiple of its "
                f"{CLASSIFIER_HEAD_CHANNELS} channels per attention head; drop {res} or use a "
                "larger --classifier_width"
            )
    if widths[-1] % CLASSIFIER_HEAD_CHANNELS:
        raise FlagError(
            f"--classifier_width {width}: the classifier's middle block ({bottom}x{bottom}) "
            f"has {widths[-1]} channels, not a multiple of its {CLASSIFIER_HEAD_CHANNELS} "
            "channels per attention head; use a larger --classifier_width (or more levels in "
            "--classifier_channel_mult)"
        )


def create_classifier_and_diffusion(
    image_size,
    classifier_use_fp16,
    classifier_width,
    classifier_depth,
    classifier_attention_resolutions,
    classifier_use_scale_shift_norm,
    classifier_resblock_updown,
    classifier_pool,
    learn_sigma,
    diffusion_steps,
    noise_schedule,
    timestep_respacing,
    use_kl,
    predict_xstart,
    rescale_timesteps,
    rescale_learned_sigmas,
    classifier_channel_mult="",
    classifier_num_classes=NUM_CLASSES,
    sigma_small=False,
):
    """(classifier, diffusion) from the flags of classifier_and_diffusion_defaults()
    (guided-diffusion's keyword names; ours have defaults)."""
    classifier = create_classifier(
        image_size,
        classifier_use_fp16,
        classifier_width,
        classifier_depth,
        classifier_attention_resolutions,
        classifier_use_scale_shift_norm,
        classifier_resblock_updown,
        classifier_pool,
        classifier_channel_mult=classifier_channel_mult,
        classifier_num_classes=classifier_num_classes,
    )
    diffusion = diffusion_from_flags(dict(
        diffusion_steps=diffusion_steps, learn_sigma=learn_sigma, sigma_small=sigma_small,
        noise_schedule=noise_schedule, use_kl=use_kl, predict_xstart=predict_xstart,
        rescale_timesteps=rescale_timesteps, rescale_learned_sigmas=rescale_learned_sigmas,
        timestep_respacing=timestep_respacing))
    return classifier, diffusion


def sr_model_and_diffusion_defaults():
    """Defaults for the super-resolution model: the flags sr_create_model_and_diffusion takes."""
    res = model_and_diffusion_defaults()
    res["large_size"] = 256
    res["small_size"] = 64
    arg_names = inspect.getfullargspec(sr_create_model_and_diffusion)[0]
    for k in list(res.keys()):
        if k not in arg_names:
            del res[k]
    return res


def sr_create_model_and_diffusion(
    large_size,
    small_size,
    class_cond,
    learn_sigma,
    num_channels,
    num_res_blocks,
    num_heads,
    num_heads_upsample,
    attention_resolutions,
    dropout,
    diffusion_steps,
    noise_schedule,
    timestep_respacing,
    use_kl,
    predict_xstart,
    rescale_timesteps,
    rescale_learned_sigmas,
    use_checkpoint,
    use_scale_shift_norm,
    num_head_channels=-1,
    resblock_updown=False,
    use_new_attention_order=False,
    channel_mult="",
    num_classes=NUM_CLASSES,
    use_fp16=False,
):
    """Build (SuperResModel, diffusion) from the flags of sr_model_and_diffusion_defaults().
    ``use_fp16``: guided-diffusion's keyword, recorded on the model (see create_model_and_diffusion).
    """
    model = sr_create_model(
        large_size,
        small_size,
        num_channels,
        num_res_blocks,
        learn_sigma=learn_sigma,
        class_cond=class_cond,
        use_checkpoint=use_checkpoint,
        attention_resolutions=attention_resolutions,
        num_heads=num_heads,
        num_heads_upsample=num_heads_upsample,
        use_scale_shift_norm=use_scale_shift_norm,
        dropout=dropout,
        num_head_channels=num_head_channels,
        resblock_updown=resblock_updown,
        use_new_attention_order=use_new_attention_order,
        channel_mult=channel_mult,
        num_classes=num_classes,
        use_fp16=use_fp16,
    )
    diffusion = create_gaussian_diffusion(
        steps=diffusion_steps,
        learn_sigma=learn_sigma,
        sigma_small=False,
        noise_schedule=noise_schedule,
        use_kl=use_kl,
        predict_xstart=predict_xstart,
        rescale_timesteps=rescale_timesteps,
        rescale_learned_sigmas=rescale_learned_sigmas,
        timestep_respacing=timestep_respacing,
    )
    return model, diffusion


def sr_create_model(
    large_size,
    small_size,
    num_channels,
    num_res_blocks,
    learn_sigma=False,
    class_cond=False,
    use_checkpoint=False,
    attention_resolutions="16,8",
    num_heads=1,
    num_heads_upsample=-1,
    use_scale_shift_norm=False,
    dropout=0.0,
    num_head_channels=-1,
    resblock_updown=False,
    use_new_attention_order=False,
    channel_mult="",
    num_classes=NUM_CLASSES,
    use_fp16=False,
):
    """Build the SuperResModel producing ``large_size`` images from ``small_size`` ones."""
    _check_image_size(small_size, "--small_size")
    try:
        mults = parse_channel_mult(channel_mult, large_size)
    except FlagError as e:
        raise FlagError(str(e).replace("--image_size", "--large_size")) from None
    attention_ds = parse_attention_resolutions(attention_resolutions, large_size)
    _check_model_flags(
        num_channels, mults, attention_ds, num_heads, num_head_channels, num_heads_upsample,
        class_cond, num_classes,
    )
    return SuperResModel(
        image_size=large_size,
        in_channels=3,
        model_channels=num_channels,
        out_channels=(3 if not learn_sigma else 6),
        num_res_blocks=num_res_blocks,
        attention_resolutions=attention_ds,
        dropout=dropout,
        channel_mult=mults,
        num_classes=(num_classes if class_cond else None),
        use_checkpoint=use_checkpoint,
        num_heads=num_heads,
        num_head_channels=num_head_channels,
        num_heads_upsample=num_heads_upsample,
        use_scale_shift_norm=use_scale_shift_norm,
        resblock_updown=resblock_updown,
        use_new_attention_order=use_new_attention_order,
        use_fp16=use_fp16,
    )


def diffusion_from_flags(flags):
    """create_gaussian_diffusion from the diffusion flags (DIFFUSION_FLAG_KEYS) of ``flags``."""
    kwargs = {k: flags[k] for k in DIFFUSION_FLAG_KEYS if k != "diffusion_steps"}
    return create_gaussian_diffusion(steps=flags["diffusion_steps"], **kwargs)


def create_gaussian_diffusion(
    *,
    steps=1000,
    learn_sigma=False,
    sigma_small=False,
    noise_schedule="linear",
    use_kl=False,
    predict_xstart=False,
    rescale_timesteps=False,
    rescale_learned_sigmas=False,
    timestep_respacing="",
):
    """Build the (possibly respaced) diffusion process, as upstream."""
    # Imported here so that the model half of this module is usable on its own.
    from . import gaussian_diffusion as gd
    from .respace import SpacedDiffusion, space_timesteps

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise FlagError(f"--diffusion_steps must be a positive integer, got {steps!r}")
    if noise_schedule not in ("linear", "cosine"):
        raise FlagError(f"--noise_schedule {noise_schedule!r} is unknown; use linear or cosine")
    betas = gd.get_named_beta_schedule(noise_schedule, steps)
    if betas.max() > 1:  # the linear schedule scales its betas by 1000 / steps
        raise FlagError(f"--diffusion_steps {steps} with --noise_schedule linear: its last beta "
                        f"(0.02 * 1000 / {steps} = {betas.max():g}) exceeds 1; use "
                        f"--diffusion_steps 20 or more, or --noise_schedule cosine")
    if use_kl:
        loss_type = gd.LossType.RESCALED_KL
    elif rescale_learned_sigmas:
        loss_type = gd.LossType.RESCALED_MSE
    else:
        loss_type = gd.LossType.MSE
    if not timestep_respacing:
        timestep_respacing = [steps]
    try:  # space_timesteps' ValueError explains a bad --timestep_respacing in one line
        use_timesteps = space_timesteps(steps, timestep_respacing)
    except ValueError as e:
        raise FlagError(f"--timestep_respacing {timestep_respacing!r}: {e}") from None
    return SpacedDiffusion(
        use_timesteps=use_timesteps,
        betas=betas,
        model_mean_type=(
            gd.ModelMeanType.EPSILON if not predict_xstart else gd.ModelMeanType.START_X
        ),
        model_var_type=(
            (gd.ModelVarType.FIXED_LARGE if not sigma_small else gd.ModelVarType.FIXED_SMALL)
            if not learn_sigma
            else gd.ModelVarType.LEARNED_RANGE
        ),
        loss_type=loss_type,
        rescale_timesteps=rescale_timesteps,
    )
