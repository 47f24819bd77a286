"""
Encode an image folder into a latent folder for DiT (and decode sampled latents back to images),
with diffusers' AutoencoderKL, as facebookresearch/DiT and fast-DiT's extract_features do.

Needs the ``diffusers`` package (``pip install diffusers``; a GPU is advised), not needed by the
trainer. ``--vae`` is one of

- ``ema`` / ``mse``: ``stabilityai/sd-vae-ft-ema`` / ``-mse`` from the Hugging Face hub (NEEDS
  THE NETWORK the first time: about 330 MB into diffusers' cache);
- a local diffusers folder (``config.json`` + weights, e.g. a downloaded ``sd-vae-ft-ema``):
  ``AutoencoderKL.from_pretrained(DIR, local_files_only=True)``, offline;
- a single weights file (``.safetensors``, ``.ckpt``, ``.pt``, ``.bin``; e.g.
  ``vae-ft-mse-840000-ema-pruned.safetensors``): ``AutoencoderKL.from_single_file(FILE)``,
  offline with the VAE's ``config.json`` beside the file (else diffusers looks for its default
  config in its cache).

    python datasets/vae_latents.py encode IMAGES --out LATENTS [--image_size 256]
        [--vae ema|DIR|FILE] [--batch_size 32] [--seed 0] [--device cuda]
    python datasets/vae_latents.py decode samples_16x4x32x32.npz --out images.npz [--vae ...]

The VAE's identity is the sha256 of its weights (``vae_identity``: every tensor of its state dict
in name order, as float32, with its name and shape), so the hub, a folder and a single file of
the same weights give the same id. encode records it in ``LATENTS/vae.json`` ({"source",
"sha256", "scale"}) and refuses to add latents of another VAE to a folder that has one (or to a
folder of latents without one); train.py stores it in its model and EMA files (the ``vae`` tag),
sample.py writes it into its npz (``vae_sha256``), and decode refuses samples of latents made with
another VAE than the one it loaded: one line naming both ids and the files, exit 1, nothing
written.

encode: every image of IMAGES (recursively) is preprocessed as DiT's train.py does (ADM's center
crop to --image_size, RGB in [-1, 1]), encoded, one draw from the posterior taken and scaled by
0.18215 (Stable Diffusion's latent scale), and saved as ``LATENTS/<same relative path>.npy``:
float32 [4, image_size / 8, image_size / 8], so the class prefix of the name is kept
(``7_0042.png`` -> ``7_0042.npy``). Train on it with ``--in_channels 4 --image_size
<image_size / 8>``. A latent already written is skipped (a rerun completes an interrupted one).

decode: the float32 latents ``arr_0`` [N, 4, h, w] that scripts/sample.py writes for a latent
model become images ``arr_0`` uint8 [N, 8h, 8w, 3] (labels ``arr_1`` kept), the format of
sample.py's image output (scripts/eval_digits.py and other tools read it).
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion.infra import cli  # noqa: E402
from improved_diffusion.image_datasets import (  # noqa: E402
    DataError,
    center_crop_arr,
    list_image_files,
)

LATENT_SCALE = 0.18215  # Stable Diffusion's VAE: latents * this have about unit variance
HUB_VAES = ("ema", "mse")  # --vae NAME: stabilityai/sd-vae-ft-NAME
WEIGHT_FILES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
VAE_FILE = "vae.json"  # image_datasets.LATENT_VAE_FILE: the trainer reads it


class VAEMismatchError(DataError):
    """Latents of one VAE meeting another VAE (encode into a folder, decode of samples); exit 1."""


def load_vae(spec, device):
    """diffusers' AutoencoderKL for ``--vae`` (see the module docstring) on ``device``, in eval
    mode. Returns (vae, source): the source as recorded in vae.json (the hub name, or the
    folder's or file's absolute path).

    :raises DataError: diffusers missing, a path that does not exist or that diffusers cannot
        read offline.
    """
    if spec in HUB_VAES:
        source, kind = f"stabilityai/sd-vae-ft-{spec}", "hub"
    elif os.path.isdir(spec):
        source, kind = os.path.abspath(spec), "folder"
    elif os.path.isfile(spec):
        source, kind = os.path.abspath(spec), "file"
    else:
        raise DataError(f"--vae {spec}: no such folder or file; pass ema, mse, a local diffusers "
                        f"folder (config.json + weights) or a weights file "
                        f"({', '.join(WEIGHT_FILES)})")
    try:
        from diffusers.models import AutoencoderKL
    except ImportError:
        raise DataError("datasets/vae_latents.py needs diffusers for its VAE: pip install "
                        "diffusers") from None
    try:
        if kind == "hub":
            vae = AutoencoderKL.from_pretrained(source)
        elif kind == "folder":
            vae = AutoencoderKL.from_pretrained(source, local_files_only=True)
        else:  # its config: a config.json beside the file, else diffusers' default (the hub's)
            beside = os.path.dirname(source)
            config = beside if os.path.isfile(os.path.join(beside, "config.json")) else None
            vae = AutoencoderKL.from_single_file(source, config=config, local_files_only=True)
    except (OSError, ValueError, EnvironmentError) as e:
        what = {"hub": "download (needs the network; or pass a local folder or file)",
                "folder": "read as a diffusers folder offline (it needs config.json and "
                          "diffusion_pytorch_model.safetensors or .bin)",
                "file": "read as a single weights file offline (put the VAE's config.json, e.g. "
                        "sd-vae-ft-mse's, beside it)"}[kind]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--vae {spec}: cannot {what}: {first}") from e
    return vae.to(device).eval(), source


def vae_identity(vae):
    """The sha256 (hex) of a VAE's weights: every tensor of ``vae.state_dict()`` in name order,
    its name, shape and values (floating ones as float32, so the dtype a loader chose does not
    change the id of the same weights). Works for any torch.nn.Module.

    :raises TypeError: for an object without a state_dict (nothing to identify it by).
    """
    import torch as th

    if not hasattr(vae, "state_dict"):
        raise TypeError(f"{type(vae).__name__} has no state_dict(); the VAE's identity is the "
                        f"sha256 of its weights (give a torch.nn.Module)")
    h = hashlib.sha256()
    sd = vae.state_dict()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu")
        if t.is_floating_point():
            t = t.to(th.float32)
        h.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def vae_record(vae, source):
    """What vae.json holds: {"source", "sha256", "scale"}."""
    return {"source": str(source), "sha256": vae_identity(vae), "scale": LATENT_SCALE}


def check_latent_folder(out, record):
    """Refuse ``out`` when it holds latents of another VAE than ``record``'s (its vae.json names
    another sha256), or latents without a vae.json (of an unknown VAE). Returns the path of its
    vae.json and whether it must be written."""
    path = os.path.join(out, VAE_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {path}: {e}; pass another --out") from e
        if old.get("sha256") != record["sha256"]:
            raise VAEMismatchError(
                f"--out {out} holds latents of the VAE {old.get('sha256')} ({old.get('source')}, "
                f"{path}); --vae {record['source']} is the VAE {record['sha256']}: pass another "
                f"--out, or the VAE that made them")
        return path, False
    if os.path.isdir(out) and any(f.endswith((".npy", ".npz")) for _, _, files in os.walk(out)
                                  for f in files):
        raise VAEMismatchError(
            f"--out {out} holds latents but no {VAE_FILE} (made by an unknown VAE); pass "
            f"another --out, so that every latent of a folder is of one VAE")
    return path, True


def _image(path, size):
    """np.float32 [3, size, size] in [-1, 1]: DiT's preprocessing (ADM's center crop)."""
    from PIL import Image

    with Image.open(path) as im:
        arr = center_crop_arr(im.convert("RGB"), size)
    return np.transpose(arr.astype(np.float32) / 127.5 - 1, (2, 0, 1))


def encode_folder(images, out, vae, *, image_size=256, batch_size=32, seed=0, device="cpu",
                  log=print, source=None):
    """Write one latent .npy per image of ``images`` into ``out`` (see the module docstring),
    and ``out/vae.json`` (the VAE's identity; ``source``: where it came from) before the first.

    :param vae: an AutoencoderKL (or any torch.nn.Module whose
        ``encode(x).latent_dist.sample(generator=)`` gives [N, 4, h, w] for x [N, 3, H, W] in
        [-1, 1]).
    :return: the number of latents written (already present ones are skipped).
    :raises VAEMismatchError: ``out`` holds latents of another VAE (nothing written).
    """
    import torch as th

    paths = list_image_files(images)
    if not paths:
        raise DataError(f"{images}: no images (.png/.jpg/.jpeg/.gif) found; give an image folder")
    record = vae_record(vae, source or type(vae).__name__)
    record_path, new = check_latent_folder(out, record)
    if new:
        os.makedirs(out, exist_ok=True)
        with open(record_path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(record_path + ".tmp", record_path)
    todo = []
    for p in paths:
        target = os.path.join(out, os.path.splitext(os.path.relpath(p, images))[0] + ".npy")
        if not os.path.exists(target):
            todo.append((p, target))
    generator = th.Generator(device=device).manual_seed(seed)
    written = 0
    for i in range(0, len(todo), batch_size):
        chunk = todo[i:i + batch_size]
        x = th.from_numpy(np.stack([_image(p, image_size) for p, _ in chunk])).to(device)
        with th.no_grad():
            z = vae.encode(x).latent_dist.sample(generator=generator) * LATENT_SCALE
        for (_, target), latent in zip(chunk, z.float().cpu().numpy()):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = target + ".tmp.npy"
            np.save(tmp, latent)
            os.replace(tmp, target)  # never a half-written latent under the final name
            written += 1
        log(f"encoded {min(i + batch_size, len(todo))}/{len(todo)}")
    return written


def decode_samples(npz_in, npz_out, vae, *, batch_size=16, device="cpu", source=None):
    """sample.py's latents ``arr_0`` [N, 4, h, w] -> ``npz_out`` with uint8 images [N, 8h, 8w, 3]
    (and ``arr_1``, the labels, when present). Returns the images' shape.

    :raises VAEMismatchError: the npz names (``vae_sha256``) another VAE than ``vae``; nothing
        is written.
    """
    import torch as th

    with np.load(npz_in, allow_pickle=False) as z:
        latents, labels = z["arr_0"], (z["arr_1"] if "arr_1" in z.files else None)
        made_by = str(z["vae_sha256"]) if "vae_sha256" in z.files else None
    if made_by is not None:
        mine = vae_identity(vae)
        if made_by != mine:
            raise VAEMismatchError(
                f"{npz_in} holds latents of the VAE {made_by} (the model's training latents); "
                f"--vae {source or type(vae).__name__} is the VAE {mine}: decode with the VAE "
                f"that encoded them (their folder's {VAE_FILE} names it); nothing written")
    images = []
    for i in range(0, len(latents), batch_size):
        x = th.from_numpy(latents[i:i + batch_size]).to(device)
        with th.no_grad():
            img = vae.decode(x / LATENT_SCALE).sample
        img = ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(th.uint8)
        images.append(img.permute(0, 2, 3, 1).cpu().numpy())
    arrays = {"arr_0": np.concatenate(images)}
    if labels is not None:
        arrays["arr_1"] = labels
    np.savez(npz_out, **arrays)
    return arrays["arr_0"].shape


def run(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("encode", help="an image folder -> a latent folder")
    e.add_argument("images")
    e.add_argument("--out", required=True)
    e.add_argument("--image_size", type=int, default=256)
    e.add_argument("--batch_size", type=int, default=32)
    e.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("decode", help="sample.py's latents npz -> an images npz")
    d.add_argument("npz")
    d.add_argument("--out", required=True)
    d.add_argument("--batch_size", type=int, default=16)
    for s in (e, d):
        s.add_argument("--vae", default="ema", metavar="ema|mse|DIR|FILE",
                       help="the hub's sd-vae-ft-ema/-mse (network), a local diffusers folder or "
                            "a single weights file (offline)")
        s.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = p.parse_args(argv)
    if args.command == "encode" and args.image_size % 8:
        p.error(f"--image_size {args.image_size} is not a multiple of 8 (the VAE's factor)")
    vae, source = load_vae(args.vae, args.device)
    if args.command == "encode":
        n = encode_folder(args.images, args.out, vae, image_size=args.image_size,
                          batch_size=args.batch_size, seed=args.seed, device=args.device,
                          source=source)
        print(f"wrote {n} latents to {args.out}; train with --in_channels 4 --image_size "
              f"{args.image_size // 8}")
    else:
        shape = decode_samples(args.npz, args.out, vae, batch_size=args.batch_size,
                               device=args.device, source=source)
        print(f"wrote {shape[0]} images {shape[1]}x{shape[2]} to {args.out}")
    return 0


def _cuda():
    import torch as th

    return th.cuda.is_available()


def main(argv=None):
    """Entry point: a UserError (no images, ...) is one `error: ...` line and exit 1."""
    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
