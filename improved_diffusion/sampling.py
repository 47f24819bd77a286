"""Sampling from trained weights: the reusable part of scripts/sample.py and friends.

* `load_for_sampling`: a model file of any kind (ours, tagged with its flags; upstream's raw state
  dict; a combined dict) becomes a model and a diffusion. Flags the file carries win; a flag given
  EXPLICITLY on the command line that contradicts the file is an error naming both values.
* Per-sample randomness: sample ``i`` draws its label, its initial noise and every step's noise from
  its own ``torch.Generator`` seeded from ``(seed, i)`` (the noise on the model's device), so the
  output does not depend on the number of ranks or the batch size (`PerSampleRandn`,
  `sample_seed`).
* `shard_batches` splits the global sample indices into batches, ``batches[rank::world_size]``
  (EDM style); `generate` runs them and gathers the results to rank 0 (collective).
* `save_samples`: ``samples_{N}x{H}x{W}x{C}.npz`` (``arr_0`` uint8 NHWC, ``arr_1`` labels) and a
  PNG grid beside it.

Errors made by the user (missing file, bad or contradicting flags) raise `SampleError` with a
one-line message that names the flag or file; scripts print it as ``error: ...``.
"""

import math
import os

import numpy as np
import torch as th

from . import cli, dist_util, logger
from .errors import UserError
from .script_util import FlagError, explicit_args, same_flag_value
from .state_fit import fit_state_dict, shapes_of

# Model/diffusion flags that may legitimately differ from the training run at sampling time.
SAMPLE_TIME_FLAGS = ("timestep_respacing", "use_checkpoint", "dropout")


class SampleError(UserError):
    """A user mistake in sampling input (a file, its contents); the message is one line (exit 1).
    Bad flag values are script_util.FlagError (exit 2)."""


class FlagConflictError(FlagError):
    """An explicit command-line flag contradicts the flags stored in the model file."""


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
        raise FlagError("--model_path is required (a model*.pt or ema_*.pt file)")
    if getattr(args, "seed", 0) < 0:  # per-sample seeds need seed >= 0 (np.random.SeedSequence)
        raise FlagError(f"--seed {args.seed}: must be a non-negative integer")
    timeout = getattr(args, "dist_timeout", dist_util.DEFAULT_TIMEOUT_S)
    cli.check_dist_timeout(timeout)
    dist_util.setup_dist(timeout=timeout)
    logger.configure(dir=args.log_dir or os.environ.get("OPENAI_LOGDIR") or None)
    return args, explicit


def run_script(main, argv=None):
    """Entry point of the sampling scripts: a UserError becomes one `error: ...` line and its exit
    code (FlagError: 2); anything else keeps its traceback (cli.run_main)."""
    return cli.run_main(main, argv)


# ----------------------------------------------------------------------------------------------
# Flags


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
            if not same_flag_value(explicit[k], file_flags[k]):
                raise FlagConflictError(
                    f"--{k} {explicit[k]} contradicts {source}, which was trained with "
                    f"{k}={file_flags[k]}; drop --{k} (the file's flags are used)"
                )
            continue
        flags[k] = explicit[k]
    return flags


def parse_classes(text, num_classes):
    """``"3,7"`` -> [3, 7]; validates against `num_classes` (raises SampleError naming --classes)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        classes = [int(p) for p in str(text).split(",") if p.strip() != ""]
    except ValueError:
        raise FlagError(f"--classes {text!r}: expected comma-separated integers, e.g. 3,7")
    if not classes:
        raise FlagError(f"--classes {text!r}: expected comma-separated integers, e.g. 3,7")
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise FlagError(
            f"--classes {text}: class {bad[0]} is out of range for a model with "
            f"num_classes={num_classes} (use 0..{num_classes - 1})"
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
    from . import checkpoint

    if want not in ("auto", "ema", "model"):
        raise FlagError(f"--weights {want}: expected auto, ema or model")
    try:
        ckpt = checkpoint.load_file_collective(path)
    except checkpoint.CheckpointError as e:
        msg = str(e)
        raise SampleError(msg if msg.startswith("--") else f"--model_path {msg}") from None
    except (OSError, EOFError) as e:
        raise SampleError(f"--model_path {path}: {e}") from None
    if ckpt.kind == "opt":
        raise SampleError(
            f"--model_path {path} holds optimizer state, not model weights; pass a model*.pt or "
            f"ema_*.pt file"
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
            f"--model_path {path} holds no model weights (kind {ckpt.kind}); pass a model*.pt or "
            f"ema_*.pt file"
        )
    return sd, ckpt


def _fit_error(path, fit, from_file):
    """A one-line SampleError saying why the weights of `path` do not fit (a state_fit.Fit)."""
    if from_file:
        hint = "the flags stored in the file do not match its weights"
    elif fit.likely_flags:
        hint = f"pass the model flags it was trained with (likely {'; '.join(fit.likely_flags)})"
    else:
        hint = ("pass the model flags it was trained with (e.g. --image_size, --num_channels, "
                "--num_res_blocks, --learn_sigma, --class_cond)")
    return SampleError(f"--model_path {path} does not fit the model: {fit.summary()}; {hint}")


def load_for_sampling(path, explicit, *, defaults=None, create=None, want="auto",
                      device=None):
    """Build the model and diffusion for `path` and load its weights (eval mode, on `device`).

    Collective: call from all ranks with the same arguments.

    :param explicit: flags typed on the command line (dict; see `explicit_args`).
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
    sd, ckpt = load_weights(path, want)
    file_flags = ckpt.flags if isinstance(ckpt.flags, dict) else None
    if file_flags is None and ckpt.kind == "combined" and isinstance(ckpt.raw, dict):
        file_flags = ckpt.raw.get("flags") if isinstance(ckpt.raw.get("flags"), dict) else None
    flags = reconcile_flags(file_flags, explicit, defaults, source=f"{path}")
    model, diffusion = create(**flags)  # a bad flag value is a FlagError naming the flag
    fit = fit_state_dict(shapes_of(model.state_dict()), shapes_of(sd))
    if not fit.ok:
        raise _fit_error(path, fit, file_flags is not None)
    model.load_state_dict(sd)
    model.to(device if device is not None else dist_util.dev())
    model.eval()
    return model, diffusion, flags, ckpt


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
        raise FlagError(f"--num_samples {num_samples}: must be at least 1")
    if batch_size < 1:
        raise FlagError(f"--batch_size {batch_size}: must be at least 1")
    n_batches = math.ceil(num_samples / (batch_size * world_size)) * world_size
    batches = np.array_split(np.arange(num_samples, dtype=np.int64), n_batches)
    return batches[rank::world_size]


def to_uint8(sample):
    """[N x C x H x W] float in [-1, 1] -> [N x H x W x C] uint8 numpy (upstream's rounding)."""
    sample = ((sample + 1) * 127.5).clamp(0, 255).to(th.uint8)
    return sample.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def generate(model, diffusion, *, num_samples, batch_size, shape, seed=0, use_ddim=False,
             clip_denoised=True, num_classes=None, classes=None, extra_kwargs=None,
             progress=True, log=print):
    """Generate `num_samples` samples, sharded over ranks and gathered to rank 0.

    Collective: call from all ranks with the same arguments.

    :param shape: (C, H, W) of one sample.
    :param num_classes: None for an unconditional model; else labels are drawn (or cycled through
        `classes`) per sample and passed as ``y``.
    :param extra_kwargs: optional callable ``indices -> dict of tensors [B x ...]`` merged into
        model_kwargs (e.g. ``low_res`` for super-resolution).
    :return: on rank 0 (images uint8 [N x H x W x C] numpy, labels int64 [N] numpy or None);
        on other ranks (None, None).
    """
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    device = next(model.parameters()).device
    batches = shard_batches(num_samples, batch_size, rank, world)
    sample_fn = diffusion.ddim_sample_loop if use_ddim else diffusion.p_sample_loop
    # Only rank 0 holds the output array; the other ranks send it each batch (gather, not
    # all-gather), so their memory does not grow with num_samples.
    images = labels = None
    if rank == 0:
        images = np.zeros((num_samples, shape[1], shape[2], shape[0]), dtype=np.uint8)
        labels = np.zeros((num_samples,), dtype=np.int64) if num_classes else None
    # A bar (and one per batch over timesteps) on a terminal, plain lines otherwise.
    bar = logger.Progress(num_samples, "samples", "img", enabled=progress and rank == 0)
    for idx in batches:
        if len(idx):
            randn = PerSampleRandn([sample_seed(seed, i) for i in idx], device=device)
            noise = randn(th.empty((len(idx),) + tuple(shape), device=device))
            model_kwargs = {}
            y = None
            if num_classes:
                y = sample_labels(idx, seed, num_classes, classes)
                model_kwargs["y"] = y.to(device)
            if extra_kwargs is not None:
                model_kwargs.update({k: v.to(device) for k, v in extra_kwargs(idx).items()})
            with th.no_grad():
                out = sample_fn(model, (len(idx),) + tuple(shape), noise=noise,
                                clip_denoised=clip_denoised, model_kwargs=model_kwargs,
                                progress=bar.is_tty,
                                randn_like=randn)
            part = (idx, to_uint8(out), None if y is None else y.numpy())
        else:
            part = (idx, np.zeros((0, shape[1], shape[2], shape[0]), np.uint8), None)
        for g_idx, g_img, g_lab in dist_util.gather_object(part, dst=0) or ():
            if len(g_idx):
                images[g_idx] = g_img
                if labels is not None and g_lab is not None:
                    labels[g_idx] = g_lab
                bar.update(len(g_idx))
    bar.close()
    if rank != 0:
        return None, None
    return images, labels


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


def save_samples(log_dir, images, labels=None, *, ncol=None, grid=True, overwrite=False):
    """Write ``samples_{N}x{H}x{W}x{C}.npz`` (+ ``.png`` grid) into `log_dir` (call on rank 0).

    The npz is written under a temporary name and renamed into place. Refuses to replace an
    existing npz unless `overwrite` (SampleError naming the file and --overwrite).
    :return: (npz path, png path or None).
    """
    import blobfile as bf

    npz_path, png_path = sample_paths(log_dir, images.shape)
    if not overwrite and bf.exists(npz_path):
        raise SampleError(
            f"{npz_path} already exists; pass another --log_dir or --overwrite True")
    bf.makedirs(log_dir)
    arrays = {"arr_0": images}
    if labels is not None:
        arrays["arr_1"] = labels
    if "://" in log_dir:
        with bf.BlobFile(npz_path, "wb") as f:
            np.savez(f, **arrays)
    else:
        tmp = npz_path + f".tmp{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, npz_path)
    if not grid:
        return npz_path, None
    from PIL import Image

    h = images.shape[1]
    scale = max(1, 64 // h) if h < 64 else 1
    g = make_grid(images, ncol=ncol, scale=scale, pad=max(2, h * scale // 16))
    if g.shape[2] == 1:
        g = g[:, :, 0]
    with bf.BlobFile(png_path, "wb") as f:
        Image.fromarray(g).save(f, format="PNG")
    return npz_path, png_path


def write_results(log_dir, images, labels=None, *, ncol=None, grid=True, overwrite=False):
    """
    Rank 0 writes the npz and the grid (`save_samples`) and logs where; a failed write there is
    raised on every rank (dist_util.run_on_rank0), so no rank is left waiting.

    Collective: call from all ranks with the same arguments (``images`` may be None off rank 0).
    """
    npz, png = dist_util.run_on_rank0(
        lambda: save_samples(log_dir, images, labels, ncol=ncol, grid=grid, overwrite=overwrite))
    logger.log(f"saving to {npz}")
    if png:
        logger.log(f"grid: {png}")
    logger.log("sampling complete")
