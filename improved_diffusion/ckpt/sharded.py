"""
The sharded layout of a step: one torch.distributed.checkpoint (DCP) checkpoint per step, every
rank writing its own shards, and our manifest over all of its files, written LAST.

What a step is on disk (step 10 of a run saved by 2 ranks)::

    runs/a/step000010.dcp/__0_0.distcp     rank 0's shards (and every non-tensor value)
    runs/a/step000010.dcp/__1_0.distcp     rank 1's shards
    runs/a/step000010.dcp/.metadata        DCP's index of the tensors and their chunks
    runs/a/manifest000010.json             written last: "layout": "sharded", every file of the
                                           folder with its size and CRC-32 ("files", keys
                                           relative to the log dir: "step000010.dcp/.metadata"),
                                           the full-layout files the step holds ("holds":
                                           ["model000010.pt", "ema_0.9999_000010.pt",
                                           "opt000010.pt"]), the ranks that wrote it ("ranks")
    runs/a/phema_0.050_000010.pt           a state's file (--phema_stds), whole, beside the
                                           folder (write_beside), listed in "files" too

The state saved is ``{file name: payload}``, exactly the payloads the full layout writes
(checkpoint.model_payload / ema_payload / opt_payload with the named-v1 optimizer state), but
whose parameter, EMA and Adam-moment tensors are DTensors (Shard(0) over the world); every rank
passes the identical structure. Within a payload, each dict or list without a DTensor (the
trainer state with every rank's RNG, the flags, the param groups) is saved as one value, its
torch.save bytes (``_pack``); a reader places them by the saved structure (``_pack_like``), so
its template needs only their place, whatever the rank count that wrote them. Beside them, one
string (``STRUCTURE_KEY``): the nesting and key order of the whole structure, so that a reader
without a template (``consolidate``) rebuilds the payloads exactly, empty dicts and lists
included (DCP keeps only leaves). Plain tensors (buffers, each rank's own under FSDP) are saved
from rank 0, as the full layout does. The manifest also records the model's flags and kind
(``read_flags``: a flagless resume takes them without a DCP read).

The rules of a step hold as in the full layout (run_dir): the shards go into a temporary folder
(``step000010.dcp.tmp-<hex>``, a temp name to run_dir: removed by tidy and prune); once every
rank's files are written and fsynced (DCP's FileSystemWriter, sync_files=True) and every rank
said so (one all-gather), rank 0 renames the folder into place, fsyncs the log dir and writes
the manifest. A kill at any moment leaves the previous step usable: a temp folder is removed, a
folder without manifest is an interrupted save (quarantined to incomplete/ by the resume). A
disk fault is one line (file_writer's wording) on every rank, the partial folder removed.

Reading trusts nothing unverified: ``verify`` compares every file's size and CRC-32 with the
manifest before any weight is loaded (DCP itself reads a flipped byte silently); DCP's
``.metadata`` (a pickle) is read with an unpickler that admits only DCP's metadata classes, and
non-tensor values with ``torch.load(weights_only=True)``: a checkpoint can never run code.

    pending = start_save(log_dir, 10, files, settings)   # collective; returns once staged
    ... training goes on ...
    pending.collect()                                    # collective; raises on every rank
    read_step(step_path(log_dir, 10), template)          # collective; DCP reshards on load
    consolidate(step_path(log_dir, 10))                  # one process: {file: payload}

On an object store (s3://, gs://, az://) there is no folder rename: each rank has DCP write
its files into a local staging folder, then uploads its own files under their final names in
``stepS.dcp/`` through storage (retries, one-line errors); CRCs are computed from the staged
bytes and all-gathered, and rank 0 writes the manifest object last: the manifest is the commit
(a folder without one is an interrupted save, as on a local disk). Reading a bucket's step
downloads its folder into a local temporary folder first (every rank).
"""

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch as th
import torch.distributed as dist

from . import checkpoint as ckpt
from . import file_writer, run_dir
from .checkpoint import CheckpointError, CheckpointReadError
from .. import dist_util
from ..infra import storage
from ..infra.errors import typed_one_line

LAYOUT = "sharded"
FORMAT = "torch.distributed.checkpoint"
STEP_DIR_RE = re.compile(r"^step(\d+)\.dcp$")
METADATA_NAME = ".metadata"
STRUCTURE_KEY = "_structure"  # the extra top-level key of a step: its structure, as JSON
MODES = ("process", "thread", "sync")


class ShardedStepError(CheckpointError):
    """A sharded step that cannot be read or written as asked (one line naming the folder)."""


# ---------------------------------------------------------------------------------------------
# names


def step_dirname(step):
    """``step000010.dcp``: the folder of a sharded step."""
    return f"step{int(step):06d}.dcp"


def step_path(log_dir, step):
    return ckpt.join(log_dir, step_dirname(step))


def dir_step(path):
    """The step of a sharded step's folder name (``.../step000010.dcp`` -> 10), else None."""
    m = STEP_DIR_RE.match(ckpt.basename(path))
    return int(m.group(1)) if m else None


def is_sharded_manifest(doc):
    return isinstance(doc, dict) and doc.get("layout") == LAYOUT


# ---------------------------------------------------------------------------------------------
# the structure (what DCP does not keep: nesting order and empty containers)


def _skeleton(obj):
    if isinstance(obj, dict):
        return {"d": [[k if isinstance(k, str) else ["k", k], _skeleton(v)]
                      for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_skeleton(v) for v in obj]}
    return None


_MISSING = object()


def _rebuild(skel, val, where):
    """The value of ``skel``'s shape from DCP's nested result ``val`` (a leaf or terminal list
    DCP kept whole is taken as it is)."""
    if skel is None or (val is not _MISSING and not isinstance(val, (dict, list))):
        if val is _MISSING:
            raise ShardedStepError(f"{where}: a value listed in its structure is not in the "
                                   f"checkpoint (damaged step); use an older step")
        return val
    if "d" in skel:
        src = val if isinstance(val, dict) else {}
        out = {}
        for key, child in skel["d"]:
            k = key[1] if isinstance(key, list) else key
            out[k] = _rebuild(child, src.get(k, _MISSING), where)
        return out
    if isinstance(val, list) and len(val) == len(skel["l"]) and not any(
            isinstance(c, dict) for c in skel["l"]):
        return val  # DCP kept it whole (a list of plain values)
    src = val if isinstance(val, (list, dict)) else []
    get = (lambda i: src.get(i, src.get(str(i), _MISSING))) if isinstance(src, dict) else (
        lambda i: src[i] if i < len(src) else _MISSING)
    return [_rebuild(c, get(i), where) for i, c in enumerate(skel["l"])]


# ---------------------------------------------------------------------------------------------
# values in one piece: every dict or list that holds no DTensor (the trainer state, the flags,
# the optimizer's param groups) is saved as one value (its torch.save bytes), so that a reader's
# template needs only its place, not its content (a list of per-rank RNG states, say, whose
# length the reader cannot know)


def _has_dtensor(node):
    if isinstance(node, dict):
        return any(_has_dtensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_dtensor(v) for v in node)
    from torch.distributed.tensor import DTensor
    return isinstance(node, DTensor)


def _pack(files):
    """``{file: payload}`` with each payload's DTensor-free dicts and lists as blobs (the
    top-level payloads stay dicts)."""
    def pack(node):
        if isinstance(node, (dict, list)) and not _has_dtensor(node):
            buf = io.BytesIO()
            th.save(node, buf)
            return buf.getvalue()  # a plain bytes value: DCP saves it whole
        if isinstance(node, dict):
            return {k: pack(v) for k, v in node.items()}
        if isinstance(node, list):
            return [pack(v) for v in node]
        return node
    return {name: ({k: pack(v) for k, v in payload.items()} if isinstance(payload, dict)
                   else payload) for name, payload in files.items()}


def _unpack(node):
    """A packed value back: each blob (bytes) read with torch.load(weights_only=True)."""
    if isinstance(node, (bytes, bytearray)):
        return th.load(io.BytesIO(bytes(node)), weights_only=True)
    if isinstance(node, dict):
        return {k: _unpack(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unpack(v) for v in node]
    return node


# ---------------------------------------------------------------------------------------------
# reading DCP's files without running code


_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                    ("collections", "OrderedDict"), ("builtins", "set"),
                    ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata pickle, admitting DCP's metadata classes, torch dtypes and sizes only."""

    def find_class(self, module, name):
        if (module.startswith("torch.distributed.checkpoint.")
                or (module, name) in _ALLOWED_GLOBALS
                or (module == "torch" and isinstance(getattr(th, name, None), th.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_metadata(step_dir):
    """DCP's Metadata of a sharded step (the tensors, their shapes, dtypes and chunks), read
    without loading any weight. ShardedStepError when it is not a DCP index we admit;
    CheckpointReadError when the read fails. The bytes are read each time; the index of the
    same bytes as the last call's is that call's object (a resume reads it four times: its
    unpickling cost 0.1 s each on 41M parameters), which no caller changes (the reader sets
    its load_id, which every load sets anew). Not collective."""
    path = ckpt.join(step_dir, METADATA_NAME)
    data = ckpt.read_bytes(path)
    if _LAST_METADATA.get("data") == data:
        return _LAST_METADATA["meta"]
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any garbage in the pickle: a content problem of this step
        raise ShardedStepError(f"{path}: not a readable DCP index ({typed_one_line(e)}); the "
                               f"step is damaged or not ours: use an older step") from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    if not isinstance(meta, Metadata):
        raise ShardedStepError(f"{path}: not a DCP index; use an older step")
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()
    _LAST_METADATA.update(data=data, meta=meta)
    return meta


_LAST_METADATA = {}  # read_metadata's last index: {"data": its bytes, "meta": Metadata}


def _reader(step_dir):
    """DCP's reader of a local step folder (a bucket's: see _local_copy), with our
    metadata unpickler."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta = read_metadata(step_dir)
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(step_dir)


def _safe_load_bytes(value):
    return th.load(value, weights_only=True)


def _load_planner(empty=False, keys=None):
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner, _EmptyStateDictLoadPlanner)
    from torch.distributed.checkpoint._nested_dict import set_element

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafePlanner(base):
        def load_bytes(self, read_item, value):
            obj = _safe_load_bytes(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner(keys=keys) if empty else SafePlanner()


def tensor_shapes(step_dir):
    """{path tuple (file, key, ...): (shape tuple, dtype)} of every tensor of a sharded step,
    from its index alone (no weight read): the resume's "does it fit this model" check.
    Not collective."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = read_metadata(step_dir)
    paths = meta.planner_data or {}
    out = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[tuple(paths.get(fqn, (fqn,)))] = (tuple(md.size), md.properties.dtype)
    return out


def state_dict_shapes(step_dir, file_name):
    """{name: torch.Size} of ``file_name``'s "state_dict" in a sharded step (e.g. the model's
    parameters and buffers), from the index alone. Not collective."""
    return {p[2]: th.Size(shape) for p, (shape, _) in tensor_shapes(step_dir).items()
            if len(p) == 3 and p[0] == file_name and p[1] == "state_dict"}


def ranks_of(step_dir):
    """How many ranks wrote the step (its ``__{rank}_*.distcp`` files)."""
    return len({n.split("_")[2] for n in run_dir.listdir(step_dir)
                if n.startswith("__") and n.endswith(".distcp")})


# ---------------------------------------------------------------------------------------------
# writing


def _unwrap(e):
    """The first underlying exception of DCP's CheckpointException (else ``e``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def _errno_in(e):
    """An OSError inside ``e``'s chain or its text (DCP's subprocess sends text), else None."""
    seen = 0
    while e is not None and seen < 8:
        e = _unwrap(e)
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _fault_line(e, log_dir, step):
    """One line for a disk fault, else None."""
    kept = (f"step {step} was not saved (no manifest; its partial files were removed) and the "
            f"last complete step is intact, so a rerun resumes from it")
    doing = f"saving step {step} ({step_dirname(step)})"
    inner = _errno_in(e)
    if inner is not None:
        return storage.write_fault_message(inner, log_dir, doing, kept)
    text = str(e)
    for code, words in ((errno.ENOSPC, "No space left on device"),
                        (errno.EDQUOT, "Disk quota exceeded"),
                        (errno.EROFS, "Read-only file system")):
        if words in text:
            return storage.write_fault_message(OSError(code, words), log_dir, doing, kept)
    return None


def _rmtree(path):
    shutil.rmtree(path, ignore_errors=True)


def _remove_folder(path, names):
    """Remove a step folder of this save, quietly: a local one (its temporary folder, or the one
    it renamed into place) whole; in a bucket, the objects ``names`` this save put there, and
    nothing else (an object it refused to overwrite is not its own to remove)."""
    if not ckpt.is_remote(path):
        return _rmtree(path)
    for name in names:
        try:
            storage.remove(ckpt.join(path, name))
        except OSError:
            pass


def _upload(staging, folder, names, uploaded):
    """Upload this rank's staged files ``names`` under their final names in the bucket's step
    ``folder`` (conditional creates: an object already there is an error, not overwritten);
    each name is appended to ``uploaded`` once its object is up."""
    for name in names:
        with open(os.path.join(staging, name), "rb") as f:
            data = f.read()
        if not storage.put(ckpt.join(folder, name), data, exclusive=True):
            raise CheckpointError(f"{ckpt.join(folder, name)}: already exists; refusing to "
                                  f"overwrite a checkpoint (move it away or start from a "
                                  f"later step)")
        uploaded.append(name)


def _local_copy(step_dir):
    """A local folder holding a bucket's step folder (downloaded into a temporary folder);
    ``step_dir`` itself when local."""
    if not ckpt.is_remote(step_dir):
        return step_dir
    local = tempfile.mkdtemp(prefix="sharded-read-")
    for name in storage.listdir(step_dir):
        with open(os.path.join(local, name), "wb") as f:
            f.write(storage.read_bytes(ckpt.join(step_dir, name)))
    return local


def _crc_entries(folder, names, prefix):
    out = {}
    for name in names:
        out[f"{prefix}/{name}"] = file_writer.file_digest(ckpt.join(folder, name))
    return out


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_GROUPS: Dict[str, object] = {}


def _own_group():
    """A gloo process group of its own for DCP's thread-based async save (on the training
    group its collectives interleave with the training's). Collective the first time."""
    if "thread" not in _GROUPS:
        _GROUPS["thread"] = dist.new_group(backend="gloo")
    return _GROUPS["thread"]


@dataclass
class PendingSave:
    """A sharded save under way (start_save); ``collect()`` finishes it."""

    log_dir: str
    step: int
    tmp_name: str
    holds: List[str]
    settings: Optional[dict]
    mode: str
    flags: Optional[dict] = None
    kind: Optional[str] = None
    beside: Optional[dict] = None  # {name: manifest entry} of whole files beside the folder
    staging: Optional[str] = None  # where DCP writes this rank's files
    future: object = None
    error: Optional[BaseException] = None
    collected: bool = False

    def done(self):
        """True when this rank's part is written (collect will not wait for it). Not
        collective."""
        return self.future is None or self.future.done()

    def collect(self):
        """
        Wait for every rank's shards, then (rank 0) put the folder in place and write the
        manifest last. Raises the same CheckpointError (disk fault: one line) on every rank
        when any rank failed; the partial folder is removed and older steps are untouched.
        Returns the manifest's path.

        Collective: call from all ranks with the same arguments.
        """
        if self.collected:
            raise RuntimeError(f"step {self.step}: this save was collected already")
        self.collected = True
        log_dir, step = self.log_dir, self.step
        remote = ckpt.is_remote(log_dir)
        folder = step_path(log_dir, step) if remote else ckpt.join(log_dir, self.tmp_name)
        staging = self.staging or folder
        rank = dist_util.get_rank()
        err, entries, uploaded = self.error, {}, []
        if err is None and self.future is not None:
            try:
                self.future.result()
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                err = e
        if err is None:
            try:  # this rank's own files (on a shared disk rank 0 could read them all)
                mine = [n for n in run_dir.listdir(staging)
                        if n.startswith(f"__{rank}_") or (rank == 0 and n == METADATA_NAME)]
                entries = _crc_entries(staging, mine, step_dirname(step))
                if remote:
                    _upload(staging, folder, mine, uploaded)
            except BaseException as e:
                err = e
        if remote:
            _rmtree(staging)
        line = None if err is None else (_fault_line(err, log_dir, step) or
                                         f"rank {rank}: {typed_one_line(_unwrap(err))}")
        report = (rank, err is None, line, entries, uploaded)
        reports = [report]
        if dist_util.is_distributed():
            reports = [None] * dist_util.get_world_size()
            dist.all_gather_object(reports, report)
        failed = [r for r in reports if not r[1]]
        if failed:
            if rank == 0:  # every rank's objects up so far (a bucket's), or the temp folder
                _remove_folder(folder, [n for r in reports for n in r[4]])
                run_dir._remove_written(log_dir, list(self.beside or {}))
            dist_util.barrier()
            faults = [r[2] for r in failed if not r[2].startswith("rank ")]
            if err is not None and not faults and _fault_line(err, log_dir, step) is None:
                raise err  # a bug on this rank: its own traceback
            raise CheckpointError(faults[0] if faults else
                                  f"{log_dir}: saving step {step} failed on rank "
                                  f"{failed[0][0]} ({failed[0][2]}); nothing of it was kept")
        all_entries = {}
        for r in reports:
            all_entries.update(r[3])
        return dist_util.run_on_rank0(lambda: self._publish(folder, all_entries, len(reports)))

    def _publish(self, folder, entries, world):
        log_dir, step = self.log_dir, self.step
        final = step_path(log_dir, step)
        manifest = ckpt.join(log_dir, ckpt.manifest_filename(step))
        listed = {k.split("/", 1)[1] for k in entries}
        present = set(run_dir.listdir(folder))
        if present != listed:
            _remove_folder(folder, sorted(listed))
            raise ShardedStepError(f"{final}: the ranks' files {sorted(present)} are not the "
                                   f"ones they wrote {sorted(listed)}; step {step} not saved")
        try:
            for p in (final, manifest) if folder != final else (manifest,):
                if ckpt.exists(p):
                    raise CheckpointError(f"{p}: already exists; refusing to overwrite a "
                                          f"checkpoint (move it away or start from a later "
                                          f"step)")
            if folder != final:  # a local disk: the folder renamed into place
                _fsync_path(folder)
                os.rename(folder, final)
                _fsync_path(log_dir)
            extra = {"layout": LAYOUT, "format": FORMAT, "dir": step_dirname(step),
                     "holds": list(self.holds), "ranks": world}
            if self.flags is not None:  # what a flagless resume takes, without a DCP read
                extra["flags"] = dict(self.flags)
                extra["kind"] = self.kind
            file_writer.write_file(manifest, run_dir._manifest_bytes(
                step, dict(sorted({**entries, **(self.beside or {})}.items())), self.settings,
                extra=extra))
        except BaseException as e:
            if folder != final:
                _rmtree(folder)
            if not ckpt.exists(manifest):
                _remove_folder(final, sorted(listed))
            line = _fault_line(e, log_dir, step)
            if line is None:
                raise
            raise CheckpointError(line) from None
        return manifest


def _check_names(log_dir, step, files):
    log_dir = os.fspath(log_dir)
    remote = ckpt.is_remote(log_dir)
    if not remote and not os.path.isdir(log_dir):
        raise CheckpointError(storage.gone_message(
            log_dir, f"saving step {step}", f"nothing of step {step} was written"))
    for name in files:
        info = ckpt.name_info(name)
        if ckpt.basename(name) != name or info is None or info.kind in ("temp", "manifest") \
                or info.step != step:
            raise CheckpointError(f"{name}: not a checkpoint file name of step {step} for the "
                                  f"sharded layout")
    for p in [step_path(log_dir, step), ckpt.join(log_dir, ckpt.manifest_filename(step)),
              *(ckpt.join(log_dir, n) for n in files)]:
        if ckpt.exists(p):
            raise CheckpointError(f"{p}: already exists; refusing to overwrite a checkpoint "
                                  f"(move it away or start from a later step)")
    tmp = f"{step_dirname(step)}.tmp-{uuid.uuid4().hex}"
    if not remote:
        os.mkdir(ckpt.join(log_dir, tmp))
    return tmp


def start_save(log_dir, step, files, settings=None, *, mode="process", flags=None,
               kind="model", beside=None):
    """
    Start saving ``files`` ({file name: payload}, DTensor leaves, the same structure on every
    rank) as step ``step``'s sharded layout; returns a PendingSave once DCP has staged the
    state (a copy: training may go on and change it) — for ``mode`` "sync" once written.
    ``mode``: "process" (DCP's process-based async save: a writer process per rank with a
    process group of its own), "thread" (DCP's thread-based async save on a gloo group of its
    own), "sync" (dcp.save now). Call ``collect()`` on the result (collective) before the next
    save and before exit: only then is the manifest written. ``settings``: the manifest's
    run_flags, as run_dir.write_step; ``flags``: the model's flags, which the manifest records
    as "flags" and ``kind`` (the model file's: "model" or "classifier") beside them (read_flags:
    a resume takes them without reading the shards); ``beside``: {name: manifest entry} of
    whole files of the step already written beside the folder (write_beside), which the
    manifest lists too. Tensors that
    are not DTensors (buffers, which each rank keeps its own of) are saved from rank 0, as
    the full layout saves them.

    Collective: call from all ranks with the same arguments.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if mode not in MODES:
        raise ValueError(f"start_save: mode must be one of {MODES}, not {mode!r}")
    log_dir, step = os.fspath(log_dir), int(step)
    holds = list(files)
    tmp = dist_util.run_on_rank0(lambda: _check_names(log_dir, step, holds))
    state = _pack(files)
    state[STRUCTURE_KEY] = json.dumps(_skeleton(state))
    # a bucket's step: each rank's own local staging folder, uploaded by collect()
    staging = (tempfile.mkdtemp(prefix=f"{tmp}-") if ckpt.is_remote(log_dir)
               else ckpt.join(log_dir, tmp))
    writer = FileSystemWriter(staging, sync_files=True, single_file_per_rank=True)
    pending = PendingSave(log_dir=log_dir, step=step, tmp_name=tmp, holds=holds,
                          settings=dict(settings) if settings else None, mode=mode,
                          flags=None if flags is None else dict(flags), kind=kind,
                          beside=dict(beside or {}), staging=staging)
    from torch.distributed.checkpoint import DefaultSavePlanner
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    distributed = dist_util.is_distributed()
    try:
        if mode == "sync":
            with _quiet_no_dist(not distributed):
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=not distributed)
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            kind = (AsyncCheckpointerType.PROCESS if mode == "process"
                    else AsyncCheckpointerType.THREAD)
            group = _own_group() if (mode == "thread" and distributed) else None
            with _quiet_no_dist(not distributed):
                pending.future = dcp.async_save(state, storage_writer=writer, planner=planner,
                                                process_group=group,
                                                async_checkpointer_type=kind,
                                                no_dist=not distributed)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        pending.error = e
    return pending


def write_beside(log_dir, step, name, payload):
    """Rank 0's part of a file that a sharded step keeps whole beside its folder (a state's
    file: a post-hoc EMA snapshot, which outlives its step when that is pruned): ``payload``
    (whole CPU tensors) written as ``name`` by file_writer.write_file (temp name, fsync,
    no-overwrite rename), the full layout's bytes. Returns its manifest entry (size, CRC-32),
    for start_save's ``beside``. A disk fault is one line (CheckpointError). Not
    collective."""
    log_dir = os.fspath(log_dir)
    info = ckpt.name_info(name)
    if ckpt.basename(name) != name or info is None or info.kind in ("temp", "manifest") \
            or info.step != step:
        raise CheckpointError(f"{name}: not a checkpoint file name of step {step}")
    path = ckpt.join(log_dir, name)
    if ckpt.exists(path):
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint "
                              f"(move it away or start from a later step)")
    try:
        return file_writer.write_file(path, payload)
    except BaseException as e:
        line = _fault_line(e, log_dir, step)
        if line is None:
            raise
        raise CheckpointError(line) from None


def write_step(log_dir, step, files, settings=None, *, mode="sync"):
    """
    Save one step in the sharded layout and return once it is complete (its manifest
    written): ``start_save(...).collect()``. Returns the manifest's path; raises the same
    CheckpointError on every rank on a disk fault (one line), nothing older lost.

    Collective: call from all ranks with the same arguments.
    """
    return start_save(log_dir, step, files, settings, mode=mode).collect()


# ---------------------------------------------------------------------------------------------
# reading


def verify(log_dir, step):
    """
    The StepStatus of sharded step ``step`` of ``log_dir`` after checking its manifest (every
    file of the folder listed, sizes) and every file's CRC-32; ``.complete``/``.problem`` say
    the result. Reads no weight. Not collective (rank 0, as run_dir).
    """
    for st in run_dir.list_steps(log_dir):
        if st.step == step:
            if st.complete:
                run_dir.verify_step(st, log_dir)
            return st
    raise ShardedStepError(f"{log_dir}: no step {step} (list them with `python scripts/ckpt.py "
                           f"inspect {log_dir}`)")


def _with_structure(template):
    state = dict(template)
    state[STRUCTURE_KEY] = ""
    return state


def read_step(step_dir, template):
    """
    Load a sharded step into ``template`` ({file name: payload} of the live model, EMAs and
    optimizer, loaded in place: DTensor leaves resharded by DCP to this world, or plain
    tensors, which every rank reads whole: a sharded step resumed with --fsdp False) and
    return it with the non-tensor values replaced by the saved ones. Verify the step first
    (``verify``; the resume's plan does): DCP does not check content. ShardedStepError (one
    line) when the step does not hold what the template asks.

    Collective: call from all ranks with the same arguments.
    """
    local, structure, failed = step_dir, None, None
    try:  # each rank reads it; a failure on any rank raises on every rank (before dcp.load)
        local = _local_copy(step_dir)  # a bucket's step downloaded once
        structure = _read_structure(local, step_dir)  # where a dict or list is one value
    except CheckpointError as e:
        failed = e
    except OSError as e:  # the download's local copy
        failed = CheckpointReadError(f"{step_dir}: cannot read ({typed_one_line(e)}); check "
                                     f"that it is reachable and readable")
    try:
        failed = next((e for e in dist_util.all_gather_object(failed) if e is not None), None)
        if failed is not None:
            raise failed
        try:
            skeleton = json.loads(structure)
        except (TypeError, ValueError):
            raise ShardedStepError(f"{step_dir}: holds no structure record (not written by "
                                   f"this code); it cannot be read") from None
        state = _with_structure(_pack_like(template, skeleton))
        _dcp_load(local, state, shown=step_dir)
    finally:
        if local != step_dir:
            _rmtree(local)
    for k in template:
        template[k] = _unpack(state[k])
    return template


def _read_structure(local, shown):
    """The structure record (STRUCTURE_KEY) of the local step folder ``local``, read at its place
    in the index (a few hundred bytes; a dcp.load of it alone cost 0.12 s on 2 ranks: a plan
    and its collectives), or None when the index has none. ``shown``: the step's name in
    messages. Not collective (but for a record the index says is stored transformed, read by
    dcp.load: collective, and the same on every rank, whose index is the same)."""
    meta = read_metadata(local)
    found = [(k, v) for k, v in meta.storage_data.items() if k.fqn == STRUCTURE_KEY]
    if not found:
        return None
    info = found[0][1]
    if getattr(info, "transform_descriptors", None):  # stored transformed: DCP's own read
        saved = {STRUCTURE_KEY: ""}
        _dcp_load(local, saved, shown=shown)
        return saved[STRUCTURE_KEY]
    path = os.path.join(local, info.relative_path)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as e:
        raise CheckpointReadError(f"{ckpt.join(shown, info.relative_path)}: cannot read "
                                  f"({typed_one_line(e)}); check that it is reachable and "
                                  f"readable") from None
    try:
        return _safe_load_bytes(io.BytesIO(data))
    except Exception as e:
        raise ShardedStepError(f"{ckpt.join(shown, info.relative_path)}: its structure "
                               f"record cannot be read ({typed_one_line(e)[:200]}); verify "
                               f"the step (`python scripts/ckpt.py verify`)") from None


def _pack_like(node, skel):
    """``node`` (a template) with a placeholder value wherever the saved structure ``skel``
    has one value (a blob of _pack) and the template a dict or list."""
    if isinstance(node, (dict, list)) and skel is None:
        return b""
    if isinstance(node, dict) and isinstance(skel, dict) and "d" in skel:
        kids = {(k[1] if isinstance(k, list) else k): c for k, c in skel["d"]}
        return {k: _pack_like(v, kids.get(k)) if k in kids else v for k, v in node.items()}
    if isinstance(node, list) and isinstance(skel, dict) and "l" in skel:
        return [_pack_like(v, c) for v, c in zip(node, skel["l"])] + node[len(skel["l"]):]
    return node


# DCP's warning for a load or save without a process group, which one process asks for on
# purpose (no_dist: --fsdp False, one rank): PyTorch's words and source line between our lines.
_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def _quiet_no_dist(no_dist):
    """Within: DCP's no-process-group warning silenced, when ``no_dist`` (nothing else)."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
        yield


def _dcp_load(local, state, shown):
    """dcp.load of ``state`` (in place) from the local step folder ``local`` (_local_copy's),
    with our reader and planner; a failure is one line naming ``shown``, the step as the user
    named it. Collective."""
    import torch.distributed.checkpoint as dcp
    try:
        no_dist = not dist_util.is_distributed()
        with _quiet_no_dist(no_dist):
            dcp.load(state, storage_reader=_reader(local), planner=_load_planner(),
                     no_dist=no_dist)
    except CheckpointError:
        raise
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        inner = _unwrap(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        if isinstance(inner, OSError):
            raise CheckpointReadError(f"{shown}: cannot read ({typed_one_line(inner)}); "
                                      f"check that it is reachable and readable") from None
        raise ShardedStepError(f"{shown}: does not hold what this run asks "
                               f"({typed_one_line(inner)[:300]}); check the model flags, or "
                               f"consolidate it (`python scripts/ckpt.py consolidate`) and "
                               f"inspect it") from None


def consolidate(step_dir, files=None):
    """
    ``{file name: payload}`` of a sharded step with full (plain CPU) tensors, in one process
    without a process group (under one too: this process alone reads): exactly the dicts the
    full layout writes for the same state (key order and empty containers from the saved
    structure). ``files``: the names of the payloads to read (``["ema_0.9999_000010.pt"]``:
    sampling reads one), else all. Verify the step first. Not collective.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd = {}
    local = None
    keys = None if files is None else {STRUCTURE_KEY, *files}
    try:
        local = _local_copy(step_dir)
        _load_state_dict(sd, storage_reader=_reader(local),
                         planner=_load_planner(empty=True, keys=keys), no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        inner = _unwrap(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise ShardedStepError(f"{step_dir}: cannot be read ({typed_one_line(inner)[:300]}); "
                               f"verify it (`python scripts/ckpt.py verify`)") from None
    finally:
        if local not in (None, step_dir):
            _rmtree(local)
    structure = sd.pop(STRUCTURE_KEY, None)
    if not isinstance(structure, str):
        raise ShardedStepError(f"{step_dir}: holds no structure record (not written by this "
                               f"code); it cannot be consolidated")
    skeleton = json.loads(structure)
    if files is not None:  # the payloads asked for, in the saved order
        skeleton = {"d": [entry for entry in skeleton.get("d", []) if entry[0] in files]}
        missing = sorted(set(files) - {entry[0] for entry in skeleton["d"]})
        if missing:
            raise ShardedStepError(f"{step_dir}: holds no {missing[0]}; verify the step "
                                   f"(`python scripts/ckpt.py verify`)")
    return _unpack(_rebuild(skeleton, sd, step_dir))


def read_manifest(step_dir):
    """The manifest of a sharded step's folder (a dict: its "kind", "flags", "holds", ...), or
    None when it cannot be read. Not collective; never raises."""
    step = dir_step(step_dir)
    if step is None:
        return None
    try:
        doc = json.loads(ckpt.read_bytes(ckpt.join(ckpt.dirname(os.fspath(step_dir)),
                                                   ckpt.manifest_filename(step))))
    except Exception:  # the resume's own checks word a bad step
        return None
    return doc if isinstance(doc, dict) else None


def held_files(step_dir):
    """The names of the full-layout files whose payloads a sharded step holds (``model*.pt``,
    each ``ema_*.pt``, ``opt*.pt``), from its index alone. Not collective."""
    meta = read_metadata(step_dir)
    return {path[0] for path in (meta.planner_data or {}).values()
            if path and path[0] != STRUCTURE_KEY}


def read_flags(step_dir, kinds=None):
    """The model flags a sharded step's manifest records (start_save's ``flags``), or None
    (also when its model's kind is not in ``kinds``, when given). Not collective; never
    raises."""
    doc = read_manifest(step_dir)
    if doc is None or (kinds is not None and doc.get("kind") not in kinds):
        return None
    flags = doc.get("flags")
    return dict(flags) if isinstance(flags, dict) else None


def init_optim_state(optimizer):
    """Create the state entries (zeros, and step 0) of an optimizer that has not stepped, so
    that a template built from it has every Adam moment to load into (in place). Adam/AdamW:
    the entries its first step would make (Adam._init_group's), each moment of a DTensor
    parameter made from zeros of its local slice (DTensor.from_local: no sharding propagation;
    DCP's _init_optim_state, a step over zero gradients, took 4 of a 41M-parameter resume's 13
    s in DTensor dispatch); another optimizer: DCP's step over zero gradients."""
    if not isinstance(optimizer, th.optim.Adam) or optimizer.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        _init_optim_state(optimizer)
        return
    from torch.optim.optimizer import _get_scalar_dtype
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state[p]
            state["step"] = (th.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                                      device=p.device) if on_device
                             else th.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            for key in moments:
                state[key] = _zeros_like(p)


def _zeros_like(p):
    """Zeros shaped, placed and sharded as ``p`` (a DTensor: from zeros of its local slice)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return th.zeros_like(p, memory_format=th.preserve_format)
    local = th.zeros_like(p.to_local(), memory_format=th.preserve_format)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
