"""Run scripts/train.py with NaN injected at chosen steps, so that a test can try --nan_policy.

Usage: python tests/nan_train.py [train.py flags...]   (also under mpiexec)

Environment:
  NAN_LOSS_STEPS=3,4   the batch of these steps (1-based: the step being taken) is all NaN, so
                       this rank's loss and gradients are NaN (a corrupt image does the same)
  NAN_EMA_AFTER_STEP=k after step k, the first tensor of the first EMA is set to NaN
  NAN_RANKS=1          the ranks that do either (default: every rank)
  CPU_BF16=0|1         --use_fp16's branch on the CPU, forced (tests/amp_train.py)

Nothing else about train.py changes (same flags, output and exit code).
"""
import os

import torch

import amp_train  # tests/ (this script's folder), as train_driver, which makes the repo importable
from train_driver import run_train_py

from improved_diffusion import train_util  # noqa: E402


def _ints(name):
    return {int(x) for x in os.environ.get(name, "").split(",") if x.strip()}


LOSS_STEPS = _ints("NAN_LOSS_STEPS")
EMA_AFTER = _ints("NAN_EMA_AFTER_STEP")
RANKS = _ints("NAN_RANKS")
_run_step = train_util.TrainLoop.run_step


def run_step(self, batch, cond):
    here = not RANKS or self.rank in RANKS
    if here and self.step + 1 in LOSS_STEPS:
        batch = torch.full_like(batch, float("nan"))
    _run_step(self, batch, cond)
    if here and self.step in EMA_AFTER:
        with torch.no_grad():
            self.ema_params[0][0].fill_(float("nan"))


train_util.TrainLoop.run_step = run_step

if __name__ == "__main__":
    amp_train.force_cpu_bf16_from_env()
    run_train_py()
