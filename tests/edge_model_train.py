r"""train.py's machinery (train_job) with a model of one's own that has the edges users' models
have (issue 29, items 2, 4 and 15): two layers sharing one weight (``self.b.weight =
self.a.weight``), a parameter left out of the loss on some steps and ranks (``rare``: used only
when the batch's first timestep is even), and BatchNorm buffers.

    mpiexec -n 2 python tests/edge_model_train.py --data_dir D --log_dir L [train.py's flags]
        [--parts_find_unused True]   # ask through train_job.Parts instead of the flag
        [--edge_rare False]          # ``rare`` never used (FSDP2 needs every rank alike)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion.infra import preemption  # noqa: E402

preemption.install()

import torch as th  # noqa: E402
from torch import nn  # noqa: E402

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, train_job  # noqa: E402
from improved_diffusion.image_datasets import load_data  # noqa: E402
from improved_diffusion.ckpt.rng import seed_rngs  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    create_gaussian_diffusion,
    model_and_diffusion_defaults,
    train_defaults,
)
from improved_diffusion.infra.flags import create_parser  # noqa: E402


class EdgeModel(nn.Module):
    def __init__(self, steps, width=16, rare=True):
        super().__init__()
        self.use_rare = rare
        self.inp = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.emb = nn.Embedding(steps, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight  # tied: one parameter, two state-dict names
        self.rare = nn.Linear(width, width)
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, x, t, y=None):
        h = self.norm(self.inp(x))
        e = self.emb(t)
        if self.use_rare and int(t[0]) % 2 == 0:
            e = e + self.rare(e)
        h = h + (self.a(e) + self.b(e.flip(-1)))[:, :, None, None]
        return self.out(nn.functional.silu(h))


def build(args):
    flags = dict(image_size=args.image_size, diffusion_steps=args.diffusion_steps,
                 noise_schedule=args.noise_schedule)
    seed_rngs(args.seed, 0, 0)
    model = EdgeModel(args.diffusion_steps, rare=args.edge_rare).to(dist_util.dev())
    diffusion = create_gaussian_diffusion(steps=args.diffusion_steps,
                                          noise_schedule=args.noise_schedule)
    data = load_data(data_dir=args.data_dir, batch_size=args.batch_size,
                     image_size=args.image_size, seed=args.seed, num_workers=args.num_workers)
    return train_job.Parts(model, diffusion, data, flags,
                           find_unused_parameters=True if args.parts_find_unused else None)


def train(argv=None):
    defaults = dict(train_defaults(), **model_and_diffusion_defaults(), parts_find_unused=False,
                    edge_rare=True)
    args = create_parser(__doc__, defaults, prog="edge_model_train.py").parse_args(argv)
    train_job.check_train_args(args)
    return train_job.run_training(args, build)


if __name__ == "__main__":
    cli.exit_process(cli.run_main(train))
