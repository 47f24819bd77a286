"""Run scripts/train.py with slow, two-part file writes, so that a test can kill it inside a save.

Usage: python tests/slow_save_train.py [train.py flags...]

The writer of a .pt file's bytes (`torch_zip.save`, the checkpoint writer's torch.save) is
replaced by a version that serialises to memory (torch.save), writes the first half of the bytes
to the target, flushes, sleeps SLOW_SAVE_S seconds (default 0.05), writes the rest, flushes and
sleeps again (with SLOW_SAVE_STEP=N set, only the files of step N). A SIGKILL during a save
then often finds a half-written temp file, or a step with
some of its files renamed into place and no manifest yet: the states a crash can leave behind.
Nothing else about train.py changes (same flags, output and exit code).
"""
import io
import os
import time

import torch
from train_driver import run_train_py  # tests/ (this script's folder)

from improved_diffusion.ckpt import torch_zip

PAUSE_S = float(os.environ.get("SLOW_SAVE_S", "0.05"))
ONLY_STEP = os.environ.get("SLOW_SAVE_STEP")  # every payload holds its "step"


def _slow_save(obj, f, *args, **kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    half = len(data) // 2
    own = isinstance(f, (str, bytes, os.PathLike))
    slow = ONLY_STEP is None or (isinstance(obj, dict) and str(obj.get("step")) == ONLY_STEP)
    pause_s = PAUSE_S if slow else 0.0
    fh = open(f, "wb") if own else f
    try:
        fh.write(data[:half])
        fh.flush()
        time.sleep(pause_s)
        fh.write(data[half:])
        fh.flush()
    finally:
        if own:
            fh.close()
    time.sleep(pause_s)


torch_zip.save = _slow_save

if __name__ == "__main__":
    run_train_py()
