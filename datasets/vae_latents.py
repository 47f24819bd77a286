"""
Encode an image folder into a latent folder for DiT (and decode sampled latents back to images),
with diffusers' AutoencoderKL, as facebookresearch/DiT and fast-DiT's extract_features do.

NEEDS THE NETWORK the first time (diffusers downloads ``stabilityai/sd-vae-ft-ema`` or ``-mse``,
about 330 MB, into its cache) and the ``diffusers`` package (``pip install diffusers``); a GPU is
advised. Neither is needed by the trainer, nor used by the tests (which pass a stand-in VAE).

    python datasets/vae_latents.py encode IMAGES --out LATENTS [--image_size 256] [--vae ema]
        [--batch_size 32] [--seed 0] [--device cuda]
    python datasets/vae_latents.py decode samples_16x4x32x32.npz --out images.npz [--vae ema]

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
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import cli  # noqa: E402
from improved_diffusion.image_datasets import (  # noqa: E402
    DataError,
    center_crop_arr,
    list_image_files,
)

LATENT_SCALE = 0.18215  # Stable Diffusion's VAE: latents * this have about unit variance


def load_vae(name, device):
    """diffusers' AutoencoderKL ``stabilityai/sd-vae-ft-{name}`` on ``device`` (downloads)."""
    from diffusers.models import AutoencoderKL

    return AutoencoderKL.from_pretrained(f"stabilityai/sd-vae-ft-{name}").to(device).eval()


def _image(path, size):
    """np.float32 [3, size, size] in [-1, 1]: DiT's preprocessing (ADM's center crop)."""
    from PIL import Image

    with Image.open(path) as im:
        arr = center_crop_arr(im.convert("RGB"), size)
    return np.transpose(arr.astype(np.float32) / 127.5 - 1, (2, 0, 1))


def encode_folder(images, out, vae, *, image_size=256, batch_size=32, seed=0, device="cpu",
                  log=print):
    """Write one latent .npy per image of ``images`` into ``out`` (see the module docstring).

    :param vae: an AutoencoderKL (or anything whose ``encode(x).latent_dist.sample(generator=)``
        gives [N, 4, h, w] for x [N, 3, H, W] in [-1, 1]).
    :return: the number of latents written (already present ones are skipped).
    """
    import torch as th

    paths = list_image_files(images)
    if not paths:
        raise DataError(f"{images}: no images (.png/.jpg/.jpeg/.gif) found; give an image folder")
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


def decode_samples(npz_in, npz_out, vae, *, batch_size=16, device="cpu"):
    """sample.py's latents ``arr_0`` [N, 4, h, w] -> ``npz_out`` with uint8 images [N, 8h, 8w, 3]
    (and ``arr_1``, the labels, when present). Returns the images' shape."""
    import torch as th

    with np.load(npz_in, allow_pickle=False) as z:
        latents, labels = z["arr_0"], (z["arr_1"] if "arr_1" in z.files else None)
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
        s.add_argument("--vae", choices=("ema", "mse"), default="ema")
        s.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = p.parse_args(argv)
    if args.command == "encode" and args.image_size % 8:
        p.error(f"--image_size {args.image_size} is not a multiple of 8 (the VAE's factor)")
    vae = load_vae(args.vae, args.device)
    if args.command == "encode":
        n = encode_folder(args.images, args.out, vae, image_size=args.image_size,
                          batch_size=args.batch_size, seed=args.seed, device=args.device)
        print(f"wrote {n} latents to {args.out}; train with --in_channels 4 --image_size "
              f"{args.image_size // 8}")
    else:
        shape = decode_samples(args.npz, args.out, vae, batch_size=args.batch_size,
                               device=args.device)
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
