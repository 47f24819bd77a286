"""Run scripts/train.py with faults a test asks for through the environment.

Usage: python tests/fault_train.py [train.py flags...]

* ``FAULT_PID_DIR``: each rank writes its pid to ``{FAULT_PID_DIR}/rank{R}.pid`` once its process
  group is up (a test can then ``kill -9`` one rank, or check that every process is gone).
* ``FAULT_RANK``, ``FAULT_STEP``, ``FAULT_RAISE``: rank FAULT_RANK raises, at the start of the
  step after FAULT_STEP completed steps, ``KeyboardInterrupt`` (FAULT_RAISE=KeyboardInterrupt) or
  ``SystemExit(N)`` (FAULT_RAISE=SystemExit:N), as a Ctrl-C or a ``sys.exit`` on that rank would.

Nothing else about train.py changes (same flags, output and exit codes).
"""
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from improved_diffusion import dist_util, train_util  # noqa: E402

_setup_dist = dist_util.setup_dist


def _setup_and_record(*args, **kwargs):
    _setup_dist(*args, **kwargs)
    pid_dir = os.environ.get("FAULT_PID_DIR")
    if pid_dir:
        os.makedirs(pid_dir, exist_ok=True)
        path = os.path.join(pid_dir, f"rank{dist_util.get_rank()}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def _fault():
    kind = os.environ.get("FAULT_RAISE", "KeyboardInterrupt")
    if kind.startswith("SystemExit:"):
        return SystemExit(int(kind.split(":", 1)[1]))
    return KeyboardInterrupt()


_run_step = train_util.TrainLoop.run_step


def _run_step_with_fault(self, batch, cond):
    if ("FAULT_RANK" in os.environ and dist_util.get_rank() == int(os.environ["FAULT_RANK"])
            and self.step == int(os.environ.get("FAULT_STEP", "0"))):
        raise _fault()
    return _run_step(self, batch, cond)


dist_util.setup_dist = _setup_and_record
train_util.TrainLoop.run_step = _run_step_with_fault

if __name__ == "__main__":
    script = str(REPO / "scripts" / "train.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
