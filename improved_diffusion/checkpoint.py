"""
The checkpoint file format: schema-tagged files, a rank-0 atomic writer, a validated reader,
discovery of the newest complete step, legacy (upstream) files, and pruning.

docs/checkpoints.md is the reference for the format; keep it in step with this module.

Files of one step (``step`` = completed optimizer steps), in the log dir:

    model{step:06d}.pt         {"schema", "version", "kind": "model", "step", "state_dict", "flags"}
    ema_{rate}_{step:06d}.pt      {... "kind": "ema", "state_dict", "flags", "rate", "rate_str"}
    opt{step:06d}.pt              {... "kind": "opt", "optimizer", "trainer"}
    manifest{step:06d}.json       written LAST: {"step", "files": {name: {"size", "sha256"}}, ...}

Reading always uses ``torch.load(weights_only=True, map_location="cpu")``: a file can never run
code. Every failure is a ``CheckpointError`` whose one-line message names the file.
"""

import datetime
import errno
import hashlib
import io
import json
import os
import pickle
import re
import time
import uuid
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional

import blobfile as bf
import torch as th

from . import dist_util

SCHEMA = "improved_diffusion.checkpoint"
VERSION = 1
KINDS = ("model", "ema", "opt")

# Temporary files: "<final name>.tmp-<32 hex>" in the same directory as the final file.
_TMP_RE = re.compile(r"^(?P<final>.+)\.tmp-[0-9a-f]{8,32}$")
_MODEL_RE = re.compile(r"^model(\d+)\.pt$")
_EMA_RE = re.compile(r"^ema_(.+)_(\d+)\.pt$")
_OPT_RE = re.compile(r"^opt(\d+)\.pt$")
_MANIFEST_RE = re.compile(r"^manifest(\d+)\.json$")
# Also accepted by parse_step (names a user may give to --resume_checkpoint).
_STEP_NAME_RES = (
    _MODEL_RE,
    _OPT_RE,
    _MANIFEST_RE,
    re.compile(r"^ema_.+_(\d+)\.pt$"),
    re.compile(r"^(?:model|ema|opt|ckpt|checkpoint)[_-]?(?:step[_-]?)?(\d+)"
               r"\.(?:pt|pth|safetensors)$"),
)
_PREFIXES = ("module.", "_orig_mod.")
_COMBINED_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "net")
_COMBINED_EMA_KEYS = ("ema", "ema_state_dict", "model_ema", "ema_model")
_COMBINED_OPT_KEYS = ("opt", "optimizer", "optimizer_state_dict", "optim")
_FLAT_FP16_NOTE = "flattened fp16 master-parameter optimizer state (upstream: 1 group; guided: 2)"
_HEAD_BYTES = 4096


class CheckpointError(Exception):
    """A checkpoint file/directory problem; the one-line message names the file and what to do."""


# ---------------------------------------------------------------------------------------------
# names


def model_filename(step):
    return f"model{step:06d}.pt"


def ema_filename(rate, step):
    """``rate`` is the rate's string as given on the command line (e.g. "0.9999")."""
    return f"ema_{rate}_{step:06d}.pt"


def opt_filename(step):
    return f"opt{step:06d}.pt"


def manifest_filename(step):
    return f"manifest{step:06d}.json"


def _basename(path):
    return os.path.basename(os.fspath(path).rstrip("/"))


def _dirname(path):
    path = os.fspath(path)
    if _is_remote(path):
        return bf.dirname(path)
    return os.path.dirname(path) or "."


def _join(d, name):
    d = os.fspath(d)
    return bf.join(d, name) if _is_remote(d) else os.path.join(d, name)


def _is_remote(path):
    return "://" in os.fspath(path)


def parse_step(path):
    """
    The step number carried by a checkpoint file name (``model000100.pt`` -> 100,
    ``ema_0.9999_000100.pt`` -> 100, ``opt000100.pt``, ``manifest000100.json``).

    Raises CheckpointError naming the file when the name carries no step (never a silent 0).
    """
    name = _basename(path)
    for rx in _STEP_NAME_RES:
        m = rx.match(name)
        if m:
            return int(m.group(m.lastindex))
    raise CheckpointError(
        f"{os.fspath(path)}: cannot read a step number from the file name (expected e.g. "
        f"model000100.pt); rename it to modelNNNNNN.pt or use a tagged checkpoint"
    )


def ema_paths_beside(model_path, step):
    """{rate_str: path} of the EMA files of ``step`` in the directory of ``model_path``."""
    d = _dirname(model_path)
    out = {}
    for name in _listdir(d):
        m = _EMA_RE.match(name)
        if m and int(m.group(2)) == step:
            out[m.group(1)] = _join(d, name)
    return dict(sorted(out.items()))


def _listdir(d):
    try:
        return sorted(bf.listdir(d))
    except (FileNotFoundError, NotADirectoryError):
        return []


# ---------------------------------------------------------------------------------------------
# file contents


def model_payload(step, state_dict, flags):
    """The dict saved as ``model{step:06d}.pt``."""
    return {"schema": SCHEMA, "version": VERSION, "kind": "model", "step": int(step),
            "state_dict": state_dict, "flags": dict(flags or {})}


def ema_payload(step, rate_str, state_dict, flags):
    """The dict saved as ``ema_{rate_str}_{step:06d}.pt``."""
    return {"schema": SCHEMA, "version": VERSION, "kind": "ema", "step": int(step),
            "state_dict": state_dict, "flags": dict(flags or {}), "rate": float(rate_str),
            "rate_str": str(rate_str)}


def opt_payload(step, optimizer, trainer):
    """The dict saved as ``opt{step:06d}.pt`` (``optimizer``: named-v1 state; ``trainer``: dict)."""
    return {"schema": SCHEMA, "version": VERSION, "kind": "opt", "step": int(step),
            "optimizer": optimizer, "trainer": trainer}


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class CkptFile:
    """A loaded checkpoint file, tagged or not, with what we could tell about it."""

    path: str
    kind: str  # "model" | "ema" | "opt" | "combined" | "unknown"
    tagged: bool
    step: Optional[int] = None
    rate_str: Optional[str] = None
    flags: Optional[dict] = None
    state_dict: Optional[dict] = None  # model weights, prefixes stripped
    optimizer: Optional[dict] = None  # raw torch or named-v1 optimizer dict
    trainer: Optional[dict] = None
    raw: Any = None
    notes: List[str] = field(default_factory=list)
    nbytes: int = 0


def strip_prefixes(sd):
    """
    Remove DDP ``module.`` and torch.compile ``_orig_mod.`` prefixes carried by EVERY key.

    Returns (new OrderedDict, notes); notes name each prefix removed.
    """
    notes = []
    keys = list(sd.keys())
    changed = True
    while changed and keys:
        changed = False
        for prefix in _PREFIXES:
            if all(isinstance(k, str) and k.startswith(prefix) for k in keys):
                keys = [k[len(prefix):] for k in keys]
                notes.append(_prefix_note(prefix))
                changed = True
    if not notes:
        return sd, notes
    return OrderedDict(zip(keys, sd.values())), notes


def _prefix_note(prefix):
    if prefix == "module.":
        return "keys carry a DDP `module.` prefix (stripped)"
    return "keys carry a torch.compile `_orig_mod.` prefix (stripped)"


def _is_state_dict(obj):
    return (isinstance(obj, dict) and len(obj) > 0
            and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, th.Tensor) for v in obj.values()))


def _is_optimizer_state(obj):
    return isinstance(obj, dict) and "param_groups" in obj and "state" in obj


def _flattened_fp16_groups(opt):
    """Number of groups when ``opt`` is upstream's flat master-param layout (1 or 2), else 0."""
    groups = opt.get("param_groups")
    state = opt.get("state")
    if not isinstance(groups, list) or len(groups) not in (1, 2) or not isinstance(state, dict):
        return 0
    if not all(isinstance(g, dict) and len(g.get("params", ())) == 1 for g in groups):
        return 0
    total = sum(len(g["params"]) for g in groups)
    if len(state) not in (0, total):
        return 0
    for s in state.values():
        t = s.get("exp_avg") if isinstance(s, dict) else None
        if not isinstance(t, th.Tensor) or t.dim() != 1:
            return 0
    # One flat 1-D buffer per group: a real (non-flat) model has many more parameters.
    return len(groups) if state else 0


def classify(obj):
    """
    What a loaded object is: returns (kind, notes) with kind one of "model", "ema", "opt",
    "combined", "unknown" and notes a list of one-line diagnoses.

    Recognises tagged files, upstream's raw model state dicts (str -> tensor), raw torch optimizer
    state dicts ("state" + "param_groups", incl. the flattened fp16 layouts), name-keyed
    (named-v1) optimizer state, combined dicts ({"model": ..., "ema": ..., "opt": ...}), and
    ``module.`` / ``_orig_mod.`` key prefixes.
    """
    notes = []
    if not isinstance(obj, dict):
        return "unknown", [f"top level is a {type(obj).__name__}, not a dict"]
    if obj.get("schema") == SCHEMA:
        kind = obj.get("kind")
        version = obj.get("version")
        if version != VERSION:
            notes.append(f"format version {version!r} (this code reads version {VERSION})")
        if kind not in KINDS:
            return "unknown", notes + [f"tagged file with unknown kind {kind!r}"]
        if kind in ("model", "ema") and isinstance(obj.get("state_dict"), dict):
            notes += strip_prefixes(obj["state_dict"])[1]
        if kind == "opt" and isinstance(obj.get("optimizer"), dict):
            notes += _opt_notes(obj["optimizer"])
        return kind, notes
    if not obj:
        return "unknown", ["empty dict"]
    if _is_optimizer_state(obj) or obj.get("format") == "named-v1":
        return "opt", notes + _opt_notes(obj)
    if _is_state_dict(obj):
        return "model", strip_prefixes(obj)[1]
    entries = [k for k in (*_COMBINED_MODEL_KEYS, *_COMBINED_EMA_KEYS, *_COMBINED_OPT_KEYS)
               if isinstance(obj.get(k), dict)]
    if entries:
        notes.append("combined dict with entries: " + ", ".join(entries))
        for k in entries:
            if _is_state_dict(obj[k]):
                notes += [f"{k}: {n}" for n in strip_prefixes(obj[k])[1]]
        return "combined", notes
    keys = ", ".join(repr(k) for k in list(obj)[:5]) + (", ..." if len(obj) > 5 else "")
    return "unknown", [f"dict with keys {keys} is neither a state dict nor optimizer state"]


def _opt_notes(opt):
    if opt.get("format") == "named-v1":
        return ["name-keyed optimizer state (named-v1)"]
    n = _flattened_fp16_groups(opt)
    if n:
        return [f"{_FLAT_FP16_NOTE}: {n} group{'s' if n > 1 else ''}"]
    return []


def describe(ckpt):
    """A short phrase for messages: "a model state dict", "optimizer state", ..."""
    return {
        "model": "a model state dict",
        "ema": "an EMA model state dict",
        "opt": "optimizer state",
        "combined": "a combined dict (" + ", ".join(
            k for k in ckpt.raw if isinstance(ckpt.raw.get(k), dict)) + ")"
        if isinstance(ckpt.raw, dict) else "a combined dict",
    }.get(ckpt.kind, "something that is not a checkpoint")


def _load_error_reason(e):
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
    if (isinstance(e, pickle.UnpicklingError) or "invalid load key" in text
            or "magic number" in text):
        return "not a torch checkpoint (unreadable pickle data)"
    first = text[:160] or type(e).__name__
    return f"cannot be loaded ({type(e).__name__}: {first})"


def _zip_crc_problem(data):
    """Why a torch zip file's records fail their CRC check, else None.

    torch.load does not check CRCs, so a flipped byte inside a tensor record would load silently
    as damaged weights. (An unreadable archive is left to torch.load, which explains it.)
    """
    if data[:4] != b"PK\x03\x04":
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
    except Exception:
        return None
    return f"corrupt record {bad!r} (CRC mismatch: the data was damaged)" if bad else None


def _torch_load_bytes(data, name):
    if len(data) == 0:
        raise CheckpointError(
            f"{name}: empty file (0 bytes), probably an interrupted write; delete it or use an "
            f"earlier step")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = th.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(
            f"{name}: {_load_error_reason(e)}; replace it or resume from another step") from None
    problem = _zip_crc_problem(data)  # loaded, but possibly with damaged tensor bytes
    if problem:
        raise CheckpointError(f"{name}: {problem}; replace it or resume from another step")
    return obj


def _read_local_bytes(path):
    data, err = dist_util.read_local(os.fspath(path))
    if err is not None:
        raise CheckpointError(err[1])
    return data


def load_file(path_or_bytes, name=None):
    """
    Load and classify one checkpoint file (local, NOT collective).

    ``path_or_bytes``: a path / blobfile URL, or the file's bytes (then ``name`` names it in
    messages and supplies the step/rate for untagged files). Always
    ``torch.load(weights_only=True, map_location="cpu")``. Any failure (missing, directory,
    empty, truncated, random bytes, pickled code, corrupt zip, a tagged file from a newer
    format, a tagged file without its payload) raises CheckpointError with a one-line message.
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        name = os.fspath(name) if name is not None else "<bytes>"
    else:
        name = os.fspath(path_or_bytes) if name is None else os.fspath(name)
        data = _read_local_bytes(path_or_bytes)
    obj = _torch_load_bytes(data, name)
    return _make_ckpt(obj, name, len(data))


def load_file_collective(path):
    """
    ``load_file`` with the bytes read once on rank 0 and broadcast (dist_util.load_bytes), so
    every rank gets the same object or raises the same CheckpointError. Ranks given different
    paths all raise CheckpointError naming each rank's path.

    Collective: call from all ranks with the same arguments.
    """
    path = os.fspath(path)
    try:
        data = dist_util.load_bytes(path)
    except dist_util.DistMismatchError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(str(e)) from None
    return load_file(data, name=path)


def _make_ckpt(obj, name, nbytes):
    kind, notes = classify(obj)
    c = CkptFile(path=name, kind=kind, tagged=False, raw=obj, notes=notes, nbytes=nbytes)
    if isinstance(obj, dict) and obj.get("schema") == SCHEMA:
        c.tagged = True
        version = obj.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise CheckpointError(
                f"{name}: checkpoint format version {version!r} is newer than this code reads "
                f"({VERSION}); update improved_diffusion")
        if kind == "unknown":
            raise CheckpointError(f"{name}: tagged checkpoint of unknown kind {obj.get('kind')!r}; "
                                  f"it was not written by this trainer")
        step = obj.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"{name}: tagged checkpoint has no valid 'step'; replace it")
        c.step = step
        if kind in ("model", "ema"):
            sd = obj.get("state_dict")
            if not isinstance(sd, dict):
                raise CheckpointError(f"{name}: tagged {kind} file has no 'state_dict'; replace it")
            c.state_dict, _ = strip_prefixes(sd)
            c.flags = obj.get("flags") if isinstance(obj.get("flags"), dict) else None
            if kind == "ema":
                c.rate_str = obj.get("rate_str") or (
                    str(obj["rate"]) if obj.get("rate") is not None else None)
        else:
            if not isinstance(obj.get("optimizer"), dict):
                raise CheckpointError(f"{name}: tagged opt file has no 'optimizer'; replace it")
            c.optimizer = obj["optimizer"]
            c.trainer = obj.get("trainer") if isinstance(obj.get("trainer"), dict) else None
        return c

    # Untagged (upstream and others): step and rate from the name when it carries them.
    notes.insert(0, "untagged (legacy) file")
    base = _basename(name)
    try:
        c.step = parse_step(base)
    except CheckpointError:
        c.step = None
    if kind == "model":
        m = _EMA_RE.match(base)
        if m:
            c.kind, c.rate_str = "ema", m.group(1)
        c.state_dict, _ = strip_prefixes(obj)
    elif kind == "opt":
        c.optimizer = obj
    elif kind == "combined":
        c.state_dict = _combined_entry(obj, _COMBINED_MODEL_KEYS, state_dict=True)
        c.optimizer = _combined_entry(obj, _COMBINED_OPT_KEYS, state_dict=False)
        if isinstance(obj.get("step"), int):
            c.step = obj["step"]
    return c


def _combined_entry(obj, keys, state_dict):
    for k in keys:
        v = obj.get(k)
        if isinstance(v, dict):
            if state_dict and _is_state_dict(v):
                return strip_prefixes(v)[0]
            if state_dict and v.get("schema") == SCHEMA and isinstance(v.get("state_dict"), dict):
                return strip_prefixes(v["state_dict"])[0]
            if not state_dict and _is_optimizer_state(v):
                return v
    return None


def model_state_from(ckpt, want="model"):
    """
    Model weights (prefixes stripped) of a loaded file: the file's own for model/ema files; from a
    combined dict, the ``want`` ("model" or "ema") entry. Raises CheckpointError naming the file
    when it holds no such weights (e.g. optimizer state).
    """
    if want not in ("model", "ema"):
        raise ValueError(f"want must be 'model' or 'ema', not {want!r}")
    if ckpt.kind in ("model", "ema") and ckpt.state_dict is not None:
        return ckpt.state_dict
    if ckpt.kind == "combined":
        keys = _COMBINED_EMA_KEYS if want == "ema" else _COMBINED_MODEL_KEYS
        sd = _combined_entry(ckpt.raw, keys, state_dict=True)
        if sd is not None:
            return sd
        raise CheckpointError(
            f"{ckpt.path}: combined checkpoint has no {want} weights (entries: "
            f"{', '.join(map(str, ckpt.raw))}); give a file that holds them")
    raise CheckpointError(
        f"{ckpt.path}: holds {describe(ckpt)}, not model weights; give a model or EMA file")


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


def _exists(path):
    return bf.exists(path) if _is_remote(path) else os.path.lexists(path)


def atomic_write(path, obj):
    """
    Write ``obj`` (torch.save'd; raw ``bytes`` are written as they are) to ``path`` so that the
    file either does not exist or is complete: a temp name in the same directory, flush + fsync,
    then a no-overwrite rename (hard link + unlink, else os.replace). Remote blobfile paths
    (gs://, az://) are written directly (the object appears only once the upload completes).
    Refuses to overwrite an existing file (CheckpointError). Returns {"size", "sha256"}.

    A full disk, an exceeded quota, a read-only file system, a denied permission or a vanished
    directory is a CheckpointError whose one line names the directory and what to do (see
    ``_disk_fault``); the temp file is removed. Any other error keeps its type and traceback.

    Not collective; ``save_step`` calls it on rank 0.
    """
    path = os.fspath(path)
    try:
        return _atomic_write(path, obj)
    except (OSError, RuntimeError) as e:
        fault = _disk_fault(e, _dirname(path))
        if fault is None:
            raise
        raise CheckpointError(_fault_message(fault, _dirname(path), f"writing {_basename(path)}",
                                             "nothing partial was left there")) from None


def _atomic_write(path, obj):
    """``atomic_write`` without the disk-fault messages (raises the OSError itself)."""
    if _exists(path):
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint "
                              f"(move it away or start from a later step)")
    if _is_remote(path):
        if isinstance(obj, (bytes, bytearray)):
            data = bytes(obj)
        else:
            buf = io.BytesIO()
            th.save(obj, buf)
            data = buf.getvalue()
        with bf.BlobFile(path, "wb") as f:
            f.write(data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    d = _dirname(path)
    tmp = os.path.join(d, f"{_basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            _save_into(obj, f)
            f.flush()
            os.fsync(f.fileno())
        info = _file_digest(tmp)
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
    finally:
        _unlink_quietly(tmp)


# os.link fails with these where the filesystem has no hard links (then os.replace is used).
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK,
                  getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}


def _unlink_quietly(path):
    """Remove a local file if it is there; a failure to remove it is not worth a second error."""
    try:
        os.unlink(path)
    except OSError:
        pass


class _WriteGuard:
    """A file wrapper for torch.save that remembers the OSError of a failed write.

    torch.save reports a failed write as "RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos ..." without the errno; ``_save_into`` raises the remembered OSError instead.
    """

    def __init__(self, f):
        self._f = f
        self.error = None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self._f.flush()


def _save_into(obj, f):
    """Write ``obj`` (raw bytes as they are, else torch.save) into the open file ``f``."""
    if isinstance(obj, (bytes, bytearray)):
        f.write(obj)
        return
    guard = _WriteGuard(f)
    try:
        th.save(obj, guard)
    except RuntimeError:
        if guard.error is not None:
            raise guard.error from None
        raise


# errno -> (what happened, what to do); the message names the directory before them.
_FAULTS = {
    errno.ENOSPC: ("no space left on device",
                   "free space there (delete old steps, or pass --keep_checkpoints N) or copy the "
                   "log dir to a bigger disk and rerun with --log_dir there"),
    errno.EDQUOT: ("disk quota exceeded (no space left for this user)",
                   "free space there (delete old steps, or pass --keep_checkpoints N) or raise "
                   "the quota"),
    errno.EROFS: ("read-only file system",
                  "remount it read-write, or copy the log dir to a writable disk and rerun with "
                  "--log_dir there"),
    errno.EACCES: ("permission denied",
                   "give this user write access to it (or rerun with another --log_dir)"),
    errno.EPERM: ("permission denied (operation not permitted)",
                  "give this user write access to it (or rerun with another --log_dir)"),
}
_GONE = ("the log dir no longer exists (removed while the job ran?)",
         "it is not recreated, since an empty log dir would hide the lost checkpoints: restore it "
         "and rerun, or rerun with a new --log_dir to start over")
# torch.save's text for a write that failed below it (the errno is lost on the way).
_TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|"
                                 r"file write failed", re.I)
_LOW_SPACE_BYTES = 1 << 20


def _disk_fault(e, directory):
    """(what happened, what to do) when ``e`` is a disk fault of writing into ``directory``.

    Only these are mapped: ENOSPC, EDQUOT, EROFS, EACCES/EPERM, and a directory that no longer
    exists; also torch.save's RuntimeError for a failed write when the file system is (nearly)
    full (``os.statvfs``). Anything else (a bug, an unexpected errno) returns None.
    """
    if isinstance(e, OSError):
        if e.errno == errno.ENOENT and not _is_remote(directory) and not os.path.isdir(directory):
            return _GONE
        return _FAULTS.get(e.errno)
    if isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED.search(str(e)):
        free = _free_bytes(directory)
        if free is not None and free < _LOW_SPACE_BYTES:
            return _FAULTS[errno.ENOSPC]
    return None


def _free_bytes(directory):
    """Bytes available to this user on the file system of a local ``directory``, else None."""
    if _is_remote(directory):
        return None
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _fault_message(fault, directory, doing, kept):
    """One line: "<dir>: <what happened> while <doing>[ (free space)]; <kept>; <what to do>"."""
    what, todo = fault
    free = _free_bytes(directory) if fault in (_FAULTS[errno.ENOSPC],
                                               _FAULTS[errno.EDQUOT]) else None
    where = f" (only {_human_bytes(free)} free there)" if free is not None else ""
    return f"{directory}: {what} while {doing}{where}; {kept}; {todo}"


def _human_bytes(n):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _file_digest(path):
    h = hashlib.sha256()
    size = 0
    with bf.BlobFile(path, "rb") as f:
        while True:
            chunk = f.read(8 * 1024 * 1024)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def save_step(log_dir, step, files):
    """
    Write one step's checkpoint files, then its manifest LAST.

    ``files``: {filename: object}, e.g. {model_filename(s): model_payload(...), ...}. Only rank
    0's ``files`` are used (other ranks may pass the same dict or ``{}``). Rank 0 refuses to
    overwrite any existing file (checked before anything is written), writes each file with
    ``atomic_write``, then ``manifest{step:06d}.json`` with each file's size and sha256. An error on
    rank 0 is broadcast, so every rank raises the same exception; all ranks return together.

    A local ``log_dir`` must exist (the caller creates it at start; train.py's logger does): one
    that vanished is an error, never silently recreated empty. When the write fails (full disk,
    quota, read-only, permission, vanished log dir: one-line CheckpointError naming the log dir
    and what to do; anything else keeps its type), the files already written for this step are
    removed, so no partial step is left and the previous complete step stays the newest.

    Collective: call from all ranks with the same arguments.
    """
    dist_util.run_on_rank0(lambda: _save_step_rank0(os.fspath(log_dir), int(step), files))


def _save_step_rank0(log_dir, step, files):
    kept = (f"step {step} was not saved (no manifest; its partial files were removed) and the "
            f"last complete step is intact, so a rerun resumes from it")
    if not _is_remote(log_dir) and not os.path.isdir(log_dir):
        raise CheckpointError(_fault_message(_GONE, log_dir, f"saving step {step}", kept))
    names = list(files)
    for name in names:
        if _basename(name) != name or _TMP_RE.match(name) or _MANIFEST_RE.match(name):
            raise CheckpointError(f"{name}: not a valid checkpoint file name for save_step")
    manifest = manifest_filename(step)
    for name in names + [manifest]:
        p = _join(log_dir, name)
        if _exists(p):
            raise CheckpointError(f"{p}: already exists; refusing to overwrite a checkpoint "
                                  f"(move it away or start from a later step)")
    written, current = [], None
    try:
        entries = {}
        for name in names:
            current = name
            entries[name] = _atomic_write(_join(log_dir, name), files[name])
            written.append(name)
        doc = {
            "schema": SCHEMA,
            "version": VERSION,
            "kind": "manifest",
            "step": step,
            "files": entries,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        current = manifest
        _atomic_write(_join(log_dir, manifest), (json.dumps(doc, indent=1) + "\n").encode())
    except BaseException as e:
        _remove_written(log_dir, written)
        fault = _disk_fault(e, log_dir) if isinstance(e, (OSError, RuntimeError)) else None
        if fault is None:
            raise
        doing = f"saving step {step} ({current})"
        raise CheckpointError(_fault_message(fault, log_dir, doing, kept)) from None


def _remove_written(log_dir, names):
    """Best effort: remove the files of an unfinished save (no manifest), newest first."""
    for name in reversed(names):
        try:
            _remove(_join(log_dir, name))
        except Exception:  # the step has no manifest, so it is never taken for complete anyway
            pass


# ---------------------------------------------------------------------------------------------
# discovery


@dataclass
class StepStatus:
    """One step found in a log dir. ``files``: paths of all its files (manifest included)."""

    step: int
    files: List[str]
    complete: bool
    problem: Optional[str] = None
    legacy: bool = False

    def _find(self, rx):
        for p in self.files:
            if rx.match(_basename(p)):
                return p
        return None

    @property
    def model_path(self):
        return self._find(_MODEL_RE)

    @property
    def opt_path(self):
        return self._find(_OPT_RE)

    @property
    def manifest_path(self):
        return self._find(_MANIFEST_RE)

    @property
    def ema_paths(self):
        """{rate_str: path}"""
        out = {}
        for p in self.files:
            m = _EMA_RE.match(_basename(p))
            if m:
                out[m.group(1)] = p
        return dict(sorted(out.items()))


def _step_of_name(name):
    for rx, grp in ((_MODEL_RE, 1), (_OPT_RE, 1), (_MANIFEST_RE, 1), (_EMA_RE, 2)):
        m = rx.match(name)
        if m:
            return int(m.group(grp))
    return None


def _size(path):
    if _is_remote(path):
        return bf.stat(path).size
    return os.stat(path).st_size


def _is_tagged_file(path):
    """Cheap check: our tag string sits near the start of a tagged torch zip file."""
    try:
        with bf.BlobFile(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
    except Exception:
        return False
    return SCHEMA.encode() in head


def list_steps(log_dir, verify_checksums=False):
    """
    Every step found in ``log_dir``, newest first, with whether it is complete (resumable).

    With a manifest: complete when every listed file is present with the listed size (and sha256
    when ``verify_checksums``). Without one: an upstream (legacy) step when its model file is
    untagged - complete if the opt file is present too (EMA optional); a step of tagged files
    without manifest is an interrupted save (incomplete). Not collective (read-only).
    """
    log_dir = os.fspath(log_dir)
    by_step = {}
    for name in _listdir(log_dir):
        s = _step_of_name(name)
        if s is not None:
            by_step.setdefault(s, []).append(_join(log_dir, name))
    out = []
    for step in sorted(by_step, reverse=True):
        paths = sorted(by_step[step])
        st = StepStatus(step=step, files=paths, complete=False)
        if st.manifest_path is not None:
            st.problem = _check_manifest(st, log_dir, verify_checksums)
        else:
            st.problem, st.legacy = _check_legacy(st)
        st.complete = st.problem is None
        out.append(st)
    return out


def _check_manifest(st, log_dir, verify):
    mpath = st.manifest_path
    try:
        with bf.BlobFile(mpath, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
        files = doc["files"]
        if doc.get("step") != st.step or not isinstance(files, dict) or not files:
            raise ValueError("bad content")
    except Exception:
        return f"manifest {_basename(mpath)} is unreadable"
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        return f"manifest {_basename(mpath)} has format version {doc.get('version')!r} (newer)"
    for name, info in files.items():
        p = _join(log_dir, name)
        if not _exists(p):
            return f"{name} is missing"
        size = _size(p)
        if size != info.get("size"):
            return f"{name} has {size} bytes, manifest says {info.get('size')} (truncated?)"
        if verify and _file_digest(p)["sha256"] != info.get("sha256"):
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def _check_legacy(st):
    """(problem or None, legacy flag) for a step without manifest."""
    model = st.model_path
    if model is None:
        return "no manifest and no model file (interrupted save or stray files)", False
    if _is_tagged_file(model):
        return "no manifest (the save was interrupted before it completed)", False
    if _size(model) == 0:
        return f"{_basename(model)} is empty", True
    opt = st.opt_path
    if opt is None:
        return "upstream step without an opt file (no optimizer state to resume)", True
    if _size(opt) == 0:
        return f"{_basename(opt)} is empty", True
    for p in st.ema_paths.values():
        if _size(p) == 0:
            return f"{_basename(p)} is empty", True
    return None, True


def latest_complete_step(log_dir, warn=print, verify_checksums=False):
    """
    The newest complete step in ``log_dir`` (StepStatus) or None; each newer incomplete step is
    skipped with a one-line warning through ``warn``. Not collective: call on one rank and
    broadcast the result (or call on all ranks of a shared filesystem that is not being written).
    """
    for st in list_steps(log_dir, verify_checksums=verify_checksums):
        if st.complete:
            return st
        if warn is not None:
            warn(f"warning: skipping step {st.step} in {log_dir}: {st.problem}")
    return None


def _remove(path):
    if _is_remote(path):
        bf.remove(path)
    else:
        os.unlink(path)


def prune(log_dir, keep, *, temp_age_s=60.0):
    """
    Keep the newest ``keep`` complete steps; delete every file of steps older than the oldest
    kept one (complete or not). Never touches the newest complete step, nor any step newer than
    the kept ones (it may be a save in progress); with no complete step it deletes nothing. Each
    step's manifest goes FIRST (then opt, EMA, model), so a half-deleted step is never "complete".
    Also removes temp files (``*.tmp-<hex>``) older than ``temp_age_s`` seconds. ``keep`` < 1
    deletes no step (only stale temp files). Returns the deleted paths. Not collective: call on
    rank 0 after a save (save_step's return means every rank has finished it).
    """
    log_dir = os.fspath(log_dir)
    deleted = []
    if keep >= 1:
        steps = list_steps(log_dir)
        kept = [s for s in steps if s.complete][:keep]
        if kept:
            oldest_kept = kept[-1].step
            for st in steps:
                if st.step >= oldest_kept:
                    continue
                order = {"manifest": 0, "opt": 1, "ema": 2, "model": 3}

                def rank_of(p):
                    n = _basename(p)
                    for key, rx in (("manifest", _MANIFEST_RE), ("opt", _OPT_RE),
                                    ("ema", _EMA_RE), ("model", _MODEL_RE)):
                        if rx.match(n):
                            return order[key]
                    return 9

                for p in sorted(st.files, key=rank_of):
                    try:
                        _remove(p)
                        deleted.append(p)
                    except FileNotFoundError:
                        pass
    now = time.time()
    for name in _listdir(log_dir):
        if not _TMP_RE.match(name):
            continue
        p = _join(log_dir, name)
        try:
            age = now - (bf.stat(p).mtime if _is_remote(p) else os.stat(p).st_mtime)
            if age >= temp_age_s:
                _remove(p)
                deleted.append(p)
        except FileNotFoundError:
            pass
    return deleted


if __name__ == "__main__":
    import sys

    from improved_diffusion.ckpt_tool import main

    sys.exit(main())
