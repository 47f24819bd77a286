"""SIGTERM / SIGUSR1 from a job's first line to its last: the one owner of the process's handlers.

A training script calls ``install()`` on its first lines, before importing torch, so that a
preemption signal at any later moment is caught (before that, Python's own start-up, a signal
still ends the process as it would). The job then goes through three phases:

* **starting** (from ``install()`` until the loop runs: imports, the rendezvous, the wait for
  the log dir's lock, the model and data, the resume): a signal is only recorded. At each
  ``check()`` (a collective at the points where train_job changes phase or waits: after the
  rendezvous, once a second while waiting for the lock, after the model and data, after the
  resume) every rank learns whether any rank got one, and if so every rank raises
  ``Preempted`` there; ``cli.run_main`` ends the job with exit ``EXIT_CODE`` (75) and the one
  line ``BEFORE_TRAINING`` (printed once), leaving the log dir as it was (the resume only reads;
  the lock is released). A rank blocked in a call that does not return meanwhile (a rendezvous
  waiting for a rank that does not come, a collective with a rank that left, a long read) is
  ended by a watcher thread ``HARD_EXIT_S`` seconds after the signal: the same line, exit 75, at
  once (``os._exit``: nothing is written; the log dir's lock is released first).
* **training** (``Checkpointer.watch_signals``, through ``training()``): a signal sets the flag
  that the loop reads at a step boundary (all ranks agree, a complete save, then 75). Later
  signals only set it again, so a second signal during the preemption save does not cut it
  short.
* **finishing** (after the loop: closing, taking down the process group, releasing the lock):
  signals are recorded and ignored; the job ends with the loop's exit code.

What the launchers do with it: ``mpiexec`` (MPICH's hydra) forwards SIGTERM and SIGUSR1 to every
rank, and exits with the ranks' code: 75, also when one rank exits 75 and hydra ends the others.
``torchrun`` forwards a signal it gets to its workers (each exits 75) but exits 1 itself; a
worker that exits alone makes it stop the other workers (with SIGTERM) and, while
``--max_restarts`` allows, start them again.

Data-loading worker processes (``--num_workers``) ignore both signals (``starting_workers`` and
``ignore_in_worker``, which image_datasets' loader uses): the ranks' launchers and a cluster's
SIGTERM to every process of a job reach them too, and a worker that died of it would end the job
with an error before the main process saved.

Without ``install()`` (a user's own loop on the checkpointer, examples/own_loop.py, or a TrainLoop
in a user's process), ``training()`` installs the flag handlers for the loop alone and restores
the previous ones after it: such a loop is preemptible inside its ``watch_signals`` block.

This module imports nothing heavy at import time (no torch), so that scripts can install it first.
"""
import atexit
import contextlib
import os
import select
import signal
import sys
import threading
import time

# EX_TEMPFAIL: "try again later". A job script can requeue on it.
EXIT_CODE = 75
SIGNALS = ("SIGTERM", "SIGUSR1")
BEFORE_TRAINING = "preempted before training started; nothing new to save"
# Seconds from a signal in the starting phase to the watcher's hard exit, for a rank whose main
# thread has not reached a check() by then. Well inside a scheduler's grace period (SLURM's
# KillWait is often 30 s) and longer than a check's usual distance (a second while waiting for
# the lock, the time to build the model or read a checkpoint).
HARD_EXIT_S = 10.0

STARTING, TRAINING, ENDING, FINISHING = "starting", "training", "ending", "finishing"


class Preempted(BaseException):
    """Raised by check() on every rank when some rank got a preemption signal before training.

    A BaseException (like KeyboardInterrupt): no ``except Exception`` on the way takes it for an
    error; cli.run_main turns it into exit 75 and one line.
    """


class _State:
    def __init__(self):
        self.flag = {"set": False, "signal": None}  # the loop reads it (Checkpointer.watch_signals)
        self.phase = STARTING
        self.installed = False
        self.deadline = None  # watcher: when to end a rank still starting, after a signal
        self.wake = None  # the write end of the watcher's pipe (the signal wakeup fd)
        self.lock = threading.Lock()


_state = _State()


def _handler(signum, frame):
    """Record the signal; never raises (the main thread may be anywhere)."""
    _state.flag["set"] = True
    _state.flag["signal"] = signal.Signals(signum).name


def _signals():
    return [getattr(signal, name) for name in SIGNALS if hasattr(signal, name)]


def install():
    """Own SIGTERM/SIGUSR1 for this whole process (idempotent): record them, and start the
    watcher thread that ends a rank stuck before training (module docstring). Call from the main
    thread, as early as possible (first lines of a script). Not collective."""
    if _state.installed:
        return
    for sig in _signals():
        signal.signal(sig, _handler)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    os.set_inheritable(read_fd, False)
    os.set_inheritable(write_fd, False)
    # The C-level handler writes the signal's number here even while the main thread is blocked
    # in a call that does not return (Python runs _handler only once it does).
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _state.wake = write_fd
    _state.installed = True
    threading.Thread(target=_watch, args=(read_fd,), name="preemption-watcher",
                     daemon=True).start()
    os.register_at_fork(after_in_child=_forget_in_child)
    # Registered first, so it runs last: Python's own shutdown restores the default handlers,
    # and a signal in the process's last moments would turn its exit code into -15.
    atexit.register(_ignore_from_now_on)


def _ignore_from_now_on():
    for sig in _signals():
        signal.signal(sig, signal.SIG_IGN)


def _forget_in_child():
    """A forked child (a data loader worker) must not wake its parent's watcher."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one
        pass


# --------------------------------------------------------------------------------------------
# data-loading worker processes


@contextlib.contextmanager
def starting_workers():
    """
    Wrap the start of worker processes (a DataLoader's ``iter()``): the preemption signals are
    blocked in this thread meanwhile, so that each worker starts with them blocked (a fork copies
    the thread's mask, an exec keeps it) until its init calls ``ignore_in_worker()``; no window
    is left in which a signal ends a worker. A signal that reaches this process meanwhile is
    pending and is handled when the block ends, as it would have been. Not collective.
    """
    sigs = set(_signals())
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask on this platform
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_in_worker():
    """
    In a data-loading worker process (its ``worker_init_fn``): ignore the preemption signals,
    then unblock them (``starting_workers``). The main process owns them: a cluster sends
    SIGTERM to every process of a job (SLURM), mpiexec's and torchrun's ranks pass it on to
    their process groups, and a worker that died of it would take the job down with
    ``DataLoader worker ... is killed by signal`` before the main process could save. A worker
    ends when its main process closes the loader, or within seconds of that process's death
    (the DataLoader's own watchdog). Not collective.
    """
    sigs = _signals()
    for sig in sigs:
        signal.signal(sig, signal.SIG_IGN)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(sigs))
    except (AttributeError, OSError, ValueError):
        pass


def installed():
    return _state.installed


def signalled():
    """The name of the preemption signal this process got ("SIGTERM", ...), or None."""
    return _state.flag["signal"] if _state.flag["set"] else None


def phase():
    return _state.phase


def before_training():
    """Whether a signal now would end the job with nothing to save (the starting phase)."""
    return _state.phase in (STARTING, ENDING)


def check():
    """
    Raise ``Preempted`` on every rank if any rank got a preemption signal in the starting phase;
    else return. A no-op once training runs.

    Collective: call from all ranks with the same arguments.
    """
    if _state.phase != STARTING:
        return
    from .. import dist_util  # here: this module is imported before torch

    if dist_util.any_rank(_state.flag["set"]):
        ending()  # from here the main thread ends the job itself
        raise Preempted(BEFORE_TRAINING)


def ending():
    """The main thread now ends the job by itself (cli.run_main after ``Preempted``): the
    watcher stands down, since that ending is bounded on its own. Not collective."""
    with _state.lock:
        if _state.phase == STARTING:
            _state.phase = ENDING
        _state.deadline = None


@contextlib.contextmanager
def training():
    """
    The training phase, for the duration of the ``with``: yields the flag dict
    ``{"set": bool, "signal": name or None}`` that the loop reads at each step boundary. After
    ``install()`` the flag is the process's (a signal that came since the last check() counts)
    and the finishing phase follows; without it, handlers are installed for the ``with`` alone
    on a fresh flag and the previous ones restored after it. Not collective.
    """
    if not _state.installed:
        with _temporary_handlers() as flag:
            yield flag
        return
    with _state.lock:
        _state.phase, _state.deadline = TRAINING, None
    try:
        yield _state.flag
    finally:
        _state.phase = FINISHING


@contextlib.contextmanager
def _temporary_handlers():
    flag = {"set": False, "signal": None}

    def handler(signum, frame):
        flag["set"] = True
        flag["signal"] = signal.Signals(signum).name

    old = {}
    for sig in _signals():
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# --------------------------------------------------------------------------------------------
# the watcher


def _watch(read_fd):
    """Daemon thread: woken by the wakeup fd; arms the deadline for a signal in the starting
    phase and, when it passes with the rank still starting, ends the process (_hard_exit)."""
    ours = {int(s) for s in _signals()}
    while True:
        with _state.lock:
            deadline = _state.deadline
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], timeout)
        if ready:
            try:
                got = os.read(read_fd, 512)
            except OSError:
                return
            if not ours.intersection(got):
                continue
            with _state.lock:
                if _state.phase == STARTING and _state.deadline is None:
                    _state.deadline = time.monotonic() + HARD_EXIT_S
            continue
        with _state.lock:
            due = _state.phase == STARTING and _state.deadline is not None and \
                time.monotonic() >= _state.deadline
        if due:
            _hard_exit()


# What a hard exit runs first (on_hard_exit): the log dir's lock registers its release.
_HARD_EXIT_HOOKS = []


def on_hard_exit(fn):
    """Have ``fn()`` (quick, never raising) run when a signal ends this rank at once
    (``_hard_exit``), before the line and the exit: run_lock registers the release of its local
    locks (their files removed), which this module cannot import (it is below ckpt/). Not
    collective."""
    if fn not in _HARD_EXIT_HOOKS:
        _HARD_EXIT_HOOKS.append(fn)


def _hard_exit():
    """End this rank now with EXIT_CODE and the one line (once for the job where the process
    group's store still answers), recording why in its heartbeat state so that a rank whose
    collective fails on its absence can say so; the hooks run first (the log dir's lock is
    released, its file removed). No other cleanup, no log file written."""
    line = BEFORE_TRAINING
    try:
        for fn in list(_HARD_EXIT_HOOKS):
            fn()
        # loaded by now where a process group exists (not imported here: torch)
        dist_util = sys.modules.get(__package__.rpartition(".")[0] + ".dist_util")
        heartbeat = sys.modules.get(__package__ + ".heartbeat")
        if dist_util is not None and heartbeat is not None and dist_util.is_distributed():
            heartbeat.mark_ending(line, seconds=2.0)
            show = heartbeat.first_to_report("preempted")
        else:
            show = True
        if show:
            os.write(2, f"{line}\n".encode())
    finally:
        os._exit(EXIT_CODE)
