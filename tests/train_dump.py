"""Test helper: run scripts/train.py's loop and dump each rank's training state to files.

Usage: python tests/train_dump.py DUMP_DIR [train.py flags...]   (under mpiexec or torchrun too)

Writes, per rank r:
  DUMP_DIR/loaded_rank{r}.pt  right after TrainLoop was built (i.e. after the resume), and
  DUMP_DIR/final_rank{r}.pt   after run_loop(),
each {"step", "optimizer" (named-v1 state), "model" (state dict), "ema" ([[tensor]] per rate)}.
Then exits with run_loop()'s code. The test compares the dumps across ranks and with the files.
"""
import os
import runpy
import sys
from pathlib import Path

import torch as th

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from improved_diffusion import dist_util, train_job  # noqa: E402
from improved_diffusion.ckpt import optim_state  # noqa: E402


def dump(loop, path):
    th.save(
        {
            "step": loop.step,
            "optimizer": optim_state.named_optimizer_state(loop.opt, loop.named_params),
            "model": {k: v.detach().cpu().clone() for k, v in loop.model.state_dict().items()},
            "ema": [[p.detach().cpu().clone() for p in params] for params in loop.ema_params],
        },
        path,
    )


def run_job(dump_dir, argv, prefix="", after_load=None):
    """One train.py job with the dumps (files named {prefix}loaded_rank{r}.pt ...); after_load(loop,
    rank), if given, runs right after the first dump. Leaves the process group up."""
    train = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")
    args = train["create_argparser"]().parse_args([str(a) for a in argv])
    train_job.check_train_args(args)
    lock = train_job.start_job(args)
    try:
        loop = train_job.make_loop(args, train["build"](args))
        rank = dist_util.get_rank()
        dump(loop, os.path.join(dump_dir, f"{prefix}loaded_rank{rank}.pt"))
        if after_load is not None:
            after_load(loop, rank)
        code = loop.run_loop()
        loop.close()
        dump(loop, os.path.join(dump_dir, f"{prefix}final_rank{rank}.pt"))
    finally:
        lock.release()
    return code


def main():
    dump_dir, argv = sys.argv[1], sys.argv[2:]
    os.makedirs(dump_dir, exist_ok=True)
    code = run_job(dump_dir, argv)
    dist_util.cleanup()
    return code


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(main())
