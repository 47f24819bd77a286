"""Run scripts/train.py with faults a test asks for through the environment.

Usage: python tests/fault_train.py [train.py flags...]

* ``FAULT_PID_DIR``: each rank writes its pid to ``{FAULT_PID_DIR}/rank{R}.pid`` once its process
  group is up (a test can then ``kill -9`` one rank, or check that every process is gone).
* ``FAULT_RANK``, ``FAULT_STEP``, ``FAULT_RAISE``: rank FAULT_RANK raises, at the start of the
  step after FAULT_STEP completed steps, ``KeyboardInterrupt`` (FAULT_RAISE=KeyboardInterrupt) or
  ``SystemExit(N)`` (FAULT_RAISE=SystemExit:N), as a Ctrl-C or a ``sys.exit`` on that rank would,
  or is killed there by SIGKILL (FAULT_RAISE=SIGKILL), as ``kill -9`` would (once its --tracker
  threads sent all they were given: what they hold back is all that is not sent), or sends
  itself a SIGTERM there and trains on (FAULT_RAISE=SIGTERM), as a preemption notice would.
* ``FAULT_LATE_RANK``, ``FAULT_LATE_S``: that rank (its launcher's rank variable) sleeps
  FAULT_LATE_S seconds before the rendezvous (under mpiexec: after MPI_Init), so the others
  wait in it. Every rank prints ``FAULT: rank R enters the rendezvous`` as it does.
* ``FAULT_SLOW_LOAD_S``: each checkpoint load (checkpoint.load_file_collective) first prints
  ``FAULT: loading NAME`` (rank 0) and sleeps that long on every rank (on rank
  ``FAULT_SLOW_LOAD_RANK`` alone when set: the others wait for it in a collective), as a slow
  disk would.
* ``FAULT_HARD_EXIT_S``: preemption.HARD_EXIT_S (how long a rank stuck before training has
  after a signal before it is ended), shorter for a test.
* ``FAULT_EIO_READ=NAME``: on every rank, reading a file called NAME fails with a real
  ``OSError(EIO)``, as a failing disk's read does, except inside ``run_dir.plan_resume`` (rank 0's
  plan, which verifies the step's checksums): so the fault hits when the file is loaded, after the
  plan chose and verified it. The open succeeds; every read of the file (``open(NAME, "rb")``,
  ``io.open``, ``io.FileIO``, which blobfile uses) fails. The first injected fault prints
  ``fault_train: EIO reading NAME`` on stderr.

Nothing else about train.py changes (same flags, output and exit codes).
"""
import builtins
import errno
import io
import os
import signal
import sys
import time

from train_driver import run_train_py  # tests/ (this script's folder); makes the repo importable

from improved_diffusion import dist_util, logger, train_util  # noqa: E402
from improved_diffusion.ckpt import checkpoint, run_dir
from improved_diffusion.infra import preemption  # noqa: E402

if os.environ.get("FAULT_HARD_EXIT_S"):
    preemption.HARD_EXIT_S = float(os.environ["FAULT_HARD_EXIT_S"])

_setup_dist = dist_util.setup_dist


def _setup_and_record(*args, **kwargs):
    late = os.environ.get("FAULT_LATE_RANK")
    rank = logger.get_rank_without_dist()
    if late is not None and rank == int(late):
        if "PMI_RANK" in os.environ:  # MPI_Init first (the others wait in it, holding their
            from mpi4py import MPI  # noqa: F401  interpreter): they wait in the rendezvous
        time.sleep(float(os.environ.get("FAULT_LATE_S", "60")))
    print(f"FAULT: rank {rank} enters the rendezvous", flush=True)
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
        if os.environ.get("FAULT_RAISE") == "SIGKILL":
            deadline = time.time() + 120
            while (self.outputs.trackers is not None and time.time() < deadline
                   and not all(b.drained for b in self.outputs.trackers.backends)):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("FAULT_RAISE") == "SIGTERM":  # a real SIGTERM; the step goes on
            os.kill(os.getpid(), signal.SIGTERM)
            return _run_step(self, batch, cond)
        raise _fault()
    return _run_step(self, batch, cond)


_load = checkpoint.load_file_collective


def _slow_load(path, *args, **kwargs):
    if dist_util.get_rank() == 0:
        print(f"FAULT: loading {os.path.basename(os.fspath(path))}", flush=True)
    only = os.environ.get("FAULT_SLOW_LOAD_RANK")
    if only is None or dist_util.get_rank() == int(only):
        time.sleep(float(os.environ["FAULT_SLOW_LOAD_S"]))
    return _load(path, *args, **kwargs)


dist_util.setup_dist = _setup_and_record
train_util.TrainLoop.run_step = _run_step_with_fault
if os.environ.get("FAULT_SLOW_LOAD_S"):
    checkpoint.load_file_collective = _slow_load

EIO_NAME = os.environ.get("FAULT_EIO_READ")
_in_plan = []
_real_file_io, _real_open, _real_plan_resume = io.FileIO, builtins.open, run_dir.plan_resume


def _faulty(path):
    return (EIO_NAME is not None and not _in_plan and not isinstance(path, int)
            and os.path.basename(os.fspath(path)) == EIO_NAME)


class _FaultyFileIO(_real_file_io):
    """A file whose reads fail with EIO while the fault is armed (outside the plan)."""

    told = False  # the first fault is printed

    def _fail(self):
        if _faulty(self.name):
            if not _FaultyFileIO.told:
                _FaultyFileIO.told = True
                print(f"fault_train: EIO reading {EIO_NAME}", file=sys.stderr, flush=True)
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.name)

    def read(self, *args):
        self._fail()
        return super().read(*args)

    def readall(self):
        self._fail()
        return super().readall()

    def readinto(self, b):
        self._fail()
        return super().readinto(b)


def _open(file, mode="r", buffering=-1, *args, **kwargs):
    if not _faulty(file) or mode not in ("rb", "br"):
        return _real_open(file, mode, buffering, *args, **kwargs)
    raw = _FaultyFileIO(file, "r")
    return raw if buffering == 0 else io.BufferedReader(raw)


def _plan_resume(*args, **kwargs):
    _in_plan.append(True)
    try:
        return _real_plan_resume(*args, **kwargs)
    finally:
        _in_plan.pop()


if EIO_NAME:
    io.FileIO = _FaultyFileIO
    builtins.open = io.open = _open
    run_dir.plan_resume = _plan_resume

if __name__ == "__main__":
    run_train_py()
