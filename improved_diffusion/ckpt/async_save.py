"""
Checkpoint saves that barely pause training: host copies of payloads, and the one background
thread that waits for a write.

At a save with ``--async_save True`` (the default), rank 0 copies the tensors of every payload
into the writer process's shared memory (writer_process.WriterProcess.pack) and hands them to
``BackgroundWriter``, whose thread passes them to the writer process and waits for it: the
serialising and writing run in that process (run_dir.write_step, manifest last) while training
goes on. ``HostSnapshot.copy`` is the same host copy in this process (buffers kept from the
previous copy, pinned when the tensors live on CUDA), which the thread then writes itself:
for steps below writer_process.PROCESS_MIN_BYTES (``tensor_bytes``), a training whose threads
fill every core (writer_process.core_free), ``--save_writer thread``, or a platform without a
writer process (writer_process.use_process). A
synchronous save writes the same payloads through ``to_host`` (no copy at all for CPU tensors)
in the calling thread. All write the same bytes: a copy keeps each tensor's storage, offset,
shape and strides, and the sharing between tensors and containers, that torch.save records.

Nothing here is collective or knows about ranks: the checkpointer decides who snapshots (rank 0) and
when every rank learns of a failed write.
"""

import copy
import threading

import numpy as np
import torch as th

# Containers rebuilt by the copy (any other object that is not a tensor is deep-copied, since
# training may change it while the writer serialises it; immutable ones are kept as they are).
_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None), th.dtype, th.device, th.Size)


class HostSnapshot:
    """
    Host copies of payloads, in buffers reused from one save to the next.

    ``copy(obj)`` returns ``obj`` with every tensor replaced by a copy on the host, in a buffer
    that the previous ``copy`` used for the same source storage when there is one (same storage,
    same size: a model's parameters, EMAs and Adam moments keep theirs for the whole run), else a
    new one; buffers no longer used are dropped. Tensors on CUDA are copied into pinned buffers
    without blocking, then waited for once. The caller must not call ``copy`` again while a
    writer still reads the previous result (TrainLoop waits for the previous save first).
    """

    def __init__(self, arena=None):
        self._buffers = {}
        self._arena = arena
        self.nbytes = 0  # bytes held in buffers after the last copy

    def copy(self, obj):
        used = {}
        arena = self._arena
        if arena is not None and arena.high > 2 * self.nbytes + (1 << 20):
            self._buffers = {}  # the arena holds more dropped buffers than live ones: start over
            arena.reset()
        out = _HostCopier(self._buffers, used, arena).walk(obj)
        self._buffers = used
        self.nbytes = sum(b.nbytes() for b in used.values())
        return out


def to_host(obj):
    """``obj`` with its CUDA tensors copied to (new, unpinned) host memory and its CPU tensors as
    they are (no copy): what a synchronous save writes. Same structure as HostSnapshot.copy."""
    return _HostCopier(None, None).walk(obj)


class _HostCopier:
    """One walk over a payload; ``buffers``/``used`` None: a synchronous save's to_host."""

    def __init__(self, buffers, used, arena=None):
        self._buffers = buffers
        self._used = used
        self._arena = arena
        self._memo = {}  # id(source object) -> its copy (pickle records sharing: keep it)
        self._storages = {}  # source storage -> host storage, within this walk
        self._devices = set()  # the CUDA devices copied from without blocking

    def walk(self, obj):
        out = self._walk(obj)
        wait_for_copies(self._devices)
        return out

    def _walk(self, obj):
        if isinstance(obj, _IMMUTABLE):
            return obj
        key = id(obj)
        if key in self._memo:
            return self._memo[key][1]
        if isinstance(obj, th.Tensor):
            out = self._tensor(obj)
        elif isinstance(obj, dict):
            out = type(obj)()
            self._memo[key] = (obj, out)
            for k, v in obj.items():
                out[self._walk(k)] = self._walk(v)
            if getattr(obj, "__dict__", None):
                out.__dict__.update(copy.deepcopy(obj.__dict__))
            return out
        elif isinstance(obj, list):
            out = []
            self._memo[key] = (obj, out)
            out.extend(self._walk(v) for v in obj)
            return out
        elif isinstance(obj, tuple) and type(obj) is tuple:
            out = tuple(self._walk(v) for v in obj)
        elif isinstance(obj, np.ndarray):
            out = obj if self._buffers is None else obj.copy()
        else:
            out = obj if self._buffers is None else copy.deepcopy(obj)
        self._memo[key] = (obj, out)  # the source is kept alive, so its id stays unique
        return out

    def _tensor(self, t):
        t = t.detach()
        if self._buffers is None and t.device.type == "cpu":
            return t  # a synchronous save writes CPU tensors as they are
        src = t.untyped_storage()
        skey = storage_key(src)
        host = self._storages.get(skey)
        if host is None:
            host = self._host_storage(skey, src)
            # as byte tensors: a tensor copy uses torch's intra-op threads (a storage copy does not)
            _bytes(host).copy_(_bytes(src), non_blocking=src.device.type == "cuda")
            if src.device.type == "cuda":
                self._devices.add(src.device)
            self._storages[skey] = host
        return th.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())

    def _host_storage(self, skey, src):
        if self._buffers is None:
            return th.UntypedStorage(src.nbytes())
        buf = self._buffers.get(skey)
        if buf is None and self._arena is not None and src.nbytes():
            buf = self._arena.alloc(src.nbytes(), pinned=src.device.type == "cuda")
        elif buf is None:
            pin = src.device.type == "cuda"
            buf = th.empty(src.nbytes(), dtype=th.uint8, pin_memory=pin).untyped_storage()
        self._used[skey] = buf
        return buf


def storage_key(storage):
    """What names ``storage`` among a payload's (the address of torch's storage object, unique
    while it lives, on any device; its size): the key under which host copies reuse a buffer
    from one save to the next (a buffer holds its source storage, which therefore lives;
    writer_process.WriterProcess.pack builds the same key inline)."""
    return storage._cdata, storage.nbytes()


def tensor_bytes(obj):
    """Bytes of the tensor storages in ``obj`` (dicts, lists and tuples walked; a storage that
    several tensors share counted once): what a host copy of ``obj`` copies. A DTensor (a
    sharded model's) counts its global shape: what fsdp.gather_full makes of it on rank 0.

    >>> w = th.zeros(4, 4); tensor_bytes({"a": w, "b": [w.T, th.zeros(2, dtype=th.float64)]})
    80
    """
    seen, stack = {}, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, th.Tensor) and hasattr(o, "device_mesh"):  # a DTensor: made whole
            seen[("whole", id(o))] = o.numel() * o.element_size()
        elif isinstance(o, th.Tensor):
            s = o.untyped_storage()
            seen[storage_key(s)] = s.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return sum(seen.values())


def wait_for_copies(devices):
    """Wait until the non-blocking copies from each CUDA device in ``devices`` are done: each is
    synchronised itself (th.cuda.synchronize() alone waits on the current device only, and a
    process may copy from another one, e.g. a single process with LOCAL_RANK=1)."""
    for device in sorted(devices, key=str):
        th.cuda.synchronize(device)


def _bytes(storage):
    """A flat uint8 tensor over all of ``storage`` (no copy)."""
    return th.empty(0, dtype=th.uint8, device=storage.device).set_(storage)


class BackgroundWriter:
    """
    One background job at a time (a save: waiting for the writer process, or writing itself), in a
    non-daemon thread: a process that ends for another reason still waits for the files it
    began (the write is never cut half-way by the interpreter's exit).

    ``start(fn)`` runs ``fn()`` in the thread; ``poll()`` returns None while it runs or when there
    is nothing new, else ``("done", result)`` or ``("failed", exception)`` once (the exception
    keeps its traceback); ``wait()`` blocks until it ends and returns the same (or None).
    """

    def __init__(self):
        self._thread = None
        self._outcome = None

    @property
    def busy(self):
        return self._thread is not None

    @property
    def running(self):
        """Whether the job still runs (busy stays True after it ends, until it is collected)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn):
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.start: the previous job was not waited for")

        def run():
            try:
                self._outcome = ("done", fn())
            except BaseException as e:  # handed to the main thread, which raises it
                self._outcome = ("failed", e)

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self._thread.start()

    def poll(self):
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def wait(self):
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        return outcome
