r"""Your own training loop (own model, loss and optimizer; no TrainLoop) on the checkpointer.

    mpiexec -n 2 python examples/own_loop.py --data_dir D --log_dir L --max_steps 200 \
        --save_interval 50 [--resume_checkpoint auto|L/model000100.pt] [--async_save False]

What the loop gets from improved_diffusion's checkpointer alone, as train.py does: auto-resume of
the newest complete step of --log_dir (run the same command again), a save every --save_interval
steps (in the background unless --async_save False; model, opt and manifest written last),
SIGTERM/SIGUSR1 -> a save, then exit 75 (requeue on it), one job per log dir (--lock_wait), and a
resume bitwise equal to a straight run: the checkpointer restores the optimizer, the data position
and every rank's RNG. The lines between "checkpointer" marks are all it takes. (On 3+ ranks DDP's
first step after a start sums gradients in another bucket order than later steps: prime it as
train_util.TrainLoop._prime_ddp_buckets does, for bitwise equality to the last bit.)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch as th  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from improved_diffusion import cli, dist_util, logger, train_job  # noqa: E402
from improved_diffusion.ckpt.checkpointer import (  # noqa: E402
    PREEMPTED_EXIT_CODE, CheckpointConfig, Checkpointer)
from improved_diffusion.image_datasets import load_data  # noqa: E402
from improved_diffusion.ckpt.rng import seed_rngs  # noqa: E402
from improved_diffusion.script_util import train_defaults  # noqa: E402
from improved_diffusion.flags import create_parser  # noqa: E402

FLAGS = ("data_dir", "log_dir", "batch_size", "lr", "max_steps", "save_interval", "log_interval",
         "keep_checkpoints", "async_save", "save_writer", "resume_checkpoint", "seed", "lock_wait",
         "dist_timeout")


class Denoiser(nn.Module):
    """Predicts the noise of x_t = sqrt(1 - t) x + sqrt(t) noise, t in (0, 1)."""

    def __init__(self, ch=32):
        super().__init__()
        self.inp = nn.Conv2d(4, ch, 3, padding=1)
        self.body = nn.Sequential(nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(),
                                  nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x, t):
        return self.body(self.inp(th.cat([x, t[:, None, None, None].expand_as(x[:, :1])], 1)))


def train(argv=None):
    defaults = {k: train_defaults()[k] for k in FLAGS}
    args = create_parser(__doc__, dict(defaults, image_size=8), "own_loop.py").parse_args(argv)
    lock = train_job.start_job(args)  # the process group, the log dir's lock, the logger
    try:
        seed_rngs(args.seed)  # the same initial weights on every rank
        device, rank = dist_util.dev(), dist_util.get_rank()
        model = Denoiser().to(device)
        opt = th.optim.AdamW(model.parameters(), lr=args.lr)
        data = load_data(data_dir=args.data_dir, batch_size=args.batch_size,
                         image_size=args.image_size, seed=args.seed, num_workers=0)
        seed_rngs(args.seed, 0, rank)  # each rank its own noise
        # --- checkpointer: resume (a fresh start returns 0); on leaving, the last save is waited
        with Checkpointer(CheckpointConfig.from_flags(args), model=model, optimizer=opt,
                          data=data, batch_size=args.batch_size, seed=args.seed) as ckpt:
            step, preempted = ckpt.resume(), False
            net = DDP(model) if dist_util.get_world_size() > 1 else model
            batches = iter(data)
            logger.start_progress(step, args.max_steps)
            with ckpt.watch_signals():  # --- checkpointer: SIGTERM/SIGUSR1 -> save, exit 75
                while step < args.max_steps and not preempted:
                    ckpt.step_begins()  # --- checkpointer: the ranks' flags travel meanwhile
                    x, _ = next(batches)
                    x, t = x.to(device), th.rand(x.shape[0], device=device) * 0.98 + 0.01
                    noise = th.randn_like(x)
                    a, b = (1 - t).sqrt()[:, None, None, None], t.sqrt()[:, None, None, None]
                    loss = ((net(a * x + b * noise, t) - noise) ** 2).mean()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    step += 1
                    logger.logkv_mean("loss", loss.item())
                    if step % args.log_interval == 0:
                        logger.logkv("step", step)
                        logger.dumpkvs()  # "step 20/200  loss 0.41  3.1 steps/s ..."
                    preempted = ckpt.step_ends(step)  # --- checkpointer: saves; True: preempted
            if not preempted:
                ckpt.save(step, wait=True)  # --- checkpointer: the final step, complete on disk
        del net  # before the process group goes (a live DDP wrapper can abort the exit)
        dist_util.cleanup()
        return PREEMPTED_EXIT_CODE if preempted else 0
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(cli.run_main(train))
