"""Reading one torch file safely: bytes in, objects out, nothing run, every record's CRC checked.

``checked_load(raw, records)`` is ``torch.load(weights_only=True, map_location="cpu")`` through a
reader (``CheckedReader``) that checks the CRC-32 of each zip record as torch reads it, straight
into the new tensor's memory: the bytes are read once and copied once, and a flipped byte inside
a tensor record is found (torch.load itself checks no CRC). Ranks that load one file share the
checking (``share`` = (k, n): the records whose index is k modulo n). ``zip_records`` lists a
file's records from its central directory alone, ``records_digest`` names them (equal files,
equal digests: how ranks tell they see one file).

A file whose pickle holds objects that safe loading refuses (DiT's ``args``, an
``argparse.Namespace``) can be read again with stand-ins (``stand_ins_for``: ``PickledObject``
classes that keep the plain data and run nothing); what to make of them is the format's
(checkpoint.read_pickled_objects).

Nothing here names a file or knows a checkpoint's kinds: failures are ``Unreadable`` (a read
failed: I/O, memory), ``Refused`` (pickled objects) or ``BadBytes`` (the content), each with the
``reason`` a caller puts after the file's name (checkpoint._torch_load words them as
CheckpointReadError / CheckpointError).

Example::

    with open(path, "rb") as f:
        records = zip_records(f)          # [Record(index, name, header_offset, size, crc), ...]
        obj = checked_load(f, records)    # BadBytes("corrupt record 'archive/data/3' ...")
"""
import errno
import hashlib
import io
import pickle
import re
import warnings
import zipfile
import zlib

import torch as th

from ..infra.errors import typed_one_line


def load_error_reason(e):
    """A one-line reason for a torch.load failure (never torch's "use weights_only=False")."""
    text = " ".join(str(e).split())
    if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in text:
        m = re.search(r"GLOBAL ([\w.]+)", text)
        if m:
            return (f"holds pickled code/objects ({m.group(1)}) that safe (weights_only) loading "
                    f"refuses; nothing in it was executed")
        if re.search(r"Unsupported operand", text):
            return "not a torch checkpoint (unreadable or corrupt pickle data)"
        m = re.search(r"WeightsUnpickler error: (.*?)(?:\. |$)", text)
        what = m.group(1)[:120] if m else "unsupported pickle content"
        return (f"holds pickle content that safe (weights_only) loading refuses ({what}); "
                f"nothing in it was executed")
    if "central directory" in text or "zip archive" in text or "PytorchStreamReader" in text:
        return "truncated or corrupt (the zip archive cannot be read)"
    if isinstance(e, (EOFError,)) or "Ran out of input" in text:
        return "truncated (ended early)"
    if (isinstance(e, (pickle.UnpicklingError, UnicodeDecodeError)) or "invalid load key" in text
            or "magic number" in text):
        return "not a torch checkpoint (unreadable pickle data)"
    first = text[:160] or type(e).__name__
    return f"cannot be loaded ({type(e).__name__}: {first})"


class Record:
    """One stored record of a torch zip file (from the central directory)."""

    __slots__ = ("index", "name", "header_offset", "size", "crc")

    def __init__(self, index, name, header_offset, size, crc):
        self.index, self.name, self.header_offset = index, name, header_offset
        self.size, self.crc = size, crc


def zip_records(raw):
    """The records (list of Record) of the torch zip file open in ``raw`` (seekable), from its
    central directory alone; None when it is not a readable zip of stored records (a legacy
    torch file, or damage that torch.load will explain). A failed read raises OSError."""
    if not is_zip(raw):
        return None
    try:
        with zipfile.ZipFile(raw) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, EOFError, ValueError):  # damaged: torch.load explains it
        return None
    except OSError as e:
        if e.errno == errno.EINVAL:  # a seek to a negative offset read from damaged bytes
            return None
        raise
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return None
    return [Record(n, i.filename, i.header_offset, i.file_size, i.CRC)
            for n, i in enumerate(infos)]


def is_zip(raw):
    raw.seek(0)
    return raw.read(4) == b"PK\x03\x04"


def records_digest(records):
    """A digest of a zip's records (names, offsets, sizes, CRCs): equal for equal files."""
    h = hashlib.sha256()
    for r in records or ():
        h.update(f"{r.name}:{r.header_offset}:{r.size}:{r.crc};".encode())
    return h.hexdigest()


class CheckedReader:
    """What torch.load reads a file through: each record torch reads (its 30-byte local header,
    then one readinto of exactly the record, straight into the new tensor's memory) has its
    CRC-32 checked right there, so the bytes are read once and copied once. torch.load itself
    checks no CRC: a flipped byte inside a tensor record would load silently as damaged weights.

    ``mine``: the records this process checks (ranks reading the same file share the work);
    ``finish()`` checks, by reading them, those that torch did not read in that way.
    ``bad``: the first record that failed; ``read_error``: an OSError of the file.
    """

    def __init__(self, raw, mine):
        self._raw = raw
        self._by_header = {r.header_offset: r for r in mine}
        self._by_data = {}
        self._unchecked = {r.index: r for r in mine}
        self.bad = None
        self.read_error = None

    def _seen(self, pos, view):
        rec = self._by_header.get(pos)
        if rec is not None and view.nbytes >= 30 and bytes(view[:4]) == b"PK\x03\x04":
            data = pos + 30 + int.from_bytes(view[26:28], "little") \
                + int.from_bytes(view[28:30], "little")
            self._by_data[data] = rec
            end = data - pos + rec.size
            if view.nbytes < end:
                return
            view, pos = view[data - pos:end], data  # header and data in one read
        rec = self._by_data.get(pos)
        if rec is None or view.nbytes != rec.size or rec.index not in self._unchecked:
            return
        del self._unchecked[rec.index]
        if self.bad is None and zlib.crc32(view) != rec.crc:
            self.bad = rec.name

    def _io(self, fn, *args):
        """``fn(*args)``, remembering an OSError (a failed read, not bad content)."""
        try:
            return fn(*args)
        except OSError as e:
            self.read_error = e
            raise

    def readinto(self, b):
        pos = self._raw.tell()
        n = self._io(self._raw.readinto, b)
        self._seen(pos, memoryview(b).cast("B")[:n or 0])
        return n

    def read(self, n=-1):
        pos = self._raw.tell()
        data = self._io(self._raw.read, n)
        self._seen(pos, memoryview(data))
        return data

    def readline(self, *args):  # a legacy (non-zip) torch file is read as a plain pickle
        return self._io(self._raw.readline, *args)

    def seek(self, *args):
        return self._raw.seek(*args)

    def tell(self):
        return self._raw.tell()

    def readable(self):
        return True

    def seekable(self):
        return True

    def finish(self):
        """Check the records of ``mine`` that torch.load did not read as expected, reading them
        (in 8 MB pieces); raises OSError when a read fails."""
        for rec in list(self._unchecked.values()):
            self._raw.seek(rec.header_offset)
            head = self._raw.read(30)
            if len(head) < 30:
                self.bad = self.bad or rec.name
                continue
            self._raw.seek(rec.header_offset + 30 + int.from_bytes(head[26:28], "little")
                           + int.from_bytes(head[28:30], "little"))
            crc, left = 0, rec.size
            while left:
                piece = self._raw.read(min(left, 8 << 20))
                if not piece:
                    break
                crc, left = zlib.crc32(piece, crc), left - len(piece)
            if (left or crc != rec.crc) and self.bad is None:
                self.bad = rec.name
            del self._unchecked[rec.index]


class MemoryFile(io.RawIOBase):
    """A read-only seekable file over a bytes-like object, without copying it (io.BytesIO copies
    a bytearray)."""

    def __init__(self, data):
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        out = memoryview(b).cast("B")
        n = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self):
        return self._pos



class Unreadable(Exception):
    """A read of the file failed (I/O, memory): not its content. ``reason``: what to say after
    the file's name, advice included."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class BadBytes(Exception):
    """The file's bytes are not a readable torch file (empty, truncated, not torch, a damaged
    record, pickled content refused); ``reason`` says which, after the file's name."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class Refused(BadBytes):
    """Safe (weights_only) loading refused pickled objects (nothing was run); a reader with
    stand-ins for them (``stand_ins_for``) may still read the rest."""


def checked_load(raw, records, share=(0, 1), stand_ins=()):
    """One ``torch.load(weights_only=True, map_location="cpu")`` of the file open in ``raw``
    through a CheckedReader: the CRC-32 of each record in ``records`` (``zip_records(raw)``, None
    for a legacy file) whose index is k modulo n, ``share`` = (k, n), checked as it is read.
    ``stand_ins``: [(class, "module.Name")] read in place of those globals. Raises Unreadable
    (a failed read, out of memory), Refused (pickled objects) or BadBytes (any other bad
    content)."""
    raw.seek(0)
    k, n = share
    reader = CheckedReader(raw, [r for r in records or () if r.index % n == k])
    try:
        with warnings.catch_warnings(), th.serialization.safe_globals(list(stand_ins)):
            warnings.simplefilter("ignore")
            obj = th.load(reader, weights_only=True, map_location="cpu")
        reader.finish()
    except MemoryError:
        raise Unreadable("out of memory while loading it; free memory or load it on a machine "
                         "with more") from None
    except Exception as e:  # torch.load's failures on bad bytes have no common type
        if reader.read_error is not None:  # a read failed (a seek to a negative offset read
            # from damaged bytes is content)
            raise Unreadable(f"cannot read ({typed_one_line(reader.read_error)}); check that it "
                             f"is reachable and readable") from None
        reason = load_error_reason(e)
        if records is None and reason.startswith("cannot be loaded") and not is_zip(raw):
            # no zip: a legacy pickle, whose unpickler fails on random bytes in many ways
            reason = "not a torch checkpoint (unreadable pickle data)"
        if reason.startswith("holds pickle") and "nothing in it was executed" in reason:
            raise Refused(reason) from None
        raise BadBytes(reason) from None
    if reader.bad is not None:  # loaded, but with damaged bytes
        raise BadBytes(f"corrupt record {reader.bad!r} (CRC mismatch: the data was damaged)")
    return obj


# ---------------------------------------------------------------------------------------------


class PickledObject:
    """Stands in, while a file is read, for an object of a class or function that safe loading
    does not construct (``name``, e.g. "argparse.Namespace"): it keeps the plain data the pickle
    hands it (``args``, ``state``, each read under weights_only's rules) and runs nothing."""

    name = "?"

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state


def stand_ins_for(raw):
    """[(stand-in class, "module.Name")] for every global of the torch zip in ``raw`` that safe
    loading refuses (read statically from its pickle, nothing run); None when there is none or
    the file is not a torch zip. Modules torch blocks outright (os, sys, ...) stay refused."""
    try:
        raw.seek(0)
        names = th.serialization.get_unsafe_globals_in_checkpoint(raw)
    except Exception:  # not a readable torch zip: the refusal stands
        return None
    return [(type(n.rsplit(".", 1)[-1], (PickledObject,), {"name": n}), n) for n in names] or None
