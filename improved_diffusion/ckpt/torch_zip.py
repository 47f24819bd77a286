"""
torch.save's file, byte for byte, with the records' CRC-32s computed here: in parallel, and
while the bytes are being written, instead of by torch one byte after another before each write.

Why: torch's zip writer computes the CRC-32 of every record before it hands the record to the
file, on the saving thread (about 1.5 GB/s here, zlib's 2.4 GB/s). At 60M-250M parameters on
this CPU that is about a third of a synchronous save (benchmarks/checkpoint.py, save_sync_s).
zlib's CRC releases the GIL, so a large record's CRC is split into pieces computed on a few
threads while the write itself runs (``PARALLEL_MIN``, ``workers()``) and combined
(file_writer.crc32_combine): for a save the training waits for. A background write, beside
the steps, passes ``threads=1``: each large record's CRC whole on one pool thread while the
writing thread writes it (the two overlap: the write no longer waits for its CRC first; measured
in docs/performance.md, "A background save's three costs").

How: torch's own writer with its CRCs off (``torch._C.PyTorchFileWriter(out, False, alignment)``
and ``torch.serialization._save``, what torch.save runs), into a ``_CrcFiller`` that follows the
zip records as they pass and writes the CRCs in where torch leaves zeros:

- each record: a local header (30 bytes, ``PK\\x03\\x04``; "a descriptor follows" flag), its
  name, its extra field (alignment padding), its data, then a data descriptor (``PK\\x07\\x08``,
  the CRC and the sizes): the descriptor gets the record's CRC. A record without data (an empty
  storage) has no descriptor, and the CRC of no bytes is 0 already;
- ``.data/serialization_id``: torch derives its last 20 digits from the records' CRCs
  (``serialization_id``); they are recomputed from the real ones;
- the central directory (one write, after the records): each entry's CRC.

The result is the file torch.save writes (tests/test_checkpoint.py compares the bytes). Any
other pattern (another torch version's layout) is detected before the file is complete (a name,
size or count that does not match, a serialization id not derived as expected) and the file is
written again from the start by torch.save itself (``save``: the writer's ``restart``); this
process then always uses torch.save.

Not collective; called by file_writer's writer for every .pt file.
"""

import concurrent.futures
import os
import pickle
import threading
import zlib

import torch as th

# A record's data of at least this many bytes has its CRC computed in pieces on the pool's
# threads while the write runs; smaller ones on the writing thread as they pass.
PARALLEL_MIN = 512 << 10
# The smallest piece one thread computes.
PIECE_MIN = 256 << 10
MAX_WORKERS = 4

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_SERIALIZATION_ID = ".data/serialization_id"
_HAS_DESCRIPTOR = 0x8  # general purpose flag bit 3

# What this process learned of its torch: "fast", whether torch's layout is the one followed
# here (None until the first save; False: every file is written by torch.save). Tests reset it.
learned = {"fast": None}
_pool_holder = {"pool": None}  # the CRC threads, started at the first large record
_lock = threading.Lock()


class LayoutUnknown(Exception):
    """torch wrote a zip layout this module does not follow (the file is written again)."""


def workers():
    """Threads for one large record's CRC: the cores this process may use, at most
    MAX_WORKERS."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, n or 1))


def _pool():
    with _lock:
        if _pool_holder["pool"] is None:
            _pool_holder["pool"] = concurrent.futures.ThreadPoolExecutor(
                max_workers=MAX_WORKERS, thread_name_prefix="checkpoint-crc")
        return _pool_holder["pool"]


def _forget_pool_in_child():
    _pool_holder["pool"] = None  # its threads did not survive the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def crc32(view, crc_combine, threads=None):
    """zlib.crc32 of the bytes of ``view`` (a flat byte memoryview), in pieces on up to
    ``threads`` of the pool's threads when it is large (None: workers(); 1: the whole record on
    one of them, beside the write), else at once on this thread; ``crc_combine(crc_a, crc_b,
    len_b)`` joins them. Returns a callable giving the CRC: call it after anything that should
    overlap with the computation (the write of the same bytes)."""
    n = view.nbytes
    threads = workers() if threads is None else max(1, min(threads, workers()))
    if n < PARALLEL_MIN:
        value = zlib.crc32(view)
        return lambda: value
    parts = max(1, min(threads, n // PIECE_MIN))
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [_pool().submit(zlib.crc32, view[a:b]) for a, b in zip(bounds, bounds[1:])]

    def result():
        crc = 0
        for fut, a, b in zip(futures, bounds, bounds[1:]):
            crc = crc_combine(crc, fut.result(), b - a)
        return crc
    return result


_MASK64 = (1 << 64) - 1


def hash_combine(seed, value):
    """c10::hash_combine on 64-bit size_t (boost's)."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) \
        & _MASK64


def serialization_id(given, crcs):
    """The serialization id torch.save writes (40 digits: a hash of the record names, then the
    records' CRCs hash-combined), from ``given``, the one torch wrote with its CRCs off (every
    CRC 0), and the real CRCs of the records before it. LayoutUnknown when ``given`` is not
    derived that way (another torch's id)."""
    if len(given) != 40 or not given.isdigit():
        raise LayoutUnknown(f"serialization id {given[:48]!r}")
    zeros = real = 0
    for crc in crcs:
        zeros, real = hash_combine(zeros, 0), hash_combine(real, crc)
    if given[20:] != b"%020d" % zeros:
        raise LayoutUnknown("serialization id not derived from the records' CRCs")
    return given[:20] + b"%020d" % real


class _CrcFiller:
    """A file-like object between torch's zip writer (CRCs off) and ``out``: it follows the
    records (see the module docstring), computes each one's CRC as its data passes, and writes
    the CRCs into the descriptors, the serialization id and the central directory."""

    def __init__(self, out, crc_combine, threads=None):
        self._out = out
        self._combine = crc_combine
        self._threads = threads
        self._records = []  # (name, data size, crc) in the order written
        self._expect = "header"  # header | name | extra | data | tail (after the directory)
        self._need = 0  # bytes still expected in the name or extra field
        self._extra = 0  # the extra field's length (after the name)
        self._name = b""
        self._flags = 0
        self._size = 0
        self._crc = 0
        self.unknown = None  # the LayoutUnknown raised, if any
        self.discard = False

    def write(self, data):
        if self.discard:  # torch's writer after a LayoutUnknown (its destructor finishing the
            return memoryview(data).nbytes  # zip): nothing more reaches ``out``
        try:
            return self._write(data)
        except LayoutUnknown as e:
            self.unknown = e  # torch reports it as its own RuntimeError
            raise

    def _write(self, data):
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._expect == "name":
            self._take_name(view)
        elif self._expect == "extra":
            self._take_extra(n)
        elif self._expect == "header" and n == 30 and view[:4] == _LOCAL:
            self._start_record(view)
        elif self._expect == "header" and view[:4] == _CENTRAL:
            view = self._fill_central(view)
        elif self._expect == "data" and self._is_descriptor(view):
            view = self._fill_descriptor(view)
        elif self._expect == "data":
            return self._data(view)
        elif self._expect != "tail":
            raise LayoutUnknown(f"a write of {n} bytes while expecting {self._expect}")
        self._out.write(view)
        return n

    def flush(self):
        return self._out.flush()

    def _start_record(self, view):
        if bytes(view[14:26]) != bytes(12):  # CRC and sizes: in the descriptor
            raise LayoutUnknown("a local header with its CRC or sizes set")
        self._flags = int.from_bytes(view[6:8], "little")
        self._name, self._size, self._crc = b"", 0, 0
        self._need = int.from_bytes(view[26:28], "little")
        self._extra = int.from_bytes(view[28:30], "little")
        self._expect = "name"

    def _take_name(self, view):
        if view.nbytes > self._need:
            raise LayoutUnknown("a name written with more than the name")
        self._name += bytes(view)
        self._need -= view.nbytes
        if self._need == 0:
            self._need, self._expect = self._extra, "extra"
            if self._need == 0:
                self._end_of_header()

    def _take_extra(self, n):
        if n > self._need:
            raise LayoutUnknown("an extra field written with more than itself")
        self._need -= n
        if self._need == 0:
            self._end_of_header()

    def _end_of_header(self):
        if self._flags & _HAS_DESCRIPTOR:
            self._expect = "data"
        else:  # no descriptor: a record without data (its CRC, 0, is in the header)
            self._records.append((self._name, 0, 0))
            self._expect = "header"

    def _data(self, view):
        if self._name.endswith(_SERIALIZATION_ID.encode()):
            if self._size:
                raise LayoutUnknown("the serialization id in pieces")
            # torch's id hashes the CRCs of the records with data (not those of empty storages)
            crcs = [crc for _, size, crc in self._records if size]
            view = memoryview(serialization_id(bytes(view), crcs))
        crc = crc32(view, self._combine, self._threads)
        try:
            written = self._out.write(view)  # the CRC's threads run meanwhile
        finally:
            value = crc()  # they are done with the bytes before torch may free them
        self._crc = self._combine(self._crc, value, view.nbytes)
        self._size += view.nbytes
        return written

    def _is_descriptor(self, view):
        if view.nbytes not in (16, 24) or view[:4] != _DESCRIPTOR:
            return False
        width = (view.nbytes - 8) // 2
        sizes = {int.from_bytes(view[8:8 + width], "little"),
                 int.from_bytes(view[8 + width:], "little")}
        return self._size > 0 and bytes(view[4:8]) == bytes(4) and sizes == {self._size}

    def _fill_descriptor(self, view):
        self._records.append((self._name, self._size, self._crc))
        self._expect = "header"
        return memoryview(bytes(view[:4]) + self._crc.to_bytes(4, "little") + bytes(view[8:]))

    def _fill_central(self, view):
        """The central directory with each entry's CRC (entries in the records' order)."""
        out = bytearray(view)
        at = 0
        for name, size, crc in self._records:
            if out[at:at + 4] != _CENTRAL:
                raise LayoutUnknown("fewer central directory entries than records")
            name_len, extra_len, comment_len = (int.from_bytes(out[at + k:at + k + 2], "little")
                                                for k in (28, 30, 32))
            sizes = {int.from_bytes(out[at + k:at + k + 4], "little") for k in (20, 24)}
            if (bytes(out[at + 46:at + 46 + name_len]) != name
                    or not sizes <= {size, 0xFFFFFFFF} or out[at + 16:at + 20] != bytes(4)):
                raise LayoutUnknown(f"central directory entry {name!r} does not match")
            out[at + 16:at + 20] = crc.to_bytes(4, "little")
            at += 46 + name_len + extra_len + comment_len
        if at != len(out):
            raise LayoutUnknown("more central directory entries than records")
        self._expect = "tail"
        return memoryview(out)


def _torch_writer(out):
    """(torch's zip writer into ``out`` with its CRCs off, torch's function that writes an
    object's records into it); AttributeError or TypeError where this torch has neither."""
    writer = th._C.PyTorchFileWriter(out, False, th.serialization._get_storage_alignment())
    return writer, th.serialization._save


def save(obj, out, crc_combine, threads=None):
    """torch.save(obj, out) with the records' CRCs computed here (the module docstring).
    ``out``: a file-like object with ``restart()`` (truncate to nothing and start over: used
    when torch's layout is not the one followed here, and the file is written by torch.save).
    ``crc_combine``: file_writer.crc32_combine. ``threads``: threads for a large record's CRC
    (None: workers(), for a save the training waits for; 1: one CRC thread beside the writing
    thread, for a background write beside the steps, where more would take cores from them). An
    error of ``out`` (a full disk) or of the object (a type pickle refuses) is raised as
    torch.save would raise it."""
    zf = None
    if learned["fast"] is not False:
        filler = _CrcFiller(out, crc_combine, threads)
        try:
            zf, save_records = _torch_writer(filler)
        except (AttributeError, TypeError):  # another torch: not the internals followed here
            learned["fast"] = False
    if zf is None:
        th.save(obj, out)
        return
    try:
        save_records(obj, zf, pickle, th.serialization.DEFAULT_PROTOCOL, False)
        zf.write_end_of_file()
    except Exception as e:
        filler.discard = True  # torch's writer, destroyed later, may finish the zip: not in out
        del zf
        if filler.unknown is None and not isinstance(e, LayoutUnknown):
            raise  # out's error (a full disk) or the object's: as torch.save raises it
        learned["fast"] = False  # this torch's layout is not the one followed here
        out.restart()
        th.save(obj, out)
        return
    learned["fast"] = True
