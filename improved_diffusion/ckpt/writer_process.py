"""
The background write out of the training process: one writer process per job, fed through
shared memory.

``WriterProcess`` owns two things of rank 0's: an ``Arena`` (an anonymous shared-memory file,
``memfd_create``, that grows) and, from the first pack on, a child process: a fresh interpreter
(subprocess, as multiprocessing's "spawn" starts one; never a fork of the trainer: its threads,
torch's and gloo's, do not survive one) given the trainer's sys.path, a socket, the arena's
descriptor and copies of the job's lock descriptors. Like spawn, it first runs the job's entry
script under another name when that only defines things (``_importable_main``: a script whose
work sits under ``if __name__ == "__main__"``), so what such a script sets up at import holds in
the writer too; any other script is not run.

``pack(files)`` is the host copy of a save, the only pause of training: the payloads pickled (at
C speed; only tensors reach Python code) with each tensor as a reference to an arena buffer
(offset and size of its storage, dtype, storage offset, shape, strides; everything else pickled
as it is, the sharing between objects kept), and every storage copied into its buffer once
(buffers reused from the previous save; from the CPU on the cores the pause leaves idle,
host_copy.HostCopy, the storages of the last saves begun before the payloads are built; from
CUDA into page-locked memory without blocking, then one synchronise per device).
``write(log_dir, step, packed, keep)`` hands it to the child and blocks until it has written
it with ``run_dir.write_step`` (the files, fsync'd and renamed into place, then the manifest)
and pruned (``run_dir.prune_lines``). It returns (the child's ``time.perf_counter()`` when it
was done: the same clock in every process of the host, lines to log), or raises the child's
error (its one-line CheckpointError as it is; any other keeps its type, with the child's
traceback as its cause). The checkpointer calls it from its BackgroundWriter thread, which only
waits: the serialisation, the checksums, the writes and the fsyncs run in the child, off the
trainer's GIL and on a core of its own when there is one. The child rebuilds the tensors over
the same shared pages (no copy), so its torch.save writes the bytes a synchronous save writes.

Failure modes: a child that dies (kill -9, out of memory) is a ``CheckpointError`` naming the step
and saying what is on disk (no manifest: the step does not count), never a hang; the next write
starts a new child. The child ignores SIGTERM, SIGUSR1 and SIGINT (the trainer owns them,
preemption.py; a cluster's SIGTERM to every process of the job must not end a write the preemption
save waits for), and ends when the trainer closes the connection.

Priority (best effort): each write starts with every thread of the child at WRITER_NICE above the
trainer's nice level, so that the steps beside it keep their core; once the trainer waits for the
write (the next save, a preemption save, the end: ``hurry``), it sets the child's threads back to
its own level, so that a starved writer does not hold up that wait (a writer kept at nice 19
throughout was measured starved by the machine's other work: docs/performance.md). Setting them
back needs the privilege to lower a nice value (root, or an RLIMIT_NICE that allows it:
``may_renice``); a trainer without it leaves the writer at its own level (as before), since a
writer it could not set back could hold up a preemption save. Only the CPU priority: the page
cache is written to the disk by the kernel's own threads, which an I/O priority of this process
does not reach.

A trainer that dies (kill -9) leaves no writer behind, and its writer never puts a file into a log
dir that another job may own. Three guards, the first two the kernel's; none relies on the child
getting the CPU or the GIL in time (a thread that polls the parent pid does: a long C call, such as
torch's pickling of a large state, holds the GIL, and a loaded host delays the thread; so did
this writer before: it outlived its trainer by 0.1-0.2 s at 11 MB a step, 0.4-0.6 s at 590 MB
here, 2.3-3.4 s as reported, and could put a file in place after the lock was free):

- the child holds a copy of the descriptor of the job's local lock (run_lock.held_locks,
  inherited): a flock belongs to the open file, which the kernel releases only once every
  descriptor of it is closed, so the log dir's lock stays held while the writer lives, even after
  the trainer is gone, and no other job can take the log dir while the writer could still write;
- the kernel kills the child (SIGKILL, ``PR_SET_PDEATHSIG``) as its trainer ends, when the
  trainer started it from its main thread (the signal follows the thread that started it: pack()
  starts it, on the checkpointer's main thread); the poll of the parent pid every WATCH_S
  remains for a child started from another thread;
- before each file is put in place (linked or renamed into the log dir: file_writer's
  publish_check) and before pruning, the child ends at once, putting nothing in place and
  removing nothing, if its trainer is gone (its parent pid changed) or if the log dir's lock file
  is no longer the one the job locked (the job let the lock go, or the file was removed: another
  job may own the log dir); a trainer that lives reports the latter (EXIT_LOCK_LOST).

What a killed writer leaves is what a kill -9 inside a synchronous save leaves: a temp file, or a
step with files and no manifest (set aside by the resume). A remote log dir has no descriptor to
hold: its lock object goes stale (run_lock) long after the killed writer is gone.

A process forked from the trainer (a DataLoader's workers) closes its copies of the connection and
the arena's descriptor at once (``os.register_at_fork``), so no worker holds the writer's pipe open
(run_lock closes a worker's copy of the lock's). The arena is an anonymous file: nothing is left in
/dev/shm on any exit path; its pages are freed when the last process holding them ends.

Not collective and knows nothing of ranks: the checkpointer makes one on rank 0 (where
``available()`` is False, not Linux, it writes from its thread as before: async_save.HostSnapshot).
"""

import copyreg
import io
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection

from . import host_copy

# Seconds between the child's checks that its parent still lives (the fallback where the kernel
# does not end it with its trainer: see the module docstring).
WATCH_S = 0.2
# The child's exit codes when it ends itself before putting a file in place: its trainer is gone;
# the log dir's lock is no longer the job's.
EXIT_TRAINER_GONE = 70
EXIT_LOCK_LOST = 71
# prctl(2)'s PR_SET_PDEATHSIG: the signal this process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1
# Arena buffers are aligned to this many bytes (a cache line; torch's CPU allocator uses 64).
ALIGN = host_copy.ALIGN
# The interpreter's switch interval while pack's helper threads copy (seconds; Python's default
# is 0.005): a helper takes the GIL between pieces, and waits up to this long for the thread that
# pickles to let it go; at the default, a helper had copied 0-2% of the pieces by the time the
# pickling ended (docs/performance.md, "The pause on the idle cores").
SWITCH_S = 0.0005
# How much nicer than the trainer the child writes while training goes on (0: the same; see the
# module docstring, and docs/performance.md for the steps' p99 with and without).
WRITER_NICE = 10


def may_renice(nice):
    """Whether this process may set a thread at nice level ``nice`` + WRITER_NICE back to
    ``nice``: lowering a nice value takes root (CAP_SYS_NICE) or an RLIMIT_NICE soft limit of at
    least 20 - ``nice`` (``ulimit -e``)."""
    import resource

    if os.geteuid() == 0:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - nice


# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): fault pages in, writable, keeping their bytes.
_MADV_POPULATE_WRITE = 23


# What prepare() adds to the arena beyond the step's storages: room for the storages a save
# makes anew (the RNG states), so that the first pack finds it in the pages faulted in.
PREPARE_SLACK = 4 << 20
# --save_writer's choices: where an async save's write runs.
WRITERS = ("auto", "process", "thread")
# "auto" writes a step of at least this many tensor bytes from the writer process, a smaller
# one from the trainer's thread. Measured (docs/performance.md, benchmarks/checkpoint.py
# --figures start,run --writers process,thread): the process costs a job ~2 s of wall and
# ~2.5 s of CPU once (a fresh interpreter importing torch), the thread ~0.1 s more than the
# process per save at 152 MiB (the GIL beside the step, roughly in proportion to the bytes) and
# nothing at a few KiB (both write a tiny step in ~3 ms). At 64 MiB the thread's cost is
# ~0.05 s a save: the process pays for itself only over tens of saves, below it hardly ever.
PROCESS_MIN_BYTES = 64 << 20


def available():
    """Whether this platform has what the writer process needs (memfd_create: Linux)."""
    return hasattr(os, "memfd_create") and hasattr(os, "register_at_fork")


def use_process(writer, nbytes, free_core=True):
    """Whether an async save of ``nbytes`` tensor bytes per step is written by the writer
    process (else by the trainer's thread): ``writer`` is --save_writer ("process": where
    available(); "thread": never; "auto": where available(), nbytes >= PROCESS_MIN_BYTES and
    ``free_core``: the training leaves a core for the writer, see ``core_free``).

    >>> use_process("auto", 4 << 20), use_process("thread", 1 << 40)
    (False, False)
    >>> use_process("auto", 1 << 30, free_core=False)  # the ranks' threads fill every core
    False
    """
    if writer not in WRITERS:
        raise ValueError(f"save_writer must be one of {', '.join(WRITERS)} (got {writer!r})")
    if writer == "thread" or not available():
        return False
    return writer == "process" or (nbytes >= PROCESS_MIN_BYTES and free_core)


def core_free(on_cpu, threads, local_ranks, affinity, host_cpus):
    """Whether the training leaves a core for the writer process (which inherits this
    process's CPU affinity): on an accelerator, yes (the ranks' threads mostly wait on it); on
    the CPU, when the torch threads of the ranks on this host (``threads`` each, ``local_ranks``
    ranks) are fewer than the cores they run on: this process's ``affinity`` when a launcher
    bound it to part of the host's ``host_cpus`` (that part is its own), else the host's.
    Measured (docs/performance.md, "The writer by size"): where every core runs a training
    thread, the writer process slows the steps more than the trainer's own thread does (60M:
    2.07 against 1.22 s a save on 2 ranks of 2 cores).

    >>> core_free(True, 1, 1, 2, 2), core_free(True, 2, 1, 2, 2), core_free(False, 16, 8, 96, 96)
    (True, False, True)
    >>> core_free(True, 1, 2, 2, 2), core_free(True, 5, 4, 6, 48)  # 2 ranks; bound to 6 cores
    (False, True)
    """
    if not on_cpu:
        return True
    if affinity < host_cpus:
        return threads < affinity
    return threads * max(1, local_ranks) < affinity


class Arena:
    """
    Shared memory for host copies: a memfd mapped in this process, grown as needed (the old
    mappings stay valid while tensors view them; every mapping of the file shows the same
    pages). ``alloc(n)`` returns (offset, a uint8 tensor over n new bytes at that offset);
    ``reset()`` forgets all allocations (the caller guarantees none is in use). ``fd`` and
    ``size`` are what a process needs to map it.
    """

    def __init__(self, initial=0):
        self.fd = os.memfd_create("checkpoint-host-copy", os.MFD_CLOEXEC)
        self.size = 0
        self.high = 0  # bytes allocated so far (the bump pointer)
        self._dirty = 0  # the end of the bytes ever handed out (beyond it: the file's zeros)
        self._maps = []  # (base address, size, mmap): newest last
        self._pinned = set()  # base addresses registered with CUDA
        if initial:
            self._grow(initial)

    def alloc(self, nbytes, pinned=False):
        """(offset, a flat uint8 tensor over the new n bytes); ``pinned``: page-locked for
        CUDA copies."""
        import torch as th

        off = -(-self.high // ALIGN) * ALIGN
        if off + nbytes > self.size:
            self._grow(max(2 * self.size, off + nbytes))
        base, size, mm = self._maps[-1]
        if self.high < min(off, self._dirty):  # the gap zeroed (see span()) where it was used
            mm[self.high:min(off, self._dirty)] = bytes(min(off, self._dirty) - self.high)
        self.high = off + nbytes
        self._dirty = max(self._dirty, self.high)
        if pinned:
            self._pin()
        return off, th.frombuffer(mm, dtype=th.uint8, count=nbytes, offset=off)

    def span(self, off, nbytes, dtype):
        """A tensor of ``dtype`` over the file's bytes ``off``..``off + nbytes`` (the newest
        mapping, which maps the whole file): buffers that ``alloc`` gave one after the other
        with the gaps between them, which ``alloc`` zeroes (host_copy sums such a run of
        buffers at once: a zero adds nothing)."""
        import torch as th

        item = th.empty(0, dtype=dtype).element_size()
        return th.frombuffer(self._maps[-1][2], dtype=dtype, count=nbytes // item, offset=off)

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

    def reset(self):
        self.high = 0

    def populate(self):
        """Fault in every page of the newest mapping, writable, without changing its bytes
        (madvise MADV_POPULATE_WRITE, Linux 5.14+, through ctypes: the GIL is let go meanwhile);
        where the kernel refuses it, the pages not handed out yet are written with the zeros
        they hold. The first copy into them then takes no page fault (first_save.py)."""
        import ctypes

        import torch as th

        base, size, mm = self._maps[-1]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(base, size, _MADV_POPULATE_WRITE) == 0:
            return
        start = -(-self._dirty // mmap.PAGESIZE) * mmap.PAGESIZE  # (bytes in use left alone)
        if start < size:
            th.frombuffer(mm, dtype=th.uint8, count=size - start, offset=start).zero_()

    def offset_of(self, storage):
        """The offset in the file of ``storage`` when its bytes lie in one of this arena's
        mappings (memory that ``alloc`` gave), else None."""
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        for base, size, _ in self._maps:
            if base <= ptr and ptr + nbytes <= base + size:
                return ptr - base  # every mapping maps the file from its start
        return None

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

    def __init__(self, copy_threads=1):
        self.arena = Arena()
        self._buffers = {}  # source storage key -> (offset, arena view, source bytes view)
        self._ahead = {}  # the CPU buffers of the last pack that the one before used too (all
        # of them after the first pack): what the next pack copies ahead
        self._cuda = {}  # storage key -> CUDA device, of the buffers of storages on one
        self.nbytes = 0  # bytes of the buffers the last pack used
        self.non_finite = []  # [(label, tensors with a NaN/Inf)] of the last pack's ``check``
        self.copy_threads = copy_threads  # threads that make the CPU host copy
        self._helpers = None  # their helper threads (host_copy.Helpers), from the first pack
        self._plans = {}  # host_copy.HostCopy's, kept from pack to pack
        self._proc = None
        self._conn = None
        self._locks = None  # the lock descriptors the child got (run_lock.held_locks)
        self._writes = 0  # writes handed to the child
        self._warming = None  # prepare's thread that faults the arena's pages in
        self._lock = threading.Lock()  # one write at a time; close() waits for it
        self._finalizer = weakref.finalize(self, _shut_down, self.__dict__)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_fork(ref))

    @property
    def pid(self):
        return None if self._proc is None else self._proc.pid

    def alloc_for_gather(self):
        """``alloc(nbytes)`` -> a flat uint8 tensor of new arena memory, for fsdp.gather_full to
        copy each whole tensor of a sharded model's step into: the step then lies in the arena
        already and ``pack(..., gathered=True)`` copies nothing. The last save's buffers are
        forgotten (call it only once the previous write is done: the new tensors reuse its
        memory)."""
        self._warmed()
        self._buffers, self._ahead = {}, {}
        self._plans.clear()  # (its pieces copy into the buffers forgotten here)
        self.arena.reset()
        self.nbytes = 0
        return lambda nbytes: self.arena.alloc(nbytes)[1]

    def pack(self, files, check=(), gathered=False):
        """The host copy of a save: ``files`` pickled for the child, with every tensor's storage
        copied into its arena buffer (the one the last pack used for the same storage, else a
        new one), in one pass (from CUDA: one foreach copy per device without blocking, then
        one synchronise per device; from the CPU: host_copy.HostCopy, on ``copy_threads``
        threads, the storages of the last saves begun while the payload is pickled). A storage
        that lies in the arena already (``gathered``: ``files`` made whole into
        ``alloc_for_gather``'s memory) is referenced where it is, not copied. Returns the
        packed payload for ``write``. Call it only once the previous write is done (its buffers
        are reused). Starts the child when there is none: from the thread that packs (the
        checkpointer's main thread), whose end the kernel ties the child's to (the module
        docstring).

        ``files`` may be a function that returns (files, check): called once the copy of the
        storages of the last saves that held nothing to check (the optimizer's moments) has
        begun on the helper threads, so that it runs while the caller builds the payloads
        (host_copy.HostCopy.ahead).

        ``check``: [(label, tensors)] whose NaN/Inf are counted during the copy (the
        checkpointer's weights check, off the pause): a CPU tensor in ``files`` on its host copy,
        piece by piece right after each piece is copied (while it is in the cache), any other
        with checkpointer.count_non_finite. ``self.non_finite`` is then [(label, how many of its
        tensors hold a NaN or Inf)], what count_non_finite of each label's tensors gives."""
        with self._lock:
            self._start()
        self._warmed()
        if not gathered and self.arena.high > 2 * self.nbytes + (1 << 20):
            self._buffers, self._ahead = {}, {}  # the arena holds more dropped buffers than live
            self._plans.clear()
            self.arena.reset()
        if self._helpers is None or self._helpers.n != self.copy_threads - 1:
            self._helpers = host_copy.Helpers(self.copy_threads - 1)
        copy = host_copy.HostCopy(self._helpers, span=self.arena.span, plans=self._plans)
        switch = sys.getswitchinterval()
        if self._helpers.n:  # a helper takes the GIL between pieces: see SWITCH_S
            sys.setswitchinterval(min(switch, SWITCH_S))
        try:
            copy.ahead(self._ahead)
            if callable(files):
                files, check = files()
            return self._pack(copy, files, check, gathered)
        except BaseException:
            copy.abandon()  # no helper writes into the arena once this returns
            raise
        finally:
            sys.setswitchinterval(switch)

    def _pack(self, copy, files, check, gathered):
        import torch as th

        # the storages of the last saves (this step's too, mostly: not the RNG states a save
        # makes anew), copied while the payload pickles
        copy.start(self._ahead, check)
        used = {}
        cuda = {}  # storage key -> its CUDA device, of the storages in ``used`` on one
        total = [0]

        def locate(storage, nbytes):
            """The arena offset of ``storage``'s buffer (recording the copy to make), or None
            for a storage pickled as it is (not on the CPU or CUDA)."""
            key = (storage._cdata, nbytes)  # async_save.storage_key
            entry = used.get(key)
            if entry is not None:
                return entry[0]
            entry = self._buffers.get(key)
            if entry is not None:  # the same storage as at the last save (the entry holds it)
                if key in self._cuda:
                    cuda[key] = self._cuda[key]
            else:
                device = storage.device
                if device.type not in ("cpu", "cuda"):
                    return None
                off = self.arena.offset_of(storage) if gathered else None
                if off is not None:  # in place: nothing to copy
                    entry = (off, None, None)
                else:
                    off, view = self.arena.alloc(nbytes, pinned=device.type == "cuda")
                    src = th.empty(0, dtype=th.uint8, device=device).set_(storage)
                    entry = (off, view, src)
                    if device.type == "cuda":
                        cuda[key] = device
            used[key] = entry
            total[0] += nbytes
            return entry[0]

        buf = io.BytesIO()
        _Packer(buf, locate).dump(files)
        copied, on_cpu, by_device = {}, {}, {}  # not in the arena already; of those, on the CPU
        for key, entry in used.items():
            if entry[1] is None:
                continue
            copied[key] = entry
            device = cuda.get(key)
            if device is None:
                on_cpu[key] = entry
            else:
                by_device.setdefault(device, ([], []))
                by_device[device][0].append(entry[1])
                by_device[device][1].append(entry[2])
        for views, srcs in by_device.values():
            th._foreach_copy_(views, srcs, non_blocking=True)
        for device in sorted(by_device, key=str):
            th.cuda.synchronize(device)
        self.non_finite = copy.finish(on_cpu)
        self._ahead = {k: e for k, e in on_cpu.items()  # all of them after the first pack
                       if not self._buffers or self._buffers.get(k) is e}
        self._buffers, self._cuda = copied, cuda
        self.nbytes = total[0]
        return self.arena.size, buf.getvalue()

    def start(self):
        """The child started now (its interpreter, imports and rehearsal of a write run while
        training goes on: first_save.py), from the calling thread (the main thread: the kernel
        ends the child with it). Not collective."""
        with self._lock:
            self._start()

    def prepare(self, files, check=()):
        """Ready the first pack of ``files`` (step files of the run's current state, as ``pack``
        takes them; ``check`` as pack's) before it comes: the child started, the arena grown
        once to the step's size and its pages faulted in on a thread of its own
        (Arena.populate; the child then maps them too), a buffer laid out for every storage in
        the order pack visits them, and the copy's pieces planned (host_copy.HostCopy.start
        without copying). The first pack then finds what a later one finds (the same storages:
        a model's parameters, EMAs and optimizer moments keep theirs) and copies ahead. Nothing
        is copied, no training state changes, and the arena holds what the first pack would
        allocate, plus PREPARE_SLACK for the storages a save makes anew. Only before the first
        pack (else nothing happens). Returns while the pages are faulted in; pack and
        alloc_for_gather wait for that first. Not collective."""
        import torch as th

        with self._lock:
            self._start()
        if self._buffers or self.arena.high or self._warming is not None:
            return
        order = {}  # storage key -> storage, in the order the pickling visits them

        def visit(storage, nbytes):
            if storage.device.type in ("cpu", "cuda"):
                order.setdefault((storage._cdata, nbytes), storage)
            return 0  # (a reference, not the tensor's bytes)

        _Packer(io.BytesIO(), visit).dump(files)
        self.arena._grow(sum(-(-n // ALIGN) * ALIGN for _, n in order) + PREPARE_SLACK)
        buffers, cuda = {}, {}
        for key, storage in order.items():
            off, view = self.arena.alloc(key[1])
            src = th.empty(0, dtype=th.uint8, device=storage.device).set_(storage)
            buffers[key] = (off, view, src)
            if storage.device.type == "cuda":
                cuda[key] = storage.device
        on_cpu = {k: e for k, e in buffers.items() if k not in cuda}
        if self._helpers is None or self._helpers.n != self.copy_threads - 1:
            self._helpers = host_copy.Helpers(self.copy_threads - 1)
        host_copy.HostCopy(self._helpers, span=self.arena.span, plans=self._plans).start(
            on_cpu, check, launch=False)
        self._buffers, self._cuda, self._ahead = buffers, cuda, on_cpu
        self.nbytes = sum(n for _, n in order)
        self._warming = threading.Thread(target=self._populate, args=(bool(cuda),),
                                         name="checkpoint-arena-warm-up", daemon=True)
        self._warming.start()

    def _populate(self, pin):
        """prepare's thread: the arena's pages faulted in, page-locked when CUDA copies into
        them; then the child told to map them (before its first write)."""
        try:
            self.arena.populate()
            if pin:
                self.arena._pin()
        except Exception:  # not fatal: the first copy faults them in itself
            pass
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send_bytes(pickle.dumps({"map": self.arena.size}))
                    self._conn.send_bytes(b"")
                except OSError:
                    pass  # (a child that died: the next write says so)

    def _warmed(self):
        """Wait for prepare's thread (bounded: it faults in the pages the first copy would)."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def write(self, log_dir, step, packed, keep=0, settings=None):
        """Write ``step``'s files (``packed`` by ``pack``) into ``log_dir`` in the child, then
        prune to ``keep`` complete steps; blocks until done (see the module docstring).
        ``settings``: the run's settings for the step's manifest (run_dir.write_step)."""
        arena_size, payload = packed
        with self._lock:
            self._start()
            header = pickle.dumps({"log_dir": os.fspath(log_dir), "step": int(step),
                                   "keep": int(keep), "arena_size": arena_size,
                                   "settings": settings})
            try:
                self._writes += 1
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

    def hurry(self):
        """The trainer now waits for the write: the child's threads back to this process's nice
        level (best effort: without the privilege to lower a nice value, nothing changes).
        Not collective; costs no wait."""
        proc = self._proc
        if proc is not None and WRITER_NICE:
            _renice(proc.pid, os.getpriority(os.PRIO_PROCESS, 0))

    def close(self):
        """End the child (after the write in flight, if any) and free the arena."""
        with self._lock:
            self._finalizer()

    def _start(self):
        """Start the child when there is none: it inherits the socket, the arena and copies of
        the job's lock descriptors (run_lock.held_locks), and the kernel ends it with this
        thread when this is the main thread (see the module docstring)."""
        from . import run_lock

        locks = run_lock.held_locks()
        if self._proc is not None and (self._writes or locks == self._locks):
            return
        if self._proc is not None:  # started early (start()), before the job took a lock that
            _end_idle(self._proc, self._conn)  # it must hold a copy of: started again
            self._proc = self._conn = None
        ours, theirs = socket.socketpair()
        boot = ("import sys; from multiprocessing.connection import Connection; "
                "c = Connection(int(sys.argv[1])); import pickle; p = pickle.loads(c.recv_bytes());"
                " sys.path[:] = p['sys_path']; "
                "from improved_diffusion.ckpt.writer_process import _child_main; _child_main(c, p)")
        try:
            with _signals_blocked():  # the child starts with them blocked, until it ignores them
                proc = subprocess.Popen(
                    [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", boot,
                     str(theirs.fileno())],
                    pass_fds=(theirs.fileno(), self.arena.fd, *(fd for _, fd in locks)),
                    stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps({
            "sys_path": list(sys.path), "parent": os.getpid(), "arena_fd": self.arena.fd,
            "main": _importable_main(), "locks": locks,
            "nice": _writer_nice(),
            "die_with_parent": threading.current_thread() is threading.main_thread()}))
        self._proc, self._conn, self._locks = proc, conn, locks

    def _died(self, log_dir, step):
        """The CheckpointError of a child that ended during the write of ``step``."""
        from . import checkpoint, run_dir

        proc, conn = self._proc, self._conn
        self._proc = self._conn = None  # the next write starts a new one
        conn.close()
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        how = ("still running" if code is None else f"killed by signal {-code}" if code < 0
               else f"exit code {code}")
        manifest = checkpoint.join(log_dir, checkpoint.manifest_filename(step))
        if checkpoint.exists(manifest):
            kept = f"its manifest was written, so step {step} is complete on disk"
        else:
            kept = (f"step {step} has no manifest, so it does not count and a rerun resumes "
                    f"from the last complete step")
        if code == EXIT_LOCK_LOST:
            return run_dir.CheckpointError(
                f"{log_dir}: the checkpoint writer process (pid {proc.pid}) stopped while "
                f"saving step {step}, before putting a file in place: the log dir's lock file is "
                f"no longer the one this job locked (removed, or the lock let go), so another "
                f"job may own the log dir; {kept}; check that no other job writes this log dir")
        return run_dir.CheckpointError(
            f"{log_dir}: the checkpoint writer process (pid {proc.pid}) died ({how}) while "
            f"saving step {step}; {kept}; see the job's log for why (out of memory? killed?)")


def _shut_down(state):
    """Close the connection (the child ends at once when idle), wait for the child, free the
    arena's descriptor. Safe to call twice; also the finalizer at the interpreter's exit."""
    conn, proc = state.get("_conn"), state.get("_proc")
    state["_conn"] = state["_proc"] = None
    if proc is not None and not state.get("_writes"):
        _end_idle(proc, conn)  # (started early and never written to: may still be importing)
        proc = conn = None
    if conn is not None:
        conn.close()
    if proc is not None:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    arena = state.get("arena")
    if arena is not None:
        arena.close_fd()


def _end_idle(proc, conn):
    """End a child that was never handed a write (nothing of it to wait for)."""
    conn.close()
    proc.kill()
    proc.wait()


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


class _Packer(pickle.Pickler):
    """Pickles a payload for the child: each CPU or CUDA tensor as a reference to the arena
    buffer of its storage (``locate(storage, nbytes)`` -> offset, which also records the copy
    to make; None: pickle the tensor as it is), everything else as it is. Only tensors reach
    Python code here (a dispatch table entry for the tensor type): pickling the rest runs at C
    speed. The pickle memo keeps one tensor object that appears twice one object in the child,
    as torch.save records it."""

    def __init__(self, f, locate):
        import torch as th

        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self._locate = locate
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table[th.Tensor] = self._tensor

    def _tensor(self, t):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        off = self._locate(storage, nbytes) if nbytes else None
        if off is None:
            return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # pickled whole
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            dtype = _DTYPE_NAMES[t.dtype] = str(t.dtype).rpartition(".")[2]
        return (_arena_tensor, (off, nbytes, dtype, t.storage_offset(), tuple(t.size()),
                                t.stride()))


_DTYPE_NAMES = {}  # torch dtype -> its name in torch ("float32"), as packed tensors carry it


def _arena_tensor(*args):
    """The name a packed tensor is pickled under; the child's _Unpickler resolves it to its
    own rebuild over the arena (never called)."""
    raise RuntimeError("writer_process: an arena tensor unpickled outside the writer process")


class _Unpickler(pickle.Unpickler):
    """Rebuilds the packed tensors over the child's mapping of the arena: one storage per
    (offset, size), so tensors that shared a storage share one again (no copy)."""

    def __init__(self, f, mapping):
        super().__init__(f)
        self._mapping = mapping
        self._storages = {}

    def find_class(self, module, name):
        if module == __name__ and name == "_arena_tensor":
            return self._tensor
        return super().find_class(module, name)

    def _tensor(self, off, nbytes, dtype, offset, size, stride):
        import torch as th

        storage = self._storages.get((off, nbytes))
        if storage is None:
            storage = th.frombuffer(self._mapping, dtype=th.uint8, count=nbytes,
                                    offset=off).untyped_storage()
            self._storages[(off, nbytes)] = storage
        return th.empty(0, dtype=getattr(th, dtype)).set_(storage, offset, size, stride)


# ------------------------------------------------------------------------- the child


def _child_main(conn, prep):
    """The writer process (started by WriterProcess._start with ``prep``: the trainer's
    sys.path, pid, the arena's descriptor, its main script when that is importable, the job's
    lock descriptors, whether the kernel may end it with the thread that started it): end with
    the trainer (the kernel's signal, else a watch of the parent pid), ignore the trainer's
    signals, guard every file put in place (PublishGuard), run the main script as spawn would
    (so what it sets up at import, a test's slow or recorded writes, holds here too), then serve
    writes until the connection closes."""
    from . import file_writer

    if prep["die_with_parent"]:
        _die_with_parent()
    if os.getppid() != prep["parent"]:  # the trainer ended before the line above took effect
        os._exit(EXIT_TRAINER_GONE)
    for sig in _signals_blocked.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _signals_blocked.SIGNALS)
    threading.Thread(target=_watch_parent, args=(prep["parent"],), name="parent-watch",
                     daemon=True).start()
    guard = PublishGuard(prep["parent"], prep["locks"])
    file_writer.publish_check = guard
    if prep["main"]:
        import runpy

        runpy.run_path(prep["main"], run_name="__mp_main__")
    _rehearse()
    fd = prep["arena_fd"]
    maps = {}
    while True:
        try:
            header = pickle.loads(conn.recv_bytes())
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if "map" in header:  # prepare(): the arena as the first write finds it, mapped now
            maps.clear()
            maps[header["map"]] = mmap.mmap(
                fd, header["map"], flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            continue
        if prep.get("nice") is not None:  # each write starts nicer than the trainer
            _renice(os.getpid(), prep["nice"])
        reply = _serve(header, payload, fd, maps, guard)
        try:
            conn.send_bytes(reply)
        except OSError:
            return


def _rehearse():
    """The child, before its first write: import what a write uses and write a small file once,
    outside any log dir (torch's zip writer, the checksums, the fsync: what a process loads or
    learns at its first write, torch_zip.learned), so that its first write costs what a later
    one does (first_save.py). Best effort."""
    import tempfile

    try:
        import torch as th

        from . import file_writer, run_dir  # noqa: F401  (what _serve uses)

        with tempfile.TemporaryDirectory(prefix="checkpoint-writer-") as d:
            file_writer.write_file(os.path.join(d, "rehearsal.pt"), {"w": th.zeros(1024)},
                                   crc_threads=1)
    except Exception:  # the first write then loads it itself, and says what fails
        pass


def _writer_nice():
    """The nice level the child writes at while training goes on: WRITER_NICE above this
    process's, where it may set it back (may_renice), else None (the child keeps this
    process's level)."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    return mine + WRITER_NICE if WRITER_NICE and may_renice(mine) else None


def _renice(pid, nice):
    """Set every thread of process ``pid`` to nice level ``nice`` (Linux: a nice level belongs
    to a thread, /proc/PID/task lists them); best effort: a thread that ended, or a level this
    process may not set (lowering one needs a privilege), is left as it is."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


def _importable_main():
    """The path of the script this interpreter was started with (``sys.orig_argv``: the outer
    script also when it runs another one through runpy, as tests/slow_save_train.py runs
    train.py) when running it again under another name does nothing but define things, as
    ``multiprocessing``'s spawn would (its work sits under ``if __name__ == "__main__"``, and no
    other top-level statement is a loop, a with/try block or a bare call): a test's script that
    patches writes at import. Else None (``python -c``, ``-m``, pytest, a script that trains at
    its top level: running it again would train)."""
    import ast

    path = _script_of(getattr(sys, "orig_argv", None) or [])
    if path is None or not path.endswith(".py"):
        return None
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = False
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') in (
                '__name__ == "__main__"', '"__main__" == __name__'):
            guarded = True
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                   ast.AsyncFunctionDef, ast.Assign, ast.AnnAssign)):
            return None
    return os.path.abspath(path) if guarded else None


def _script_of(argv):
    """The script in an interpreter's command line (``python [options] script args``), or None
    for ``-c``, ``-m``, stdin."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-c", "-m", "-"):
            return None
        if a in ("-W", "-X"):
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            return a
    return None


def _die_with_parent():
    """Ask the kernel to SIGKILL this process as the thread that started it ends (prctl's
    PR_SET_PDEATHSIG); nothing where there is no prctl (then _watch_parent does it, slower)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_parent(parent_pid):
    """End this process once its parent is gone (reparented: the trainer was killed). The
    fallback of _die_with_parent: a Python thread, which a long C call holding the GIL delays."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(EXIT_TRAINER_GONE)
        time.sleep(WATCH_S)


class PublishGuard:
    """The child's check before it puts a file in place in a log dir (file_writer.publish_check,
    called with the file's final path) or prunes one (``check_dir``): this process ends at once,
    putting nothing more in place and removing nothing, when its trainer is gone (its parent pid
    is no longer the trainer's: EXIT_TRAINER_GONE) or when the log dir's lock file is no longer
    the file the job locked (the job let the lock go, or the file was removed: another job may
    own the log dir now; EXIT_LOCK_LOST, which a living trainer reports). ``locks``: [(lock file
    path, descriptor)] of the job's local locks, whose copies this process holds. A log dir that
    is gone is left to the write's own error (file_writer's one line)."""

    def __init__(self, parent, locks):
        self.parent = parent
        self.locks = {os.path.realpath(os.path.dirname(path)): (path, fd) for path, fd in locks}

    def __call__(self, path):
        self.check_dir(os.path.dirname(os.fspath(path)))

    def check_dir(self, directory):
        if os.getppid() != self.parent:
            os._exit(EXIT_TRAINER_GONE)
        if "://" in directory:
            return  # a remote log dir: its lock object goes stale once the trainer is gone
        lock = self.locks.get(os.path.realpath(directory))
        if lock is None:
            return
        path, fd = lock
        try:
            here = os.stat(path)
        except FileNotFoundError:
            if not os.path.isdir(directory):
                return  # the log dir is gone: putting the file there fails, and says so
            os._exit(EXIT_LOCK_LOST)
        mine = os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (here.st_dev, here.st_ino):
            os._exit(EXIT_LOCK_LOST)


def _serve(header, payload, fd, maps, guard):
    """One write; returns the pickled reply ("done", (time, lines)) or ("failed", (error,
    traceback text))."""
    try:
        from . import run_dir

        size = header["arena_size"]
        if size not in maps:
            maps.clear()  # older, smaller mappings: nothing views them any more
            maps[size] = mmap.mmap(fd, size) if size else None
        files = _Unpickler(io.BytesIO(payload), maps[size]).load()
        run_dir.write_step(header["log_dir"], header["step"], files, crc_threads=1,  # beside steps
                           settings=header.get("settings"))
        del files
        guard.check_dir(header["log_dir"])  # pruning removes files: the same guard
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
