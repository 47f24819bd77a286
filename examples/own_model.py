r"""Your own model, trained with every flag of train.py (resume, EMA, fp16, DDP, saving, ...).

    mpiexec -n 2 python examples/own_model.py --data_dir D --log_dir L --image_size 32 \
        --dim 128 --depth 4 --patch_size 4 $DIFFUSION_FLAGS $TRAIN_FLAGS

The model here is shaped like the one of the multi-GPU report this project started from: a
DiT-style timestep embedder (``t_embedder.mlp.*``), a small ViT encoder
(``encoder.to_patch_embedding.*``, ``encoder.transformer.layers.N.*``, a frozen sin-cos position
table) and a conv decoder with BatchNorm (``decoder.2.running_mean``, ...). Replace it with yours:
what train.py's machinery needs is a function ``build(args) -> train_job.Parts`` and one call,
``train_job.run_training(args, build)``: the documented, stable way to plug in a model. The model
is called as ``model(x_t, t, **cond)`` and returns [N, C, H, W] (or [N, 2C, H, W] with
--learn_sigma True); buffers (BatchNorm statistics) and frozen parameters are saved and restored
as they are, so a resume is bitwise equal to a straight run.

Flags: those of train.py (the model flags that do not apply to this model are ignored), plus
--dim, --depth, --heads and --patch_size below. Sampling needs this model too: build it the same
way and load the weights of model*.pt / ema_*.pt (their "state_dict").
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch as th  # noqa: E402
from torch import nn  # noqa: E402

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, logger, train_job  # noqa: E402
from improved_diffusion.image_datasets import load_data, resolve_num_classes  # noqa: E402
from improved_diffusion.resample import create_named_schedule_sampler  # noqa: E402
from improved_diffusion.ckpt.rng import seed_rngs  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    create_gaussian_diffusion,
    model_and_diffusion_defaults,
    train_defaults,
)
from improved_diffusion.infra.flags import create_parser, explicit_args  # noqa: E402

OWN_FLAGS = dict(dim=64, depth=2, heads=4, patch_size=2)
DIFFUSION_FLAGS = ("diffusion_steps", "learn_sigma", "sigma_small", "noise_schedule",
                   "use_kl", "predict_xstart", "rescale_timesteps", "rescale_learned_sigmas",
                   "timestep_respacing")


class TimestepEmbedder(nn.Module):
    """t [N] -> [N, dim]: sinusoidal frequencies, then an MLP (DiT's)."""

    def __init__(self, dim, freq=64):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        half = self.freq // 2
        f = th.exp(-math.log(10000) * th.arange(half, device=t.device) / half)
        args = t.float()[:, None] * f[None]
        return self.mlp(th.cat([th.cos(args), th.sin(args)], dim=-1))


class Block(nn.ModuleList):
    """Pre-norm attention and MLP (``layers.N.0`` and ``layers.N.1``)."""

    def __init__(self, dim, heads):
        super().__init__([nn.MultiheadAttention(dim, heads, batch_first=True),
                          nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                        nn.Linear(2 * dim, dim))])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        h = self.norm(x)
        x = x + self[0](h, h, h, need_weights=False)[0]
        return x + self[1](x)


class Encoder(nn.Module):
    """[N, C, H, W] -> tokens [N, (H/p)(W/p), dim] through a ViT with a frozen position table."""

    def __init__(self, image_size, channels, dim, depth, heads, patch):
        super().__init__()
        self.patch = patch
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(channels * patch * patch),
                                                nn.Linear(channels * patch * patch, dim))
        n = (image_size // patch) ** 2
        pos = th.arange(n)[:, None] / (10000 ** (th.arange(dim)[None] / dim))
        table = th.where(th.arange(dim)[None] % 2 == 0, th.sin(pos), th.cos(pos))
        self.pos_embedding = nn.Parameter(table[None].float(), requires_grad=False)  # frozen
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, x, emb):
        p = self.patch
        n, c, h, w = x.shape
        x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(
            n, (h // p) * (w // p), c * p * p)
        x = self.to_patch_embedding(x) + self.pos_embedding + emb[:, None]
        for block in self.transformer.layers:
            x = block(x)
        return x


class OwnModel(nn.Module):
    """The report's shape: timestep embedder, ViT encoder, BatchNorm conv decoder."""

    def __init__(self, image_size, dim, depth, heads, patch_size, out_channels, num_classes=None):
        super().__init__()
        self.patch, self.side = patch_size, image_size // patch_size
        self.t_embedder = TimestepEmbedder(dim)
        self.label_emb = nn.Embedding(num_classes, dim) if num_classes else None
        self.encoder = Encoder(image_size, 3, dim, depth, heads, patch_size)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 2, patch_size, stride=patch_size), nn.SiLU(),
            nn.BatchNorm2d(dim // 2), nn.Conv2d(dim // 2, out_channels, 3, padding=1))

    def forward(self, x, t, y=None):
        emb = self.t_embedder(t)
        if self.label_emb is not None:
            emb = emb + self.label_emb(y)
        tokens = self.encoder(x, emb)  # [N, side*side, dim]
        grid = tokens.transpose(1, 2).reshape(x.shape[0], -1, self.side, self.side)
        return self.decoder(grid)


def build(args):
    """Flags -> the model, diffusion and data of train.py's loop (collective: all ranks)."""
    args.num_classes = resolve_num_classes(args.data_dir, args.num_classes, log=logger.log)
    diffusion_flags = {k: getattr(args, k) for k in DIFFUSION_FLAGS}
    model_flags = dict(diffusion_flags, image_size=args.image_size, class_cond=args.class_cond,
                       num_classes=args.num_classes, **{k: getattr(args, k) for k in OWN_FLAGS})
    seed_rngs(args.seed, 0, 0)  # identical initial weights on every rank
    model = OwnModel(args.image_size, args.dim, args.depth, args.heads, args.patch_size,
                     out_channels=6 if args.learn_sigma else 3,
                     num_classes=args.num_classes if args.class_cond else None)
    model.to(dist_util.dev())
    diffusion = create_gaussian_diffusion(steps=args.diffusion_steps, **{
        k: diffusion_flags[k] for k in DIFFUSION_FLAGS if k != "diffusion_steps"})
    data = load_data(data_dir=args.data_dir, batch_size=args.batch_size,
                     image_size=args.image_size, class_cond=args.class_cond,
                     num_classes=args.num_classes if args.class_cond else None, seed=args.seed,
                     num_workers=args.num_workers)
    sampler = create_named_schedule_sampler(args.schedule_sampler, diffusion)
    return train_job.Parts(model, diffusion, data, model_flags, sampler)


def train(argv=None):
    defaults = dict(train_defaults(), **model_and_diffusion_defaults(), **OWN_FLAGS)
    parser = create_parser(__doc__, defaults, prog="own_model.py")
    args = parser.parse_args(argv)
    given = explicit_args(parser, argv)  # a resume takes the others from its checkpoint
    return train_job.run_training(args, build, given, check=train_job.check_train_args)


if __name__ == "__main__":
    cli.exit_process(cli.run_main(train))
