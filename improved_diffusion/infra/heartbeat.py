"""Heartbeats: naming the ranks that died, and ending a job after an error on one rank.

Each rank of a process group whose store is a TCPStore beats a counter in it (``beat/RANK``, a
daemon thread with its own connection, every ``heartbeat_interval(--dist_timeout)`` seconds) and
records why it stopped (``state/RANK``: "exited", "ended the job (cause)"). With them:

* ``diagnose_failure(error)``: after a collective raised (gloo's "Connection reset by peer", a
  timeout), the ``RankLostError`` naming the ranks whose beats stopped or that ended the job,
  or None when every rank is alive (the error is then something else);
* on NCCL, whose collectives do not raise in the host thread, the heartbeat also watches its
  neighbour's beats (ring order) and ends the job naming the lost ranks;
* ``end_job_after_error(code)``: a rank that failed alone aborts the job (MPI_Abort under
  mpiexec) instead of leaving the others blocked in a collective; when every rank failed alike,
  each exits normally;
* ``wait_for_rank0``: a wait on rank 0 bounded by its beats, not by the timeout (a long save);
* ``first_to_report(topic)``: a cause shared by several ranks is printed once.

Store operations outside a collective are bounded (``bounded``): a store whose host became
unreachable does not honour its own timeout. dist_util.setup_dist calls ``start``, cleanup
``stop``; nothing here is collective.

Example (what a rank does after a failed all-reduce)::

    lost = heartbeat.diagnose_failure(err)   # RankLostError("lost rank(s) 1: no heartbeat ...")
    heartbeat.end_job_after_error(1, cause=str(lost or err), lost=getattr(lost, "lost", ()))
"""
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

from .errors import UserError


class RankLostError(UserError):
    """A collective failed because some rank died or ended; the message names the rank(s).

    ``lost``: ranks whose heartbeat stopped; ``ended``: {rank: state} of ranks that stopped on
    their own ("exited", "ended the job (cause)").
    """

    lost = ()
    ended = {}


def bounded(fn, seconds, what):
    """``fn()`` in a daemon thread, waited for at most ``seconds`` (name lookups and the operations
    of a store whose host went silent can hang); TimeoutError naming ``what`` after that."""
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except Exception as e:
            box["err"] = e

    t = threading.Thread(target=run, name="dist-lookup", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"{what} took more than {seconds:g} s")
    if "err" in box:
        raise box["err"]
    return box["ok"]


def heartbeat_interval(timeout_s):
    """Seconds between two heartbeats of a rank, for a process group bounded by ``timeout_s``."""
    return min(5.0, max(0.5, float(timeout_s) / 60.0))


def watch_window(timeout_s):
    """Seconds without a beat after which a watching heartbeat (NCCL) takes its neighbour for
    lost: a few beats, and longer with a long ``timeout_s`` (a GIL held for a while delays a beat),
    but well within the timeout, before NCCL's watchdog acts."""
    interval = heartbeat_interval(timeout_s)
    return max(2.5 * interval + 0.5, min(0.25 * float(timeout_s), 30.0))


# Bound of one store operation made outside a collective (heartbeat marks, first_to_report,
# the count of failed ranks): a healthy store answers in milliseconds.
_STORE_CALL_S = 5.0


class _Heartbeat:
    """
    A daemon thread that adds 1 to ``beat/{rank}`` in the process group's TCP store every
    ``interval`` seconds, through its own connection; ``state/{rank}`` says why a rank stopped
    ("exited", or "ended: cause" from ``end_job_after_error``). Keys live under a prefix of this
    launch, so a torchrun restart does not read the last attempt's beats.

    With ``on_lost`` (NCCL, whose collectives do not raise in the host thread: its watchdog
    aborts the process at the timeout), the thread also watches the next rank's beats (one store
    read per beat, ring order) and the job's ``lost`` key: when the neighbour has not beaten for
    ``watch_window`` seconds and recorded no state, or another rank found a loss, it calls
    ``on_lost(RankLostError naming every lost rank)`` once, from this thread.
    """

    def __init__(self, host, port, rank, world, timeout_s, on_lost=None, prefix=""):
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.interval = heartbeat_interval(timeout_s)
        self.window = watch_window(timeout_s)
        self._on_lost = on_lost if world > 1 else None
        self._neighbour = (rank + 1) % world
        self._last_beat = (None, time.monotonic())  # the neighbour's count, when it changed
        self.prefix = prefix + "heartbeat/"
        self._lock = threading.Lock()
        self.store_lost = False  # set once peer_states found the store unreachable
        self._stop = threading.Event()
        self._client = self.connect(max(10.0, 3 * self.interval))
        self._client.add(f"beat/{rank}", 1)  # the first beat before returning from setup
        self._thread = threading.Thread(target=self._run, name="dist-heartbeat", daemon=True)
        self._thread.start()

    def connect(self, timeout_s):
        client = dist.TCPStore(self.host, self.port, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(self.prefix, client)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                with self._lock:
                    self._client.add(f"beat/{self.rank}", 1)
                    found = self._on_lost is not None and self._look_for_loss()
            except Exception:
                return  # the store is gone: the collectives will say so
            if found:
                self._report_loss(found)
                return

    def _look_for_loss(self):
        """(Under the lock.) The job's recorded loss, or "neighbour" when the watched rank has
        not beaten for the window and recorded no state; else None."""
        if self._client.check(["lost"]):
            return self._client.get("lost").decode()
        count = self._client.add(f"beat/{self._neighbour}", 0)
        now = time.monotonic()
        if count != self._last_beat[0]:
            self._last_beat = (count, now)
            return None
        if now - self._last_beat[1] < self.window:
            return None
        if self._client.check([f"state/{self._neighbour}"]):  # it stopped on purpose
            self._on_lost = None  # (exited, or ended the job itself, which names its cause)
            return None
        return "neighbour"

    def _report_loss(self, found):
        """Name every lost rank (the first rank to find the loss records the line for all), then
        hand it to on_lost."""
        if found == "neighbour":
            states = peer_states(self.window, hb=self)
            lost = sorted(r for r, st in states.items() if st == "lost") or [self._neighbour]
            message = (f"lost rank(s) {', '.join(map(str, lost))}: no heartbeat for "
                       f"{self.window:.1f} s (the process or its host died)")
            found = f"{','.join(map(str, lost))}|{message}"
            try:  # the first rank's finding is the job's (the others read it at their next beat)
                found = self.call(lambda c: c.compare_set("lost", "", found)).decode()
            except Exception:
                pass
        ranks, _, message = found.partition("|")
        err = RankLostError(f"{message}; ending the job (found by the heartbeats)")
        err.lost = [int(r) for r in ranks.split(",") if r]
        self._on_lost(err)

    def call(self, fn, seconds=_STORE_CALL_S):
        """``fn(client)`` under the lock, waited for at most ``seconds``: an operation on a store
        whose host became unreachable (cable pulled, host powered off) does not honour the
        store's timeout and can block for many minutes, holding the lock. Raises TimeoutError
        when the bound passes. Not collective."""
        if self.store_lost:
            raise ConnectionError(f"the store at {self.host}:{self.port} is unreachable")

        def locked():
            if not self._lock.acquire(timeout=seconds):
                raise TimeoutError("the heartbeat's store connection is busy")
            try:
                return fn(self._client)
            finally:
                self._lock.release()

        return bounded(locked, seconds, "a heartbeat store operation")

    def mark(self, state, seconds=_STORE_CALL_S):
        """Record why this rank stops (best effort, bounded by ``seconds``)."""
        try:
            self.call(lambda c: c.set(f"state/{self.rank}", state), seconds)
        except Exception:
            pass

    def stop(self, state):
        self._stop.set()
        self._thread.join(self.interval + 1.0)
        self.mark(state)


_heartbeat = None  # this rank's, between start() and stop()


def current():
    """This rank's running heartbeat, or None (no process group, or its store is not a TCPStore)."""
    return _heartbeat


def _end_job_for_lost_ranks(error):
    """What a watching heartbeat (NCCL) does with a loss, as after a failed collective on gloo:
    the line naming the lost ranks (printed once for the job, then handed to the line hook), then
    every rank ends with exit 1."""
    message = str(error)
    if first_to_report("lost"):
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    if _error_line_hook is not None:
        _error_line_hook(message)
    end_job_after_error(1, cause=message, lost=error.lost)


_error_line_hook = None


def set_error_line_hook(hook):
    """``hook(message)`` is called (in the heartbeat thread) with the error line of a job that
    the heartbeats end (NCCL: a lost rank); cli.run_main writes it to the log files."""
    global _error_line_hook
    _error_line_hook = hook


def start(timeout, prefix):
    """Start this rank's heartbeat when the process group's store is a TCPStore; on NCCL it also
    watches for lost ranks (see _Heartbeat). Best effort: a store it cannot reach is one warning
    line (lost ranks are then found by the timeout alone); any other exception is a bug, raised.
    ``prefix``: this launch's keys in the store (a torchrun restart does not read the last
    attempt's beats). Called by dist_util.setup_dist once the process group exists."""
    global _heartbeat
    stop("restarted")
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return
    host = "127.0.0.1" if store.host in ("", "0.0.0.0", "::") else store.host
    try:
        watch = dist.get_backend() == "nccl"
        _heartbeat = _Heartbeat(host, store.port, dist.get_rank(), dist.get_world_size(),
                                timeout.total_seconds(),
                                on_lost=_end_job_for_lost_ranks if watch else None, prefix=prefix)
    except (RuntimeError, OSError) as e:  # the store unreachable (a bug in this module raises)
        _heartbeat = None  # no heartbeat: failures are still bounded by the timeout
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"warning: rank {dist.get_rank()}: no heartbeat ({why}); a lost rank is noticed "
              f"only after --dist_timeout", file=sys.stderr, flush=True)


def stop(state):
    """Stop this rank's heartbeat, recording ``state`` ("exited") for the other ranks."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop(state)
        _heartbeat = None


def peer_states(window_s=None, hb=None):
    """
    What became of the other ranks, from their heartbeats: ``{rank: state}`` for each rank that
    did not beat within ``window_s`` (default 2.5 heartbeat intervals): "lost" (no beat: the
    process or its host died) or the state it recorded ("exited", "ended: cause"). Ranks still
    beating are left out. Raises ``RankLostError`` when the store itself is unreachable (its host,
    rank 0's under mpiexec, is gone). {} without a heartbeat. ``hb``: the heartbeat to ask
    through (default this rank's). Not collective.
    """
    hb = _heartbeat if hb is None else hb
    if hb is None:
        return {}
    window = window_s if window_s is not None else 2.5 * hb.interval + 0.5
    others = [r for r in range(hb.world) if r != hb.rank]

    def look():
        client = hb.connect(window + 5.0)
        seen = {r: client.add(f"beat/{r}", 0) for r in others}
        deadline = time.monotonic() + window
        quiet = set(others)
        while quiet and time.monotonic() < deadline:
            time.sleep(min(0.2, hb.interval))
            quiet = {r for r in quiet if client.add(f"beat/{r}", 0) == seen[r]}
        states = {}
        for r in sorted(quiet):
            key = f"state/{r}"
            states[r] = client.get(key).decode() if client.check([key]) else "lost"
        return states

    try:
        # bounded: a store whose host went silent mid-way would not answer (see _Heartbeat.call)
        return bounded(look, 2 * window + 10.0 + 2 * _STORE_CALL_S, "reading the heartbeats")
    except Exception as e:
        hb.store_lost = True  # later store calls of this rank fail at once
        raise RankLostError(
            f"the process group's store at {hb.host}:{hb.port} is unreachable "
            f"({type(e).__name__}): the rank that holds it (rank 0 under mpiexec; the rendezvous "
            f"host under torchrun) or its host is lost") from None


def diagnose_failure(error):
    """
    After ``error`` (a collective that raised, e.g. gloo's "Connection reset by peer", or a
    timeout): ``RankLostError`` naming the ranks that died or ended, or None when every other rank
    is still alive (``error`` is then something else). Waits up to a few heartbeat intervals.
    Not collective.
    """
    if _heartbeat is None:
        return None
    cause = " ".join(str(error).split())[:160] or type(error).__name__
    try:
        states = peer_states()
    except RankLostError as e:
        return RankLostError(f"{e} (the collective failed with: {cause})")
    lost = [r for r, s in states.items() if s == "lost"]
    ended = {r: s for r, s in states.items() if s != "lost"}
    if not lost and not ended:
        return None
    parts = []
    if lost:
        parts.append(f"lost rank(s) {', '.join(map(str, lost))}: no heartbeat for "
                     f"{2.5 * _heartbeat.interval + 0.5:.1f} s (the process or its host died)")
    for r, s in ended.items():
        parts.append(f"rank {r} {s}")
    err = RankLostError("; ".join(parts) + f"; the collective failed with: {cause}")
    err.lost = lost
    err.ended = ended
    return err


_COMM_FAILURE_WORDS = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "socket",
                       "broken pipe", "store")


def looks_like_comm_failure(error):
    """True for what a collective raises when a peer is gone or late (torch's DistError, or the
    RuntimeError gloo raises: "Connection reset by peer", "Timed out waiting ...")."""
    if isinstance(error, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in _COMM_FAILURE_WORDS)


def first_to_report(topic):
    """True on the first rank that asks about ``topic`` (best effort: True without a store), so a
    cause shared by several ranks is printed once. Not collective."""
    hb = _heartbeat
    if hb is None or not _in_group():
        return True
    try:
        return hb.call(lambda c: c.add(f"first_to_report/{topic}", 1)) == 1
    except Exception:
        return True


def mark_ending(cause, seconds=_STORE_CALL_S):
    """Record in this rank's heartbeat state that it ends the job (``cause``: one line), so that
    the other ranks can name it (``diagnose_failure``: "rank R ended the job (cause)"). Best
    effort, bounded by ``seconds``; safe from any thread. Not collective."""
    if _heartbeat is not None:
        _heartbeat.mark(f"ended the job ({cause})", seconds)


def end_job_after_error(code, wait_s=10.0, *, cause=None, lost=()):
    """
    After an error on this rank: if every rank failed (errors of the resume are raised on all
    ranks alike, since its decisions are broadcast), return so each exits normally; if the other
    ranks did not fail within ``wait_s`` (say, an unreadable image in one rank's batch, or a
    KeyboardInterrupt on one rank), they would stay blocked in a collective, so abort the whole
    job with exit ``code`` (MPI_Abort under mpiexec; under torchrun this rank's exit makes the
    launcher stop the rest). ``lost``: ranks known dead (not waited for). ``cause`` (one line) is
    recorded in this rank's heartbeat state, so the other ranks can name it.

    Failing ranks count themselves in the process group's store; no collective is entered, so
    this is safe to call from any rank at any point. No-op without a process group.
    """
    if not _in_group():
        return
    mark_ending(cause or f"exit {code}")
    world = dist.get_world_size()
    expected = world - len(set(lost))
    reached = []

    def count_and_wait():
        store = dist.distributed_c10d._get_default_store()
        store.add("end_job_after_error/failed", 1)
        reached.append(True)
        deadline = time.time() + wait_s
        while store.add("end_job_after_error/failed", 0) < expected:
            if time.time() > deadline:
                raise TimeoutError
            time.sleep(0.1)
        store.add("end_job_after_error/left", 1)
        while dist.get_rank() == 0 and store.add("end_job_after_error/left", 0) < expected:
            if time.time() > deadline + wait_s:  # rank 0 holds the store: let the others read
                break
            time.sleep(0.05)

    try:
        if _heartbeat is not None and _heartbeat.store_lost:
            raise ConnectionError("the process group's store is unreachable")
        # bounded as a whole: the store's host may be unreachable (see _Heartbeat.call)
        bounded(count_and_wait, 2 * wait_s + _STORE_CALL_S, "counting the failed ranks")
        if not lost:
            return
    except Exception:
        pass
    if lost:
        sys.stderr.write(f"note: ending the job ({len(set(lost))} of {world} ranks lost)\n")
    elif not reached:
        sys.stderr.write(f"note: the process group's store cannot be reached; ending this rank "
                         f"(of {world})\n")
    else:
        sys.stderr.write(f"note: the other ranks did not fail; aborting all {world} ranks\n")
    sys.stderr.flush()
    _abort(code)


def _abort(code):
    mpi = sys.modules.get("mpi4py.MPI")  # imported by dist_util only under an MPI launcher
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


def _in_group():
    return dist.is_available() and dist.is_initialized()


def wait_for_rank0(hb, key, what):
    """Until rank 0 sets ``key`` in the store (run_on_rank0_unbounded); RankLostError once rank 0
    has not beaten for the heartbeat's window. Not collective."""
    beats, since = None, time.monotonic()
    pause = 0.01
    while True:
        done, count, ended = hb.call(lambda c: (c.check([key]), c.add("beat/0", 0),
                                                c.check(["state/0"])))
        if done:
            return
        now = time.monotonic()
        if ended:  # rank 0 stopped on purpose (an error it reports itself): the job ends
            state = hb.call(lambda c: c.get("state/0")).decode()
            err = RankLostError(f"rank 0 {state} during {what}")
            err.ended = {0: state}
            raise err
        if count != beats:
            beats, since = count, now
        elif now - since > hb.window:
            err = RankLostError(f"lost rank 0 during {what}: no heartbeat for {hb.window:.1f} s "
                                f"(the process or its host died)")
            err.lost = [0]
            raise err
        time.sleep(pause)
        pause = min(0.2, pause * 2)
