"""
A log dir of steps: which steps it holds, which one a resume uses, and what is done with the rest.

One step ``S`` is the files ``model{S:06d}.pt``, ``ema_{rate}_{S:06d}.pt`` (one per rate),
``opt{S:06d}.pt``, with post-hoc EMA ``phema_{std}_{S:06d}.pt`` (one per std, when the run
tracks them) and ``manifest{S:06d}.json``, the manifest written last (save_step below).
A step in the sharded layout is the folder ``step{S:06d}.dcp/`` (one DCP checkpoint, every rank's
shards) and the same manifest, which says ``"layout": "sharded"`` and lists every file of the
folder (sharded.py); listing, verifying, choosing, quarantining and pruning treat it as any step.
Snapshots outlive their step: pruning deletes a step's other files and keeps them (the history
that phema.py's reconstruction needs), and a step of which only snapshots are left, older than
the newest complete step, is not listed as a step (``list_snapshots`` lists them).
A step is *complete* (resumable) when its manifest parses and every file it lists is present with
the listed size; upstream's steps (untagged files, no manifest) are complete when the model and
opt files are there and not empty, and a DiT step (``{step:07d}.pt``, one combined file) when
its file is not empty. checkpoint.py knows what is in one file; this module knows what
is in a directory.

Cost does not grow with the run's history: listing reads names, sizes and manifests (small JSON);
checksums (``verify_step``) are read for the candidate step only, stepping back one step at a time
when it does not match. Example, a log dir with steps 30 (manifest garbled), 20 and 10::

    plan = plan_resume("runs/a", "", ["0.9999"])     # rank 0: one listing, checksums of step 20
    plan.model    -> "runs/a/model000020.pt"
    plan.warnings -> ["warning: skipping step 30 in runs/a: manifest manifest000030.json ..."]
    plan.newer_than(20) -> [30]                        # moved to runs/a/incomplete/ after loading

Content and reads are different things: a step whose bytes are wrong (sizes, checksums, a garbled
manifest) is a *problem* and is skipped with a warning; a read that fails (I/O error, permissions,
a remote store's error) raises ``checkpoint.CheckpointReadError`` and nothing is moved or chosen
because of it. Nothing here is collective: rank 0 calls it and broadcasts (train_util does).
"""

import datetime
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import checkpoint as ckpt
from . import file_writer, run_lock
from ..infra import storage
from .. import dist_util
from .checkpoint import CheckpointError, CheckpointReadError
from ..infra.errors import typed_one_line

_SHARDED_DIR_RE = re.compile(r"^step(\d+)\.dcp$")  # sharded.STEP_DIR_RE (no import cycle)


def _kind(path):
    """The name's kind as name_info says, "sharded" for a sharded step's folder, else None."""
    if _SHARDED_DIR_RE.match(ckpt.basename(path)):
        return "sharded"
    return getattr(ckpt.name_info(path), "kind", None)


def _sharded_step(path):
    m = _SHARDED_DIR_RE.match(ckpt.basename(path))
    return int(m.group(1)) if m else None

INCOMPLETE_DIR = "incomplete"


class NoUsableStepError(CheckpointError):
    """The log dir holds a run's history but no step of it can be resumed (one line)."""


# ---------------------------------------------------------------------------------------------
# listing


@dataclass
class StepStatus:
    """One step found in a directory. ``files``: paths of all its files (manifest included).

    ``problem`` says why it is not complete (None when complete); ``verified`` is True once its
    checksums were read and matched; ``legacy``: upstream's files (no manifest).
    """

    step: int
    files: List[str]
    complete: bool = False
    problem: Optional[str] = None
    legacy: bool = False
    verified: bool = False
    manifest: Optional[dict] = None

    def _find(self, kind):
        for p in self.files:
            if _kind(p) == "sharded":
                continue
            info = ckpt.name_info(p)
            if info is not None and info.kind == kind:
                return p
        return None

    @property
    def model_path(self):
        """The model file, or a DiT step's combined file (weights, EMA and optimizer in one)."""
        return self._find("model") or self._find("combined")

    @property
    def opt_path(self):
        return self._find("opt")

    @property
    def manifest_path(self):
        return self._find("manifest")

    @property
    def sharded_path(self):
        """The folder of a sharded step (``step000010.dcp``), else None."""
        return next((p for p in self.files if _kind(p) == "sharded"), None)

    @property
    def layout(self):
        """"sharded" for a step in the sharded layout (its folder), else "full"."""
        return "sharded" if self.sharded_path is not None else "full"

    @property
    def step_path(self):
        """What a resume loads: the model file (full layout) or the step's folder (sharded)."""
        return self.sharded_path or self.model_path

    @property
    def phema_paths(self):
        """{std_str: path} of the post-hoc EMA snapshots of this step."""
        return dict(sorted((ckpt.name_info(p).std_str, p) for p in self.files
                           if getattr(ckpt.name_info(p), "kind", None) == "phema"))

    @property
    def ema_paths(self):
        """{rate_str: path}"""
        out = {}
        for p in self.files:
            info = ckpt.name_info(p)
            if info is not None and info.kind == "ema":
                out[info.rate_str] = p
        return dict(sorted(out.items()))

    @property
    def has_history(self):
        """True for a step that was, or claims to have been, saved completely: it has a manifest,
        or it is an upstream (untagged) step. A step of tagged files without a manifest is only an
        interrupted save."""
        return self.manifest_path is not None or self.legacy


def listdir(d):
    """Sorted names in directory ``d``; [] when it does not exist. A failed listing raises
    CheckpointReadError (never taken for an empty directory)."""
    d = os.fspath(d)
    try:
        if ckpt.is_remote(d):
            return storage.listdir(d)
        return sorted(os.listdir(d))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointReadError(f"{d}: cannot list the directory ({typed_one_line(e)}); "
                                  f"check that it is reachable and readable") from e


def list_steps(log_dir, verify_checksums=False, names=None):
    """
    Every step found in ``log_dir``, newest first, each with whether it is complete.

    Reads names, sizes and manifests only; with ``verify_checksums`` also the checksum of every file
    of every step (the doctor's deep verify; a resume verifies only its candidate, see
    ``latest_complete_step``). ``names``: a listing made before (to list once). Raises
    CheckpointReadError when a read fails.
    """
    log_dir = os.fspath(log_dir)
    by_step = {}
    for name in listdir(log_dir) if names is None else names:
        info = ckpt.name_info(name)
        if info is not None and info.kind != "temp":
            by_step.setdefault(info.step, []).append(ckpt.join(log_dir, name))
        elif _sharded_step(name) is not None:
            by_step.setdefault(_sharded_step(name), []).append(ckpt.join(log_dir, name))
    out = []
    complete_seen = False
    for step in sorted(by_step, reverse=True):
        if complete_seen and _only_snapshots(by_step[step]):
            continue  # a pruned step's snapshots, kept on purpose; not an interrupted save
        st = StepStatus(step=step, files=sorted(by_step[step]))
        if st.manifest_path is not None:
            st.problem = _check_manifest(st, log_dir)
        else:
            st.problem, st.legacy = _check_legacy(st)
        st.complete = st.problem is None
        complete_seen = complete_seen or st.complete
        if st.complete and verify_checksums:
            verify_step(st, log_dir)
        out.append(st)
    return out


def _only_snapshots(paths):
    return all(getattr(ckpt.name_info(p), "kind", None) == "phema" for p in paths)


@dataclass(frozen=True)
class SnapshotName:
    """A post-hoc EMA snapshot file found in a log dir: its step and std as the name says."""

    step: int
    std_str: str
    path: str


def list_snapshots(log_dir, names=None):
    """Every post-hoc EMA snapshot (``phema_{std}_{step}.pt``) in ``log_dir``, of complete steps,
    interrupted ones and pruned ones alike, sorted by step then std (SnapshotName). Reads names
    only; ``names``: a listing made before. CheckpointReadError when the listing fails."""
    log_dir = os.fspath(log_dir)
    out = []
    for name in listdir(log_dir) if names is None else names:
        info = ckpt.name_info(name)
        if info is not None and info.kind == "phema":
            out.append(SnapshotName(info.step, info.std_str, ckpt.join(log_dir, name)))
    return sorted(out, key=lambda s: (s.step, float(s.std_str)))


def usable_snapshots(log_dir, names=None):
    """
    ``(snapshots, left_out)``: the post-hoc EMA snapshots a reconstruction may use, by the rule
    every reader follows (a step counts once its manifest lists and verifies it), and
    ``[(step, why)]`` for each step whose snapshots are left out. Usable: those that their
    step's manifest lists, each matching its size and checksum (this reads them), and those of
    pruned steps (snapshots alone, older than a complete step: ``prune`` keeps them on purpose
    and drops the rest of the step, manifest included). Left out: the snapshots of a save that
    was interrupted (no manifest, or a listed file missing), of a step whose manifest a snapshot
    does not match, and ones a complete step's manifest does not list. CheckpointReadError when
    a read fails.
    """
    log_dir = os.fspath(log_dir)
    names = listdir(log_dir) if names is None else names
    snaps = list_snapshots(log_dir, names=names)
    steps = {st.step: st for st in list_steps(log_dir, names=names)}  # pruned steps: absent
    usable, left_out = [], []
    for step in sorted({s.step for s in snaps}):
        mine = [s for s in snaps if s.step == step]
        st = steps.get(step)
        if st is None:
            usable += mine
            continue
        if not st.complete:
            left_out.append((step, st.problem))
            continue
        listed = st.manifest["files"]
        bad = None
        for s in mine:
            info = listed.get(ckpt.basename(s.path))
            if info is None:
                bad = f"{ckpt.basename(s.path)} is not in manifest{step:06d}.json"
                break
            algorithm, want = file_writer.checksum_of(info)
            if algorithm is None or file_writer.file_digest(s.path, algorithm)[algorithm] != want:
                bad = f"{ckpt.basename(s.path)} does not match its checksum in the manifest"
                break
        if bad:
            left_out.append((step, bad))
        else:
            usable += mine
    return usable, left_out


def _read_manifest(st):
    """The manifest's dict, or raise _Problem (content) / CheckpointReadError (read failure)."""
    path = st.manifest_path
    data = ckpt.read_bytes(path)  # a failed read (even a vanished file) is CheckpointReadError
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _Problem(f"manifest {ckpt.basename(path)} is not valid JSON (garbled)") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not files or doc.get("step") != st.step:
        raise _Problem(f"manifest {ckpt.basename(path)} does not describe step {st.step}")
    version = doc.get("version")
    if not isinstance(version, int) or version > file_writer.MANIFEST_VERSION:
        raise _Problem(f"manifest {ckpt.basename(path)} has format version {version!r} (newer "
                       f"than this code reads)")
    return doc


class _Problem(Exception):
    """Internal: a content problem of one step (becomes StepStatus.problem)."""


def _check_manifest(st, log_dir):
    try:
        doc = _read_manifest(st)
        if doc.get("layout") == "sharded":
            _check_sharded_listing(st, log_dir, doc)
    except _Problem as e:
        return str(e)
    for name, info in doc["files"].items():
        size = _size_or_none(ckpt.join(log_dir, name))
        if size is None:
            return f"{name} is missing"
        if not isinstance(info, dict) or size != info.get("size"):
            want = info.get("size") if isinstance(info, dict) else None
            return f"{name} has {size} bytes, manifest says {want} (truncated?)"
    st.manifest = doc
    return None


def _check_sharded_listing(st, log_dir, doc):
    """A sharded step's manifest must list every file of its folder and, outside it, only whole
    files of the step beside it (a state's: post-hoc EMA snapshots, sharded.write_beside) (a
    listing of one folder; raises _Problem)."""
    folder = doc.get("dir")
    if not isinstance(folder, str) or _sharded_step(folder) != st.step:
        raise _Problem(f"manifest {ckpt.basename(st.manifest_path)} names no folder of step "
                       f"{st.step}")
    listed = set(doc["files"]) - set(beside_files(doc, st.step))
    present = {f"{folder}/{n}" for n in listdir(ckpt.join(log_dir, folder))}
    if not present:
        raise _Problem(f"{folder} is missing")
    if present != listed or any(not n.startswith(folder + "/") for n in listed):
        extra = sorted(present - listed) + sorted(listed - present)
        raise _Problem(f"{folder}: its files are not those manifest "
                       f"{ckpt.basename(st.manifest_path)} lists ({', '.join(extra[:3])})")


def beside_files(doc, step):
    """The names a sharded step's manifest ``doc`` lists outside its folder, sorted: whole files
    of step ``step`` (a state's: post-hoc EMA snapshots, sharded.write_beside; present and of
    the listed size: _check_manifest). Not collective."""
    return sorted(n for n in doc.get("files", {}) if _beside_of(n, step))


def _beside_of(name, step):
    """Whether a sharded step's manifest may list ``name`` outside its folder: a whole file of
    that step."""
    info = ckpt.name_info(name) if "/" not in name else None
    return info is not None and info.step == step and info.kind not in (
        "temp", "manifest", "sharded")


# Steps whose checksums matched in this process: {identity: True} (_identity). A start-up reads
# a step's checksums once even when several choices ask for the same step (the flags a resume
# takes, its class count, the plan): a file written again, touched or replaced changes its
# inode, size, mtime or ctime, so it is read anew. Bounded: cleared when it grows past this.
_VERIFIED: Dict[tuple, bool] = {}
_VERIFIED_MAX = 64
# Steps this process wrote (write_step), by the same identity: prune keeps them unread.
_WRITTEN: Dict[tuple, bool] = {}


def _identity(st, log_dir):
    """What verifying ``st`` depends on: its manifest and every listed file's inode, size, mtime
    and ctime (ctime: no utime can set it back); None for a remote log dir (never remembered)
    or a file that cannot be stat'ed."""
    if ckpt.is_remote(log_dir):
        return None
    files = []
    for name in sorted(st.manifest["files"]):
        try:
            s = os.stat(ckpt.join(log_dir, name))
        except OSError:
            return None
        files.append((name, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
    return (os.path.abspath(log_dir), st.step, json.dumps(st.manifest, sort_keys=True),
            tuple(files))


def verify_step(st, log_dir):
    """Read every file of a complete step and compare its checksum with the manifest's (crc32,
    or sha256 in a version-1 manifest); sets ``st.complete``/``st.problem``/``st.verified``.
    Upstream steps have no checksums (verified means "loadable sizes"). A step that matched
    earlier in this process, its files unchanged since, is not read again (_VERIFIED). Raises
    CheckpointReadError when a read fails."""
    doc = st.manifest
    key = None if doc is None else _identity(st, log_dir)
    if key is not None and key in _VERIFIED:
        st.verified = True
        return st
    if doc is not None:
        for name, info in doc["files"].items():
            algorithm, want = file_writer.checksum_of(info)
            if algorithm is None:
                st.complete, st.problem = False, (
                    f"manifest {ckpt.basename(st.manifest_path)} lists no checksum for {name}")
                return st
            digest = file_writer.file_digest(ckpt.join(log_dir, name), algorithm)
            if digest[algorithm] != want:
                st.complete, st.problem = False, (
                    f"{name} does not match its {algorithm} in the manifest (corrupt)")
                return st
    st.verified = True
    _remember(key)
    return st


def _remember(key, into=_VERIFIED):
    """Put a step's identity (_identity; None: nothing) in _VERIFIED (or _WRITTEN)."""
    if key is not None:
        if len(into) >= _VERIFIED_MAX:
            into.clear()
        into[key] = True


def _size_or_none(path):
    """The size of ``path``, None when it does not exist; CheckpointReadError when the stat
    fails otherwise (an I/O error is not a missing file)."""
    try:
        return ckpt.with_retry(lambda: ckpt.file_size(path), path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ({typed_one_line(e)}); check that it is "
                                  f"reachable and readable") from e


def _check_legacy(st):
    """(problem or None, legacy flag) for a step without manifest."""
    if st.sharded_path is not None:
        return "no manifest (the save was interrupted before it completed)", False
    model = st.model_path
    if model is None:
        return "no manifest and no model file (interrupted save or stray files)", False
    if ckpt.is_tagged_file(model):
        return "no manifest (the save was interrupted before it completed)", False
    if ckpt.name_info(model).kind == "combined":  # DiT's: everything in one file
        return (None if _size_or_none(model) else f"{ckpt.basename(model)} is empty"), True
    for p in [model, st.opt_path, *st.ema_paths.values()]:
        if p is None:
            return "upstream step without an opt file (no optimizer state to resume)", True
        if _size_or_none(p) in (0, None):
            return f"{ckpt.basename(p)} is empty or missing", True
    return None, True


def latest_complete_step(log_dir, warn=print, verify_checksums=False, steps=None):
    """
    The newest complete step in ``log_dir`` (StepStatus) or None. Newer steps that are not
    complete are skipped with a one-line warning each through ``warn``. With
    ``verify_checksums`` only the candidate step's files are read (checksums); on a mismatch it is
    skipped (warned) and the next older one tried. ``steps``: a ``list_steps`` result to reuse.
    Raises CheckpointReadError when a read fails. Not collective.
    """
    for st in list_steps(log_dir) if steps is None else steps:
        if st.complete and verify_checksums and not st.verified:
            verify_step(st, log_dir)
        if st.complete:
            return st
        if warn is not None:
            warn(f"warning: skipping step {st.step} in {log_dir}: {st.problem}")
    return None


# ---------------------------------------------------------------------------------------------
# the resume plan


@dataclass
class ResumePlan:
    """
    What a resume does, decided on rank 0 from one listing and broadcast (plain data).

    ``model``: the model file to load (None: a fresh start). ``step``: its step when known before
    loading (auto-resume); an explicit file's step comes from the file. ``beside``: {step: {"ema":
    {rate: path}, "opt": path or None}} of the model file's directory. ``log_steps``: [(step,
    complete)] of every step in --log_dir, newest first. ``in_log_dir``: the model file lies in
    --log_dir (so its step counts as saved). ``temp_files``: leftovers of interrupted saves.
    ``log_files``: {step: [paths]} of those steps (acted on without listing again).
    ``warnings`` and ``message``: what to log.
    """

    log_dir: str
    source: str = "fresh"  # "fresh" | "auto" | "explicit"
    model: Optional[str] = None
    step: Optional[int] = None
    beside: Dict[int, dict] = field(default_factory=dict)
    log_steps: List[tuple] = field(default_factory=list)
    log_files: Dict[int, List[str]] = field(default_factory=dict)
    in_log_dir: bool = False
    temp_files: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    message: Optional[str] = None
    # the job that holds the source run when it is another, live run (run_lock.describe_owner):
    # its steps may be written or pruned between this plan and the loads
    source_live: Optional[str] = None
    # "sharded": ``model`` is a sharded step's folder (load it with sharded.read_step), "full":
    # a model file
    layout: str = "full"

    def files_of(self, step):
        """{"ema": {rate: path}, "opt": path or None, "layout": "full" | "sharded", "sharded":
        the step's folder or None} of ``step`` beside the model file."""
        return self.beside.get(step, {"ema": {}, "opt": None, "layout": "full",
                                      "sharded": None})

    def newer_than(self, step):
        """Steps in --log_dir newer than ``step`` (to move to incomplete/)."""
        return [s for s, _ in self.log_steps if s > step]

    def newest_complete(self):
        return next((s for s, complete in self.log_steps if complete), None)


def resume_arg(resume_checkpoint):
    """--resume_checkpoint as the path it names ("" for none): without trailing slashes, so
    that a folder typed with one (``RUN/step000006.dcp/``, ``RUN/``) is that folder, whose
    parent holds its manifest."""
    arg = os.fspath(resume_checkpoint or "")
    stripped = arg.rstrip("/")
    return stripped if stripped and not stripped.endswith(":") else arg


def plan_resume(log_dir, resume_checkpoint=""):
    """
    Decide the resume from one listing of ``log_dir`` (and of the model file's directory when it
    lies elsewhere). Not collective: rank 0 calls it, every rank acts on the result.

    ``resume_checkpoint``: "" (auto-resume if the log dir holds steps), "auto", a model file, or a
    directory (its newest complete step). Auto-resume verifies the checksums of the step it
    chooses only. Raises NoUsableStepError when the log dir holds steps that were saved completely
    once but none of them verifies (never a fresh start over a run's history), and
    CheckpointReadError when a read fails.
    """
    log_dir = os.fspath(log_dir)
    names = listdir(log_dir)
    plan = ResumePlan(log_dir=log_dir)
    plan.temp_files = [n for n in names if getattr(ckpt.name_info(n), "kind", None) == "temp"]
    steps = list_steps(log_dir, names=names)
    arg = resume_arg(resume_checkpoint)
    if arg and _sharded_step(arg) is not None:  # a sharded step's folder, given by name
        plan.source, plan.model, plan.layout = "explicit", arg, "sharded"
        plan.step = _sharded_step(arg)
        plan.in_log_dir = _same_dir(ckpt.dirname(arg), log_dir)
        plan.beside = _beside(steps if plan.in_log_dir else list_steps(ckpt.dirname(arg)))
    elif arg and arg != "auto" and not _is_dir(arg):
        plan.source, plan.model = "explicit", arg
        if _same_dir(ckpt.dirname(arg), log_dir):
            plan.in_log_dir, here = True, steps
        else:
            here = list_steps(ckpt.dirname(arg))
            holder = run_lock.live_holder(ckpt.dirname(arg))
            plan.source_live = None if holder is None else run_lock.describe_owner(holder)
        plan.beside = _beside(here)
    else:
        where = arg if arg and arg != "auto" else log_dir
        chosen_from = steps if where == log_dir else list_steps(where)
        _choose(plan, where, chosen_from, announce=bool(arg))
        plan.in_log_dir = plan.model is not None and _same_dir(where, log_dir)
    plan.log_steps = [(st.step, st.complete) for st in steps]
    plan.log_files = {st.step: list(st.files) for st in steps}
    return plan


def likely_resume_model(log_dir, resume_checkpoint=""):
    """The model file a resume will load, for the choices that must precede the model (the
    flags a resume takes, train.py's class count): the ``resume_checkpoint`` file itself, else
    the step plan_resume chooses in the run dir it names or in ``log_dir``, the newest whose
    checksums match (a newer step that fails them is skipped here as there, so the flags come
    from the step actually resumed; verify_step remembers the match, so the plan does not read
    the step again). None when there is none or a read fails (the plan then says why). Not
    collective."""
    arg = resume_arg(resume_checkpoint)
    try:
        if arg and arg != "auto" and (not _is_dir(arg) or _sharded_step(arg) is not None):
            return arg  # a model file, or a sharded step's folder
        st = latest_complete_step(arg if arg and arg != "auto" else os.fspath(log_dir),
                                  warn=None, verify_checksums=True)
    except CheckpointError:
        return None
    return None if st is None else st.step_path


class StepSettings(dict):
    """{flag: value} of a step's run settings; ``source``: where they were read: "manifest"
    (its ``run_flags``), "trainer" (the trainer state of its opt file, for a manifest that
    records none: an older release's) or None (nothing recorded)."""

    def __init__(self, settings=(), source=None):
        super().__init__(settings)
        self.source = source


def step_settings(model_path):
    """The run's settings (StepSettings) of the step of ``model_path``: the ``run_flags`` of the
    manifest beside it; for a manifest that records none (as releases before them wrote), those
    that the trainer state of the step's opt file records (trainer_settings); empty when there
    are none (upstream's steps, a file copied alone) or they cannot be read (the resume's own
    checks word a bad step). Not collective; never raises."""
    try:
        path = os.fspath(model_path)
        info = ckpt.name_info(ckpt.basename(path))
        step = _sharded_step(path) if info is None else info.step
        if step is None:
            return StepSettings()
        doc = json.loads(ckpt.read_bytes(ckpt.join(ckpt.dirname(path),
                                                   ckpt.manifest_filename(step))))
    except Exception:  # a peek: anything unreadable is "no settings"
        return StepSettings()
    found = doc.get("run_flags") if isinstance(doc, dict) else None
    if isinstance(found, dict):
        return StepSettings(found, "manifest")
    if info is None:  # a sharded step: its trainer state is inside the DCP checkpoint
        return StepSettings()
    trainer = ckpt.read_trainer(ckpt.join(ckpt.dirname(path), ckpt.opt_filename(step)))
    taken = trainer_settings(trainer)
    return StepSettings(taken, "trainer" if taken else None)


def trainer_settings(trainer):
    """{flag: value} of the run settings that a trainer state ("trainer" of opt*.pt) records:
    its ``flags`` (every setting of the run in files of the release before manifests recorded
    them, the training math's since: --lr, --weight_decay, ...), and --batch_size (per rank),
    --seed and --ema_rate from their own entries. {} for None."""
    if not isinstance(trainer, dict):
        return {}
    out = dict(trainer["flags"]) if isinstance(trainer.get("flags"), dict) else {}
    if isinstance(trainer.get("batch_size"), int):
        out["batch_size"] = trainer["batch_size"]
    if isinstance(trainer.get("seed"), int):
        out["seed"] = trainer["seed"]
    if isinstance(trainer.get("ema_rates"), (list, tuple)):
        out["ema_rate"] = ",".join(map(str, trainer["ema_rates"]))
    return out


def may_resume(log_dir, resume_checkpoint=""):
    """Whether a start with these flags could be a resume, from names alone (a file or
    directory given to resume, or a step in ``log_dir`` that was once saved completely): the
    flags a command leaves out may then be the checkpoint's rather than the defaults. Cheap,
    never raises. Not collective."""
    arg = resume_arg(resume_checkpoint)
    if arg and arg != "auto":
        return True
    try:
        return bool(log_dir) and any(st.has_history for st in list_steps(os.fspath(log_dir)))
    except (CheckpointError, OSError):
        return False


def _choose(plan, where, steps, announce):
    """Auto-resume: the newest step of ``where`` that verifies; fills ``plan``."""
    explicit_dir = not _same_dir(where, plan.log_dir)
    flag = "--resume_checkpoint" if explicit_dir else "--log_dir"
    if not steps:
        if explicit_dir:
            raise CheckpointError(f"--resume_checkpoint {where}: no checkpoint files in this "
                                  f"directory; give a model file or a run directory")
        if announce:
            plan.message = f"--resume_checkpoint auto: no checkpoint in {where}; starting fresh"
        return
    warn = plan.warnings.append
    if explicit_dir:
        holder = run_lock.live_holder(where)
        if holder is not None:  # another job is writing there as we read it
            plan.source_live = run_lock.describe_owner(holder)
            warn = _live_source_warn(plan.warnings.append, plan.source_live)
    st = choose_step(where, steps, flag, warn=warn, refuse_fresh=explicit_dir)
    if st is not None:
        plan.source, plan.step = "auto", st.step
        plan.model = st.step_path
        plan.layout = st.layout
        plan.beside = _beside([st])
        plan.message = f"auto-resume: newest complete step in {where} is {st.step}"
        return
    plan.message = FRESH_OVER_INTERRUPTED.format(where=where)


# What a resume says when a run dir holds only interrupted saves (and starts fresh).
FRESH_OVER_INTERRUPTED = ("no complete checkpoint in {where} (only interrupted saves); starting "
                          "fresh")


def choose_step(where, steps, flag="--log_dir", warn=None, verify_checksums=True,
                refuse_fresh=False):
    """The step a resume of run dir ``where`` takes (StepStatus), from its ``steps``
    (``list_steps``, non-empty): the newest complete one whose checksums match (read here for
    the candidate alone, unless ``verify_checksums`` is False or they were read already); None
    for a fresh start (only interrupted saves). Raises NoUsableStepError (one line naming
    ``flag``) when steps that were saved completely once are there but none verifies, or when
    ``refuse_fresh`` (a directory named to resume from). The one decision that plan_resume and
    `ckpt.py verify` both make. CheckpointReadError when a read fails. Not collective."""
    st = latest_complete_step(where, warn=warn, verify_checksums=verify_checksums, steps=steps)
    if st is not None:
        return st
    history = [s for s in steps if s.has_history]
    if history or refuse_fresh:
        raise NoUsableStepError(_no_usable_step_message(flag, where, history or steps))
    return None


def _live_source_warn(warn, owner):
    """``warn`` for the steps skipped in a run that a live job holds: a step without a manifest
    there is most likely the save that job is writing, not an interrupted one."""
    interrupted = "no manifest (the save was interrupted before it completed)"

    def live_warn(line):
        warn(line.replace(interrupted, f"no manifest yet: most likely the save the job that "
                                       f"holds the run ({owner}) is writing now"))
    return live_warn


def _no_usable_step_message(flag, where, steps):
    problems = "; ".join(f"step {s.step}: {s.problem}" for s in steps[:5])
    more = f" (+{len(steps) - 5} more)" if len(steps) > 5 else ""
    return (f"{flag} {where} holds {len(steps)} saved step(s) but none can be resumed "
            f"({problems}{more}); nothing was changed. Check them with `python scripts/ckpt.py "
            f"verify {where}`, pass --resume_checkpoint FILE to resume from a file you trust, or "
            f"use a new --log_dir")


def _beside(steps):
    return {st.step: {"ema": st.ema_paths, "opt": st.opt_path, "layout": st.layout,
                      "sharded": st.sharded_path} for st in steps}


def _is_dir(path):
    try:
        return storage.isdir(path)
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ({typed_one_line(e)})") from e


def _same_dir(a, b):
    a, b = os.fspath(a) or ".", os.fspath(b) or "."
    if ckpt.is_remote(a) or ckpt.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def refuse_overwrite(plan, step):
    """Raise when --log_dir holds a complete step newer than the resume ``step`` (an explicit
    older file would otherwise write over the run's later history)."""
    newest = plan.newest_complete()
    if newest is not None and newest > step:
        raise CheckpointError(
            f"--log_dir {plan.log_dir} already holds a complete checkpoint at step {newest}, "
            f"newer than the resume step {step}; resume from it (--resume_checkpoint auto) or "
            f"pass a new --log_dir")


def tidy_for_resume(plan, step):
    """
    Rank 0, after the resume step is known: move the files of newer (incomplete or damaged) steps
    to ``{log_dir}/incomplete/step{S}/`` (never deleted; they would block the saves of those
    steps), and remove temp files of interrupted saves. Returns (moved names, removed names).
    """
    moved = []
    for s in plan.newer_than(step if step is not None else -1):
        moved += _quarantine(plan.log_dir, s, plan.log_files[s])
    removed = []
    for name in plan.temp_files:
        try:
            _remove(ckpt.join(plan.log_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return moved, removed


def _move_object_or_folder(src, target):
    """A bucket has no rename: copy, then remove; a sharded step's folder (a prefix) object by
    object, each removed once its copy is there."""
    if not storage.isdir(src):
        storage.copy(src, target)
        if not storage.exists(target):  # never removed without its copy
            raise CheckpointError(f"{src}: its copy to {target} is not there; nothing removed")
        storage.remove(src)
        return
    for name in storage.listdir(src):
        storage.copy(ckpt.join(src, name), ckpt.join(target, name))
        storage.remove(ckpt.join(src, name))


def _quarantine(log_dir, step, files):
    """Move one step's files to incomplete/step{S}/, manifest first (so it is never "complete"
    half-moved); a name moved there before is kept (suffix .1, .2, ...)."""
    dest = ckpt.join(ckpt.join(log_dir, INCOMPLETE_DIR), f"step{step:06d}")
    storage.makedirs(dest)
    names = sorted((ckpt.basename(p) for p in files), key=lambda n: not n.startswith("manifest"))
    moved = []
    for name in names:
        src, target = ckpt.join(log_dir, name), ckpt.join(dest, name)
        if not ckpt.exists(src):
            continue
        base, n = target, 1
        while ckpt.exists(target):
            target, n = f"{base}.{n}", n + 1
        if ckpt.is_remote(src):
            _move_object_or_folder(src, target)
        else:
            os.replace(src, target)
        moved.append(name)
    return moved


# ---------------------------------------------------------------------------------------------
# writing a step


def save_step(log_dir, step, files, settings=None):
    """
    Write one step's checkpoint files, then its manifest LAST.

    ``files``: {filename: object}, e.g. {model_filename(s): model_payload(...), ...}. Only rank
    0's ``files`` are used (other ranks may pass the same dict or ``{}``). Rank 0 refuses to
    overwrite any existing file (checked before anything is written), writes each file with
    ``file_writer.write_file`` (temp name, fsync, no-overwrite rename), then
    ``manifest{step:06d}.json`` with each file's size and crc32. An error on rank 0 is broadcast,
    so every rank raises the same exception; all ranks return together.

    A local ``log_dir`` must exist (the caller creates it at start; train.py's logger does): one
    that vanished is an error, never silently recreated empty. When the write fails (full disk,
    quota, read-only, permission, vanished log dir: one-line CheckpointError naming the log dir
    and what to do; anything else keeps its type), the files already written for this step are
    removed, so no partial step is left and the previous complete step stays the newest.
    ``settings``: {flag: value} of the run's settings, recorded in the manifest (write_step).

    Collective: call from all ranks with the same arguments.
    """
    dist_util.run_on_rank0(lambda: write_step(log_dir, step, files, settings=settings))


def write_step(log_dir, step, files, crc_threads=None, settings=None):
    """save_step's work, in this process only (not collective): rank 0's part, also run by the
    trainer's background writer (async_save). Each file's size and CRC-32 are computed while it
    is written (file_writer.write_file), never read back. ``crc_threads``: threads for a large
    record's CRC (torch_zip.save; None: torch_zip.workers(), for a save the training waits
    for; a background write passes 1, beside the steps). ``settings``: {flag: value} of the
    run's settings, the manifest's ``run_flags`` (step_settings reads them back): in the
    manifest, not in the checkpoint files, so that two runs of the same training with other
    side settings (--eval_interval, --async_save, ...) write the same bytes."""
    writer = StepWriter(log_dir, step, list(files), crc_threads, settings)
    for name in files:
        writer.add(name, files[name])
    writer.finish()


class StepWriter:
    """write_step one file at a time, for a caller that makes each payload just before it is
    written (the full layout under --fsdp: checkpointer gathers one file to rank 0, writes it,
    drops it, so that rank 0 never holds the whole state). ``StepWriter(log_dir, step, names)``
    checks that no file of the step (nor its manifest) exists, before anything is written;
    ``add(name, payload)`` writes the next file (in ``names``' order); ``finish()`` the
    manifest, last. A failure of any of them removes the files already written (a one-line
    CheckpointError for a disk fault, as write_step); ``abort()`` does the same for a failure
    elsewhere (a gather that failed). Not collective: one process writes."""

    def __init__(self, log_dir, step, names, crc_threads=None, settings=None):
        self.log_dir, self.step = os.fspath(log_dir), int(step)
        self.crc_threads, self.settings = crc_threads, settings
        self.names, self.entries, self.written = list(names), {}, []
        if not ckpt.is_remote(self.log_dir) and not os.path.isdir(self.log_dir):
            raise CheckpointError(storage.gone_message(
                self.log_dir, f"saving step {self.step}", self._kept()))
        for name in self.names:
            info = ckpt.name_info(name)
            if ckpt.basename(name) != name or info is None or info.kind in ("temp", "manifest"):
                raise CheckpointError(f"{name}: not a valid checkpoint file name for save_step")
        self.manifest = ckpt.manifest_filename(self.step)
        for name in self.names + [self.manifest]:  # a store's error names the file it asked of
            self._guarded(name, lambda name=name: self._check_free(name))

    def _kept(self):
        return (f"step {self.step} was not saved (no manifest; its partial files were removed) "
                f"and the last complete step is intact, so a rerun resumes from it")

    def _check_free(self, name):
        p = ckpt.join(self.log_dir, name)
        if ckpt.exists(p):
            raise CheckpointError(f"{p}: already exists; refusing to overwrite a checkpoint "
                                  f"(move it away or start from a later step)")

    def add(self, name, payload):
        """Write the next file, ``name`` (of ``names``), with ``payload``."""
        def write():
            self.entries[name] = file_writer.write_file(ckpt.join(self.log_dir, name), payload,
                                                        self.crc_threads)
            self.written.append(name)
        self._guarded(name, write)

    def finish(self):
        """Write the manifest (every file added): the step is complete."""
        missing = [n for n in self.names if n not in self.entries]
        if missing:
            self.abort()
            raise CheckpointError(f"step {self.step}: {', '.join(missing)} not written; "
                                  f"no manifest")
        data = _manifest_bytes(self.step, self.entries, self.settings)
        self._guarded(self.manifest, lambda: file_writer.write_file(
            ckpt.join(self.log_dir, self.manifest), data))
        self.written = []  # a complete step: abort() leaves it
        remember_written(self.log_dir, self.step, json.loads(data))

    def abort(self):
        """Remove the files written so far (no manifest was): returns those left behind."""
        left, self.written = _remove_written(self.log_dir, self.written), []
        return left

    def _guarded(self, current, fn):
        try:
            fn()
        except BaseException as e:
            left = self.abort()
            kept = self._kept()
            if left:  # the store refuses their removal too: a resume moves them aside
                kept = (f"step {self.step} was not saved (no manifest; {', '.join(left)} left "
                        f"behind, which a resume moves to incomplete/) and the last complete "
                        f"step is intact, so a rerun resumes from it")
            doing = f"saving step {self.step}" + (f" ({current})" if current else "")
            message = storage.write_fault_message(e, self.log_dir, doing, kept)
            if message is None:
                raise
            raise CheckpointError(message) from None


def remember_written(log_dir, step, manifest):
    """Record a step this process has just written (its ``manifest``'s dict): the checksums it
    lists were computed from the bytes as they were written, so the prune after the save does
    not read them back while the files are unchanged (_WRITTEN; a resume still reads them).
    Not collective."""
    _remember(_identity(StepStatus(step=int(step), files=[], manifest=manifest),
                        os.fspath(log_dir)), _WRITTEN)


def _manifest_bytes(step, entries, settings=None, extra=None):
    """``extra``: more top-level keys (a sharded step's "layout", "dir", "holds", "ranks")."""
    doc = {
        "schema": ckpt.SCHEMA,
        "version": file_writer.MANIFEST_VERSION,
        "kind": "manifest",
        "step": step,
        "files": entries,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if extra:
        doc.update(extra)
    if settings:
        doc["run_flags"] = dict(settings)
    return (json.dumps(doc, indent=1) + "\n").encode()


def _remove_written(log_dir, names):
    """Best effort: remove the files of an unfinished save (no manifest), newest first;
    returns the names that could not be removed."""
    left = []
    for name in reversed(names):
        try:
            _remove(ckpt.join(log_dir, name))
        except FileNotFoundError:
            pass
        except OSError:  # no manifest: the step is never taken for complete anyway
            left.append(name)
    return left[::-1]


# ---------------------------------------------------------------------------------------------
# pruning


def _remove(path):
    if ckpt.is_remote(path):
        storage.remove(path)
    elif os.path.isdir(path) and not os.path.islink(path):  # a sharded step's (temp) folder
        shutil.rmtree(path)
    else:
        os.unlink(path)


_SET_ASIDE_RE = re.compile(r"^step(\d+)$")


def _prune_set_aside(log_dir, oldest_kept):
    """Delete incomplete/stepNNNNNN/ folders of steps older than ``oldest_kept``."""
    root = ckpt.join(log_dir, INCOMPLETE_DIR)
    deleted = []
    for name in listdir(root):
        m = _SET_ASIDE_RE.match(name)
        if not m or int(m.group(1)) >= oldest_kept:
            continue
        folder = ckpt.join(root, name)
        for inner in listdir(folder):
            try:
                _remove(ckpt.join(folder, inner))
                deleted.append(ckpt.join(folder, inner))
            except FileNotFoundError:
                pass
        if not ckpt.is_remote(folder):
            try:
                os.rmdir(folder)
            except OSError:  # something else was put there: leave it
                pass
    return deleted


_DELETE_ORDER = {"manifest": 0, "opt": 1, "ema": 2, "phema": 2, "model": 3, "sharded": 3}


def prune_lines(log_dir, keep):
    """After a complete save: ``prune(log_dir, keep)`` when ``keep`` (--keep_checkpoints), as
    the lines to log (the writer process does not log). A failed delete is a warning line, not
    an error: it must not kill a run that just saved (a bug still raises)."""
    if not keep:
        return []
    try:
        deleted = prune(log_dir, keep)
    except (CheckpointError, OSError) as e:
        return [f"warning: --keep_checkpoints {keep}: prune failed: {e}"]
    return [f"pruned {len(deleted)} old checkpoint file(s)"] if deleted else []


def prune(log_dir, keep, *, temp_age_s=60.0, snapshots=False):
    """
    Keep the newest ``keep`` resumable steps: complete, with their checksums matching, checked
    newest first as a resume checks its candidate (verify_step; a step verified before in this
    process or written by it, unchanged since, is not read again), so the step a resume would
    take is always kept. Delete every file of steps older than the oldest kept one (complete, damaged or
    interrupted) except their post-hoc EMA snapshots (``phema_*``: the history the
    reconstruction needs), which only ``snapshots=True`` deletes (then also those left by earlier
    prunes). Never touches a step newer than the oldest kept one (a damaged step stays for
    `ckpt.py verify` to show, a step without manifest may be a save in progress); with no
    resumable step it deletes nothing. Each
    step's manifest goes FIRST (then opt, EMA, model), so a half-deleted step is never "complete".
    Also removes temp files (``*.tmp-<hex>``) older than ``temp_age_s`` seconds, and the
    interrupted saves set aside in ``incomplete/stepNNNNNN/`` once they are older than the oldest
    kept step (so repeated crashes cannot fill the disk). ``keep`` < 1 deletes no step (only stale
    temp files). Returns the deleted paths. Not collective: call on rank 0 after a save
    (save_step's return means every rank has finished it), or where no job holds the log dir's
    lock (`ckpt.py prune` takes it: a job's save in progress has temp files of any age).
    CheckpointReadError when a read fails (nothing is deleted then).
    """
    log_dir = os.fspath(log_dir)
    names = listdir(log_dir)
    deleted = []
    if keep >= 1:
        steps = list_steps(log_dir, names=names)
        kept = []
        for st in steps:
            if len(kept) == keep:
                break
            written_here = st.manifest is not None and _identity(st, log_dir) in _WRITTEN
            if st.complete and not st.verified and not written_here:
                verify_step(st, log_dir)
            if st.complete:
                kept.append(st)
        oldest_kept = kept[-1].step if kept else None
        doomed = [p for st in steps if oldest_kept is not None and st.step < oldest_kept
                  for p in sorted(st.files, key=lambda p: _DELETE_ORDER.get(_kind(p), 9))
                  if snapshots or _kind(p) != "phema"]
        if snapshots and oldest_kept is not None:  # kept by earlier prunes: not in any step
            listed = set(doomed)
            doomed += [s.path for s in list_snapshots(log_dir, names=names)
                       if s.step < oldest_kept and s.path not in listed]
        for p in doomed:
            try:
                _remove(p)
                deleted.append(p)
            except FileNotFoundError:
                pass
        if oldest_kept is not None:
            deleted += _prune_set_aside(log_dir, oldest_kept)
    now = time.time()
    for name in names:
        info = ckpt.name_info(name)
        if info is None or info.kind != "temp":
            continue
        p = ckpt.join(log_dir, name)
        try:
            if now - ckpt.file_mtime(p) >= temp_age_s:
                _remove(p)
                deleted.append(p)
        except FileNotFoundError:
            pass
    return deleted
