"""
The background write out of the training process: one writer process per job, fed through
shared memory.

``WriterProcess`` owns two things of rank 0's: an ``Arena`` (an anonymous shared-memory file,
``memfd_create``, that grows; HostSnapshot copies every tensor of a save into buffers inside it)
and, from the first write on, a child process started with multiprocessing's "spawn" context
(never a fork of the trainer: its threads, torch's and gloo's, do not survive one). ``write(
log_dir, step, files, keep)`` hands the child a step whose tensors lie in the arena (pickled as
references: storage offset and size, dtype, storage offset, shape, strides; everything else
pickled as it is, with the sharing between objects kept), and blocks until the child has written
it with ``run_dir.write_step`` (the files, fsync'd and renamed into place, then the manifest) and
pruned (``run_dir.prune_lines``). It returns (the child's ``time.perf_counter()`` when it was
done: the same clock in every process of the host, lines to log), or raises the child's error
(its one-line CheckpointError as it is; any other keeps its type, with the child's traceback as
its cause). The checkpointer calls it from its BackgroundWriter thread, which only waits: the
serialisation, the checksums, the writes and the fsyncs run in the child, off the trainer's GIL
and on a core of its own when there is one. The child rebuilds the tensors over the same shared
pages (no copy), so its torch.save writes the bytes a synchronous save writes.

Failure modes: a child that dies (kill -9, out of memory) is a ``CheckpointError`` naming the
step and saying what is on disk (no manifest: the step does not count), never a hang; the next
write starts a new child. The child ignores SIGTERM, SIGUSR1 and SIGINT (the trainer owns them,
preemption.py; a cluster's SIGTERM to every process of the job must not end a write the
preemption save waits for), and ends itself, within WATCH_S, once the trainer is gone (its parent
pid changes: a trainer that was kill -9'd leaves no writer behind), or when the trainer closes
the connection. A process forked from the trainer (a DataLoader's workers) closes its copies of
the connection and the arena's descriptor at once (``os.register_at_fork``), so no worker holds
the writer's pipe open. The arena is an anonymous file: nothing is left in /dev/shm on any exit
path; its pages are freed when the last process holding them ends.

Not collective and knows nothing of ranks: the checkpointer makes one on rank 0.
"""

import io
import mmap
import multiprocessing
import multiprocessing.reduction as mp_reduction
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref

# Seconds between the child's checks that its parent still lives.
WATCH_S = 0.2
# Arena buffers are aligned to this many bytes (a cache line; torch's CPU allocator uses 64).
ALIGN = 64


class WriterDied(Exception):
    """The writer process ended while a write was in flight (wrapped in a CheckpointError)."""


class Arena:
    """
    Shared memory for host copies: a memfd mapped in this process, grown as needed (the old
    mappings stay valid while tensors view them; every mapping of the file shows the same
    pages). ``alloc(n)`` returns a new n-byte UntypedStorage inside it; ``offset(storage)`` the
    offset of an arena storage in the file (None for any other storage); ``reset()`` forgets all
    allocations (the caller guarantees none is in use). ``fd`` and ``size`` are what a process
    needs to map it.
    """

    def __init__(self, initial=0):
        self.fd = os.memfd_create("checkpoint-host-copy", os.MFD_CLOEXEC)
        self.size = 0
        self.high = 0  # bytes allocated so far (the bump pointer)
        self._maps = []  # (base address, size, mmap): newest last
        self._pinned = set()  # base addresses registered with CUDA
        if initial:
            self._grow(initial)

    def alloc(self, nbytes, pinned=False):
        import torch as th

        off = -(-self.high // ALIGN) * ALIGN
        if off + nbytes > self.size:
            self._grow(max(2 * self.size, off + nbytes))
        self.high = off + nbytes
        if pinned:
            self._pin()
        return th.frombuffer(self._maps[-1][2], dtype=th.uint8, count=nbytes,
                             offset=off).untyped_storage()

    def _pin(self):
        """Page-lock the newest mapping for CUDA (cudaHostRegister), once: device-to-host copies
        into it then run without blocking, as into pinned memory. A refusal leaves the copies
        correct, only slower (pageable memory)."""
        import torch as th

        base, size, _ = self._maps[-1]
        if base in self._pinned:
            return
        self._pinned.add(base)
        try:
            th.cuda.cudart().cudaHostRegister(base, size, 0)
        except Exception:  # not fatal: the copy into pageable memory is synchronous
            pass

    def offset(self, storage):
        ptr = storage.data_ptr()
        for base, size, _ in reversed(self._maps):
            if base <= ptr < base + size:
                return ptr - base
        return None

    def reset(self):
        self.high = 0

    def _grow(self, size):
        import torch as th

        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        os.ftruncate(self.fd, size)
        mm = mmap.mmap(self.fd, size)
        base = th.frombuffer(mm, dtype=th.uint8).data_ptr()
        self._maps.append((base, size, mm))
        self.size = size

    def close_fd(self):
        """Close the descriptor (the mappings stay until nothing views them)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class WriterProcess:
    """The job's writer process and its arena (see the module docstring)."""

    def __init__(self):
        self.arena = Arena()
        self._proc = None
        self._conn = None
        self._lock = threading.Lock()  # one write at a time; close() waits for it
        self._finalizer = weakref.finalize(self, _shut_down, self.__dict__)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_fork(ref))

    @property
    def pid(self):
        return None if self._proc is None else self._proc.pid

    def write(self, log_dir, step, files, keep=0):
        """Write ``step``'s ``files`` (tensors in the arena) into ``log_dir`` in the child, then
        prune to ``keep`` complete steps; blocks until done (see the module docstring)."""
        with self._lock:
            self._start()
            header = pickle.dumps({"log_dir": os.fspath(log_dir), "step": int(step),
                                   "keep": int(keep), "arena_size": self.arena.size})
            payload = _dumps(files, self.arena)
            try:
                self._conn.send_bytes(header)
                self._conn.send_bytes(payload)
                reply = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise self._died(log_dir, step) from e
        kind, value = reply
        if kind == "done":
            return value
        error, remote = value
        raise error from _RemoteTraceback(remote)

    def close(self):
        """End the child (after the write in flight, if any) and free the arena."""
        with self._lock:
            self._finalizer()

    def _start(self):
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        with _signals_blocked():  # the child starts with them blocked, until it ignores them
            proc = ctx.Process(target=_child_main, args=(theirs, os.getpid()),
                               name="checkpoint-writer", daemon=True)
            proc.start()
        theirs.close()
        mp_reduction.send_handle(ours, self.arena.fd, proc.pid)
        self._proc, self._conn = proc, ours

    def _died(self, log_dir, step):
        """The CheckpointError of a child that ended during the write of ``step``."""
        from . import checkpoint, run_dir

        proc, conn = self._proc, self._conn
        self._proc = self._conn = None  # the next write starts a new one
        conn.close()
        proc.join(timeout=10)
        code = proc.exitcode
        how = ("still running" if code is None else f"killed by signal {-code}" if code < 0
               else f"exit code {code}")
        manifest = checkpoint.join(log_dir, checkpoint.manifest_filename(step))
        if checkpoint.exists(manifest):
            kept = f"its manifest was written, so step {step} is complete on disk"
        else:
            kept = (f"step {step} has no manifest, so it does not count and a rerun resumes "
                    f"from the last complete step")
        return run_dir.CheckpointError(
            f"{log_dir}: the checkpoint writer process (pid {proc.pid}) died ({how}) while "
            f"saving step {step}; {kept}; see the job's log for why (out of memory? killed?)")


def _shut_down(state):
    """Close the connection (the child ends at once when idle), wait for the child, free the
    arena's descriptor. Safe to call twice; also the finalizer at the interpreter's exit."""
    conn, proc = state.get("_conn"), state.get("_proc")
    state["_conn"] = state["_proc"] = None
    if conn is not None:
        conn.close()
    if proc is not None:
        proc.join(timeout=60)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    arena = state.get("arena")
    if arena is not None:
        arena.close_fd()


def _forget_in_fork(ref):
    """In a process forked from the trainer (a loader worker): close this process's copies of
    the connection and the arena's descriptor, leaving the parent's untouched."""
    self = ref()
    if self is None:
        return
    self._finalizer.detach()
    if self._conn is not None:
        try:
            os.close(self._conn.fileno())
        except OSError:
            pass
        self._conn._handle = None  # closed above; the object must not close the number again
    self._conn = self._proc = None
    self.arena.close_fd()


class _signals_blocked:
    """SIGTERM/SIGUSR1/SIGINT blocked in this thread while the child is started (a spawned
    child inherits the mask, and ignores them before unblocking them)."""

    SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}

    def __enter__(self):
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old)


class _RemoteTraceback(Exception):
    """The child's traceback of an error it handed back (the cause of the re-raised error)."""

    def __str__(self):
        return "\n" + self.args[0]


# ------------------------------------------------------------------------- the wire format


class _Pickler(pickle.Pickler):
    """Pickles tensors whose storage lies in ``arena`` as references to it; the same tensor
    object twice as the same reference (torch.save records it once)."""

    def __init__(self, f, arena):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena
        self._tensors = {}  # id(tensor) -> index (the payload keeps every tensor alive)

    def persistent_id(self, obj):
        import torch as th

        if type(obj) is not th.Tensor:
            return None
        index = self._tensors.get(id(obj))
        if index is not None:
            return ("same", index)
        storage = obj.untyped_storage()
        off = self.arena_offset(storage)
        if off is None:
            return None  # not a host copy (an empty tensor, a test's own): pickled whole
        self._tensors[id(obj)] = index = len(self._tensors)
        return ("tensor", index, off, storage.nbytes(), obj.dtype, obj.storage_offset(),
                tuple(obj.size()), obj.stride())

    def arena_offset(self, storage):
        if storage.device.type != "cpu" or storage.nbytes() == 0:
            return None
        return self._arena.offset(storage)


def _dumps(obj, arena):
    buf = io.BytesIO()
    _Pickler(buf, arena).dump(obj)
    return buf.getvalue()


class _Unpickler(pickle.Unpickler):
    """Rebuilds the referenced tensors over the child's mapping of the arena: one storage per
    (offset, size), so tensors that shared a storage share one again."""

    def __init__(self, f, mapping):
        super().__init__(f)
        self._mapping = mapping
        self._storages = {}
        self._tensors = {}

    def persistent_load(self, pid):
        import torch as th

        if pid[0] == "same":
            return self._tensors[pid[1]]
        _, index, off, nbytes, dtype, offset, size, stride = pid
        storage = self._storages.get((off, nbytes))
        if storage is None:
            storage = th.frombuffer(self._mapping, dtype=th.uint8, count=nbytes,
                                    offset=off).untyped_storage()
            self._storages[(off, nbytes)] = storage
        t = th.empty(0, dtype=dtype).set_(storage, offset, size, stride)
        self._tensors[index] = t
        return t


# ------------------------------------------------------------------------- the child


def _child_main(conn, parent_pid):
    """The writer process: ignore the trainer's signals, watch the parent, then serve writes
    until the connection closes."""
    for sig in _signals_blocked.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _signals_blocked.SIGNALS)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch",
                     daemon=True).start()
    fd = mp_reduction.recv_handle(conn)
    maps = {}
    while True:
        try:
            header = pickle.loads(conn.recv_bytes())
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        reply = _serve(header, payload, fd, maps)
        try:
            conn.send_bytes(reply)
        except OSError:
            return


def _watch_parent(parent_pid):
    """End this process once its parent is gone (reparented: the trainer was killed)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(WATCH_S)


def _serve(header, payload, fd, maps):
    """One write; returns the pickled reply ("done", (time, lines)) or ("failed", (error,
    traceback text))."""
    try:
        from . import run_dir

        size = header["arena_size"]
        if size not in maps:
            maps.clear()  # older, smaller mappings: nothing views them any more
            maps[size] = mmap.mmap(fd, size) if size else None
        files = _Unpickler(io.BytesIO(payload), maps[size]).load()
        run_dir.write_step(header["log_dir"], header["step"], files)
        del files
        lines = run_dir.prune_lines(header["log_dir"], header["keep"])
        return pickle.dumps(("done", (time.perf_counter(), lines)))
    except BaseException as e:  # handed to the trainer, which raises it
        return pickle.dumps(("failed", (_portable(e), traceback.format_exc())))


def _portable(e):
    """``e`` if it survives a pickle round trip, else a RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


if __name__ == "__main__":  # not a script: the writer is started by WriterProcess
    sys.exit("improved_diffusion.ckpt.writer_process: started by the checkpointer, not by hand")
