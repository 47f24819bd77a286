r"""Your own training loop (own model, loss and optimizer; no TrainLoop) on the checkpointer.

    mpiexec -n 2 python examples/own_loop.py --data_dir D --log_dir L --max_steps 200 \
        --save_interval 50 [--resume_checkpoint auto|L/model000100.pt] [--async_save False]

What the loop gets from the checkpointer alone (the lines marked checkpointer), as train.py does:
auto-resume of the newest complete step of --log_dir, saves every --save_interval steps (in the
background unless --async_save False; the manifest last), SIGTERM/SIGUSR1 -> a save and exit 75,
one job per log dir (--lock_wait), a resume bitwise equal to a straight run (on 3+ ranks prime DDP
as TrainLoop._prime_ddp_buckets does). With --global_batch_size G --microbatch m instead of
--batch_size (the lines marked shards) the run is the same on any rank count dividing G/m, bit
for bit (improved_diffusion/virtual_shards.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch as th  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, logger, train_job, virtual_shards  # noqa: E402
from improved_diffusion.ckpt.checkpointer import (  # noqa: E402
    PREEMPTED_EXIT_CODE, CheckpointConfig, Checkpointer)
from improved_diffusion.image_datasets import load_data  # noqa: E402
from improved_diffusion.ckpt.rng import seed_rngs  # noqa: E402
from improved_diffusion.script_util import train_defaults  # noqa: E402
from improved_diffusion.infra.flags import create_parser  # noqa: E402

FLAGS = ("data_dir", "log_dir", "batch_size", "lr", "max_steps", "save_interval", "log_interval",
         "keep_checkpoints", "async_save", "save_writer", "resume_checkpoint", "seed", "lock_wait",
         "dist_timeout", "global_batch_size", "microbatch")


class Denoiser(nn.Module):
    """Predicts the noise of x_t = sqrt(1 - t) x + sqrt(t) noise, t in (0, 1)."""

    def __init__(self, ch=32):
        super().__init__()
        self.inp, self.body = nn.Conv2d(4, ch, 3, padding=1), nn.Sequential(
            nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x, t):
        return self.body(self.inp(th.cat([x, t[:, None, None, None].expand_as(x[:, :1])], 1)))


def train(argv=None):
    defaults = {k: train_defaults()[k] for k in FLAGS}
    args = create_parser(__doc__, dict(defaults, image_size=8), "own_loop.py").parse_args(argv)
    virtual_shards.resolve_batch_flags(args)  # --- shards: --batch_size = G / ranks
    lock = train_job.start_job(args)  # the process group, the log dir's lock, the logger
    try:
        seed_rngs(args.seed)  # the same initial weights on every rank
        model = Denoiser().to(device := dist_util.dev())
        shards = virtual_shards.from_flags(args, model)  # --- shards: None without G

        def backward(x, _=None):  # x's loss per sample ({"loss": [n]}), after its backward
            t = th.rand(x.shape[0], device=device) * 0.98 + 0.01
            noise, t4, x = th.randn_like(x, device=device), t[:, None, None, None], x.to(device)
            loss = ((net((1 - t4).sqrt() * x + t4.sqrt() * noise, t) - noise) ** 2).mean((1, 2, 3))
            loss.mean().backward()
            return {"loss": loss.detach()}
        opt = th.optim.AdamW(model.parameters(), lr=args.lr)
        data = load_data(data_dir=args.data_dir, batch_size=args.batch_size,
                         image_size=args.image_size, seed=args.seed, num_workers=0)
        seed_rngs(args.seed, 0, dist_util.get_rank())  # each rank its own noise
        # --- checkpointer: resume (a fresh start returns 0); on leaving, the last save is waited
        with Checkpointer(CheckpointConfig.from_flags(args), model=model, optimizer=opt,
                          data=data, batch_size=args.batch_size, seed=args.seed,
                          states={shards.name: shards} if shards else {}) as ckpt:
            step, preempted = ckpt.resume(), False
            net = DDP(model) if dist_util.get_world_size() > 1 and not shards else model
            batches = iter(data)
            logger.start_progress(step, args.max_steps)
            with ckpt.watch_signals():  # --- checkpointer: SIGTERM/SIGUSR1 -> save, exit 75
                while step < args.max_steps and not preempted:
                    ckpt.step_begins()  # --- checkpointer: the ranks' flags travel meanwhile
                    x, _ = next(batches)
                    opt.zero_grad(set_to_none=True)
                    out = shards.step(step + 1, x, {}, backward) if shards else backward(x)
                    opt.step()
                    step += 1
                    logger.logkv_mean("loss", out["loss"].mean().item())  # --- shards: all G
                    if step % args.log_interval == 0:
                        logger.logkv("step", step)
                        logger.dumpkvs()  # "step 20/200  loss 0.41  3.1 steps/s ..."
                    preempted = ckpt.step_ends(step)  # --- checkpointer: saves; True: preempted
            if not preempted:
                ckpt.save(step, wait=True)  # --- checkpointer: the final step, complete on disk
        del net  # the DDP wrapper, before the process group goes
        dist_util.cleanup()
        return PREEMPTED_EXIT_CODE if preempted else 0
    finally:
        lock.release()


if __name__ == "__main__":
    cli.exit_process(cli.run_main(train))
