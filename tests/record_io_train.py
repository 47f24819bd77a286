"""Run scripts/train.py and record, in order, every operation that creates, writes, syncs, renames
or removes a file under one directory, so that a test can check the order of a save and that no
file is ever written under its final name.

Usage: RECORD_IO=events.jsonl RECORD_IO_DIR=LOG_DIR python tests/record_io_train.py [flags...]

One JSON line per operation, in the order they happened (from any thread), ``{"op", "path"}``
plus ``"to"`` for a link or rename; paths absolute (symlinks resolved); each operation is
recorded once it succeeded:

  write    a file opened for writing: open() / io.open (pathlib too), io.FileIO (blobfile's
           local files), os.open with a write flag, or torch.save given a path (which torch
           opens in C++)
  fsync    os.fsync of an open file or directory (its path read from /proc/self/fd)
  link, rename, replace    os.link / os.rename / os.replace of ``path`` to ``to``
  unlink   os.unlink / os.remove

Operations are recorded at the os and io level, below checkpoint.py and run_dir.py, so the record
holds whatever code writes the files. Nothing else about train.py changes.
"""
import builtins
import io
import json
import os
import threading

import torch
from train_driver import run_train_py  # tests/ (this script's folder)

RECORD = os.environ["RECORD_IO"]
ROOT = os.path.realpath(os.environ.get("RECORD_IO_DIR", "/"))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_real = {name: getattr(os, name) for name in ("open", "fsync", "link", "rename", "replace",
                                              "unlink", "remove")}
_real_open, _real_file_io, _real_save = builtins.open, io.FileIO, torch.save
_lock = threading.Lock()
_out = _real_open(RECORD, "a", buffering=1)


def _path(p):
    if isinstance(p, int):
        return None
    return os.path.realpath(os.fsdecode(os.fspath(p)))


def _record(op, path, to=None):
    paths = [p for p in (path, to) if p is not None]
    if not paths or not any(p == ROOT or p.startswith(ROOT.rstrip("/") + "/") for p in paths):
        return
    event = {"op": op, "path": path} if to is None else {"op": op, "path": path, "to": to}
    with _lock:
        _out.write(json.dumps(event) + "\n")


def _writes(mode):
    return any(c in mode for c in "wax+")


def _open(file, mode="r", *args, **kwargs):
    f = _real_open(file, mode, *args, **kwargs)
    if _writes(mode):
        _record("write", _path(file))
    return f


class _FileIO(_real_file_io):
    def __init__(self, file, mode="r", *args, **kwargs):
        super().__init__(file, mode, *args, **kwargs)
        if _writes(mode):
            _record("write", _path(file))


def _os_open(path, flags, *args, **kwargs):
    fd = _real["open"](path, flags, *args, **kwargs)
    if flags & _WRITE_FLAGS:
        _record("write", _path(path))
    return fd


def _fsync(fd):
    number = fd if isinstance(fd, int) else fd.fileno()
    try:
        target = os.readlink(f"/proc/self/fd/{number}")
    except OSError:
        target = None
    _real["fsync"](fd)
    if target is not None:
        _record("fsync", target)


def _two_paths(op):
    def call(src, dst, *args, **kwargs):
        result = _real[op](src, dst, *args, **kwargs)
        _record(op, _path(src), _path(dst))
        return result
    return call


def _removal(op):
    def call(path, *args, **kwargs):
        result = _real[op](path, *args, **kwargs)
        _record("unlink", _path(path))
        return result
    return call


def _save(obj, f, *args, **kwargs):
    if isinstance(f, (str, bytes, os.PathLike)):
        _record("write", _path(f))
    return _real_save(obj, f, *args, **kwargs)


builtins.open = io.open = _open
io.FileIO = _FileIO
os.open, os.fsync = _os_open, _fsync
os.link, os.rename, os.replace = _two_paths("link"), _two_paths("rename"), _two_paths("replace")
os.unlink, os.remove = _removal("unlink"), _removal("remove")
torch.save = _save

if __name__ == "__main__":
    run_train_py()
