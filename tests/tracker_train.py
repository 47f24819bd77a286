"""Run scripts/train.py with the --tracker faults a test asks for through the environment.

Usage: python tests/tracker_train.py [train.py flags...]

* ``TRACKER_KILL_AFTER=NAME:WHAT:STEP`` (WHAT: row or image): the process is killed by SIGKILL,
  as ``kill -9`` would, in tracker NAME's thread as soon as its call that sent the row (or the
  grid) of step STEP to the tracker returned: between a send and the tracker's record of it in
  LOG_DIR/trackers/NAME.json. Prints ``FAULT: killed after NAME's WHAT of step STEP`` first.
* ``TRACKER_NOT_INSTALLED=a,b``: the modules a and b are not installed for this process
  (``import a`` fails, ``importlib.util.find_spec("a")`` is None), as in an environment that
  never had them.
* ``TRACKER_SETTLE=1``: the job's first training step starts once every tracker has opened its
  run and sent what the job started with, or failed (so a tracker that fails at its start has
  failed before the job's first row and save).

Nothing else about train.py changes (same flags, output and exit codes).
"""
import os
import signal
import sys
import time

for _name in filter(None, os.environ.get("TRACKER_NOT_INSTALLED", "").split(",")):
    sys.modules[_name] = None  # before anything imports them

from train_driver import run_train_py  # noqa: E402  tests/ (this script's folder)

from improved_diffusion import train_util, trackers  # noqa: E402

_KILL = os.environ.get("TRACKER_KILL_AFTER")
if _KILL:
    _name, _what, _at = _KILL.split(":")
    _cls = {"mlflow": trackers.MlflowTracker, "wandb": trackers.WandbTracker}[_name]
    _method = {"row": "log", "image": "image"}[_what]
    _real = getattr(_cls, _method)

    def _sent_then_killed(self, step, *args, **kwargs):
        out = _real(self, step, *args, **kwargs)
        if step == int(_at):
            print(f"FAULT: killed after {_name}'s {_what} of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(_cls, _method, _sent_then_killed)

if os.environ.get("TRACKER_SETTLE"):
    _run_step, _settled = train_util.TrainLoop.run_step, []

    def _run_step_settled(self, batch, cond):
        trackers_ = self.outputs.trackers
        deadline = time.time() + 120
        while (not _settled and trackers_ is not None and time.time() < deadline
               and not all(b.drained for b in trackers_.backends)):
            time.sleep(0.05)
        _settled.append(True)
        return _run_step(self, batch, cond)

    train_util.TrainLoop.run_step = _run_step_settled

if __name__ == "__main__":
    run_train_py()
