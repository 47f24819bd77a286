"""Test helper: scripts/train.py whose model sleeps DELAY seconds in each eval-mode forward, so
that a --sample_interval grid (drawn from an eval-mode copy) is slow while training is not.

Usage: python tests/train_slow_grids.py DELAY [train.py flags...]   (under mpiexec too)
"""
import runpy
import sys
import time
from pathlib import Path

from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from improved_diffusion.infra import cli
from improved_diffusion import train_job  # noqa: E402


class SlowWhenSampling(nn.Module):
    def __init__(self, inner, delay):
        super().__init__()
        self.inner, self.delay = inner, delay

    def forward(self, x, t, **kwargs):
        if not self.training:
            time.sleep(self.delay)
        return self.inner(x, t, **kwargs)


def main(argv):
    delay, argv = float(argv[0]), argv[1:]
    train = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")
    args = train["create_argparser"]().parse_args(argv)
    train_job.check_train_args(args)

    def build(args):
        parts = train["build"](args)
        return parts._replace(model=SlowWhenSampling(parts.model, delay))

    return train_job.run_training(args, build)


if __name__ == "__main__":
    sys.exit(cli.run_main(main, sys.argv[1:]))
