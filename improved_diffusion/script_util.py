"""The one place where flags become a model and a diffusion.

Flag names and defaults are upstream improved-diffusion's, plus guided-diffusion's
``num_head_channels``, ``resblock_updown``, ``use_new_attention_order`` and ``channel_mult``, and
``num_classes``. The dict of these flags is what checkpoint files store as "flags".

``channel_mult=""`` picks the channel multipliers from ``image_size``:

* the sizes upstream knows use upstream's choice: 32 -> (1, 2, 2, 2), 64 -> (1, 2, 3, 4),
  256 -> (1, 1, 2, 2, 4, 4); guided-diffusion's 128 -> (1, 1, 2, 3, 4) and
  512 -> (0.5, 1, 1, 2, 2, 4, 4);
* any other size gets one level per exact halving that keeps the feature map at least 4 pixels
  wide (at most 6 halvings): (1,) followed by 2, 2, 2, 4, 4, 4 for the levels below the top.
  So 8 -> (1, 2), 16 -> (1, 2, 2), 28 -> (1, 2, 2), 48 -> (1, 2, 2, 2), 96 -> (1, 2, 2, 2, 4),
  and a size that cannot be halved (odd, or below 8) -> (1,): no downsampling.
"""
import argparse
import inspect

from .unet import SuperResModel, UNetModel
from .errors import UsageError

NUM_CLASSES = 1000

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
        # Write checkpoints in a background thread: a save pauses training only to copy the state
        # to host memory (False: write them before training goes on).
        async_save=True,
        num_workers=-1,  # data-loading worker processes; -1: image_datasets.auto_num_workers()
        # torch.compile the model's forward/backward (off by default; see benchmarks/train.py).
        compile=False,
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

def nll_defaults():
    """Defaults of nll.py's own flags (bits/dim of an image folder under a model)."""
    return dict(data_dir="", clip_denoised=True, num_samples=1000, batch_size=1, model_path="",
                log_dir="", seed=0, weights="auto", dist_timeout=600.0)


def model_flag_keys():
    """The keys of model_and_diffusion_defaults(): the flags a checkpoint stores as "flags"."""
    return list(MODEL_FLAG_KEYS)


def normalize_flag_value(v):
    """
    A comparable form of a flag value, however it was written: ``True`` / ``"true"`` / ``"yes"``,
    ``16`` / ``"16"`` / ``16.0``, ``"16, 8"`` / ``"16,8"`` / ``(16, 8)`` compare equal.
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
            return ",".join(p.strip() for p in s.split(","))
    if isinstance(v, (list, tuple)):
        return ",".join(str(normalize_flag_value(p)) for p in v)
    return v


def same_flag_value(a, b):
    """True when two flag values mean the same (``True`` == ``"True"``, ``16`` == ``16.0``)."""
    return normalize_flag_value(a) == normalize_flag_value(b)


def _check_image_size(image_size, flag="--image_size"):
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise FlagError(f"{flag} must be a positive integer, got {image_size!r}")


def parse_channel_mult(channel_mult, image_size):
    """Turn the ``--channel_mult`` flag into a tuple of per-level channel multipliers.

    :param channel_mult: "" for the default for ``image_size`` (see the module docstring), or a
        comma-separated list of positive numbers such as "1,2,2" or "0.5,1,2".
    :param image_size: the image side length in pixels.
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
                f"--channel_mult {text!r} must be a comma-separated list of positive numbers, "
                "e.g. --channel_mult 1,2,2 (or \"\" for the default for --image_size)"
            )
        mults.append(int(value) if value.is_integer() else value)
    factor = 2 ** (len(mults) - 1)
    if image_size % factor != 0:
        raise FlagError(
            f"--channel_mult {text} has {len(mults)} levels (downsamples {factor}x), but "
            f"--image_size {image_size} is not divisible by {factor}; use fewer levels in "
            "--channel_mult or a different --image_size"
        )
    return tuple(mults)


def parse_attention_resolutions(attention_resolutions, image_size):
    """Turn ``--attention_resolutions`` (resolutions, e.g. "16,8") into downsample rates.

    As upstream, each resolution ``res`` becomes the rate ``image_size // res``; rates that no
    level of the UNet has are ignored (upstream behaviour, so default flags work at any size).

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
                f"--attention_resolutions {attention_resolutions!r} must be a comma-separated "
                "list of positive integers (feature-map sizes such as 16,8), or \"\" for none"
            )
        rates.append(image_size // res)
    return tuple(rates)


def _check_model_flags(
    num_channels, channel_mult, attention_ds, num_heads, num_head_channels, num_heads_upsample,
    class_cond, num_classes,
):
    """Raise FlagError for flag combinations the UNet cannot be built with."""
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels <= 0:
        raise FlagError(f"--num_channels must be a positive integer, got {num_channels!r}")
    widths = []
    for mult in channel_mult:
        width = mult * num_channels
        if width != int(width) or int(width) % 32 != 0:
            raise FlagError(
                f"--num_channels {num_channels} times --channel_mult entry {mult} gives {width} "
                "channels, which is not a multiple of 32 (GroupNorm uses 32 groups); use a "
                "multiple of 32 for --num_channels"
            )
        widths.append(int(width))
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
):
    """Build (model, diffusion) from the flags of model_and_diffusion_defaults().

    Also takes guided-diffusion's keyword set, which has ``use_fp16`` and no ``sigma_small``
    (both default to False here). ``use_fp16`` is recorded on the model and converts nothing:
    call ``model.convert_to_fp16()`` to run its torso in float16, as guided's scripts do. It is not
    a model flag of ours (checkpoints do not store it): training in mixed precision is the
    training flag ``--use_fp16`` (autocast over float32 weights).
    """
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
):
    """Build the UNet for ``image_size`` x ``image_size`` RGB images.

    Output channels are 6 (mean and variance) when ``learn_sigma``, else 3, as upstream.
    ``use_fp16``: guided-diffusion's flag, recorded on the model (see UNetModel).
    :raises FlagError: for flag values the UNet cannot be built with.
    """
    mults = parse_channel_mult(channel_mult, image_size)
    attention_ds = parse_attention_resolutions(attention_resolutions, image_size)
    _check_model_flags(
        num_channels, mults, attention_ds, num_heads, num_head_channels, num_heads_upsample,
        class_cond, num_classes,
    )
    return UNetModel(
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


def add_dict_to_argparser(parser, default_dict):
    """Add a ``--key`` option per entry of ``default_dict``, typed like its default value, in the
    group of FLAG_HELP with its meaning and default (flags the table lacks go under "other")."""
    groups = {}
    existing = {g.title: g for g in getattr(parser, "_action_groups", [])}
    order = {g: i for i, g in enumerate(FLAG_GROUPS)}

    def group_of(k):
        group = FLAG_HELP.get(k, ("other",))[0]
        # --batch_size and --seed of a script that does not train are sampling flags there
        return "sampling" if group == "training" and "lr" not in default_dict else group

    items = sorted(default_dict.items(), key=lambda kv: order.get(group_of(kv[0]), len(order)))
    for k, v in items:
        v_type = type(v)
        if v is None:
            v_type = str
        elif isinstance(v, bool):
            v_type = str2bool
        group_name, meaning = group_of(k), FLAG_HELP.get(k, ("other", ""))[1]
        if group_name not in groups:
            title = f"{group_name} flags"
            groups[group_name] = existing.get(title) or parser.add_argument_group(title)
        help_text = f"{meaning} (default {flag_default_text(v)})".strip().replace("%", "%%")
        groups[group_name].add_argument(f"--{k}", default=v, type=v_type, metavar=_metavar(v),
                                        help=help_text)


def args_to_dict(args, keys):
    """Pick ``keys`` from an argparse namespace into a dict."""
    return {k: getattr(args, k) for k in keys}


def str2bool(v):
    """Parse a boolean flag value (true/false, yes/no, t/f, y/n, 1/0; any case).

    https://stackoverflow.com/questions/15008758/parsing-boolean-values-with-argparse
    :raises argparse.ArgumentTypeError: for anything else.
    """
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("yes", "true", "t", "y", "1"):
        return True
    if s in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected a boolean (true/false, yes/no, 1/0), got {v!r}"
    )


# ---------------------------------------------------------------------------------------------
# The command line: one table of every flag's group and meaning (the scripts' --help and the
# README's flag table are made from it), and the parser every script uses.

# Groups in the order --help shows them.
FLAG_GROUPS = ("model", "diffusion", "data", "training", "checkpointing", "logging",
               "distributed", "sampling")

# flag -> (group, one-line meaning). Defaults live in the *_defaults() functions above.
FLAG_HELP = {
    # model
    "image_size": ("model", "image side in pixels"),
    "num_channels": ("model", "base channel count of the UNet (a multiple of 32)"),
    "num_res_blocks": ("model", "residual blocks per resolution level"),
    "num_heads": ("model", "attention heads (when --num_head_channels is -1)"),
    "num_heads_upsample": ("model", "attention heads on the way up; -1 = --num_heads"),
    "num_head_channels": ("model", "channels per attention head; -1 = use --num_heads"),
    "attention_resolutions": ("model", "feature-map sizes with self-attention, e.g. 16,8; '' = "
                              "none"),
    "channel_mult": ("model", "width multiplier per level, e.g. 1,2,2; '' = upstream's choice for "
                     "--image_size"),
    "dropout": ("model", "dropout rate in the residual blocks"),
    "learn_sigma": ("model", "the model also outputs the variance (6 output channels)"),
    "class_cond": ("model", "class-conditional model: the class of a file is its name before "
                   "the first '_'"),
    "num_classes": ("model", "classes of a --class_cond model; training without it counts the "
                    "class names in --data_dir"),
    "use_checkpoint": ("model", "gradient checkpointing: less memory, slower steps"),
    "use_scale_shift_norm": ("model", "FiLM-style timestep conditioning in the residual blocks"),
    "resblock_updown": ("model", "residual blocks for up/downsampling (guided-diffusion)"),
    "use_new_attention_order": ("model", "split qkv before the heads (guided-diffusion)"),
    "large_size": ("model", "super-resolution output side in pixels"),
    "small_size": ("model", "super-resolution input side in pixels"),
    # diffusion
    "diffusion_steps": ("diffusion", "timesteps of the diffusion process"),
    "noise_schedule": ("diffusion", "beta schedule: linear or cosine"),
    "timestep_respacing": ("diffusion", "use fewer timesteps, e.g. 250 or ddim50 (sampling); '' "
                           "= all"),
    "sigma_small": ("diffusion", "fixed small variance instead of the large one (without "
                    "--learn_sigma)"),
    "use_kl": ("diffusion", "train on the variational bound (KL) instead of MSE"),
    "predict_xstart": ("diffusion", "the model predicts x0 instead of the noise"),
    "rescale_timesteps": ("diffusion", "feed timesteps scaled to 0..1000 to the model"),
    "rescale_learned_sigmas": ("diffusion", "weigh the learned-variance term as upstream "
                               "(RESCALED_MSE)"),
    # data
    "data_dir": ("data", "folder of images (.png/.jpg/.jpeg/.gif, searched recursively)"),
    "num_workers": ("data", "data-loading worker processes, 4 batches ahead each (output never "
                    "depends on their number); -1 = auto: 0 on the CPU, 1-8 on a GPU"),
    "base_samples": ("data", "npz of low-resolution samples to upsample (as sample.py writes)"),
    # training
    "lr": ("training", "learning rate (AdamW)"),
    "weight_decay": ("training", "AdamW weight decay"),
    "lr_anneal_steps": ("training", "anneal the lr linearly to 0 over this many steps, then stop; "
                        "0 = constant lr, no stop"),
    "batch_size": ("training", "images per rank per step (sampling: per forward pass)"),
    "microbatch": ("training", "split each batch into microbatches of this size; -1 = off"),
    "ema_rate": ("training", "comma-separated EMA rates, e.g. 0.9999,0.999"),
    "schedule_sampler": ("training", "timestep sampler: uniform or loss-second-moment"),
    "use_fp16": ("training", "mixed precision (autocast; fp16 + loss scaling on GPU)"),
    "fp16_scale_growth": ("training", "loss-scale growth per good step (log2), as upstream"),
    "max_steps": ("training", "stop after this many optimizer steps in total (resumed ones "
                  "count); 0 = no limit"),
    "seed": ("training", "seeds everything (data order, noise, sampled labels)"),
    "nan_policy": ("training", "a step with a NaN/Inf loss or gradient: stop (exit 1) or skip"),
    "compile": ("training", "torch.compile the model's forward/backward (keys unchanged; a slower "
                "start, then faster steps)"),
    "deterministic": ("training", "deterministic GPU kernels (cuDNN, cuBLAS, atomics), so that a "
                      "resumed GPU run is bitwise a straight one; slower"),
    # checkpointing
    "log_dir": ("checkpointing", "where checkpoints and logs go (default $OPENAI_LOGDIR)"),
    "save_interval": ("checkpointing", "save a checkpoint every this many steps; 0 = only at "
                      "the end"),
    "resume_checkpoint": ("checkpointing", "auto, a model file, or a run dir (its newest complete "
                          "step); '' = auto in --log_dir"),
    "keep_checkpoints": ("checkpointing", "keep the newest K complete steps; 0 = keep all"),
    "async_save": ("checkpointing", "write checkpoints in a background thread; a save pauses "
                   "training only to copy the state to host memory"),
    "allow_model_change": ("checkpointing", "on resume, keep the tensors whose name and shape "
                           "fit the model of the flags and start the others fresh (off: a "
                           "one-line error)"),
    "lock_wait": ("checkpointing", "seconds to wait for another job holding --log_dir"),
    "model_path": ("checkpointing", "model or EMA file to load (ours or upstream's)"),
    "weights": ("checkpointing", "which weights of a combined file: auto, model or ema"),
    # logging
    "log_interval": ("logging", "log (a progress line, a progress.csv row) every this many steps"),
    "log_format": ("logging", "stdout: progress (one line per --log_interval) or table "
                   "(upstream's key/value table)"),
    "log_sample_indices": ("logging", "append each rank's dataset indices per step to "
                           "LOG_DIR/sample_indices/rankR.csv"),
    "progress": ("logging", "show progress (a bar on a terminal, plain lines otherwise)"),
    # distributed
    "dist_timeout": ("distributed", "seconds any wait between ranks may take; a dead rank ends "
                     "the job within about this long"),
    # sampling
    "num_samples": ("sampling", "how many samples to draw (nll.py: images to evaluate)"),
    "use_ddim": ("sampling", "DDIM sampling (with --timestep_respacing ddimN)"),
    "clip_denoised": ("sampling", "clip the predicted x0 to [-1, 1]"),
    "classes": ("sampling", "comma-separated class labels to cycle through; '' = random labels "
                "of the trained classes"),
    "grid": ("sampling", "also write a PNG grid of the samples"),
    "overwrite": ("sampling", "replace an existing samples npz"),
}


def flag_default_text(value):
    """A default as --help and the README show it: '' for an empty string, else the value."""
    return "''" if value == "" else str(value)


def flag_to_argv(key, value):
    """``--key value`` shell-quoted, so that it pastes back into any script ('' when empty)."""
    import shlex

    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    return f"--{key} {shlex.quote(text)}"


def flags_to_argv(flags):
    """A dict of flags as one command-line string that pastes back into any script."""
    return " ".join(flag_to_argv(k, v) for k, v in flags.items())


def _metavar(value):
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "N"
    if isinstance(value, float):
        return "X"
    return "STR"


class FlagHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, then each flag with its meaning and default on one line."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=110)

    def _format_usage(self, usage, actions, groups, prefix):
        # One short usage line: the full list of ~60 flags is what --help is for.
        return f"usage: {self._prog} [--flag value ...]   (flags below)\n\n"


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching whose errors are one line (a UsageError, exit 2):
    an unknown flag names the closest known ones ("did you mean --num_channels?")."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", FlagHelpFormatter)
        super().__init__(*args, **kwargs)

    def known_flags(self):
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def error(self, message):
        raise UsageError(unknown_flag_message(message, self.known_flags(), self.prog))


def closest_flags(flag, known, n=2):
    """The known flags closest to ``flag`` (difflib), best first: the best match and any other
    about as close, or the longer flags it is a prefix of."""
    import difflib

    name = flag.split("=", 1)[0].lstrip("-")
    bare = {k.lstrip("-"): k for k in known}
    scored = sorted(((difflib.SequenceMatcher(None, name, b).ratio(), b) for b in bare),
                    reverse=True)
    hits = [b for r, b in scored if r >= 0.6 and r >= scored[0][0] - 0.05][:n] if scored else []
    if not hits:  # a prefix of a longer flag (no abbreviations any more)
        hits = [b for b in bare if b.startswith(name)][:n]
    return [bare[h] for h in hits]


def unknown_flag_message(message, known, prog):
    """argparse's error ``message`` as one line; unknown flags get "did you mean ...?"."""
    prefix = "unrecognized arguments: "
    if message.startswith(prefix):
        words = message[len(prefix):].split()
        flags = [w for w in words if w.startswith("-")]
        if flags:
            parts = []
            for f in flags:
                near = closest_flags(f, known)
                hint = f" (did you mean {' or '.join(near)}?)" if near else ""
                parts.append(f"{f.split('=', 1)[0]}{hint}")
            what = "unknown flag" if len(parts) == 1 else "unknown flags"
            return f"{prog}: {what} {', '.join(parts)}; see {prog} --help"
        return (f"{prog}: unexpected argument {words[0]!r} (flags are --name value); "
                f"see {prog} --help")
    return f"{prog}: {message}; see {prog} --help"


def create_parser(description, defaults, prog=None):
    """The parser of a script: ``--key`` per entry of ``defaults``, grouped as FLAG_GROUPS, each
    with its meaning and default in --help. ``description``: the script's docstring."""
    parser = FlagParser(prog=prog, description=description)
    add_dict_to_argparser(parser, defaults)
    return parser


def explicit_args(parser, argv=None):
    """The flags given explicitly on the command line, as a dict (parsed and typed).

    Re-parses `argv` with every default replaced by a sentinel object, so a flag that was not
    typed is absent from the result even when its value equals the default.
    """
    import copy

    unset = object()
    quiet = copy.deepcopy(parser)
    quiet.set_defaults(**{a.dest: unset for a in quiet._actions if a.dest != "help"})
    return {k: v for k, v in vars(quiet.parse_args(argv)).items() if v is not unset}


def flags_markdown(script_defaults):
    """The README's flag table, grouped as --help groups them: | flag | default | scripts |
    meaning |. ``script_defaults``: {script name: {flag: default}} of the scripts' parsers; a
    default that differs between scripts is shown per script. Every flag of FLAG_HELP has a row
    (one no script takes yet shows "-")."""
    rows = ["| flag | default | taken by | meaning |", "|---|---|---|---|"]
    names = list(script_defaults)
    for group in FLAG_GROUPS:
        rows.append(f"| **{group}** | | | |")
        for k, (g, meaning) in FLAG_HELP.items():
            if g != group:
                continue
            takers = [n for n in names if k in script_defaults[n]]
            shown = {}
            for n in takers:
                shown.setdefault(flag_default_text(script_defaults[n][k]), []).append(n)
            if not shown:
                default = "-"
            elif len(shown) == 1:
                default = f"`{next(iter(shown))}`"
            else:
                default = "; ".join(f"`{v}` ({', '.join(ns)})" for v, ns in shown.items())
            by = "all" if takers == names else (", ".join(takers) or "-")
            rows.append(f"| `--{k}` | {default} | {by} | {meaning} |")
    return "\n".join(rows) + "\n"
