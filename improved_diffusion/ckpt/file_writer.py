"""
Writing one checkpoint file, and the checksums a manifest lists: the atomic writer (a temporary
name, hashed while written, fsync, a no-overwrite link or rename, the directory fsynced), the
CRC-32 of a file as it is written (``ChecksumWriter``, from the records' CRC-32s in their data
descriptors: torch_zip computes them), ``file_digest`` for a file on disk, and the one-line
wording of disk faults (full, read-only, no permission, a vanished directory) for every writer
of the log dir (run_dir, logger). What a file holds and how it is read is checkpoint.py's; the
bytes of a .pt file are torch.save's, written by torch_zip.save.
"""

import ctypes
import errno
import functools
import hashlib
import os
import uuid
import zlib

from ..infra.errors import typed_one_line
from ..infra import storage
from . import torch_zip
from .checkpoint import CheckpointError, CheckpointReadError, basename, dirname, exists, is_remote


# ---------------------------------------------------------------------------------------------
# checksums

# The checksum a manifest lists for each file beside its size, under its own name: the CRC-32 of
# the whole file (zlib's, as 8 hex digits), which the writer gets almost for free from the
# records' CRC-32s the file holds anyway. Manifests of format version 1 list "sha256"; both are
# read (CHECKSUMS).
CHECKSUM = "crc32"
CHECKSUMS = ("crc32", "sha256")
# The manifest's own format version (2: crc32 in place of sha256); the .pt files stay VERSION.
MANIFEST_VERSION = 2


def checksum_of(info):
    """(algorithm, hex value) of a manifest's entry for one file ({"size", "crc32" or
    "sha256"}); (None, None) when it lists none of CHECKSUMS."""
    if isinstance(info, dict):
        for algorithm in CHECKSUMS:
            if isinstance(info.get(algorithm), str):
                return algorithm, info[algorithm]
    return None, None


class _Crc32:
    """zlib's CRC-32 with hashlib's interface (update, hexdigest)."""

    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self):
        return f"{self.value:08x}"


def _hasher(algorithm):
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")


def file_digest(path, algorithm=CHECKSUM):
    """{"size", algorithm: hex} of a file (``algorithm`` one of CHECKSUMS), read in 8 MB pieces;
    CheckpointReadError when a read fails."""
    h = _hasher(algorithm)
    size = 0
    try:
        with storage.open(path, "rb") as f:
            while True:
                chunk = f.read(8 * 1024 * 1024)
                if not chunk:
                    break
                h.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ({typed_one_line(e)}); check that it is "
                                  f"reachable and readable") from e
    return {"size": size, algorithm: h.hexdigest()}


# CRC-32 of a concatenation from the CRC-32s of its parts (zlib's crc32_combine, which Python's
# zlib does not expose): in GF(2), crc(A + B) = crc(A) * x^(8 len(B)) + crc(B) mod the CRC's
# polynomial (reflected bit order, as zlib).
_CRC_POLY = 0xEDB88320


def _crc_multmodp(a, b):
    """a * b modulo the CRC-32 polynomial (bit-reflected 32-bit values)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_CRC_X2N = [1 << 30]  # x^(2^k) mod the polynomial, k = 0..31
for _ in range(31):
    _CRC_X2N.append(_crc_multmodp(_CRC_X2N[-1], _CRC_X2N[-1]))


@functools.lru_cache(maxsize=4096)
def _crc_shift(nbytes):
    """x^(8 * nbytes) mod the polynomial (cached: a model's tensors share few sizes)."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _crc_multmodp(_CRC_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc_a, crc_b, len_b):
    """zlib.crc32(A + B) from zlib.crc32(A), zlib.crc32(B) and len(B) (``crc_a`` 0, as for a
    record's first piece: ``crc_b`` itself, since 0 times any shift is 0).

    >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
    True
    """
    if not crc_a:
        return crc_b
    return _crc_multmodp(_crc_shift(len_b), crc_a) ^ crc_b


# ---------------------------------------------------------------------------------------------
# writing


def _fsync_dir(d):
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Called with a file's final path just before the file is put in place (linked or renamed there,
# or uploaded); None, or a check that ends this process when it may no longer write into that
# directory. Only the checkpoint writer process sets one (writer_process.PublishGuard: a write
# whose trainer is gone, or whose job no longer holds the log dir's lock, puts nothing in place).
publish_check = None


def atomic_write(path, obj):
    """
    Write ``obj`` (torch.save'd; raw ``bytes`` are written as they are) to ``path`` so that the
    file either does not exist or is complete: a temp name in the same directory, flush + fsync,
    then a no-overwrite rename (hard link + unlink, else os.replace). Object-store URLs (s3://,
    gs://, az://: storage.py) are streamed under their final name with the store's conditional
    create, the object appearing only once the upload completes (a failed write publishes
    nothing).
    Refuses to overwrite an existing file (CheckpointError). Returns {"size", "crc32"}.

    A full disk, an exceeded quota, a read-only file system, a denied permission or a vanished
    directory is a CheckpointError whose one line names the directory and what to do (see
    ``storage.disk_fault``); the temp file is removed. Any other error keeps its type and traceback.

    Not collective; ``save_step`` calls it on rank 0.
    """
    path = os.fspath(path)
    try:
        return write_file(path, obj)
    except (OSError, RuntimeError) as e:
        fault = storage.disk_fault(e, dirname(path))
        if fault is None:
            raise
        raise CheckpointError(storage.fault_message(
            fault, dirname(path), f"writing {basename(path)}", "nothing partial was left there")
        ) from None


def write_file(path, obj, crc_threads=None):
    """``atomic_write`` without the disk-fault messages (raises the OSError itself); for a caller
    that words the fault itself (run_dir.save_step). ``crc_threads``: torch_zip.save's
    ``threads``."""
    if exists(path):
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint "
                              f"(move it away or start from a later step)")
    if is_remote(path):
        return _write_object(path, obj, crc_threads)

    d = dirname(path)
    tmp = os.path.join(d, f"{basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f, open(tmp, "rb") as back:
            out = ChecksumWriter(f, reread=lambda offset, n: os.pread(back.fileno(), n, offset),
                                 writeback=f.fileno())
            _save_into(obj, out, crc_threads)
            f.flush()
            info = out.digest()
            os.fsync(f.fileno())
        if publish_check is not None:
            publish_check(path)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint "
                                  f"(move it away or start from a later step)") from None
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            if os.path.lexists(path):
                raise CheckpointError(f"{path}: already exists; refusing to overwrite a "
                                      f"checkpoint (move it away or start from a later step)")
            os.replace(tmp, path)
        _fsync_dir(d)
        return info
    except (OSError, RuntimeError) as e:
        # the free space as the write failed, before its partial file (and the step's others)
        # are removed: what the disk-full line reports
        e.free_bytes_at_failure = storage.free_bytes(d)
        raise
    finally:
        _unlink_quietly(tmp)


def _write_object(path, obj, crc_threads):
    """write_file for an object store: streamed under the final name (parts uploaded as they
    fill, never a second copy of the bytes in memory), the CRC-32 of every byte computed as it
    passes (an upload cannot be read back), published at close only (the store's conditional
    create: an object that appeared meanwhile is refused), discarded when anything fails."""
    stream = storage.open_write(path, exclusive=True)
    try:
        out = ChecksumWriter(stream, reread=None)
        out.LARGE = float("inf")  # every write CRC'd as it passes: nothing is read back
        _save_into(obj, out, crc_threads)
        info = out.digest()
        if publish_check is not None:
            publish_check(path)
        stream.close()
    except FileExistsError:
        stream.discard()
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint "
                              f"(move it away or start from a later step)") from None
    except BaseException:
        stream.discard()
        raise
    return info


# os.link fails with these where the filesystem has no hard links (then os.replace is used).
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK,
                  getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}


def _unlink_quietly(path):
    """Remove a local file if it is there; a failure to remove it is not worth a second error."""
    try:
        os.unlink(path)
    except OSError:
        pass


class ChecksumWriter:
    """A file wrapper that computes the size and the CRC-32 (``CHECKSUM``) of the bytes as they
    are written, so that a written file is never read back for its checksum, and remembers the
    OSError of a failed write: torch.save reports one as "RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos ..." without the errno; ``_save_into`` raises the
    remembered OSError instead.

    The CRC of a tensor's bytes costs nothing here: each record's CRC-32 (torch_zip's, else
    torch's zip writer's) is in the data descriptor (``PK\x07\x08``) right after the record's
    data. A large write (``LARGE`` bytes or more) where a record's data begins (after
    a local header ``PK\x03\x04``, its name and extra field) is therefore not read; when the
    next write is the descriptor of a record of that size, its CRC is combined into the file's
    (crc32_combine), and any other pattern (a record written in pieces, another writer) reads
    the bytes back (``reread(offset, n)``, from the file as written) and computes it. Every
    other write is CRC'd as it passes. The file's CRC is that of all its bytes, whoever computed
    which part (file_digest gives the same).

    ``writeback``: the file descriptor whose written bytes the kernel is asked to start writing
    to the disk every WRITEBACK_BYTES (Linux sync_file_range, no wait), so that the final fsync
    finds most of the file on disk already, instead of the disk idling while the CPU serialises.
    """

    LARGE = 1 << 16
    WRITEBACK_BYTES = 32 << 20

    def __init__(self, f, reread, writeback=None):
        self._f = f
        self._reread = reread
        self._writeback = writeback if sync_file_range() is not None else None
        self.error = None
        self._forget_written()

    def _forget_written(self):
        """The state of a file with nothing written yet."""
        self._crc = 0
        self._pending = None  # (offset, nbytes) of a large write whose CRC is not known yet
        self._data_at = None  # where the data of the record whose local header passed begins
        self._started = 0  # bytes handed to writeback so far
        self.size = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._pending is not None:
            self._resolve_pending(view)
        if n == 30 and view[:4] == b"PK\x03\x04":  # a local header: name, extra, then the data
            self._data_at = self.size + 30 + int.from_bytes(view[26:28], "little") \
                + int.from_bytes(view[28:30], "little")
        if n >= self.LARGE and self.size == self._data_at:
            self._pending = (self.size, n)
        else:
            self._crc = zlib.crc32(view, self._crc)
        try:
            written = self._f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.size += n
        if self._writeback is not None and self.size - self._started >= self.WRITEBACK_BYTES:
            self._start_writeback()
        return written

    def _resolve_pending(self, view):
        """The CRC of the pending large write: from ``view`` when it is that record's data
        descriptor (crc32, then sizes of 4 or, zip64, 8 bytes each), else read back."""
        offset, n = self._pending
        self._pending = None
        if view.nbytes in (16, 24) and view[:4] == b"PK\x07\x08":
            width = (view.nbytes - 8) // 2
            size = int.from_bytes(view[8 + width:8 + 2 * width], "little")
            if size == n:
                record_crc = int.from_bytes(view[4:8], "little")
                self._crc = crc32_combine(self._crc, record_crc, n)
                return
        self.flush()
        self._crc = zlib.crc32(self._reread(offset, n), self._crc)

    def _start_writeback(self):
        try:
            self._f.flush()
            sync_file_range()(self._writeback, self._started, self.size - self._started,
                              _SYNC_FILE_RANGE_WRITE)
        except OSError as e:
            self.error = e
            raise
        self._started = self.size

    def flush(self):
        return self._f.flush()

    def restart(self):
        """Forget everything written: the file truncated to nothing, the CRC and size back to
        0 (torch_zip.save writes a file again from the start this way; an object's upload is
        dropped and begun again)."""
        if hasattr(self._f, "restart"):
            self._f.restart()
        else:
            self._f.flush()
            self._f.seek(0)
            self._f.truncate()
        self._forget_written()

    def digest(self):
        """{"size", CHECKSUM} of everything written so far (file_digest's format); call it while
        the file is open (a large last write is read back)."""
        if self._pending is not None:
            self._resolve_pending(memoryview(b""))
        return {"size": self.size, CHECKSUM: f"{self._crc:08x}"}


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait
_SYNC_FILE_RANGE = []


def sync_file_range():
    """Linux's sync_file_range(fd, offset, nbytes, flags) through libc (raising OSError), or None
    where there is none (another OS, no libc symbol)."""
    if not _SYNC_FILE_RANGE:
        fn = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            raw = libc.sync_file_range
            raw.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            raw.restype = ctypes.c_int

            def fn(fd, offset, nbytes, flags):
                if raw(fd, offset, nbytes, flags) != 0:
                    err = ctypes.get_errno()
                    if err not in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS):  # not supported
                        raise OSError(err, os.strerror(err))
        except (OSError, AttributeError):
            fn = None
        _SYNC_FILE_RANGE.append(fn)
    return _SYNC_FILE_RANGE[0]


def _save_into(obj, out, crc_threads=None):
    """Write ``obj`` (raw bytes as they are, else torch.save's file through torch_zip.save, its
    records' CRCs computed on ``crc_threads`` threads, in parallel with the write) into ``out``
    (a ChecksumWriter)."""
    if isinstance(obj, (bytes, bytearray)):
        out.write(obj)
        return
    try:
        torch_zip.save(obj, out, crc32_combine, crc_threads)
    except RuntimeError:
        if out.error is not None:
            raise out.error from None
        raise
