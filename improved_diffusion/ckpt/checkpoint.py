"""
One checkpoint file and its vocabulary: names, schema-tagged payloads, kinds and layouts (our
files and upstream's) and the validated reader (its byte-level half, torch.load with every
record's CRC checked, is safe_read.py's). Writing a file (the atomic writer, the checksums a
manifest lists, the wording of disk faults) is file_writer.py's; what a *directory* of steps
holds (discovery, verification, the resume plan, pruning) is run_dir.py's.

docs/checkpoints.md is the reference for the format; keep it in step with this module.

Files of one step (``step`` = completed optimizer steps), in the log dir:

    model{step:06d}.pt         {"schema", "version", "kind": "model", "step", "state_dict", "flags"}
    ema_{rate}_{step:06d}.pt      {... "kind": "ema", "state_dict", "flags", "rate", "rate_str"}
    opt{step:06d}.pt              {... "kind": "opt", "optimizer", "trainer"}
    phema_{std:.3f}_{step:06d}.pt  {... "kind": "phema", "state_dict", "flags", "std", "nimg",
                                  "param_names"}: a post-hoc EMA snapshot (phema.py), kept when
                                  its step is pruned
    manifest{step:06d}.json       written LAST: {"step", "files": {name: {"size", "crc32"}}, ...}

Also read: upstream's raw files under the same names, and facebookresearch/DiT's train.py files
``checkpoints/{step:07d}.pt`` = {"model", "ema", "opt", "args"} (a "combined" dict: weights, EMA
weights, index-keyed AdamW state, and a pickled argparse.Namespace; see read_pickled_objects).
A noised classifier's run (guided-diffusion's classifier_train.py) names its steps the same way in
its own log dir; its model file has "kind": "classifier" (weights and the classifier's flags).

Reading always uses ``torch.load(weights_only=True, map_location="cpu")``: a file can never run
code. Every failure is a ``CheckpointError`` whose one-line message names the file; a read that
failed (I/O, permissions, a remote store, memory) is its subclass ``CheckpointReadError``, which
no caller takes as a reason to fall back.
"""

import os
import re
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch as th

from .. import dist_util
from . import safe_read
from ..infra import storage

from ..infra.errors import UserError, typed_one_line

SCHEMA = "improved_diffusion.checkpoint"
VERSION = 1
KINDS = ("model", "ema", "opt", "phema", "classifier")
# The kinds whose payload is one network's weights ("state_dict") and its flags.
WEIGHT_KINDS = ("model", "ema", "phema", "classifier")
# The slots a step's file names make (a classifier's weights are in the "model" slot).
SLOTS = ("model", "ema", "opt", "phema")

# Temporary files: "<final name>.tmp-<32 hex>" in the same directory as the final file.
_TMP_RE = re.compile(r"^(?P<final>.+)\.tmp-[0-9a-f]{8,32}$")
_MODEL_RE = re.compile(r"^model(\d+)\.pt$")
_EMA_RE = re.compile(r"^ema_(.+)_(\d+)\.pt$")
_OPT_RE = re.compile(r"^opt(\d+)\.pt$")
_PHEMA_RE = re.compile(r"^phema_(\d+\.\d+)_(\d+)\.pt$")
_MANIFEST_RE = re.compile(r"^manifest(\d+)\.json$")
# DiT's train.py: checkpoints/{step:07d}.pt, a combined dict.
_DIT_RE = re.compile(r"^(\d{7,})\.pt$")
# Also accepted by parse_step (names a user may give to --resume_checkpoint).
_STEP_NAME_RES = (
    _MODEL_RE,
    _OPT_RE,
    _MANIFEST_RE,
    _DIT_RE,
    re.compile(r"^ema_.+_(\d+)\.pt$"),
    _PHEMA_RE,
    re.compile(r"^(?:model|ema|opt|ckpt|checkpoint)[_-]?(?:step[_-]?)?(\d+)"
               r"\.(?:pt|pth|safetensors)$"),
)
_PREFIXES = ("module.", "_orig_mod.")
_COMBINED_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "net")
_COMBINED_EMA_KEYS = ("ema", "ema_state_dict", "model_ema", "ema_model")
_COMBINED_OPT_KEYS = ("opt", "optimizer", "optimizer_state_dict", "optim")
# Entries of a combined dict that must be plain tensors and optimizer state (never stand-ins).
_COMBINED_PAYLOAD_KEYS = (*_COMBINED_MODEL_KEYS, *_COMBINED_EMA_KEYS, *_COMBINED_OPT_KEYS)
_HEAD_BYTES = 4096


class CheckpointError(UserError):
    """A checkpoint file/directory problem; the one-line message names the file and what to do.

    Raised for *content* (a file of the wrong kind, truncated, corrupt, from a newer format): a
    caller may explain it and fall back (the optimizer slot does). See CheckpointReadError.
    """


class CheckpointReadError(CheckpointError):
    """A read that failed (I/O error, permissions, a remote store's error, out of memory): never a
    reason to fall back, move files or start fresh; the run stops, naming the file."""


# ---------------------------------------------------------------------------------------------
# names


def model_filename(step):
    return f"model{step:06d}.pt"


def ema_filename(rate, step):
    """``rate`` is the rate's string as given on the command line (e.g. "0.9999")."""
    return f"ema_{rate}_{step:06d}.pt"


def opt_filename(step):
    return f"opt{step:06d}.pt"


def phema_filename(std, step):
    """A post-hoc EMA snapshot's name: ``phema_{std:.3f}_{step:06d}.pt`` (phema_0.050_012000.pt)."""
    return f"phema_{float(std):.3f}_{step:06d}.pt"


def posthoc_ema_filename(std, step):
    """The name of an EMA file reconstructed post hoc: ``ema_phema0.070_012000.pt`` (an EMA
    file whose rate string is ``phema{std:.3f}``)."""
    return ema_filename(posthoc_rate_str(std), step)


def posthoc_rate_str(std):
    return f"phema{float(std):.3f}"


def manifest_filename(step):
    return f"manifest{step:06d}.json"


def basename(path):
    return os.path.basename(os.fspath(path).rstrip("/"))


def dirname(path):
    path = os.fspath(path)
    if is_remote(path):
        return storage.dirname(path)
    return os.path.dirname(path) or "."


def join(d, name):
    return storage.join(os.fspath(d), name)


def is_remote(path):
    return storage.is_remote(path)


@dataclass(frozen=True)
class NameInfo:
    """What a file name says: kind ("model" | "ema" | "opt" | "phema" | "manifest" | "temp" |
    "combined": DiT's ``{step:07d}.pt``), step, rate (ema), std (phema, as the name writes it:
    "0.050")."""

    kind: str
    step: Optional[int]
    rate_str: Optional[str] = None
    std_str: Optional[str] = None


def name_info(path):
    """
    The NameInfo of a checkpoint file name, or None for any other name. The one place where the
    file-name patterns are read::

        name_info("runs/a/ema_0.9999_000200.pt") -> NameInfo("ema", 200, "0.9999")
        name_info("phema_0.050_000200.pt")       -> NameInfo("phema", 200, std_str="0.050")
        name_info("model000200.pt.tmp-9f3a...")  -> NameInfo("temp", 200)
        name_info("checkpoints/0400000.pt")      -> NameInfo("combined", 400000)  (DiT's)
        name_info("progress.csv")                -> None
    """
    name = basename(path)
    m = _TMP_RE.match(name)
    if m:
        final = name_info(m.group("final"))
        return NameInfo("temp", final.step if final else None)
    for kind, rx in (("model", _MODEL_RE), ("opt", _OPT_RE), ("manifest", _MANIFEST_RE),
                     ("combined", _DIT_RE)):
        m = rx.match(name)
        if m:
            return NameInfo(kind, int(m.group(1)))
    m = _EMA_RE.match(name)
    if m:
        return NameInfo("ema", int(m.group(2)), m.group(1))
    m = _PHEMA_RE.match(name)
    if m:
        return NameInfo("phema", int(m.group(2)), std_str=m.group(1))
    return None


def parse_step(path):
    """
    The step number carried by a checkpoint file name (``model000100.pt`` -> 100,
    ``ema_0.9999_000100.pt`` -> 100, ``opt000100.pt``, ``manifest000100.json``, DiT's
    ``0400000.pt`` -> 400000).

    Raises CheckpointError naming the file when the name carries no step (never a silent 0).
    """
    name = basename(path)
    for rx in _STEP_NAME_RES:
        m = rx.match(name)
        if m:
            return int(m.group(m.lastindex))
    raise CheckpointError(
        f"{os.fspath(path)}: cannot read a step number from the file name (expected e.g. "
        f"model000100.pt); rename it to modelNNNNNN.pt or use a tagged checkpoint"
    )


def slot_of(path):
    """The slot a step file's name claims: "model", "ema", "opt", "phema", or None for any other
    name. (A classifier's weights sit in the "model" slot: ``model{step:06d}.pt``.)"""
    info = name_info(path)
    return info.kind if info is not None and info.kind in SLOTS else None


# ---------------------------------------------------------------------------------------------
# file contents


def model_payload(step, state_dict, flags):
    """The dict saved as ``model{step:06d}.pt``."""
    return {"schema": SCHEMA, "version": VERSION, "kind": "model", "step": int(step),
            "state_dict": state_dict, "flags": dict(flags or {})}


def ema_payload(step, rate_str, state_dict, flags):
    """The dict saved as ``ema_{rate_str}_{step:06d}.pt`` (``rate``: None for a rate string that
    is not a number, as a post-hoc EMA's ``phema0.070``)."""
    try:
        rate = float(rate_str)
    except ValueError:
        rate = None
    return {"schema": SCHEMA, "version": VERSION, "kind": "ema", "step": int(step),
            "state_dict": state_dict, "flags": dict(flags or {}), "rate": rate,
            "rate_str": str(rate_str)}


def phema_payload(step, std, nimg, state_dict, flags, param_names, tied=None):
    """The dict saved as ``phema_{std:.3f}_{step:06d}.pt``: a power-function EMA of relative
    width ``std`` after ``nimg`` images (over all ranks); ``state_dict``: the model's, with the
    EMA in place of the parameters named in ``param_names`` (the other entries are buffers,
    but for the names in ``tied``, {second name of a shared parameter: its name in
    param_names}, which hold the same EMA; the key is there only when a model shares some)."""
    payload = {"schema": SCHEMA, "version": VERSION, "kind": "phema", "step": int(step),
               "state_dict": state_dict, "flags": dict(flags or {}), "std": float(std),
               "nimg": int(nimg), "param_names": [str(n) for n in param_names]}
    if tied:
        payload["tied"] = {str(a): str(n) for a, n in tied.items()}
    return payload


def posthoc_ema_payload(step, std, nimg, state_dict, flags, inputs, profile_error):
    """An ordinary EMA file's dict (``ema_payload``, rate string ``phema{std:.3f}``) for weights
    reconstructed post hoc, plus ``"phema"``: {"std", "nimg", "inputs": [[snapshot name,
    coefficient]], "profile_error"} saying how they were made."""
    payload = ema_payload(step, posthoc_rate_str(std), state_dict, flags)
    payload["phema"] = {"std": float(std), "nimg": int(nimg),
                        "inputs": [[str(n), float(c)] for n, c in inputs],
                        "profile_error": float(profile_error)}
    return payload


def classifier_payload(step, state_dict, flags):
    """The dict saved as a classifier run's ``model{step:06d}.pt`` (``flags``: the classifier's
    and its diffusion's, script_util.classifier_and_diffusion_defaults() keys)."""
    return {"schema": SCHEMA, "version": VERSION, "kind": "classifier", "step": int(step),
            "state_dict": state_dict, "flags": dict(flags or {})}


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
    kind: str  # "model" | "ema" | "opt" | "classifier" | "combined" | "unknown"
    tagged: bool
    step: Optional[int] = None
    rate_str: Optional[str] = None
    flags: Optional[dict] = None
    state_dict: Optional[dict] = None  # model weights, prefixes stripped
    optimizer: Optional[dict] = None  # raw torch or named-v1 optimizer dict
    trainer: Optional[dict] = None
    std: Optional[float] = None  # phema snapshots: the relative width,
    nimg: Optional[int] = None  # the images seen,
    param_names: Optional[List[str]] = None  # and which state_dict entries are EMA'd parameters
    tied: Optional[Dict[str, str]] = None  # {second name of a shared parameter: its param name}
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


def is_classifier_state(sd):
    """True for the key layout of guided-diffusion's noised classifier (EncoderUNetModel): the
    UNet's time embedding, input blocks and middle block and an ``out`` head, but no
    ``output_blocks`` (every UNet has them). Keys may carry the prefixes strip_prefixes removes."""
    keys = list(strip_prefixes(sd)[0]) if _is_state_dict(sd) else []
    heads = ("time_embed.", "input_blocks.", "middle_block.", "out.")
    return (bool(keys) and all(any(k.startswith(h) for k in keys) for h in heads)
            and not any(k.startswith("output_blocks.") for k in keys))


# Optimizer payload layouts (see optim_state): one detection, one phrase each.
LAYOUT_NAMED = "named-v1"
LAYOUT_INDEXED = "index-keyed"
LAYOUT_FLAT1 = "flat-fp16-1"
LAYOUT_FLAT2 = "flat-fp16-2"
LAYOUT_PHRASES = {
    LAYOUT_NAMED: "name-keyed (named-v1)",
    LAYOUT_INDEXED: "index-keyed torch state dict (upstream)",
    LAYOUT_FLAT1: "flattened fp16 master params, 1 flat param (improved-diffusion --use_fp16)",
    LAYOUT_FLAT2: "flattened fp16 master params, 2 flat params (guided-diffusion --use_fp16)",
}


def _moment_shape(entry):
    """The shape of a per-parameter optimizer state entry's largest tensor (step aside)."""
    if not isinstance(entry, dict):
        return None
    shape, numel = None, -1
    for k, v in entry.items():
        if k != "step" and isinstance(v, th.Tensor) and v.numel() > numel:
            shape, numel = tuple(v.shape), v.numel()
    return shape


def opt_layout(opt, n_params=None):
    """
    The layout of an optimizer payload: LAYOUT_NAMED, LAYOUT_FLAT1 (improved-diffusion's fp16
    master param: one flat [N] param), LAYOUT_FLAT2 (guided-diffusion's: [N1] for the params with
    ndim <= 1, then [1, N2]) or LAYOUT_INDEXED (any other torch optimizer state dict).

    :param n_params: the model's parameter count when known; a payload with as many params is
        index-keyed whatever its shapes (without it, a model of 1 or 2 parameters looks flat).
    """
    if opt.get("format") == LAYOUT_NAMED:
        return LAYOUT_NAMED
    groups = opt.get("param_groups")
    state = opt.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return LAYOUT_INDEXED
    params = [i for g in groups if isinstance(g, dict) and isinstance(g.get("params"), list)
              for i in g["params"] if isinstance(i, (int, str))]
    shapes = [_moment_shape(state.get(i)) for i in params]
    if None in shapes or len(params) not in (1, 2) or (n_params or 3) <= len(params):
        return LAYOUT_INDEXED
    values = sum(s[-1] for s in shapes if s)
    if len(shapes) == 1 and len(shapes[0]) == 1 and (n_params or values) > 1:
        return LAYOUT_FLAT1
    if len(shapes) == 2 and len(shapes[0]) == 1 and (
            len(shapes[1]) == 1 or len(shapes[1]) == 2 and shapes[1][0] == 1) \
            and (n_params or values) > 2:
        return LAYOUT_FLAT2
    return LAYOUT_INDEXED


def classify(obj):
    """
    What a loaded object is: returns (kind, notes) with kind one of "model", "ema", "opt",
    "classifier", "combined", "unknown" and notes a list of one-line diagnoses.

    Recognises tagged files, upstream's raw model state dicts (str -> tensor), guided-diffusion's
    raw classifier state dicts (is_classifier_state), raw torch optimizer state dicts ("state" +
    "param_groups", incl. the flattened fp16 layouts), name-keyed (named-v1) optimizer state,
    combined dicts ({"model": ..., "ema": ..., "opt": ...}), and ``module.`` / ``_orig_mod.``
    key prefixes.
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
        if kind in WEIGHT_KINDS and isinstance(obj.get("state_dict"), dict):
            notes += strip_prefixes(obj["state_dict"])[1]
        if kind == "opt" and isinstance(obj.get("optimizer"), dict):
            notes += _opt_notes(obj["optimizer"])
        return kind, notes
    if not obj:
        return "unknown", ["empty dict"]
    if _is_optimizer_state(obj) or obj.get("format") == LAYOUT_NAMED:
        return "opt", notes + _opt_notes(obj)
    if is_classifier_state(obj):
        return "classifier", ["guided-diffusion's noised classifier layout (no output_blocks)"
                              ] + strip_prefixes(obj)[1]
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
    layout = opt_layout(opt)
    return [] if layout == LAYOUT_INDEXED else [f"optimizer layout: {LAYOUT_PHRASES[layout]}"]


# What a file holds, as messages say it ("FILE: holds {phrase}"); keyed by CkptFile.kind.
KIND_PHRASES = {
    "model": "a model state dict",
    "ema": "EMA model weights",
    "opt": "optimizer state",
    "phema": "a post-hoc EMA snapshot (power-function EMA weights)",
    "classifier": "noised-classifier weights",
    "combined": "a combined dict",
    "unknown": "something that is not a checkpoint",
}


def describe(ckpt):
    """The phrase for what a loaded file (CkptFile) holds: "a model state dict", ..."""
    phrase = KIND_PHRASES.get(ckpt.kind, KIND_PHRASES["unknown"])
    if ckpt.kind == "combined" and isinstance(ckpt.raw, dict):
        entries = [str(k) for k in ckpt.raw if isinstance(ckpt.raw.get(k), dict)]
        phrase += f" ({', '.join(entries)})"
    return phrase


def describe_object(obj):
    """
    The phrase for what any loaded object holds, with a detail that helps find the file's
    origin (its type, tagged kind, tensor count, or keys): for a file found in the wrong slot.
    """
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    if not obj:
        return "an empty dict"
    if obj.get("schema") == SCHEMA:
        return f"a tagged {obj.get('kind', '?')} checkpoint"
    kind, _ = classify(obj)
    if kind in ("model", "classifier"):
        return f"{KIND_PHRASES[kind]} ({len(obj)} tensors, e.g. {next(iter(obj))!r})"
    if kind in ("opt", "combined"):
        return describe(CkptFile(path="", kind=kind, tagged=False, raw=obj))
    keys = ", ".join(repr(k) for k in list(obj)[:4]) + (", ..." if len(obj) > 4 else "")
    return f"a dict with keys [{keys}]"


def _torch_load(raw, nbytes, name, records=None, share=(0, 1)):
    """torch.load (weights_only) of the file open in ``raw`` (``nbytes`` long), checking the CRC-32
    of each record as it is read (safe_read.checked_load): all of them, or with ``share`` (k, n)
    those whose index is k modulo n. A failed read is CheckpointReadError; bad content (empty,
    truncated, not torch, pickled code, a damaged record) is CheckpointError; both name the file.
    ``records``: safe_read.zip_records(raw) when known.

    Returns (object, notes). A combined dict whose pickled objects all lie outside its weights and
    optimizer entries (DiT's "args") is read with stand-ins for them (read_pickled_objects); the
    notes say what was read as data and what was skipped."""
    if nbytes == 0:
        raise CheckpointError(
            f"{name}: empty file (0 bytes), probably an interrupted write; delete it or use an "
            f"earlier step")
    try:
        if records is None:
            try:
                records = safe_read.zip_records(raw)
            except OSError as e:
                raise safe_read.Unreadable(f"cannot read ({typed_one_line(e)}); check that it is "
                                           f"reachable and readable") from None
        try:
            return safe_read.checked_load(raw, records, share), []
        except safe_read.Refused:
            stand_ins = safe_read.stand_ins_for(raw) if records is not None else None
            if stand_ins:
                try:
                    obj = safe_read.checked_load(raw, records, share, stand_ins)
                except safe_read.Refused:
                    obj = None
                notes = read_pickled_objects(obj)
                if notes is not None:
                    return obj, notes
            raise
    except safe_read.Unreadable as e:
        raise CheckpointReadError(f"{name}: {e.reason}") from None
    except safe_read.BadBytes as e:
        raise CheckpointError(f"{name}: {e.reason}; replace it or resume from another step") \
            from None


# ---------------------------------------------------------------------------------------------
# pickled objects in an otherwise readable file (DiT's "args": an argparse.Namespace)


def read_pickled_objects(obj):
    """
    Whether a file read with stand-ins (PickledObject) is usable, and what was made of them:
    None when it is not (the file is refused as before: the stand-ins are in its weights or
    optimizer entries, or it is not a combined dict of weights), else the notes, one per object,
    after replacing each stand-in in place:

    * an ``argparse.Namespace`` (DiT's "args") by the dict of its fields: it is an attribute bag,
      so its fields are the data (nothing is constructed);
    * any other object by None: skipped, and named in the notes.

    Example: DiT's ``{"model", "ema", "opt", "args"}`` gives ``obj["args"] = {"model":
    "DiT-XL/2", "image_size": 256, ...}`` and the note "args: a pickled argparse.Namespace, read
    as its 12 fields (plain data; no object was constructed and no code run)".
    """
    if not isinstance(obj, dict) or obj.get("schema") == SCHEMA:
        return None
    if not any(_is_state_dict(obj.get(k)) for k in (*_COMBINED_MODEL_KEYS, *_COMBINED_EMA_KEYS)):
        return None
    if any(_holds_stand_in(obj[k]) for k in _COMBINED_PAYLOAD_KEYS if k in obj):
        return None
    notes = []
    for key in list(obj):
        obj[key] = _plain_data(obj[key], str(key), notes)
    return notes


def _holds_stand_in(v, depth=0):
    if isinstance(v, safe_read.PickledObject):
        return True
    if depth < 8 and isinstance(v, dict):
        return any(_holds_stand_in(x, depth + 1) for x in v.values())
    if depth < 8 and isinstance(v, (list, tuple)):
        return any(_holds_stand_in(x, depth + 1) for x in v)
    return False


def _plain_data(v, where, notes, depth=0):
    """``v`` with its stand-ins replaced (see read_pickled_objects); ``where``: its path."""
    if isinstance(v, safe_read.PickledObject):
        if v.name == "argparse.Namespace" and isinstance(v.state, dict) and not v.args:
            notes.append(f"{where}: a pickled argparse.Namespace, read as its {len(v.state)} "
                         f"fields (plain data; no object was constructed and no code run)")
            return {k: _plain_data(x, f"{where}.{k}", notes, depth + 1)
                    for k, x in v.state.items()}
        notes.append(f"{where}: a pickled {v.name} object, skipped (safe loading constructs no "
                     f"objects)")
        return None
    if depth < 8 and isinstance(v, dict) and _holds_stand_in(v):
        return type(v)((k, _plain_data(x, f"{where}.{k}", notes, depth + 1))
                       for k, x in v.items())
    if depth < 8 and isinstance(v, (list, tuple)) and _holds_stand_in(v):
        return type(v)(_plain_data(x, f"{where}[{i}]", notes, depth + 1) for i, x in enumerate(v))
    return v


# DiT's train.py builds its model and diffusion from these constants and its args (--model,
# --image-size, --num-classes): VAE latents of 4 channels, 8x smaller than the images; learned
# sigma; label dropout 0.1 (the null label's row); 1000 linear-schedule steps. As our flags:
DIT_TRAIN_FLAGS = dict(in_channels=4, learn_sigma=True, class_dropout_prob=0.1,
                       diffusion_steps=1000, noise_schedule="linear", use_kl=False,
                       predict_xstart=False, sigma_small=False, rescale_learned_sigmas=True)


def dit_args_flags(args, state_dict=None):
    """Our model flags for DiT's train.py args (a dict of its Namespace's fields), or None when
    they are not DiT's (no "model" naming a DiT, or no integer "image_size")::

        {"model": "DiT-XL/2", "image_size": 256, "num_classes": 1000, ...}
        -> {"arch": "DiT-XL/2", "image_size": 32, "class_cond": True, "num_classes": 1000,
            "in_channels": 4, "learn_sigma": True, "class_dropout_prob": 0.1, ...}

    ``state_dict``: the file's weights, when at hand: input channels, learned sigma and the null
    label's row are then read from their shapes (for a DiT built with other constants).
    """
    if not isinstance(args, dict):
        return None
    model, size = args.get("model"), args.get("image_size")
    if not (isinstance(model, str) and model.startswith("DiT-") and isinstance(size, int)):
        return None
    num_classes = args.get("num_classes", 1000)
    flags = dict(arch=model, image_size=size // 8, class_cond=bool(num_classes),
                 num_classes=num_classes, **DIT_TRAIN_FLAGS)
    sd = state_dict or {}
    patch, table = sd.get("x_embedder.proj.weight"), sd.get("y_embedder.embedding_table.weight")
    out = sd.get("final_layer.linear.bias")
    if isinstance(patch, th.Tensor) and patch.dim() == 4:  # [D, C, p, p]
        flags["in_channels"] = int(patch.shape[1])
        if isinstance(out, th.Tensor):  # [p * p * C_out]
            flags["learn_sigma"] = out.numel() == 2 * patch.shape[1] * patch[0, 0].numel()
    if isinstance(table, th.Tensor) and isinstance(num_classes, int):
        flags["class_dropout_prob"] = 0.1 if table.shape[0] > num_classes else 0.0
    return flags


def read_bytes(path):
    """The bytes of ``path`` in this process (not collective); CheckpointReadError naming the file
    when the read fails (remote paths are retried a few times first)."""
    data, err = with_retry(lambda: _read_once(path), path)
    if err is not None:
        raise CheckpointReadError(err[1])
    return data


def _read_once(path):
    # a remote store's transient errors were retried inside (storage.retrying)
    return dist_util.read_local(os.fspath(path))


class _Retryable(Exception):
    def __init__(self, err):
        super().__init__(err[1])
        self.err = err


def load_file(path_or_bytes, name=None):
    """
    Load and classify one checkpoint file (local, NOT collective).

    ``path_or_bytes``: a path / blobfile URL, or the file's bytes (then ``name`` names it in
    messages and supplies the step/rate for untagged files). Always
    ``torch.load(weights_only=True, map_location="cpu")``, reading each record once, straight
    into its tensor, with its CRC-32 checked on the way. Any failure (missing, directory, empty,
    truncated, random bytes, pickled code, a damaged record, a tagged file from a newer format, a
    tagged file without its payload) raises CheckpointError with a one-line message; a failed
    read is CheckpointReadError.
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        name = os.fspath(name) if name is not None else "<bytes>"
        raw = safe_read.MemoryFile(path_or_bytes)
        obj, notes = _torch_load(raw, raw.seek(0, 2), name)
        return _make_ckpt(obj, name, raw.tell(), notes)
    name = os.fspath(path_or_bytes) if name is None else os.fspath(name)
    if is_remote(path_or_bytes):
        return load_file(read_bytes(path_or_bytes), name=name)
    with _open_local(path_or_bytes) as (raw, nbytes):
        obj, notes = _torch_load(raw, nbytes, name)
    return _make_ckpt(obj, name, nbytes, notes)


def peek_file(path):
    """
    ``load_file``'s CkptFile of a local file without reading its tensors: they are memory-mapped
    (``torch.load(mmap=True, weights_only=True)``), so their shapes and dtypes are known but
    their bytes are not read (nor their CRCs checked) until touched: a first look at many files
    (the post-hoc EMA snapshots of a run) before loading them one at a time. Drop the result
    before loading the next. A remote path is loaded in full. CheckpointError as load_file.
    """
    path = os.fspath(path)
    if is_remote(path):
        return load_file(path)
    with _open_local(path) as (_, nbytes):
        if nbytes == 0:
            raise CheckpointError(f"{path}: empty file (0 bytes), probably an interrupted write; "
                                  f"delete it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = th.load(path, mmap=True, weights_only=True, map_location="cpu")
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ({typed_one_line(e)}); check that it is "
                                  f"reachable and readable") from None
    except MemoryError:
        raise CheckpointReadError(f"{path}: out of memory while loading it; free memory or load "
                                  f"it on a machine with more") from None
    except Exception as e:  # torch.load's failures on bad bytes have no common type
        raise CheckpointError(f"{path}: {safe_read.load_error_reason(e)}; replace it") from None
    return _make_ckpt(obj, path, nbytes)


class _open_local:
    """``with _open_local(path) as (file, size)``: a local file opened for reading, its failures
    worded as dist_util.read_local words them (CheckpointReadError naming the file)."""

    def __init__(self, path):
        self._path = os.fspath(path)
        self._f = None

    def __enter__(self):
        f, err = dist_util.open_local(self._path)
        if err is not None:
            raise CheckpointReadError(err[1])
        self._f = f
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError as e:
            f.close()
            raise CheckpointReadError(f"{self._path}: cannot read ({typed_one_line(e)})") from e
        return f, size

    def __exit__(self, *exc):
        self._f.close()
        return False


def _local_identity(path):
    """What a rank reports about a local file before a collective load, and keeps: (("ok",
    identity, digest), records) with identity (machine, device, inode, size, mtime) and the digest
    of its zip records (None for a file that is not a readable torch zip); (("err", (error type
    name, one line), None), None) when it cannot be opened or read."""
    f, err = dist_util.open_local(path)
    if err is not None:
        return ("err", err, None), None
    try:
        with f:
            st = os.fstat(f.fileno())
            records = safe_read.zip_records(f) if st.st_size else None
    except OSError as e:
        return ("err", ("OSError", f"{path}: cannot read ({typed_one_line(e)})"), None), None
    ident = (dist_util.machine_id(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return ("ok", ident, None if records is None else safe_read.records_digest(records)), records


def load_file_collective(path):
    """
    ``load_file`` on every rank, with every rank getting the same object or raising the same
    CheckpointError (one line naming the file). Ranks given different paths all raise
    CheckpointError naming each rank's path.

    A local file that every rank can open, with the same zip records (names, sizes, CRC-32s) on
    every rank, is loaded by each rank itself, straight into its tensors (memory: the decoded
    state, no copy of the file's bytes); ranks that read the same physical file (same machine,
    device, inode, size and mtime) split the CRC checks of its records between them, and every
    rank learns every rank's outcome. Otherwise (a remote store, a rank that cannot open the
    file, a different file on some host) rank 0 reads the bytes and broadcasts them in bounded
    pieces (dist_util.load_bytes) and each rank loads them, checking every record.

    Collective: call from all ranks with the same arguments.
    """
    path = os.fspath(path)
    if not dist_util.is_distributed():
        return load_file(path)
    mine, records = (("remote", None, None), None) if is_remote(path) else _local_identity(path)
    gathered = dist_util.all_gather_object((path, mine))
    try:
        dist_util.check_same_path([p for p, _ in gathered])
    except dist_util.DistMismatchError as e:
        raise CheckpointError(str(e)) from None
    states = [m for _, m in gathered]
    if states[0][0] == "err":  # the same one line on every rank
        raise CheckpointReadError(states[0][1][1])
    if any(st[0] != "ok" or st[2] is None or st[2] != states[0][2] or st[1][3] != states[0][1][3]
           for st in states):
        return load_file_broadcast(path)
    rank = dist_util.get_rank()
    group = [r for r, st in enumerate(states) if st[1] == states[rank][1]]
    share, of = group.index(rank), len(group)
    outcome, obj, nbytes, notes = None, None, 0, []
    try:
        with _open_local(path) as (raw, nbytes):
            obj, notes = _torch_load(raw, nbytes, path, records, share=(share, of))
    except CheckpointError as e:
        outcome = (type(e) is CheckpointReadError, str(e))
    outcomes = dist_util.all_gather_object(outcome)
    failed = [o for o in outcomes if o is not None]
    if failed:
        read_error, message = failed[0]
        raise (CheckpointReadError if read_error else CheckpointError)(message)
    return _make_ckpt(obj, path, nbytes, notes)


def load_file_broadcast(path):
    """load_file_collective's fallback: rank 0 reads, broadcasts the bytes, every rank loads."""
    try:
        data = with_retry(lambda: dist_util.load_bytes(path), path, retry_on=(OSError,))
    except dist_util.DistMismatchError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:  # one line naming the file, the same on every rank
        raise CheckpointReadError(str(e)) from None
    return load_file(data, name=path)


def from_payload(obj, name):
    """``load_file``'s CkptFile of a payload already in memory (a file a sharded step holds,
    read by sharded.consolidate), ``name`` naming it in messages: the same checks and
    classification as the file's."""
    return _make_ckpt(obj, os.fspath(name), 0)


def _make_ckpt(obj, name, nbytes, read_notes=()):
    kind, notes = classify(obj)
    c = CkptFile(path=name, kind=kind, tagged=False, raw=obj, notes=notes + list(read_notes),
                 nbytes=nbytes)
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
        if kind in WEIGHT_KINDS:
            sd = obj.get("state_dict")
            if not isinstance(sd, dict):
                raise CheckpointError(f"{name}: tagged {kind} file has no 'state_dict'; replace it")
            c.state_dict, _ = strip_prefixes(sd)
            c.flags = obj.get("flags") if isinstance(obj.get("flags"), dict) else None
            if kind == "ema":
                c.rate_str = obj.get("rate_str") or (
                    str(obj["rate"]) if obj.get("rate") is not None else None)
            if kind == "phema":
                _read_phema_tags(c, obj, name)
        else:
            if not isinstance(obj.get("optimizer"), dict):
                raise CheckpointError(f"{name}: tagged opt file has no 'optimizer'; replace it")
            c.optimizer = obj["optimizer"]
            c.trainer = obj.get("trainer") if isinstance(obj.get("trainer"), dict) else None
        return c

    # Untagged (upstream and others): step and rate from the name when it carries them.
    notes.insert(0, "untagged (legacy) file")
    base = basename(name)
    try:
        c.step = parse_step(base)
    except CheckpointError:
        c.step = None
    if kind == "model":
        info = name_info(base)
        if info is not None and info.kind == "ema":
            c.kind, c.rate_str = "ema", info.rate_str
        c.state_dict, _ = strip_prefixes(obj)
    elif kind == "classifier":
        c.state_dict, _ = strip_prefixes(obj)
    elif kind == "opt":
        c.optimizer = obj
    elif kind == "combined":
        c.state_dict = _combined_entry(obj, _COMBINED_MODEL_KEYS, state_dict=True)
        c.optimizer = _combined_entry(obj, _COMBINED_OPT_KEYS, state_dict=False)
        if isinstance(obj.get("step"), int):
            c.step = obj["step"]
        c.flags = obj.get("flags") if isinstance(obj.get("flags"), dict) else None
        dit = dit_args_flags(obj.get("args"), c.state_dict)
        if c.flags is None and dit is not None:
            c.flags = dit
            c.notes.append(
                f"DiT train.py checkpoint: flags from its args (model={dit['arch']}, "
                f"image_size={obj['args']['image_size']}: {dit['image_size']}x"
                f"{dit['image_size']} latents of {dit['in_channels']} channels)")
    return c


def _read_phema_tags(c, obj, name):
    """A snapshot's std, images seen and parameter names into ``c``; CheckpointError naming the
    file when one is missing or invalid."""
    std, nimg, names = obj.get("std"), obj.get("nimg"), obj.get("param_names")
    if not isinstance(std, float) or not 0 < std < 1:
        raise CheckpointError(f"{name}: tagged phema file has no valid 'std'; replace it")
    if not isinstance(nimg, int) or isinstance(nimg, bool) or nimg < 0:
        raise CheckpointError(f"{name}: tagged phema file has no valid 'nimg' (images seen); "
                              f"replace it")
    if (not isinstance(names, list) or not names
            or any(not isinstance(n, str) or n not in c.state_dict for n in names)):
        raise CheckpointError(f"{name}: tagged phema file has no valid 'param_names' (the "
                              f"state_dict entries that are EMA parameters); replace it")
    tied = obj.get("tied", {})
    if (not isinstance(tied, dict) or any(
            not isinstance(a, str) or a not in c.state_dict or n not in names
            for a, n in tied.items())):
        raise CheckpointError(f"{name}: tagged phema file has an invalid 'tied' (the names of "
                              f"shared parameters); replace it")
    c.std, c.nimg, c.param_names, c.tied = std, nimg, list(names), dict(tied)


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
    Model weights (prefixes stripped) of a loaded file: the file's own for model/ema/phema/
    classifier files (a post-hoc EMA snapshot is an EMA of its own width); from a combined
    dict, the ``want`` ("model" or "ema") entry. Raises CheckpointError naming the file when
    it holds no such weights (e.g. optimizer state).
    """
    if want not in ("model", "ema"):
        raise ValueError(f"want must be 'model' or 'ema', not {want!r}")
    if ckpt.kind in WEIGHT_KINDS and ckpt.state_dict is not None:
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


def read_flags(path, kinds=None):
    """The model flags a tagged model/EMA file stores, read without loading its tensors
    (_peek), or None: an untagged or unreadable file, one without flags, or one whose kind is
    not in ``kinds`` (when given). Not collective; never raises (for a peek before the real,
    checked load)."""
    obj = _peek(path)
    if obj is None or (kinds is not None and obj.get("kind") not in kinds):
        return None
    flags = obj.get("flags")
    return dict(flags) if isinstance(flags, dict) else None


def read_trainer(path):
    """The trainer state (``"trainer"``: step, batch sizes, seed, EMA rates, flags, ...) a
    tagged opt file stores, read without loading its tensors, or None, as read_flags. Not
    collective; never raises."""
    obj = _peek(path)
    trainer = None if obj is None else obj.get("trainer")
    return trainer if isinstance(trainer, dict) else None


def _peek(path):
    """A tagged file's top-level dict without its tensors' data, or None: a local file through
    torch.load with mmap (tensors mapped, not read); an object onto the meta device through a
    ranged read of its zip directory and pickle, storage.PEEK_BYTES at a time."""
    path = os.fspath(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if is_remote(path):
                with storage.open(path, "rb", block_size=storage.PEEK_BYTES) as f:
                    obj = th.load(f, map_location="meta", weights_only=True)
            else:
                obj = th.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # anything: the resume's own load words the file's problem
        return None
    return obj if isinstance(obj, dict) and obj.get("schema") == SCHEMA else None


def combined_ema_or_none(ckpt):
    """The EMA weights of a combined dict ({"model", "ema", ...}, prefixes stripped), or None
    when it holds none."""
    try:
        return model_state_from(ckpt, want="ema")
    except CheckpointError:
        return None


# ---------------------------------------------------------------------------------------------
# file system (local paths and object-store URLs alike, through storage.py)

# ``retry_on`` errors of a remote path are retried this often, after these pauses (seconds).
_REMOTE_RETRY_PAUSES = (0.5, 1.0, 2.0)


def with_retry(fn, path, retry_on=()):
    """
    ``fn()``, retried after a short pause (a few tries, bounded) when ``path`` is remote and the
    call raised one of ``retry_on``. A store's throttling, 5xx answers and dropped connections
    are retried inside storage.py already (storage.retrying), so nothing else is retried here.
    Not-found and permission errors are never retried; local paths are tried once.
    """
    final = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    pauses = _REMOTE_RETRY_PAUSES if is_remote(path) else ()
    for pause in (*pauses, None):
        try:
            result = fn()
        except final:
            raise
        except (_Retryable, *retry_on) as e:
            if pause is None:
                if isinstance(e, _Retryable):
                    return None, e.err
                raise
            time.sleep(pause)
            continue
        return result


def exists(path):
    return storage.exists(path)


def file_size(path):
    """Size in bytes; FileNotFoundError when missing."""
    return storage.stat(path).size


def file_mtime(path):
    return storage.stat(path).mtime


def is_tagged_file(path):
    """Cheap check (the first 4 KB): is this one of our tagged torch files? (The schema string
    sits near the start of the zip.) A failed read raises CheckpointReadError."""
    try:
        with storage.open(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise CheckpointReadError(f"{path}: cannot read ({typed_one_line(e)})") from e
    return SCHEMA.encode() in head
