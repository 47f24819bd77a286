"""
The weights file that a path names, in either layout of a step: what sampling reads
(sampling.load_weights, so scripts/sample.py, nll.py, classifier_sample.py and the Python API).

    RUN/model000030.pt, RUN/ema_0.9999_000030.pt   a file: the full layout (checkpoint)
    RUN/step000030.dcp                             a sharded step: the file of it that
                                                   ``want`` picks (below)
    RUN/step000030.dcp/ema_0.9999_000030.pt        one file a sharded step holds, by the name
                                                   the full layout gives it (its manifest's
                                                   "holds"; ckpt.py consolidate writes it so)
    RUN/manifest000030.json                        the step this manifest commits, in either
                                                   layout, as its folder above

``want`` (sample.py's ``--weights``) picks among a step's files as among a combined file's:
"model" the model's weights; "ema" the EMA; "auto" the EMA when the step holds one, else the
model's. A step of several EMAs is refused for "auto" and "ema": name one. A file named in
the folder is that file, whatever ``want``.

A sharded step is read only once the run dir's manifest of it (written last, beside the
folder: the step's commit) lists every file of the folder and each matches its size and CRC-32
(run_dir.verify_step): a folder without one is an interrupted save, refused in one line, as is
a damaged one. Then the one payload is read (sharded.consolidate of that file: DCP's reader in
this process, without a process group, whole CPU tensors), the dict consolidate writes as that
file, and classified as the file's would be (checkpoint.from_payload). Under a process group
rank 0 reads it and the other ranks load its torch.save bytes. Errors are CheckpointError,
one line naming the path as given and what to pass instead.
"""

import io
import os

import torch as th

from . import checkpoint as ckpt
from . import run_dir, sharded
from .checkpoint import CheckpointError
from .. import dist_util

WANTS = ("auto", "ema", "model")


def names_a_step(path):
    """Whether ``path`` names a sharded step, a file held in one, or a manifest (else it is an
    ordinary file, checkpoint.load_file's). Reads nothing."""
    return _parse(path) is not None


def _parse(path):
    """("folder", folder, None) | ("held", folder, name) | ("manifest", path, None) | None."""
    p = os.fspath(path)
    p = p.rstrip("/") or p
    if sharded.dir_step(p) is not None:
        return "folder", p, None
    parent = ckpt.dirname(p)
    if parent != p and sharded.dir_step(parent) is not None:
        return "held", parent, ckpt.basename(p)
    if getattr(ckpt.name_info(p), "kind", None) == "manifest":
        return "manifest", p, None
    return None


def load_collective(path, want="auto"):
    """
    The CkptFile of the weights ``path`` names (see the module docstring; an ordinary file:
    checkpoint.load_file_collective), the same object on every rank, or the same one-line
    CheckpointError on every rank.

    Collective: call from all ranks with the same arguments.
    """
    if want not in WANTS:
        raise ValueError(f"want must be one of {WANTS}, not {want!r}")
    path = os.fspath(path)
    if _parse(path) is None:
        return ckpt.load_file_collective(path)
    where = dist_util.run_on_rank0(lambda: resolve(path, want))
    if where[0] == "file":  # a full-layout step's manifest: the file it picks
        return ckpt.load_file_collective(where[1])
    _, folder, name = where
    shown = path if _parse(path)[0] == "held" else ckpt.join(folder, name)
    if not dist_util.is_distributed():
        return ckpt.from_payload(read_payload(folder, name), shown)

    def serialized():
        buf = io.BytesIO()
        th.save(read_payload(folder, name), buf)
        return buf.getvalue()
    data = dist_util.run_on_rank0_unbounded(serialized, what=f"rank 0's read of {shown}")
    return ckpt.load_file(data, name=shown)


def read_payload(folder, name):
    """The payload ``name`` of the verified sharded step ``folder`` (whole CPU tensors: the dict
    the full layout writes as that file). Not collective."""
    return sharded.consolidate(folder, files=[name])[name]


def resolve(path, want="auto"):
    """
    Where the weights ``path`` names are, once their step is known complete (a sharded step
    verified: every file's CRC-32): ("file", file path) for a full-layout step named by its
    manifest, else ("sharded", folder, held file name). CheckpointError (one line naming
    ``path``) for a step that is missing, incomplete or damaged, or that does not hold what is
    asked. Not collective (rank 0's part of load_collective).
    """
    form, target, named = _parse(path)
    shown = os.fspath(path)
    log_dir = ckpt.dirname(target)
    if form == "manifest":
        st = _step_status(log_dir, ckpt.name_info(target).step, shown)
        if st.layout == "full":
            _check_complete(st, shown, log_dir)
            if getattr(ckpt.name_info(st.model_path), "kind", None) == "combined":
                return "file", st.model_path  # DiT's one file: load_weights picks by want
            holds = [ckpt.basename(p) for p in st.files
                     if getattr(ckpt.name_info(p), "kind", None) in ("model", "ema", "opt")]
            return "file", ckpt.join(log_dir, _choose(holds, want, shown, log_dir))
        target = st.sharded_path
    else:
        if not ckpt.exists(target):
            raise CheckpointError(f"{shown}: no such file or folder; check the path (a run's "
                                  f"steps: `python scripts/ckpt.py verify RUN`)")
        st = _step_status(log_dir, sharded.dir_step(target), shown)
    _check_complete(st, shown, log_dir)
    run_dir.verify_step(st, log_dir)  # DCP itself reads a flipped byte silently
    if not st.complete:
        raise CheckpointError(f"{shown}: step {st.step} is damaged ({st.problem}); sample from "
                              f"another step (`python scripts/ckpt.py verify {log_dir}` lists "
                              f"them)")
    holds = [n for n in st.manifest.get("holds") or [] if isinstance(n, str)]
    if named is None:
        named = _choose(holds, want, shown, target)
    elif named not in holds:
        raise CheckpointError(f"{shown}: step {st.step} holds no {named} (it holds "
                              f"{', '.join(holds)}); name one of those")
    elif getattr(ckpt.name_info(named), "kind", None) == "opt":
        raise CheckpointError(f"{shown}: the optimizer state of step {st.step}, not model "
                              f"weights; name one of {', '.join(_weights(holds))}")
    return "sharded", target, named


def _step_status(log_dir, step, shown):
    """The StepStatus of ``step`` of ``log_dir`` from one listing and its own manifest alone
    (never the run's other steps), or CheckpointError naming ``shown``."""
    names = [n for n in run_dir.listdir(log_dir)
             if getattr(ckpt.name_info(n), "step", None) == step
             or sharded.dir_step(n) == step]
    found = [st for st in run_dir.list_steps(log_dir, names=names) if st.step == step]
    if not found:
        raise CheckpointError(f"{shown}: {log_dir} holds no step {step}; check the path "
                              f"(`python scripts/ckpt.py verify {log_dir}` lists its steps)")
    return found[0]


def _check_complete(st, shown, log_dir):
    if not st.complete:
        raise CheckpointError(f"{shown}: step {st.step} is not complete ({st.problem}); sample "
                              f"from a complete step (`python scripts/ckpt.py verify {log_dir}` "
                              f"lists them)")


def _weights(holds):
    return [n for n in holds if getattr(ckpt.name_info(n), "kind", None) in ("model", "ema")]


def _choose(holds, want, shown, folder):
    """The name among a step's files ``holds`` that ``want`` picks, or CheckpointError saying
    what to name (paths in ``folder``)."""
    models = [n for n in holds if getattr(ckpt.name_info(n), "kind", None) == "model"]
    emas = [n for n in holds if getattr(ckpt.name_info(n), "kind", None) == "ema"]
    if want == "model" or (want == "auto" and not emas):
        if models:
            return models[0]
        raise CheckpointError(f"{shown}: holds no model weights (it holds {', '.join(holds)})")
    if len(emas) == 1:
        return emas[0]
    if not emas:
        raise CheckpointError(f"{shown}: holds no EMA (it holds {', '.join(holds)}); name the "
                              f"model's file, {ckpt.join(folder, models[0])}" if models else
                              f"{shown}: holds no model weights (it holds {', '.join(holds)})")
    model = f", or the model's, {ckpt.join(folder, models[0])}" if models else ""
    raise CheckpointError(f"{shown}: holds {len(emas)} EMAs ({', '.join(emas)}); name the one "
                          f"to load, e.g. {ckpt.join(folder, emas[0])}{model}")
