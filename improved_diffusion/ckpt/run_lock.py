"""The one-job lock of a log dir: at most one training job writes a log dir at a time.

A requeued job can start while its predecessor is still running or writing its preemption save;
two jobs in one log dir overwrite each other's steps, logs and prunes. So a job takes this lock
(rank 0, before anything touches the log dir) and holds it for its whole life. A job that finds it
held waits up to ``wait_s`` seconds (``--lock_wait``), saying once whom it waits for, then fails
on every rank naming the holder, having touched nothing. A log dir that cannot be written (a
read-only mount, no permission, a path under a regular file) fails at once, touching nothing.

Two flavours, chosen by the path:

* local paths: an exclusive ``fcntl.flock`` on ``{log_dir}/.lock``. The kernel drops it when the
  holder dies, even by ``kill -9``, so a dead job never blocks the next (the job's checkpoint
  writer process holds a copy of the descriptor, ``held_locks``: the lock then stays held until
  the writer, which the kernel ends with the holder, is gone too: writer_process). The holder
  writes an owner record (host, pid, job id, start time) into the file so that a waiting job can
  name it, and removes the file when it lets go (a killed job leaves it; harmless). A job that
  locked a file which was removed meanwhile sees that its inode is no longer the path's and tries
  again, so two jobs never hold "the" lock on two files. A forked child (a data loader worker)
  closes its copy of the descriptor, so no worker keeps the lock. On NFS, Linux maps flock to
  NFS byte-range locks (held across clients; a dead client's lock ends with its lease); Lustre
  needs the ``flock`` mount option, else taking the lock fails with a ``LockError``.
* remote paths (anything with ``://``: ``s3://``, ``gs://``, ``az://``, through storage.py): a
  lock object ``{log_dir}/lock.json`` with the owner's host, pid, job id, a random token and a
  heartbeat time that a daemon thread refreshes every ``heartbeat_s``. A lock whose heartbeat is
  older than ``stale_s`` (default 4 x ``heartbeat_s``) belongs to a dead job and is taken over.
  Before anything else, the store is asked once whether it answers with these credentials
  (storage.check_store: one line naming the URL and what to set).

  A free lock is taken with the store's conditional create (``storage.put(exclusive=True)``: S3
  ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``; O_EXCL on a
  local directory): of two jobs that both saw it free, exactly one creates it, the other sees
  the winner's record and waits (the read-back below still runs: gcp-storage-emulator, for one,
  ignores the precondition). Taking over a *stale* lock has no such precondition here (that
  would need a compare-and-swap on the old object's version, which the three stores spell three
  ways), so it stays best effort: write our record, wait ``settle_s``, read it back and keep the
  lock only if our token is still there. Two jobs whose takeovers land more than ``settle_s``
  apart can both believe they hold it; the first one's heartbeat then finds the other token,
  sets ``lost`` and warns (within ``heartbeat_s``). Azure's blob leases are not used (adlfs does
  not expose them). Staleness compares the record's heartbeat with this host's clock, so host
  clocks must agree to well within ``stale_s`` (NTP).

The storage calls of the remote flavour sit behind ``BlobStore`` (``read``/``create``/``write``/
``remove``),
so its logic runs on any store, a local directory included (that is how the tests run it).
"""

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid

from ..infra import preemption, storage
from ..infra.errors import UserError

DEFAULT_WAIT_S = 300.0
DEFAULT_HEARTBEAT_S = 30.0
LOCK_FILE = ".lock"  # local flavour
LOCK_OBJECT = "lock.json"  # remote flavour
# acquire_for_job: rank 0 reports to the others this often while it waits, and every rank says
# whether it got a preemption signal (a requeued job waiting for its predecessor is preemptible)
_JOB_SLICE_S = 1.0
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")


class LockError(UserError):
    """The log dir's lock cannot be taken or read (not: it is held); the message says why."""


class LogDirLockedError(LockError):
    """Another job held the log dir for longer than we were allowed to wait; ``holder``: its
    owner record ({} when not written yet)."""

    def __init__(self, message, holder=None):
        super().__init__(message)
        self.holder = holder or {}


class LogDirNotWritableError(LockError):
    """The log dir cannot be written by this process (read-only mount, no permission, a path
    under a regular file); nothing was touched."""


# --------------------------------------------------------------------------------------------
# owner records


def _job_id():
    for name in JOB_ID_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def owner_record():
    """This process as a lock owner: host, pid, job id (scheduler's, or None), start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job_id": _job_id(),
            "since": time.time()}


def _clock(t):
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def describe_owner(record):
    """``pid 123 on host h (job 9), since 2024-05-01T12:00:00+00:00`` (what is known of it)."""
    if not record:
        return "another job (its owner record is not written yet)"
    text = f"pid {record.get('pid', '?')} on host {record.get('host', '?')}"
    if record.get("job_id"):
        text += f" (job {record['job_id']})"
    if isinstance(record.get("since"), (int, float)):
        text += f", since {_clock(record['since'])}"
    if isinstance(record.get("heartbeat"), (int, float)):
        text += f", last heartbeat {max(0.0, time.time() - record['heartbeat']):.0f} s ago"
    return text


def _parse_record(data):
    """The owner record at the start of ``data`` (trailing bytes ignored), or None."""
    try:
        record, _ = json.JSONDecoder().raw_decode(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def live_holder(log_dir):
    """The owner record of the job that holds the local lock of ``log_dir`` now ({} when its
    record is not written yet), or None when no job holds it (or for a remote log dir, whose
    lock is an object read only by ``acquire``). Takes nothing and writes nothing: a shared,
    non-blocking flock attempt on the lock's file, when it exists. Not collective."""
    if "://" in os.fspath(log_dir):
        return None
    path = os.path.join(os.fspath(log_dir), LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _parse_record(os.pread(fd, 4096, 0)) or {}
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# storage of the remote flavour


class BlobStore:
    """The storage calls of the remote lock, through storage.py (works on local paths too)."""

    def check(self, log_dir):
        """Raise storage.StoreUnreachableError (one line) when the store does not answer."""
        storage.check_store(log_dir)

    def read(self, path):
        """The object's bytes, or None when it does not exist (other errors propagate)."""
        try:
            return storage.read_bytes(path)
        except FileNotFoundError:
            return None

    def create(self, path, data):
        """Put ``data`` only if there is no object at ``path``; whether it was put."""
        return storage.put(path, data, exclusive=True)

    def write(self, path, data):
        storage.put(path, data)

    def remove(self, path):
        try:
            storage.remove(path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------
# the lock


class LogDirLock:
    """
    The one-job lock of ``log_dir`` (see the module docstring). Not collective: rank 0 takes it
    (``acquire_for_job`` does that for all ranks). Usable as a context manager.

    ``wait_s``: how long ``acquire`` waits for a held lock. ``heartbeat_s``/``stale_s``/
    ``settle_s``: the remote flavour's timing. ``store``: the remote flavour's storage (a
    ``BlobStore``-like object); giving one selects that flavour for any path.
    """

    def __init__(self, log_dir, wait_s=DEFAULT_WAIT_S, heartbeat_s=DEFAULT_HEARTBEAT_S, *,
                 stale_s=None, settle_s=None, store=None):
        self.log_dir = os.fspath(log_dir)
        self.wait_s = float(wait_s)
        self.heartbeat_s = float(heartbeat_s)
        self.stale_s = 4 * self.heartbeat_s if stale_s is None else float(stale_s)
        self.settle_s = min(2.0, self.heartbeat_s / 10) if settle_s is None else float(settle_s)
        if store is None and "://" in self.log_dir:
            store = BlobStore()
        self.store = store
        self.path = storage.join(self.log_dir, LOCK_OBJECT if store else LOCK_FILE)
        self.lost = None  # remote flavour: why the lock was lost while held, else None
        self._fd = None
        self._token = None
        self._record = None
        self._checked = False  # remote: the store answered (storage.check_store)
        self._wait_start = None  # acquire(): when the wait began (wait_s counts from there)
        self._said = False  # acquire(): the "waiting for ..." line was printed
        self._stop = threading.Event()
        self._beat_thread = None

    @property
    def held(self):
        return self._fd is not None or self._token is not None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    # -------------------------------------------------------------- acquire / release

    def acquire(self, log=print, slice_s=None):
        """
        Take the lock, waiting up to ``wait_s`` seconds while another job holds it; ``log`` gets
        one line saying whom we wait for (once). Returns self. Raises ``LogDirLockedError`` (one
        line: the holder, the log dir, what to do) when the wait runs out; nothing in the log dir
        is changed then. ``slice_s``: return None after that many seconds without the lock
        (the ``wait_s`` bound counts from the first call), so a caller can report in between.
        """
        if self.held:
            return self
        try_once = self._try_object if self.store else self._try_flock
        if self._wait_start is None:
            self._wait_start = time.monotonic()
        deadline = self._wait_start + self.wait_s
        stop = deadline if slice_s is None else min(deadline, time.monotonic() + slice_s)
        while True:
            holder = try_once(log)
            if holder is None:
                return self
            # Say it once, as soon as the holder's record is readable (or after 1 s without).
            if not self._said and (holder or time.monotonic() - self._wait_start > 1.0):
                log(f"log dir {self.log_dir} is in use by {describe_owner(holder)}; waiting up "
                    f"to {self.wait_s:g} s for it to end (--lock_wait)")
                self._said = True
            now = time.monotonic()
            if now >= deadline:
                raise LogDirLockedError(
                    f"log dir {self.log_dir} is in use by {describe_owner(holder)} (lock "
                    f"{self.path}; waited {self.wait_s:g} s): wait for that job to end, stop "
                    f"it, or use another --log_dir", holder=holder
                )
            if now >= stop:
                return None
            time.sleep(max(0.0, min(self._poll_s(), stop - now)))

    def release(self):
        """Give the lock up (no-op when not held). Never raises for a remote store's error."""
        if self._fd is not None:
            self._release_flock()
        if self._token is not None:
            self._release_object()
        if self in _FORK_HOLDERS:
            _FORK_HOLDERS.remove(self)

    def _poll_s(self):
        return 0.2 if self.store is None else max(0.05, min(5.0, self.heartbeat_s / 4))

    # -------------------------------------------------------------- local: flock

    def _try_flock(self, log):
        """Take the flock if free (returns None), else return the holder's record ({} if none)."""
        check_writable(self.log_dir)
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in _UNWRITABLE:
                raise
            raise LogDirNotWritableError(_not_writable_message(self.log_dir, e.strerror))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_record(os.pread(fd, 4096, 0)) or {}
            os.close(fd)
            return holder
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                raise LockError(
                    f"cannot lock {self.path}: the filesystem does not support file locks "
                    f"({os.strerror(e.errno)}); mount it with locks (Lustre: -o flock) or use a "
                    f"log dir on another filesystem"
                ) from None
            raise
        if not self._is_current(fd):  # its holder removed it as we opened it: try the new one
            os.close(fd)
            return {}
        data = json.dumps(owner_record()).encode()
        os.pwrite(fd, data, 0)  # then cut: a reader sees a whole record, maybe with a stale tail
        os.ftruncate(fd, len(data))
        self._fd = fd
        _forget_in_forked_children(self)
        return None

    def _is_current(self, fd):
        """Whether ``fd`` is still the file at self.path (not one removed by its last holder)."""
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)

    def _release_flock(self):
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still locked: a waiter that opened it will retry
        except OSError:  # gone, or a read-only / vanished log dir: the flock still drops below,
            pass  # and a stale .lock file blocks nobody (it is never locked)
        finally:
            os.close(fd)  # drops the flock (once a writer process's copy is closed too)

    def _forget_in_child(self):
        """In a forked child (a data loader worker, say): hold nothing. Its copy of the flock's
        fd is closed, so the lock dies with the holder alone; a remote lock is the parent's."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._token, self._beat_thread = None, None

    # -------------------------------------------------------------- remote: lock object

    def _read_object(self):
        """The lock object's record or None when absent; a torn read is retried briefly."""
        for attempt in range(3):
            data = self.store.read(self.path)
            if data is None:
                return None
            record = _parse_record(data)
            if record is not None:
                return record
            time.sleep(0.05 * (attempt + 1))
        raise LockError(
            f"{self.path} is not a lock record; if no job uses log dir {self.log_dir}, delete it"
        )

    def _is_stale(self, record):
        beat = record.get("heartbeat")
        return not isinstance(beat, (int, float)) or time.time() - beat > self.stale_s

    def _try_object(self, log):
        """Take the lock object if absent or stale (returns None), else return its record."""
        if not self._checked and hasattr(self.store, "check"):
            self.store.check(self.log_dir)  # an unreachable store: one line, before anything
            self._checked = True
        record = self._read_object()
        if record is not None and not self._is_stale(record):
            return record
        if record is not None:
            log(f"taking over the stale lock {self.path} of {describe_owner(record)} (stale "
                f"after {self.stale_s:.0f} s)")
        storage.makedirs(self.log_dir)
        token = uuid.uuid4().hex
        mine = dict(owner_record(), token=token, heartbeat=time.time())
        data = json.dumps(mine).encode()
        if record is None and hasattr(self.store, "create"):
            if not self.store.create(self.path, data):  # another job created it first
                return self._read_object() or {}
        else:
            self.store.write(self.path, data)
        # let a competing takeover land, then see who won (also where a store, such as an
        # emulator, ignores the create's precondition)
        time.sleep(self.settle_s)
        now = self._read_object()
        if now is None or now.get("token") != token:
            return now or {}
        self._token, self._record = token, mine
        self._stop.clear()
        self._beat_thread = threading.Thread(target=self._beat, name="log-dir-lock-heartbeat",
                                             daemon=True)
        self._beat_thread.start()
        _forget_in_forked_children(self)
        return None

    def _beat(self):
        """Daemon thread: refresh the heartbeat every heartbeat_s until released or lost."""
        warned = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                now = self._read_object()
                if self._stop.is_set():
                    return
                if now is None or now.get("token") != self._token:
                    self.lost = (f"lock {self.path} was taken by {describe_owner(now)}"
                                 if now else f"lock {self.path} was removed")
                    _warn(f"{self.lost}; another job may write log dir {self.log_dir}")
                    return
                self._record = dict(self._record, heartbeat=time.time())
                self.store.write(self.path, json.dumps(self._record).encode())
                warned = False
            except Exception as e:  # retried at the next beat; the lock goes stale after stale_s
                if not warned:
                    _warn(f"cannot refresh lock {self.path} ({type(e).__name__}: {e}); retrying "
                          f"every {self.heartbeat_s:.0f} s")
                    warned = True

    def _release_object(self):
        self._stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=self.heartbeat_s + 10)
        token, self._token, self._beat_thread = self._token, None, None
        try:
            now = self._read_object()
            if now is not None and now.get("token") == token:
                self.store.remove(self.path)
        except Exception as e:  # the next job takes it over once stale
            _warn(f"cannot remove lock {self.path} ({type(e).__name__}: {e}); the next job "
                  f"takes it over after {self.stale_s:.0f} s")


# What creating the log dir or its lock file meets where the log dir cannot be written.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def check_writable(log_dir):
    """Raise LogDirNotWritableError (one line: the directory, why, what to do) unless this
    process can create files in local directory ``log_dir``, or create it where it is missing.
    Reads only (the nearest existing directory's permissions and mount flags). Not collective."""
    probe = os.path.abspath(log_dir)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(log_dir) else f"is under the file {probe}"
        raise LogDirNotWritableError(_not_writable_message(log_dir, f"it {where}"))
    if os.access(probe, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "read-only file system" if read_only else "permission denied"
    if probe != os.path.abspath(log_dir):
        why += f" in {probe}"
    raise LogDirNotWritableError(_not_writable_message(log_dir, why))


def _not_writable_message(log_dir, why):
    hint = "pass a --log_dir that this job can write"
    if os.path.isdir(log_dir):
        hint += (f" (to continue the run in it from there: --resume_checkpoint {log_dir} "
                 f"--log_dir NEW)")
    return f"log dir {log_dir} cannot be written ({why}); nothing was changed: {hint}"


def _warn(message):
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


_FORK_HOLDERS = []  # locks taken in this process: a forked child must forget them


def drop_local_locks():
    """For a process about to end with ``os._exit`` (preemption.py's hard exit, from its watcher
    thread): release each local lock it holds, its ``.lock`` file removed as ``release()`` does,
    so that the log dir is left as it was (the kernel would drop the flock, but not the file). A
    remote lock is left to go stale (no store call on the way out). Never raises. Not
    collective."""
    for lock in list(_FORK_HOLDERS):
        if lock._fd is not None:
            try:
                lock._release_flock()
            except OSError:
                pass


preemption.on_hard_exit(drop_local_locks)


def held_locks():
    """[(lock file path, descriptor)] of the local locks this process holds: what a helper
    process of the job inherits (the checkpoint writer, writer_process), so that the lock stays
    held while that process lives, even after this one is gone (a flock belongs to the open
    file, which the kernel releases only once every descriptor of it is closed). Not
    collective."""
    return [(lock.path, lock._fd) for lock in _FORK_HOLDERS if lock._fd is not None]


def _forget_in_forked_children(lock):
    if not _FORK_HOLDERS:
        os.register_at_fork(after_in_child=lambda: [h._forget_in_child() for h in _FORK_HOLDERS])
    if lock not in _FORK_HOLDERS:
        _FORK_HOLDERS.append(lock)


# --------------------------------------------------------------------------------------------
# the job's lock


def acquire_for_job(log_dir, wait_s=DEFAULT_WAIT_S, heartbeat_s=DEFAULT_HEARTBEAT_S, *,
                    log=None):
    """
    Take ``log_dir``'s lock on rank 0, waiting up to ``wait_s`` seconds; returns a ``LogDirLock``
    on every rank (held on rank 0 only; ``release()`` is safe everywhere). If rank 0 cannot take
    it, every rank raises the same ``LogDirLockedError`` having touched nothing. The other ranks
    wait for rank 0 in a broadcast per slice of ``_JOB_SLICE_S`` seconds, so ``wait_s`` may
    exceed the process group's timeout; after each slice, a preemption signal on any rank ends the wait on
    every rank (``preemption.check``). A log dir this process cannot write raises
    ``LogDirNotWritableError`` on every rank, before anything is created.

    Collective: call from all ranks with the same arguments.
    """
    from .. import dist_util  # here, so that the lock itself does not import torch

    lock = LogDirLock(log_dir, wait_s, heartbeat_s)
    say = log or (lambda message: print(message, flush=True))

    def take():  # one slice of the wait: each broadcast stays far inside --dist_timeout
        return lock.acquire(log=say, slice_s=_JOB_SLICE_S) is not None

    try:
        while not dist_util.run_on_rank0(take):
            preemption.check()  # a job waiting for its predecessor ends at once when preempted
    except BaseException:
        lock.release()
        raise
    return lock
