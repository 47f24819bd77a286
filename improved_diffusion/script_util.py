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
        save_interval=10000,
        resume_checkpoint="",
        use_fp16=False,
        fp16_scale_growth=1e-3,
        log_dir="",
        max_steps=0,
        seed=0,
        keep_checkpoints=0,
        num_workers=-1,  # data-loading worker processes; -1: image_datasets.auto_num_workers()
        # torch.compile the model's forward/backward (off by default; see benchmarks/train.py).
        compile=False,
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
    sigma_small,
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
):
    """Build (model, diffusion) from the flags of model_and_diffusion_defaults()."""
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
):
    """Build the UNet for ``image_size`` x ``image_size`` RGB images.

    Output channels are 6 (mean and variance) when ``learn_sigma``, else 3, as upstream.
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
):
    """Build (SuperResModel, diffusion) from the flags of sr_model_and_diffusion_defaults()."""
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
    """Add a ``--key`` option per entry of ``default_dict``, typed like its default value."""
    for k, v in default_dict.items():
        v_type = type(v)
        if v is None:
            v_type = str
        elif isinstance(v, bool):
            v_type = str2bool
        parser.add_argument(f"--{k}", default=v, type=v_type)


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
