"""Sampling from trained weights: the reusable part of scripts/sample.py and friends.

* `load_for_sampling`: a model file of any kind (ours, tagged with its flags; upstream's raw state
  dict; a combined dict) becomes a model and a diffusion. Flags the file carries win; a flag given
  EXPLICITLY on the command line that contradicts the file is an error naming both values.
  `load_classifier` does the same for guided-diffusion's noised classifier (classifier_sample.py).
* Guidance: `sampling_forward` is what the sampler calls in place of the model (classifier-free
  guided with ``--guidance_scale``); `generate` takes a classifier guidance ``cond_fn``.
* Per-sample randomness: sample ``i`` draws its label, its initial noise and every step's noise from
  its own ``torch.Generator`` seeded from ``(seed, i)`` (the noise on the model's device), so the
  output does not depend on the number of ranks or the batch size (`PerSampleRandn`,
  `sample_seed`).
* `shard_batches` splits the global sample indices into batches, ``batches[rank::world_size]``
  (EDM style); `generate` runs them and gathers the results to rank 0 (collective).
* The Python API (docs/sampling_api.md): `load_for_sampling` then `sample_images`, uint8 NHWC
  arrays, nothing written to disk.
* `save_samples`: ``samples_{N}x{H}x{W}x{C}.npz`` (``arr_0`` uint8 NHWC, ``arr_1`` labels) and a
  PNG grid beside it; for a latent model (``as_images=False``) ``samples_{N}x{C}x{H}x{W}.npz``
  with ``arr_0`` the float32 NCHW latents, for a VAE to decode, and no grid.

Errors made by the user (missing file, bad or contradicting flags) raise `SampleError` with a
one-line message that names the file and the input: the command-line flag while a sampling
script runs (``--guidance_scale 3.0``, `run_script`), the argument of the Python API's calls
(``guidance_scale=3.0``, `named`); scripts print it as ``error: ...``.
"""

import contextvars
import functools
import math
import os
import re

import numpy as np
import torch as th

from .infra import cli
from . import dist_util, logger
from .infra.errors import UserError
from .script_util import FlagError, same_flag_value
from .infra.flags import explicit_args
from .ckpt.state_fit import fit_state_dict, shapes_of

# Model/diffusion flags that may legitimately differ from the training run at sampling time.
SAMPLE_TIME_FLAGS = ("timestep_respacing", "use_checkpoint", "dropout")

# Whether a sampling script runs (run_script), and whether a call of the Python API does
# (`_api`, outside a script): its errors then name the API's arguments, not the flags.
_SCRIPT = contextvars.ContextVar("improved_diffusion_sampling_script", default=False)
_API = contextvars.ContextVar("improved_diffusion_sampling_api", default=False)

# The Python API's argument of a flag, where the names differ (docs/sampling_api.md).
API_ARGUMENTS = {"model_path": "path", "weights": "want", "classifier_path": "path"}


class SampleError(UserError):
    """A user mistake in sampling input (a file, its contents); the message is one line (exit 1).
    Bad flag values are script_util.FlagError (exit 2)."""


class FlagConflictError(FlagError):
    """An explicit command-line flag contradicts the flags stored in the model file."""


# ----------------------------------------------------------------------------------------------
# How errors name the input


def named(flag, value=None):
    """How an error names the input ``flag`` (with its ``value``): the flag as typed,
    ``--guidance_scale 3.0``, except inside a call of the Python API (load_for_sampling,
    sample_images, load_classifier, save_samples), which names its argument,
    ``guidance_scale=3.0`` (``want='best'`` for --weights)."""
    if not _API.get():
        return f"--{flag}" if value is None else f"--{flag} {value}"
    name = API_ARGUMENTS.get(flag, flag)
    return name if value is None else f"{name}={value!r}"


def _unflagged(text):
    """``text`` (hints that name flags, e.g. state_fit's "--num_channels (file: 32, ...)") with
    the flags named as the Python API's arguments inside one of its calls."""
    return re.sub(r"--(\w+)", lambda m: API_ARGUMENTS.get(m.group(1), m.group(1)),
                  text) if _API.get() else text


def _api(fn):
    """An entry point of the Python API: its errors name its arguments (`named`), unless a
    sampling script called it (`run_script`: they name the flags)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        token = _API.set(not _SCRIPT.get())
        try:
            return fn(*args, **kwargs)
        finally:
            _API.reset(token)
    return call


# ----------------------------------------------------------------------------------------------
# Script plumbing shared by sample.py, nll.py and super_res_sample.py


def start_script(parser, argv=None):
    """
    Parse flags, check --model_path, set up the process group and the logger (--log_dir, else
    $OPENAI_LOGDIR, else a fresh temporary directory as upstream). Returns (args, explicit flags).

    Collective: call from all ranks with the same arguments.
    """
    args = parser.parse_args(argv)
    explicit = explicit_args(parser, argv)
    if not args.model_path:
        raise FlagError("--model_path is required (a model*.pt or ema_*.pt file, or a "
                        "sharded step's stepNNNNNN.dcp folder)")
    if getattr(args, "seed", 0) < 0:  # per-sample seeds need seed >= 0 (np.random.SeedSequence)
        raise FlagError(f"--seed {args.seed}: must be a non-negative integer")
    for flag in GUIDANCE_SCALE_FLAGS:
        if hasattr(args, flag):
            check_scale(flag, getattr(args, flag))
    timeout = getattr(args, "dist_timeout", dist_util.DEFAULT_TIMEOUT_S)
    cli.check_dist_timeout(timeout)
    dist_util.setup_dist(timeout=timeout)
    logger.configure(dir=args.log_dir or os.environ.get("OPENAI_LOGDIR") or None)
    return args, explicit


def run_script(main, argv=None):
    """Entry point of the sampling scripts: a UserError becomes one `error: ...` line and its exit
    code (FlagError: 2); anything else keeps its traceback (cli.run_main). Errors name the
    command-line flags meanwhile (`named`)."""
    token = _SCRIPT.set(True)
    try:
        return cli.run_main(main, argv)
    finally:
        _SCRIPT.reset(token)


# ----------------------------------------------------------------------------------------------
# Flags

# The guidance scales of the sampling scripts (1: no guidance of that kind).
GUIDANCE_SCALE_FLAGS = ("classifier_scale", "guidance_scale")
FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger scale is inf in the model's float32


def check_scale(flag, value):
    """Raise FlagError (exit 2) unless the guidance scale ``--flag value`` is a finite float32
    number (the dtype it multiplies): an inf or nan scale makes every guided step inf/nan, whose
    samples become pixel value 0, silently. A finite scale whose guided samples overflow is
    refused as they do (`generate`'s ``guided_by``)."""
    if not (math.isfinite(float(value)) and abs(float(value)) <= FLOAT32_MAX):
        raise FlagError(f"{named(flag, value)}: must be a finite number (1: no guidance; "
                        "guided-diffusion's classifier scales are 1-10, DiT's 1.5-4)")


def guided_by(args):
    """The guidance flags of ``args`` set to other than 1, as they would be typed
    (``"--classifier_scale 3.0"``), or "" when no guidance is on: `generate`'s ``guided_by``."""
    return " ".join(f"--{k} {getattr(args, k)}" for k in GUIDANCE_SCALE_FLAGS
                    if hasattr(args, k) and float(getattr(args, k)) != 1.0)


class GuidanceOverflowError(FlagError):
    """The guided samples became inf/nan: the guidance scale is too large for the model (exit 2).
    Raised on every rank alike (`generate`)."""


class _NonFiniteSamples(Exception):
    """sample_indices(check_finite=True): the samples hold inf/nan (caught by `generate`)."""


def reconcile_flags(file_flags, explicit, defaults, *, source="the model file",
                    sample_time=SAMPLE_TIME_FLAGS):
    """Decide the model/diffusion flags for sampling.

    :param file_flags: dict of flags stored in the file, or None (upstream raw state dict).
    :param explicit: flags typed on the command line (see `explicit_args`), any keys.
    :param defaults: dict key -> default for every model/diffusion flag (e.g.
        ``model_and_diffusion_defaults()``); only these keys are returned.
    :return: dict with exactly the keys of `defaults`.
    :raises FlagConflictError: an explicit flag (other than `sample_time` ones) contradicts the
        file; the message names the flag, both values and the file.
    """
    flags = dict(defaults)
    if file_flags is None:
        for k in defaults:
            if k in explicit:
                flags[k] = explicit[k]
        return flags
    for k in defaults:
        if k in file_flags:
            flags[k] = file_flags[k]
    for k in defaults:
        if k not in explicit:
            continue
        if k in file_flags and k not in sample_time:
            if not same_flag_value(explicit[k], file_flags[k], k):
                drop = (f"leave {k} out of the explicit flags" if _API.get()
                        else f"drop --{k}")
                raise FlagConflictError(
                    f"{named(k, explicit[k])} contradicts {source}, which was trained with "
                    f"{k}={file_flags[k]}; {drop} (the file's flags are used)"
                )
            continue
        flags[k] = explicit[k]
    return flags


def parse_classes(text, num_classes):
    """``"3,7"`` -> [3, 7]; validates against `num_classes` (raises FlagError naming --classes)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        classes = [int(p) for p in str(text).split(",") if p.strip() != ""]
    except ValueError:
        raise FlagError(f"--classes {text!r}: expected comma-separated integers, e.g. 3,7")
    if not classes:
        raise FlagError(f"--classes {text!r}: expected comma-separated integers, e.g. 3,7")
    return check_classes(classes, num_classes, text)


def check_classes(classes, num_classes, given=None):
    """``classes`` (ints) if each is a label of a model of `num_classes` classes, else a
    FlagError naming the input (``given``: as typed; default the list)."""
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise FlagError(
            f"{named('classes', classes if given is None else given)}: class {bad[0]} is out of "
            f"range for a model with num_classes={num_classes} (use 0..{num_classes - 1})"
        )
    return classes


# ----------------------------------------------------------------------------------------------
# Loading


def load_weights(path, want="auto"):
    """Read a model file on all ranks and pick its model weights.

    Collective: call from all ranks with the same arguments.

    :param want: "ema", "model" or "auto" (EMA weights when a combined dict holds both).
    :return: (state_dict, ckpt) where ckpt is checkpoint.CkptFile (``.flags`` may be None).
    :raises SampleError: missing/unreadable file, or a file that holds no model weights.
    """
    from .ckpt import checkpoint

    if want not in ("auto", "ema", "model"):
        raise FlagError(f"{named('weights', want)}: expected auto, ema or model")
    ckpt = _read(path, "model_path", want)
    if ckpt.kind == "opt":
        raise SampleError(
            f"{named('model_path', path)} holds optimizer state, not model weights; pass a "
            f"model*.pt or ema_*.pt file"
        )
    if ckpt.kind == "classifier":
        guide = ("load_classifier and guidance.classifier_cond_fn (docs/sampling_api.md)"
                 if _API.get() else "classifier_sample.py --classifier_path")
        raise SampleError(
            f"{named('model_path', path)} holds {checkpoint.describe(ckpt)}, not a diffusion "
            f"model; guide with it through {guide}"
        )
    sd = None
    if ckpt.kind == "combined":
        order = ["ema", "model"] if want in ("auto", "ema") else ["model", "ema"]
        for w in order:
            try:
                sd = checkpoint.model_state_from(ckpt, w)
            except checkpoint.CheckpointError:
                sd = None
            if sd:
                break
            if want != "auto":
                break
    else:
        sd = ckpt.state_dict
    if not sd:
        raise SampleError(
            f"{named('model_path', path)} holds no model weights (kind {ckpt.kind}); pass a "
            f"model*.pt or ema_*.pt file"
        )
    return sd, ckpt


def _read(path, flag, want="auto"):
    """The file ``path`` names: a file, a sharded step or a file it holds, a manifest's step
    (ckpt.step_files: ``want`` picks among a step's files), its errors one-line SampleErrors
    naming ``flag`` (a script's; the Python API's message names the file alone). Collective:
    call from all ranks with the same arguments."""
    from .ckpt import checkpoint, step_files

    prefix = "" if _API.get() else f"--{flag} "
    try:
        return step_files.load_collective(path, want)
    except checkpoint.CheckpointError as e:
        msg = str(e)
        raise SampleError(msg if msg.startswith("--") else f"{prefix}{msg}") from None
    except (OSError, EOFError) as e:
        raise SampleError(f"{prefix}{path}: {e}") from None


def _fit_error(path, fit, from_file):
    """A one-line SampleError saying why the weights of `path` do not fit (a state_fit.Fit)."""
    give = ("give the model flags it was trained with as the explicit flags" if _API.get()
            else "pass the model flags it was trained with")
    if from_file:
        hint = "the flags stored in the file do not match its weights"
    elif fit.likely_flags:
        hint = f"{give} (likely {_unflagged('; '.join(fit.likely_flags))})"
    else:
        hint = _unflagged(f"{give} (e.g. --image_size, --num_channels, --num_res_blocks, "
                          "--learn_sigma, --class_cond)")
    return SampleError(f"{named('model_path', path)} does not fit the model: {fit.summary()}; "
                       f"{hint}")


@_api
def load_for_sampling(path, explicit=None, *, defaults=None, create=None, want="auto",
                      device=None):
    """Build the model and diffusion for `path` and load its weights (eval mode, on `device`).

    Collective: call from all ranks with the same arguments (in a plain process, just call it).

    :param explicit: flags typed on the command line (dict; see `explicit_args`), or given by a
        caller: sample-time ones (e.g. ``{"timestep_respacing": "ddim25"}``) apply, others must
        agree with the file's; None: the file's flags alone.
    :param defaults: model/diffusion flag defaults (default: script_util's); the keys given to
        `create`.
    :param create: flags -> (model, diffusion) (default: script_util.create_model_and_diffusion).
    :return: (model, diffusion, flags, ckpt).
    """
    from . import script_util

    if defaults is None:
        defaults = script_util.model_and_diffusion_defaults()
    if create is None:
        create = script_util.create_model_and_diffusion
    explicit = dict(explicit or {})
    sd, ckpt = load_weights(path, want)
    file_flags = ckpt.flags if isinstance(ckpt.flags, dict) else None
    if file_flags is None and ckpt.kind == "combined" and isinstance(ckpt.raw, dict):
        file_flags = ckpt.raw.get("flags") if isinstance(ckpt.raw.get("flags"), dict) else None
    flags = reconcile_flags(file_flags, explicit, defaults, source=f"{path}")
    try:
        model, diffusion = create(**flags)  # a bad flag value is a FlagError naming the flag
    except FlagError as e:
        if not _API.get():
            raise
        raise FlagError(_unflagged(str(e))) from None  # named as the explicit dict's key
    fit = fit_state_dict(shapes_of(model.state_dict()), shapes_of(sd))
    if not fit.ok:
        raise _fit_error(path, fit, file_flags is not None)
    model.load_state_dict(sd)
    model.to(device if device is not None else dist_util.dev())
    model.eval()
    return model, diffusion, flags, ckpt


def class_names_of(ckpt):
    """The class names a weights file stores (train.py's ``class_names``: its --data_dir's, in
    label order), or None (older files, upstream's, unconditional models)."""
    names = ckpt.raw.get("class_names") if isinstance(ckpt.raw, dict) else None
    ok = isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)
    return list(names) if ok else None


def vae_of(ckpt):
    """The VAE a latent model's file names (train.py's ``vae`` tag, from its latent folder's
    vae.json: {"source", "sha256", "scale"}), or None."""
    vae = ckpt.raw.get("vae") if isinstance(ckpt.raw, dict) else None
    return dict(vae) if isinstance(vae, dict) and isinstance(vae.get("sha256"), str) else None


def load_model(args, explicit, tags=None):
    """The model of sample.py and classifier_sample.py: `load_for_sampling` of --model_path
    (--weights), its torso in float16 with guided-diffusion's --use_fp16, and one log line.

    Collective: call from all ranks with the same arguments.
    :param tags: a dict to fill with the file's tags: "vae" (`vae_of`) when it names one.
    :return: (model, diffusion, flags, the file's class names or None).
    """
    logger.log(f"loading {args.model_path} ...")
    model, diffusion, flags, ckpt = load_for_sampling(args.model_path, explicit, want=args.weights)
    if args.use_fp16:  # guided-diffusion's --use_fp16: the torso in float16, as its script did
        if not hasattr(model, "convert_to_fp16"):
            raise FlagError(f"--use_fp16 True: float16 sampling is the UNet's (guided-diffusion's "
                            f"convert_to_fp16); --arch {flags['arch']} samples in float32")
        model.convert_to_fp16()
    source = "flags stored in the file" if isinstance(ckpt.flags, dict) else "command-line flags"
    logger.log(
        f"model: {ckpt.kind} weights"
        + (f" at step {ckpt.step}" if ckpt.step is not None else "")
        + (f" ({ckpt.path})" if str(ckpt.path) != str(args.model_path) else "")
        + f", {source}; arch={flags['arch']} image_size={flags['image_size']} "
        f"class_cond={flags['class_cond']} "
        f"diffusion_steps={flags['diffusion_steps']} "
        f"timestep_respacing={flags['timestep_respacing'] or '(none)'}"
        + (" (float16 torso: --use_fp16)" if args.use_fp16 else "")
    )
    if tags is not None and vae_of(ckpt):
        tags["vae"] = vae_of(ckpt)
        logger.log(f"latents of the VAE {tags['vae']['sha256'][:12]} (its sha256 goes into the "
                   f"npz as vae_sha256; vae_latents.py decode checks it)")
    return model, diffusion, flags, class_names_of(ckpt)


def sample_to_npz(args, model, diffusion, flags, *, num_classes=None, classes=None, forward=None,
                  cond_fn=None, guidance="", class_names=None, vae=None):
    """Draw --num_samples images (`generate`) and write them into the logger's dir
    (`write_results`): what sample.py and classifier_sample.py do once their model is loaded.
    An existing npz is refused (before sampling) unless --overwrite True.

    Collective: call from all ranks with the same arguments.
    :param guidance: words for the log line (e.g. "classifier scale 3").
    :param class_names: the labels' names (`class_names_of`), for the log line of the labels.
    :param vae: the model file's VAE (`vae_of`): its sha256 goes into the npz as
        ``vae_sha256`` (a string array), which datasets/vae_latents.py decode checks.
    """
    log_dir = logger.get_dir()
    shape = (flags["in_channels"], flags["image_size"], flags["image_size"])
    as_images = shape[0] == 3  # a latent model's samples: float32 [N x C x H x W], no grid
    out_shape = ((args.num_samples, shape[1], shape[2], shape[0]) if as_images
                 else (args.num_samples,) + shape)
    npz_path, _ = sample_paths(log_dir, out_shape)
    exists = dist_util.broadcast_object(
        dist_util.get_rank() == 0 and os.path.exists(npz_path) and not args.overwrite)
    if exists:
        raise SampleError(f"{npz_path} already exists; pass another --log_dir or --overwrite True")
    logger.log(
        f"sampling {args.num_samples} images ({'DDIM' if args.use_ddim else 'ancestral'}, "
        f"{diffusion.num_timesteps} steps{', ' + guidance if guidance else ''}) on "
        f"{dist_util.get_world_size()} rank(s), batch size {args.batch_size}, seed {args.seed} ...")
    images, labels = generate(
        model, diffusion,
        num_samples=args.num_samples, batch_size=args.batch_size, shape=shape, seed=args.seed,
        use_ddim=args.use_ddim, clip_denoised=args.clip_denoised, num_classes=num_classes,
        classes=classes, progress=args.progress, forward=forward, cond_fn=cond_fn,
        as_images=as_images, guided_by=guided_by(args),
    )
    if labels is not None:
        logger.log(label_names_line(labels, class_names))
    ncol = len(classes) if classes and len(classes) > 1 else None
    extra = {"vae_sha256": np.array(vae["sha256"])} if vae else None
    write_results(log_dir, images, labels, ncol=ncol, grid=args.grid and as_images,
                  overwrite=args.overwrite, extra=extra)


def label_names_line(labels, names=None):
    """One log line: how many samples of each label, with the class names the model's file
    stores (train.py records its folder's, in label order): "labels: 0=cat x3, 1=dog x2"."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    def name(i):
        return f"{i}={names[i]}" if names and i < len(names) else str(i)
    shown = ", ".join(f"{name(i)} x{c}" for i, c in enumerate(counts) if c)
    return "labels: " + shown + ("" if names else " (the file stores no class names)")


# The classifier's diffusion flags that must be the model's: they define what a timestep means.
NOISE_PROCESS_FLAGS = ("diffusion_steps", "noise_schedule")


@_api
def load_classifier(path, explicit, model_flags, device=None):
    """Build guided-diffusion's noised classifier for ``--classifier_path`` and load its weights
    (eval mode, on ``device``).

    Collective: call from all ranks with the same arguments.

    The classifier's flags: those stored in the file (ours), else the classifier flags given on
    the command line (upstream's raw files; 1000 classes unless --classifier_num_classes says
    otherwise); its image size is the model's (guided-diffusion's one --image_size).

    :param explicit: flags typed on the command line (see `explicit_args`).
    :param model_flags: the diffusion model's flags (load_for_sampling's).
    :return: (classifier, its flags: the CLASSIFIER_FLAG_KEYS, and diffusion_steps /
        noise_schedule when the file stores them).
    :raises SampleError: a missing file, one that is not a classifier, one whose weights do not
        fit its flags, or one trained for another image size or noise process than the model.
    """
    from . import script_util
    from .ckpt import checkpoint

    if not path:
        raise FlagError(f"{named('classifier_path')} is required (a noised classifier: ours, or "
                        "guided-diffusion's e.g. 64x64_classifier.pt)")
    ckpt = _read(path, "classifier_path")
    if ckpt.kind != "classifier":
        raise SampleError(
            f"{named('classifier_path', path)} holds {checkpoint.describe(ckpt)}, not a noised "
            "classifier; pass a classifier file (guided-diffusion's *_classifier.pt, or a "
            "model*.pt of a classifier run)"
        )
    defaults = script_util.classifier_and_diffusion_defaults()
    defaults.update({k: model_flags[k] for k in defaults if k in model_flags})
    file_flags = ckpt.flags if isinstance(ckpt.flags, dict) else None
    keys = script_util.CLASSIFIER_FLAG_KEYS
    flags = reconcile_flags(file_flags, {k: v for k, v in explicit.items() if k in keys},
                            {k: defaults[k] for k in keys}, source=path)
    for k in NOISE_PROCESS_FLAGS:
        if file_flags is not None and k in file_flags:
            flags[k] = file_flags[k]
    if flags["image_size"] != model_flags["image_size"]:
        raise SampleError(
            f"{named('classifier_path', path)} classifies {flags['image_size']}x"
            f"{flags['image_size']} images, the model makes {model_flags['image_size']}x"
            f"{model_flags['image_size']}; pass a classifier trained at the model's "
            f"{named('image_size')}"
        )
    differ = [k for k in NOISE_PROCESS_FLAGS
              if k in flags and not same_flag_value(flags[k], model_flags[k], k)]
    if differ:
        raise SampleError(
            f"{named('classifier_path', path)} was trained on another noise process ("
            + ", ".join(f"{k}={flags[k]}" for k in differ) + ") than the model ("
            + ", ".join(f"{k}={model_flags[k]}" for k in differ) + "), so its timesteps mean "
            "other noise levels; pass a classifier trained with the model's"
        )
    classifier = script_util.create_classifier(**{k: flags[k] for k in keys})
    fit = fit_state_dict(shapes_of(classifier.state_dict()), shapes_of(ckpt.state_dict))
    if not fit.ok:
        hint = ("the flags stored in the file do not match its weights" if file_flags else
                _unflagged("pass the classifier flags it was trained with (--classifier_width, "
                           "--classifier_depth, --classifier_attention_resolutions, "
                           "--classifier_pool, --classifier_num_classes, ...)"))
        raise SampleError(f"{named('classifier_path', path)} does not fit the classifier: "
                          f"{fit.summary('classifier')}; {hint}")
    classifier.load_state_dict(ckpt.state_dict)
    classifier.to(device if device is not None else dist_util.dev())
    classifier.eval()
    return classifier, flags


# ----------------------------------------------------------------------------------------------
# Guidance


def sampling_forward(model, flags, guidance_scale=1.0):
    """What the sampler calls in place of ``model``: ``forward(x, t, y=None, **kw)``.

    For a class-conditional model, classifier-free guided with ``guidance_scale`` (see
    guidance.cfg_forward: 1 is the model itself, plain conditional sampling; 0 the null label;
    otherwise the conditional and the null-label batch in one forward, the mean channels guided
    and a learned variance the conditional one's). For an unconditional model, the model with
    labels dropped (they are there for a guiding classifier, as in guided-diffusion's script).

    :raises FlagError: ``--guidance_scale`` other than 1 for a model without a null label
        (trained without ``--class_dropout_prob``).
    """
    from . import guidance

    scale = float(guidance_scale)
    null = flags["num_classes"] if flags.get("class_cond") and (
        flags.get("class_dropout_prob") or 0) > 0 else None
    if scale != 1.0 and null is None:
        raise FlagError(
            f"{named('guidance_scale', guidance_scale)}: classifier-free guidance needs a model "
            f"trained with --class_dropout_prob > 0 (it has no null label); use "
            f"{named('guidance_scale', 1)}"
        )
    if not flags.get("class_cond"):
        return lambda x, t, y=None, **kw: model(x, t, **kw)
    if scale == 1.0:
        return model
    # DiT guides channels 0..2 (its forward_with_cfg; all of eps for pixels, 3 of a latent's 4)
    mean = 3 if flags.get("arch", "unet") != "unet" else None
    return guidance.cfg_forward(model, scale, null, mean_channels=mean)


@_api
def sample_images(model, diffusion, flags, num_samples, *, batch_size=16, seed=0,
                  use_ddim=False, clip_denoised=True, classes=None, guidance_scale=1.0,
                  cond_fn=None, progress=False):
    """The Python API's one call after `load_for_sampling`: ``num_samples`` images as sample.py
    draws them (the same seeds, so the same images), without writing anything.

        model, diffusion, flags, _ = sampling.load_for_sampling(
            "runs/x/ema_0.9999_010000.pt", {"timestep_respacing": "ddim25"}, device="cpu")
        images, labels = sampling.sample_images(model, diffusion, flags, 16, use_ddim=True,
                                                guidance_scale=3.0)

    :param flags: load_for_sampling's.
    :param classes: labels to cycle through (a list of ints), else each sample's label is drawn
        from its seed (class-conditional models; `class_names_of` of the file names them).
    :param guidance_scale: classifier-free guidance (a model trained with --class_dropout_prob;
        1: none). Classifier guidance: ``cond_fn=guidance.classifier_cond_fn(classifier, s,
        timesteps=diffusion.original_timesteps)`` with `load_classifier`'s classifier.
    :return: (images uint8 numpy [N x H x W x C], labels int64 [N] or None); a latent model
        (in_channels other than 3): float32 [N x C x H x W]. Under a process group (collective)
        rank 0 gets them, the other ranks (None, None).
    :raises FlagError: a guidance scale that is not finite, or one whose samples overflow.
    """
    check_scale("guidance_scale", guidance_scale)
    num_classes = flags["num_classes"] if flags.get("class_cond") else None
    if classes is not None and num_classes:
        try:
            classes = [int(c) for c in classes]
        except (TypeError, ValueError):
            raise FlagError(f"{named('classes', classes)}: expected a list of integer class "
                            f"labels, e.g. [3, 7]") from None
        classes = check_classes(classes, num_classes) if classes else None
    shape = (flags["in_channels"], flags["image_size"], flags["image_size"])
    guided = " and ".join(
        ([named("guidance_scale", guidance_scale)] if float(guidance_scale) != 1 else [])
        + ([named("cond_fn") + " (classifier guidance)"] if cond_fn is not None else []))
    return generate(
        model, diffusion, num_samples=num_samples, batch_size=batch_size, shape=shape, seed=seed,
        use_ddim=use_ddim, clip_denoised=clip_denoised, num_classes=num_classes,
        classes=classes, progress=progress, as_images=shape[0] == 3,
        forward=sampling_forward(model, flags, guidance_scale), cond_fn=cond_fn,
        guided_by=guided)


# ----------------------------------------------------------------------------------------------
# Per-sample randomness


def sample_seed(seed, index, stream=0):
    """A 63-bit seed for sample `index` of a run with `seed` (stream 0: noise, 1: label)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(index), int(stream)])
    hi, lo = ss.generate_state(2, dtype=np.uint32)
    return ((int(hi) << 32) | int(lo)) & 0x7FFFFFFFFFFFFFFF


class PerSampleRandn:
    """``randn_like`` whose row ``j`` comes from its own generator (seeded per global sample).

    The generators live on ``device`` (the model's) and draw there, in float32: on the CPU the
    noise is the same on every machine; on CUDA it is drawn on the GPU (no host work per step,
    nothing copied), the same for every batch size and rank count on one GPU model (torch's
    CUDA generator spreads its stream over the device's multiprocessors, so another GPU model
    draws other noise, as it computes other roundings anyway). Usable as the ``randn_like``
    keyword of the diffusion's sampling loops.
    """

    def __init__(self, seeds, device="cpu"):
        self.device = th.device(device)
        self.generators = [th.Generator(device=self.device).manual_seed(int(s)) for s in seeds]

    def __call__(self, x):
        """x: [N x ...] with N == len(seeds) -> standard normal noise shaped like x."""
        if x.shape[0] != len(self.generators):
            raise ValueError(f"batch of {x.shape[0]} rows but {len(self.generators)} generators")
        rows = [th.randn(tuple(x.shape[1:]), generator=g, device=self.device, dtype=th.float32)
                for g in self.generators]
        return th.stack(rows).to(device=x.device, dtype=x.dtype)


def sample_labels(indices, seed, num_classes, classes=None):
    """Labels of the given global sample indices: long tensor [len(indices)].

    With `classes` (a list), sample i gets ``classes[i % len(classes)]`` (so 100 samples of
    classes 0..9 are 10 per class, each grid column one class); otherwise a uniform random class
    from sample i's own label generator.
    """
    if classes:
        return th.tensor([classes[int(i) % len(classes)] for i in indices], dtype=th.long)
    out = []
    for i in indices:
        g = th.Generator(device="cpu").manual_seed(sample_seed(seed, i, stream=1))
        out.append(int(th.randint(num_classes, (1,), generator=g)))
    return th.tensor(out, dtype=th.long)


# ----------------------------------------------------------------------------------------------
# Sharding and generation


def shard_batches(num_samples, batch_size, rank=0, world_size=1):
    """This rank's batches of global sample indices: list of int64 arrays.

    The indices 0..num_samples-1 are cut into ``ceil(N / (batch_size * world)) * world`` nearly
    equal consecutive batches and dealt out ``batches[rank::world_size]``, so every rank gets the
    same number of batches (some may be empty) and no batch exceeds `batch_size`.
    """
    if num_samples < 1:
        raise FlagError(f"{named('num_samples', num_samples)}: must be at least 1")
    if batch_size < 1:
        raise FlagError(f"{named('batch_size', batch_size)}: must be at least 1")
    n_batches = math.ceil(num_samples / (batch_size * world_size)) * world_size
    batches = np.array_split(np.arange(num_samples, dtype=np.int64), n_batches)
    return batches[rank::world_size]


def to_uint8(sample):
    """[N x C x H x W] float in [-1, 1] -> [N x H x W x C] uint8 numpy (upstream's rounding)."""
    sample = ((sample + 1) * 127.5).clamp(0, 255).to(th.uint8)
    return sample.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def generate(model, diffusion, *, num_samples, batch_size, shape, seed=0, use_ddim=False,
             clip_denoised=True, num_classes=None, classes=None, extra_kwargs=None,
             progress=True, log=print, as_images=True, forward=None, cond_fn=None,
             guided_by=""):
    """Generate `num_samples` samples, sharded over ranks and gathered to rank 0.

    Collective: call from all ranks with the same arguments.

    :param shape: (C, H, W) of one sample.
    :param num_classes: None for an unconditional model; else labels are drawn (or cycled through
        `classes`) per sample and passed as ``y``.
    :param extra_kwargs: optional callable ``indices -> dict of tensors [B x ...]`` merged into
        model_kwargs (e.g. ``low_res`` for super-resolution).
    :param as_images: False for a latent model: the samples as they are, float32 [N x C x H x W]
        (no clipping, no uint8 rounding).
    :param forward: what the sampler calls in place of `model` (e.g. `sampling_forward`'s);
        default `model`.
    :param cond_fn: classifier guidance (guidance.classifier_cond_fn), given the model kwargs.
    :param guided_by: the guidance flags as typed (`guided_by`), or "": then a batch whose
        samples overflowed to inf/nan raises GuidanceOverflowError naming them, on every rank
        (one broadcast per batch), instead of writing images of pixel value 0.
    :return: on rank 0 (images uint8 [N x H x W x C] numpy, labels int64 [N] numpy or None);
        on other ranks (None, None).
    """
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    device = next(model.parameters()).device
    batches = shard_batches(num_samples, batch_size, rank, world)
    # Only rank 0 holds the output array; the other ranks send it each batch (gather, not
    # all-gather), so their memory does not grow with num_samples.
    images = labels = None
    one = (shape[1], shape[2], shape[0]) if as_images else tuple(shape)
    if rank == 0:
        images = np.zeros((num_samples,) + one, dtype=np.uint8 if as_images else np.float32)
        labels = np.zeros((num_samples,), dtype=np.int64) if num_classes else None
    # A bar (and one per batch over timesteps) on a terminal, plain lines otherwise.
    bar = logger.Progress(num_samples, "samples", "img", enabled=progress and rank == 0)
    empty = (np.zeros((0,) + one, np.uint8 if as_images else np.float32), None)
    for idx in batches:
        overflow = None
        if len(idx):
            try:
                part = (idx, *sample_indices(
                    model, diffusion, idx, shape=shape, seed=seed, use_ddim=use_ddim,
                    clip_denoised=clip_denoised, num_classes=num_classes, classes=classes,
                    extra_kwargs=extra_kwargs, device=device, progress=bar.is_tty,
                    as_images=as_images, forward=forward, cond_fn=cond_fn,
                    check_finite=bool(guided_by)))
            except _NonFiniteSamples:
                overflow = int(idx[0])
                part = (idx[:0], *empty)
        else:
            part = (idx, *empty)
        first_bad = None
        for g_idx, g_img, g_lab, *bad in dist_util.gather_object(part + (overflow,), dst=0) or ():
            if bad[0] is not None and first_bad is None:
                first_bad = bad[0]
            if len(g_idx):
                images[g_idx] = g_img
                if labels is not None and g_lab is not None:
                    labels[g_idx] = g_lab
                bar.update(len(g_idx))
        if guided_by:
            first_bad = dist_util.broadcast_object(first_bad)
        if first_bad is not None:
            bar.close()
            raise GuidanceOverflowError(
                f"{guided_by}: the guided samples overflowed to inf/nan (in the batch from "
                f"sample {first_bad}), the scale is too large for "
                "this model; use a smaller one (guided-diffusion's classifier scales are 1-10, "
                "DiT's 1.5-4)")
    bar.close()
    if rank != 0:
        return None, None
    return images, labels


def sample_indices(model, diffusion, idx, *, shape, seed=0, use_ddim=False, clip_denoised=True,
                   num_classes=None, classes=None, extra_kwargs=None, device=None,
                   progress=False, as_images=True, forward=None, cond_fn=None,
                   check_finite=False):
    """The samples of the global sample indices ``idx`` (int64 [n], n >= 1), in one batch, each
    from its own seeds (`sample_seed`), so they do not depend on the batch they are drawn in. Not
    collective.

    :param model: called as ``model(x, t, **model_kwargs)``; :param device: where its inputs go
        (default: that of its first parameter).
    :param check_finite: raise _NonFiniteSamples when the samples hold inf/nan (`generate`).
    Other arguments as `generate`'s.
    :return: (images uint8 [n x H x W x C] numpy, labels int64 [n] numpy or None); with
        ``as_images=False`` the samples as they are, float32 [n x C x H x W].
    """
    if device is None:
        device = next(model.parameters()).device
    randn = PerSampleRandn([sample_seed(seed, i) for i in idx], device=device)
    noise = randn(th.empty((len(idx),) + tuple(shape), device=device))
    model_kwargs = {}
    y = None
    if num_classes:
        y = sample_labels(idx, seed, num_classes, classes)
        model_kwargs["y"] = y.to(device)
    if extra_kwargs is not None:
        model_kwargs.update({k: v.to(device) for k, v in extra_kwargs(idx).items()})
    sample_fn = diffusion.ddim_sample_loop if use_ddim else diffusion.p_sample_loop
    with th.no_grad():
        out = sample_fn(model if forward is None else forward, (len(idx),) + tuple(shape),
                        noise=noise, clip_denoised=clip_denoised, model_kwargs=model_kwargs,
                        device=device, progress=progress, randn_like=randn, cond_fn=cond_fn)
    if check_finite and not bool(th.isfinite(out).all()):
        raise _NonFiniteSamples()
    samples = to_uint8(out) if as_images else out.float().cpu().numpy()
    return samples, None if y is None else y.numpy()


# ----------------------------------------------------------------------------------------------
# Output


def make_grid(images, ncol=None, pad=2, scale=1, pad_value=255):
    """images uint8 [N x H x W x C] -> one uint8 image [rows*(H+pad)+pad x ... x C]."""
    n, h, w, c = images.shape
    ncol = int(ncol or max(1, math.ceil(math.sqrt(n))))
    nrow = max(1, math.ceil(n / ncol))
    if scale > 1:
        images = images.repeat(scale, axis=1).repeat(scale, axis=2)
        h, w = h * scale, w * scale
    grid = np.full((nrow * (h + pad) + pad, ncol * (w + pad) + pad, c), pad_value, np.uint8)
    for i in range(n):
        r, q = divmod(i, ncol)
        y0, x0 = pad + r * (h + pad), pad + q * (w + pad)
        grid[y0:y0 + h, x0:x0 + w] = images[i]
    return grid


def sample_paths(log_dir, shape_nhwc):
    """(npz path, png path) for samples of shape [N, H, W, C] in `log_dir` (upstream's name)."""
    shape_str = "x".join(str(int(s)) for s in shape_nhwc)
    return (os.path.join(log_dir, f"samples_{shape_str}.npz"),
            os.path.join(log_dir, f"samples_{shape_str}.png"))


@_api
def save_samples(log_dir, images, labels=None, *, ncol=None, grid=True, overwrite=False,
                 extra=None):
    """Write ``samples_{N}x{H}x{W}x{C}.npz`` (+ ``.png`` grid) into `log_dir` (call on rank 0);
    ``extra``: more arrays of the npz by name (e.g. ``vae_sha256``).

    The npz is written under a temporary name and renamed into place. Refuses to replace an
    existing npz unless `overwrite` (SampleError naming the file and --overwrite).
    :return: (npz path, png path or None).
    """
    from .infra import storage as bf  # blobfile's names: local paths and object stores

    npz_path, png_path = sample_paths(log_dir, images.shape)
    if not overwrite and bf.exists(npz_path):
        raise SampleError(f"{npz_path} already exists; pass another {named('log_dir')} or "
                          f"{named('overwrite', True)}")
    bf.makedirs(log_dir)
    arrays = {"arr_0": images}
    if labels is not None:
        arrays["arr_1"] = labels
    arrays.update(extra or {})
    if "://" in log_dir:
        with bf.BlobFile(npz_path, "wb") as f:
            np.savez(f, **arrays)
    else:
        tmp = npz_path + f".tmp{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, npz_path)
    if not grid:
        return npz_path, None
    with bf.BlobFile(png_path, "wb") as f:
        grid_png(images, f, ncol=ncol)
    return npz_path, png_path


def grid_image(images, ncol=None):
    """The grid a PNG shows: images uint8 [N x H x W x C] -> uint8 [h x w x C], images smaller
    than 64 pixels scaled up by an integer factor, white padding of 1/16 of a side (>= 2)."""
    h = images.shape[1]
    scale = max(1, 64 // h) if h < 64 else 1
    return make_grid(images, ncol=ncol, scale=scale, pad=max(2, h * scale // 16))


def grid_png(images, f, ncol=None):
    """Write `grid_image` of ``images`` [N x H x W x C] uint8 as a PNG to the binary file ``f``
    (one channel: greyscale). Returns the grid [h x w x C]."""
    from PIL import Image

    g = grid_image(images, ncol)
    Image.fromarray(g[:, :, 0] if g.shape[2] == 1 else g).save(f, format="PNG")
    return g


def write_results(log_dir, images, labels=None, *, ncol=None, grid=True, overwrite=False,
                  extra=None):
    """
    Rank 0 writes the npz and the grid (`save_samples`) and logs where; a failed write there is
    raised on every rank (dist_util.run_on_rank0), so no rank is left waiting.

    Collective: call from all ranks with the same arguments (``images`` may be None off rank 0).
    """
    npz, png = dist_util.run_on_rank0(
        lambda: save_samples(log_dir, images, labels, ncol=ncol, grid=grid, overwrite=overwrite,
                             extra=extra))
    logger.log(f"saving to {npz}")
    if png:
        logger.log(f"grid: {png}")
    logger.log("sampling complete")
