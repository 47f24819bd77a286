"""tests/slow_save_train.py (slow two-part writes) with some of the guards that end the writer
process with its trainer turned off inside that writer process, so that a test checks each guard
alone (improved_diffusion/ckpt/writer_process.py's module docstring).

Usage: WRITER_GUARDS_OFF=pdeathsig,watch,guard python tests/writer_mechanisms_train.py [flags...]

The writer process runs this script at its start under the name ``__mp_main__`` (writer_process's
_importable_main, as spawn would), after writer_process set its guards up; there:
  pdeathsig  clears PR_SET_PDEATHSIG (the kernel's SIGKILL as the trainer ends)
  watch      stops the poll of the parent pid (its thread sleeps from its next round on)
  guard      makes the check before each file is put in place (and before pruning) do nothing
The job's lock descriptor that the writer holds a copy of is the fourth mechanism: no switch
(the test removes it by breaking writer_process). In the trainer this is slow_save_train.py.
"""
import ctypes
import os

import slow_save_train  # noqa: F401 (its slow writes, in the trainer and in the writer)
from train_driver import run_train_py  # tests/ (this script's folder)

from improved_diffusion.ckpt import writer_process

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _guards_off():
    """In the writer process: turn off the guards that WRITER_GUARDS_OFF names; their names."""
    off = {n for n in os.environ.get("WRITER_GUARDS_OFF", "").split(",") if n}
    if __name__ != "__mp_main__":
        return off
    if "pdeathsig" in off:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    if "watch" in off:
        writer_process.WATCH_S = 1e9
    if "guard" in off:
        writer_process.PublishGuard.check_dir = lambda self, directory: None
    return off


OFF = _guards_off()

if __name__ == "__main__":
    run_train_py()
