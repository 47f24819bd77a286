"""Run scripts/train.py with NaN injected at chosen steps, so that a test can try --nan_policy.

Usage: python tests/nan_train.py [train.py flags...]   (also under mpiexec)

Environment:
  NAN_LOSS_STEPS=3,4   the batch of these steps (1-based: the step being taken) is all NaN, so
                       this rank's loss and gradients are NaN (a corrupt image does the same)
  NAN_EMA_AFTER_STEP=k after step k, the first tensor of the first EMA is set to NaN
  NAN_GRAD_STEPS=3     after the backward of these steps, one value of this rank's own slice
                       of a gradient is NaN (--fsdp True: the other ranks' slices stay finite)
  INF_GRAD_STEPS=4     the same with +Inf (the grad norm is then inf, which large finite
                       gradients can give too: the slices are looked at, fsdp.any_non_finite)
  NAN_RANKS=1          the ranks that do either (default: every rank)
  CPU_BF16=0|1         --use_fp16's branch on the CPU, forced (tests/amp_train.py)

Nothing else about train.py changes (same flags, output and exit code).
"""
import os

import torch

import amp_train  # tests/ (this script's folder), as train_driver, which makes the repo importable
from train_driver import run_train_py

from improved_diffusion.infra import fsdp
from improved_diffusion import train_util  # noqa: E402


def _ints(name):
    return {int(x) for x in os.environ.get(name, "").split(",") if x.strip()}


LOSS_STEPS = _ints("NAN_LOSS_STEPS")
EMA_AFTER = _ints("NAN_EMA_AFTER_STEP")
RANKS = _ints("NAN_RANKS")
GRAD_STEPS = {s: float("nan") for s in _ints("NAN_GRAD_STEPS")}
GRAD_STEPS.update({s: float("inf") for s in _ints("INF_GRAD_STEPS")})
_run_step = train_util.TrainLoop.run_step
_forward_backward = train_util.TrainLoop.forward_backward


def run_step(self, batch, cond):
    here = not RANKS or self.rank in RANKS
    if here and self.step + 1 in LOSS_STEPS:
        batch = torch.full_like(batch, float("nan"))
    _run_step(self, batch, cond)
    if here and self.step in EMA_AFTER:
        with torch.no_grad():
            self.ema_params[0][0].fill_(float("nan"))


def forward_backward(self, batch, cond):
    _forward_backward(self, batch, cond)
    if (not RANKS or self.rank in RANKS) and self.step + 1 in GRAD_STEPS:
        grad = next(fsdp.local(p.grad) for p in self.model.parameters()
                    if p.grad is not None and fsdp.local(p.grad).numel())
        with torch.no_grad():
            grad.view(-1)[0] = GRAD_STEPS[self.step + 1]


train_util.TrainLoop.run_step = run_step
train_util.TrainLoop.forward_backward = forward_backward

if __name__ == "__main__":
    amp_train.force_cpu_bf16_from_env()
    run_train_py()
