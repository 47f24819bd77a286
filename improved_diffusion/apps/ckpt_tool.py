"""
The checkpoint doctor: say what a checkpoint file is, whether a run directory can be resumed, how a
file differs from a model, convert between our tagged files, upstream's raw state dicts and
safetensors, and reconstruct post-hoc EMAs from a run's snapshots.

    python scripts/ckpt.py inspect FILE
    python scripts/ckpt.py verify DIR [--quick]
    python scripts/ckpt.py diff FILE (--flags "--image_size 32 ..." | --against FILE2) [--want ema]
    python scripts/ckpt.py convert SRC --to tagged|raw|safetensors --out DIR [--flags "..."]
    python scripts/ckpt.py adapt SRC --flags "..." --out DIR [--seed N] [--step N] [--data_dir D]
        [--force]
    python scripts/ckpt.py prune DIR --keep K [--delete_snapshots]
    python scripts/ckpt.py phema DIR --std 0.07 [--std 0.1 ...] [--step S] --out FILE_OR_DIR
    python scripts/ckpt.py phema DIR --std 0.03,0.05,0.1 --evaluate REF.npz [--num_samples M]
        [--features inception|digits] [--inception_weights P] [--sample_steps K]
        (the sweep: FID per width, the best named, phema_sweep.png)
    python scripts/ckpt.py consolidate RUN --step N --out DIR   (a sharded step, step000010.dcp/,
        as the full layout's files; `inspect` and `verify` read sharded steps too)

(also `python -m improved_diffusion.apps.ckpt_tool ...`). Human-readable output by default,
`--json` for scripts. Exit status: 0 healthy, 1 problem found, 2 bad usage. Errors are one line on
stderr, never a traceback. Only `convert`, `adapt`, `phema` and `consolidate` (into --out) and `prune` write or delete
anything;
every file is read with `torch.load(weights_only=True)`, so a checkpoint can never run code.

Every FILE, DIR, SRC and --out may be a local path or an object-store URL (s3://, gs://, az://:
storage.py, the store's own environment variables); every existence check, read and write here
goes through storage.py. The sharded layout's steps (`consolidate`, a .dcp folder) are local
only, as the trainer writes them.
"""

import argparse
import json
import math
import os
import shlex
import sys
import traceback

import torch as th

from .. import phema
from ..ckpt import checkpoint as ckpt
from ..ckpt import file_writer, model_change, run_dir, run_lock, sharded
from ..ckpt.optim_state import (
    FORMAT,
    OptimizerStateError,
    family_of_state,
    convert_to_named,
    convert_with_report,
    named_to_raw,
    validate_optimizer_payload,
)
from ..ckpt.state_fit import fit_state_dict, shapes_of
from ..infra import storage
from ..infra.errors import UsageError, UserError
from ..infra.flags import FlagParser, flags_to_argv, unknown_flag_message

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

_SLOT_PHRASE = {"model": "model", "ema": "EMA", "opt": "optimizer",
                "phema": "post-hoc EMA snapshot"}


class ToolError(UserError):
    """A problem with the user's files (exit 1); one line."""


class _Parser(FlagParser):
    """No prefix matching; an unknown flag is one line naming the closest known ones."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.HelpFormatter)
        super().__init__(*args, **kwargs)

    def known_flags(self):
        """This parser's flags and its subcommands' (argparse reports theirs from the top)."""
        known = super().known_flags()
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                for p in a.choices.values():
                    known += [f for f in p.known_flags() if f not in known]
        return known

    def error(self, message):
        raise UsageError(unknown_flag_message(message, self.known_flags(), self.prog))


# ---------------------------------------------------------------------------------------------
# helpers


def _walk_tensors(obj, depth=0):
    """Every tensor inside nested dicts / lists / tuples (a loaded checkpoint)."""
    if isinstance(obj, th.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_tensors(v, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v, depth + 1)


def _human_size(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n} B"


def _shape_list(t):
    return [int(s) for s in t.shape]


def _opt_summary(opt):
    """A dict describing an optimizer payload (for inspect)."""
    layout = ckpt.opt_layout(opt)
    state = opt.get("state")
    states = list(state.values()) if isinstance(state, dict) else []
    groups = opt.get("param_groups") if isinstance(opt.get("param_groups"), list) else []
    out = {"layout": layout, "groups": len(groups), "params_with_state": len(states)}
    if layout == ckpt.LAYOUT_NAMED:
        out["optimizer"] = opt.get("optimizer")
        shapes = opt.get("shapes") if isinstance(opt.get("shapes"), dict) else {}
        out["parameters"] = sum(int(th.Size(s).numel()) for s in shapes.values() if isinstance(
            s, (list, tuple)) and all(isinstance(d, int) for d in s))
        out["param_tensors"] = len(shapes)
    else:
        out["param_tensors"] = sum(
            len(g["params"]) for g in groups
            if isinstance(g, dict) and isinstance(g.get("params"), list))
        total = 0
        for e in states:
            if isinstance(e, dict) and isinstance(e.get("exp_avg"), th.Tensor):
                total += e["exp_avg"].numel()
        out["parameters"] = total or None
        family = family_of_state(states, groups)
        out["optimizer"] = {"Adam": "Adam/AdamW"}.get(family, family) or "unknown"
    if groups and isinstance(groups[0], dict):
        g = groups[0]
        out["hyperparams"] = {
            k: (list(g[k]) if isinstance(g[k], tuple) else g[k])
            for k in ("lr", "betas", "eps", "weight_decay") if k in g
        }
    steps = [
        float(e["step"]) for e in states
        if isinstance(e, dict) and isinstance(e.get("step"), (th.Tensor, int, float))
        and (not isinstance(e.get("step"), th.Tensor) or e["step"].numel() == 1)
        and math.isfinite(float(e["step"]))
    ]
    if steps:
        out["adam_step"] = int(max(steps))
    return out


def _opt_problem(opt, source):
    """A reason string when an optimizer payload is unusable by this trainer (AdamW), else None."""
    reason = validate_optimizer_payload(opt)
    return reason.replace("FILE", source, 1) if reason else None


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_file(path):
    """
    Everything we can tell about one file, as a JSON-able dict with "ok", "problems", "notes".
    Never raises for a bad file (the reason is in "error").
    """
    path = os.fspath(path)
    rep = {"path": path, "ok": False, "error": None, "slot": ckpt.slot_of(path), "problems": [],
           "notes": []}
    try:
        c = ckpt.load_file(path)
    except ckpt.CheckpointError as e:
        rep["error"] = str(e)
        return rep
    rep.update(
        kind=c.kind, tagged=c.tagged, step=c.step, rate=c.rate_str, size=c.nbytes,
        flags=c.flags,
    )
    rep["notes"] = list(c.notes)
    tensors = list(_walk_tensors(c.raw))
    dtypes = {}
    for t in tensors:
        key = str(t.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + 1
    rep["tensors"] = len(tensors)
    rep["dtypes"] = dtypes
    rep["parameters"] = None
    if c.state_dict is not None:
        rep["parameters"] = int(sum(t.numel() for t in c.state_dict.values()
                                    if isinstance(t, th.Tensor)))
        rep["param_tensors"] = len(c.state_dict)
    if c.optimizer is not None and isinstance(c.optimizer, dict):
        rep["optimizer"] = _opt_summary(c.optimizer)
        if rep["parameters"] is None:
            rep["parameters"] = rep["optimizer"].get("parameters")
        reason = _opt_problem(c.optimizer, path)
        if reason:
            rep["problems"].append(reason)
    if c.kind == "phema":
        rep["phema"] = {"std": c.std, "nimg": c.nimg, "param_tensors": len(c.param_names)}
    if c.kind == "ema" and isinstance(c.raw.get("phema"), dict):  # reconstructed post hoc
        made = c.raw["phema"]
        rep["phema"] = {"std": made.get("std"), "nimg": made.get("nimg"),
                        "inputs": len(made.get("inputs") or ()),
                        "profile_error": made.get("profile_error")}
    if c.trainer is not None:
        rep["trainer"] = {k: c.trainer[k] for k in ("step", "world_size", "batch_size",
                                                     "global_batch", "seed", "ema_rates", "lr")
                          if k in c.trainer}
        tracked = c.trainer.get("phema")
        if isinstance(tracked, dict) and "stds" in tracked:  # train.py --phema_stds's tracker
            rep["trainer"]["phema_stds"] = ",".join(phema.std_str(s) for s in tracked["stds"])
            rep["trainer"]["phema_nimg"] = tracked.get("nimg")
        shards = c.trainer.get("virtual_shards")
        if isinstance(shards, dict) and shards.get("global_batch"):  # --global_batch_size
            G, m = shards["global_batch"], shards.get("microbatch")
            position = (c.trainer.get("data") or {}).get("position")
            rep["trainer"]["virtual_shards"] = (
                f"G={G} m={m}: {G // m if m else '?'} shards a step"
                + (f", the next step's shard 0 starts at global sample {position}"
                   if position is not None else ""))
    if c.kind == "combined" and isinstance(c.raw.get("args"), dict):  # DiT's args, as data
        rep["args"] = dict(c.raw["args"])
    changes = (c.trainer or {}).get("model_changes")
    if changes:  # resumed into (or adapted to) a changed model: model_change.ModelChange.record
        rep["model_changes"] = list(changes)
    if not c.tagged and c.step is not None:
        rep["notes"].append(f"step {c.step} read from the file name")
    _slot_problems(rep, c, path)
    rep["ok"] = not rep["problems"]
    return rep


def _slot_problems(rep, c, path):
    slot = rep["slot"]
    kind = c.kind
    if kind == "unknown":
        rep["problems"].append(
            f"not a checkpoint this trainer understands ({'; '.join(c.notes) or 'unknown content'})"
        )
        return
    if slot is None:
        return
    name = os.path.basename(path)
    if slot == "opt" and kind in ckpt.WEIGHT_KINDS:
        what = ckpt.KIND_PHRASES["classifier"] if kind == "classifier" else "a model state dict"
        rep["problems"].append(
            f"optimizer slot holds {what} ({name}; as written by upstream's "
            "multi-rank resume bug): resuming uses a fresh optimizer; replace the file or delete it"
        )
    elif slot in ("model", "ema") and kind == "opt":
        rep["problems"].append(
            f"{_SLOT_PHRASE[slot]} slot holds optimizer state ({name}): this step cannot be "
            "resumed or sampled from; use a model file"
        )
    elif c.tagged and slot in ("model", "ema", "phema") and kind in ("model", "ema", "phema") \
            and slot != kind:
        rep["problems"].append(
            f"{_SLOT_PHRASE[slot]} slot holds a tagged {kind} file ({name}); rename it"
        )
    elif slot == "phema" and not c.tagged:
        rep["problems"].append(
            f"post-hoc EMA snapshot slot holds an untagged state dict ({name}): it has no "
            "std or images-seen count, so a reconstruction cannot use it; move it away"
        )
    elif kind == "combined":
        rep["notes"].append(
            f"combined dict in the {_SLOT_PHRASE[slot]} slot: the loader picks the matching entry"
        )
    if c.tagged and c.step is not None:
        try:
            name_step = ckpt.parse_step(path)
        except ckpt.CheckpointError:
            name_step = None
        if name_step is not None and name_step != c.step:
            rep["problems"].append(
                f"file name says step {name_step} but the file holds step {c.step}; rename it"
            )
    if slot == "phema" and kind == "phema":
        info = ckpt.name_info(name)
        if info.std_str != phema.std_str(c.std):
            rep["problems"].append(
                f"file name says std {info.std_str} but the file holds std {c.std}; rename it")
    if slot == "ema" and c.tagged and c.rate_str is not None:
        info = ckpt.name_info(name)
        if info is not None and info.rate_str != c.rate_str:
            rep["problems"].append(
                f"file name says EMA rate {info.rate_str} but the file holds rate {c.rate_str}"
            )


def _print_inspect(rep, out):
    w = out.write
    w(f"{rep['path']}\n")
    if rep["error"]:
        w(f"  error       {rep['error']}\n")
        w("  status      PROBLEM\n")
        return
    legacy = "tagged" if rep["tagged"] else "untagged (legacy/upstream)"
    w(f"  kind        {rep['kind']}, {legacy}\n")
    if rep.get("slot"):
        w(f"  slot        {rep['slot']} (from the file name)\n")
    w(f"  step        {rep['step'] if rep['step'] is not None else 'unknown'}\n")
    if rep.get("rate"):
        w(f"  ema rate    {rep['rate']}\n")
    ph = rep.get("phema")
    if ph and rep["kind"] == "phema":
        w(f"  phema       std {ph['std']}, {ph['nimg']:,} images seen, "
          f"{ph['param_tensors']} EMA parameter tensors\n")
    elif ph:
        err, nimg = ph.get("profile_error"), ph.get("nimg")
        w(f"  phema       reconstructed post hoc: std {ph.get('std')} at "
          f"{f'{nimg:,}' if isinstance(nimg, int) else '?'} images from {ph.get('inputs')} "
          "snapshots" + (f" (profile error {err:.1%})" if isinstance(err, float) else "") + "\n")
    w(f"  size        {_human_size(rep['size'])} ({rep['size']} bytes)\n")
    dt = ", ".join(f"{k}: {v}" for k, v in sorted(rep["dtypes"].items())) or "none"
    w(f"  tensors     {rep['tensors']} ({dt})\n")
    if rep.get("parameters") is not None:
        extra = f" in {rep['param_tensors']} tensors" if rep.get("param_tensors") else ""
        w(f"  parameters  {rep['parameters']:,}{extra}\n")
    if "optimizer" in rep:
        o = rep["optimizer"]
        hp = " ".join(f"{k}={v}" for k, v in (o.get("hyperparams") or {}).items())
        w(f"  optimizer   {o.get('optimizer')}, {ckpt.LAYOUT_PHRASES[o['layout']]}, "
          f"{o['groups']} group(s), {o['params_with_state']} with state"
          + (f", adam step {o['adam_step']}" if "adam_step" in o else "") + "\n")
        if hp:
            w(f"  hyperparams {hp}\n")
    if "trainer" in rep:
        tr = " ".join(f"{k}={v}" for k, v in rep["trainer"].items())
        w(f"  trainer     {tr or '(empty: no trainer state)'}\n")
    for rec in rep.get("model_changes") or ():
        w(f"  changed     model change at {model_change.record_text(rec)}\n")
    if rep.get("args"):
        w("  args        " + " ".join(f"{k}={v}" for k, v in rep["args"].items()) + "\n")
    if rep["kind"] in ckpt.WEIGHT_KINDS or rep["kind"] == "combined" and rep.get("flags"):
        if rep.get("flags"):
            w("  flags       " + flags_to_argv(rep["flags"]) + "\n")
        else:
            w(f"  flags       none stored (give the {_network(rep['kind'])} flags when sampling or "
              "resuming)\n")
    for n in rep["notes"]:
        w(f"  note        {n}\n")
    for p in rep["problems"]:
        w(f"  problem     {p}\n")
    w(f"  status      {'ok' if rep['ok'] else 'PROBLEM'}\n")


def inspect_sharded(path):
    """JSON-able description of a sharded step's folder (step000010.dcp): layout, the ranks that
    wrote it, its files, the full-layout files it holds and their tensors (from DCP's index:
    no weight is read), and whether its manifest verifies."""
    path = os.fspath(path).rstrip("/")
    step, log_dir = sharded.dir_step(path), ckpt.dirname(path)
    rep = {"path": path, "layout": sharded.LAYOUT, "step": step, "ok": False, "error": None,
           "problems": [], "files": sorted(run_dir.listdir(path)), "ranks": None,
           "holds": [], "tensors": {}}
    try:
        st = sharded.verify(log_dir, step)
        if st.problem:
            rep["problems"].append(st.problem)
        if st.manifest:
            rep["holds"], rep["ranks"] = st.manifest.get("holds", []), st.manifest.get("ranks")
        for p, (shape, dtype) in sharded.tensor_shapes(path).items():
            rep["tensors"].setdefault(p[0], {})[".".join(map(str, p[1:]))] = [
                list(shape), str(dtype).replace("torch.", "")]
    except ckpt.CheckpointError as e:
        rep["error"] = str(e)
    rep["ok"] = rep["error"] is None and not rep["problems"]
    return rep


def _print_sharded(rep, out):
    w = out.write
    w(f"{rep['path']}: step {rep['step']}, layout sharded (DCP), written by {rep['ranks']} "
      f"rank(s)\n")
    w(f"  files: {', '.join(rep['files'])}\n")
    for name in rep["holds"]:
        tensors = rep["tensors"].get(name, {})
        n = sum(math.prod(shape) for shape, _ in tensors.values())
        w(f"  holds {name}: {len(tensors)} tensor(s), {n} value(s)\n")
        for key, (shape, dtype) in list(tensors.items())[:8]:
            w(f"    {key}: {dtype} {shape}\n")
        if len(tensors) > 8:
            w(f"    ... {len(tensors) - 8} more\n")
    for prob in rep["problems"]:
        w(f"  problem: {prob}\n")
    w("  ok\n" if rep["ok"] else "")


def cmd_inspect(args, out):
    reports = [inspect_sharded(p) if sharded.dir_step(p) is not None else inspect_file(p)
               for p in args.files]
    if args.json:
        _dump(reports[0] if len(reports) == 1 else reports, out)
    else:
        for rep in reports:
            if rep["error"]:
                args.err.write(f"error: {' '.join(rep['error'].split())}\n")
            elif rep.get("layout") == sharded.LAYOUT:
                _print_sharded(rep, out)
            else:
                _print_inspect(rep, out)
    return EXIT_OK if all(r["ok"] for r in reports) else EXIT_PROBLEM


# ---------------------------------------------------------------------------------------------
# verify


def _require_dir(path, what):
    """A ToolError unless ``path`` (a local directory or an object-store prefix) exists and is
    a directory; a store that cannot be reached is its one-line StoreUnreachableError."""
    storage.check_store(path, what)
    if not storage.exists(path):
        raise ToolError(f"{path}: no such directory; check the {what} path")
    if not storage.isdir(path):
        raise ToolError(f"{path}: is a file, not a directory; give the run directory ({what})")


def _abspath(path):
    """A local path made absolute; a URL as it is."""
    return path if storage.is_remote(path) else os.path.abspath(path)


def _same_place(a, b):
    """Whether two directories (local paths or URLs) are one."""
    if storage.is_remote(a) or storage.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def verify_dir(log_dir, deep=True):
    """JSON-able report of every step in `log_dir`, newest first, and what train.py --log_dir
    DIR would do with it: ``resume`` ({"step": N or None, "refused": its one-line error or None,
    "message"}), decided by run_dir.choose_step as the resume plan decides it (``resume_step``:
    its step). ``deep`` False: from names, sizes and manifests, no checksum read."""
    steps = run_dir.list_steps(log_dir, verify_checksums=deep)
    rows = []
    resume = _resume_decision(log_dir, steps, deep)
    for st in steps:
        row = {"step": st.step, "legacy": st.legacy, "complete": st.complete,
               "files": [os.path.basename(p) for p in st.files], "problems": [], "notes": [],
               "layout": st.layout}
        if st.problem:
            row["problems"].append(st.problem)
        if deep and st.complete and st.layout == sharded.LAYOUT:
            try:  # the index must be one we read (its bytes matched the manifest already)
                sharded.read_metadata(st.sharded_path)
            except ckpt.CheckpointError as e:
                row["problems"].append(str(e))
        elif deep and st.complete:
            for p in st.files:
                if p.endswith(".json"):
                    continue
                rep = inspect_file(p)
                if rep["error"]:
                    row["problems"].append(rep["error"])
                for prob in rep["problems"]:
                    row["problems"].append(f"{os.path.basename(p)}: {prob}")
        soft = [q for q in row["problems"] if "optimizer slot holds" in q]
        row["resumable"] = st.complete and len(soft) == len(row["problems"])
        if row["resumable"] and soft:
            row["notes"].append("resumable with a fresh optimizer")
        rows.append(row)
    snaps = _verify_snapshots(log_dir, steps, deep)
    return {"dir": os.fspath(log_dir), "steps": rows, "resume_step": resume["step"],
            "resume": resume, "snapshots": snaps,
            "ok": bool(rows) and all(not r["problems"] for r in rows) and not snaps["problems"]}


def _resume_decision(log_dir, steps, deep):
    """What `train.py --log_dir DIR` does with ``steps`` (run_dir.choose_step: the plan's own
    decision): {"step": the step it resumes or None, "refused": the one line it refuses to
    start with or None, "message": what it says}."""
    if not steps:
        return {"step": None, "refused": None, "message": None}
    try:
        st = run_dir.choose_step(os.fspath(log_dir), steps, verify_checksums=deep)
    except run_dir.NoUsableStepError as e:
        return {"step": None, "refused": str(e), "message": None}
    if st is None:
        return {"step": None, "refused": None,
                "message": run_dir.FRESH_OVER_INTERRUPTED.format(where=os.fspath(log_dir))}
    return {"step": st.step, "refused": None, "message": None}


def _verify_snapshots(log_dir, steps, deep):
    """The post-hoc EMA snapshots of ``log_dir``: counts, and (deep) the problems of those that
    no listed step holds (their steps were pruned; a complete step's were checked with it)."""
    found = run_dir.list_snapshots(log_dir)
    in_steps = {p for st in steps for p in st.files}
    outside = [s for s in found if s.path not in in_steps]
    problems = []
    for s in outside if deep else ():
        rep = inspect_file(s.path)
        problems += [rep["error"]] if rep["error"] else [
            f"{os.path.basename(s.path)}: {p}" for p in rep["problems"]]
    steps_with = sorted({s.step for s in found})
    return {"count": len(found), "stds": sorted({s.std_str for s in found}, key=float),
            "steps": steps_with, "of_pruned_steps": len(outside), "problems": problems}


def cmd_verify(args, out):
    _require_dir(args.dir, "DIR")
    rep = verify_dir(args.dir, deep=not args.quick)
    if args.json:
        _dump(rep, out)
    else:
        w = out.write
        w(f"{rep['dir']}: {len(rep['steps'])} step(s), newest first\n")
        for r in rep["steps"]:
            state = "ok" if not r["problems"] else (
                "resumable" if r["resumable"] else "NOT resumable")
            kind = "legacy" if r["legacy"] else (
                "sharded" if r["layout"] == sharded.LAYOUT else "tagged")
            w(f"  step {r['step']:>8}  {state:<13} {kind:<7} {', '.join(r['files'])}\n")
            for p in r["problems"]:
                w(f"  {'':>13}  problem: {p}\n")
            for n in r["notes"]:
                w(f"  {'':>13}  note: {n}\n")
        sn = rep["snapshots"]
        if sn["count"]:
            w(f"snapshots: {sn['count']} post-hoc EMA snapshot(s), stds {', '.join(sn['stds'])}, "
              f"at {len(sn['steps'])} step(s) {sn['steps'][0]}..{sn['steps'][-1]} "
              f"({sn['of_pruned_steps']} of pruned steps, kept for `ckpt.py phema`)\n")
            for p in sn["problems"]:
                w(f"  {'':>13}  problem: {p}\n")
        decision = rep["resume"]
        if decision["refused"]:
            w(f"resume: train.py refuses to start in this log dir: {decision['refused']}\n")
        elif decision["step"] is None:
            w("resume: no resumable step (training would start from scratch)\n")
        else:
            row = next(r for r in rep["steps"] if r["step"] == decision["step"])
            w(f"resume: step {decision['step']}" + ("" if row["resumable"] else
              " (train.py takes it, as its checksums match; the problems above stop that "
              "resume: move the step away)") + "\n")
    if not rep["steps"]:
        if not args.json:
            out.write(f"problem: no checkpoint files in {args.dir}\n")
        return EXIT_PROBLEM
    return EXIT_OK if rep["ok"] else EXIT_PROBLEM


# ---------------------------------------------------------------------------------------------
# diff


def _network(kind):
    """What a file of ``kind`` holds the weights of, as --flags builds it: "classifier" (the
    noised classifier's flags) or "model" (the diffusion model's)."""
    return "classifier" if kind == "classifier" else "model"


def _flag_defaults(kind="model"):
    from .. import script_util as su

    if _network(kind) == "classifier":
        return su.classifier_and_diffusion_defaults()
    return su.model_and_diffusion_defaults()


def _parse_model_flags(text, kind="model"):
    """(flags dict, explicitly given keys, ignored args) from a string: the model/diffusion flags
    (MODEL_FLAG_KEYS), or for a classifier file (``kind`` "classifier") the classifier's and its
    diffusion's (classifier_and_diffusion_defaults)."""
    from .. import script_util as su

    parser = _Parser(prog="--flags", add_help=False)
    defaults = _flag_defaults(kind)
    su.add_dict_to_argparser(parser, defaults)
    try:
        argv = shlex.split(text or "")
    except ValueError as e:
        raise UsageError(f"--flags: cannot split {text!r} ({e})") from None
    args, unknown = parser.parse_known_args(argv)
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")]
    flags = su.args_to_dict(args, list(defaults.keys()))
    return flags, [k for k in given if k in defaults], unknown


def _build_model(flags, kind="model"):
    from .. import script_util as su

    create = (su.create_classifier_and_diffusion if _network(kind) == "classifier"
              else su.create_model_and_diffusion)
    try:
        model, _ = create(**flags)
    except su.FlagError as e:
        raise UsageError(f"--flags: {e}") from None
    return model


class _FlagsFor:
    """convert's --flags, parsed for the network of each file: ``flags_for(kind)`` -> dict, or
    None when --flags was not given."""

    def __init__(self, text):
        self.text = text

    def __call__(self, kind):
        return None if self.text is None else _parse_model_flags(self.text, kind)[0]


def _shapes_of(c, want):
    """{name: shape list} of a loaded file's weights (or its named optimizer parameter shapes)."""
    if c.kind in (*ckpt.WEIGHT_KINDS, "combined"):
        try:
            sd = ckpt.model_state_from(c, want=want)
        except ckpt.CheckpointError as e:
            raise ToolError(str(e)) from None
        return {k: _shape_list(v) for k, v in sd.items() if isinstance(v, th.Tensor)}
    if c.kind == "opt" and isinstance(c.optimizer, dict) and c.optimizer.get("format") == FORMAT:
        return {k: [int(s) for s in v] for k, v in (c.optimizer.get("shapes") or {}).items()}
    if c.kind == "opt":
        raise ToolError(
            f"{c.path}: holds index-keyed (upstream) optimizer state without parameter names; "
            "diff the model file of the same step instead"
        )
    raise ToolError(f"{c.path}: holds {ckpt.describe(c)}; nothing to diff")


def cmd_diff(args, out):
    if bool(args.flags is not None) == bool(args.against is not None):
        raise UsageError("diff: give exactly one of --flags \"...\" or --against FILE2")
    try:
        c = ckpt.load_file(args.file)
    except ckpt.CheckpointError as e:
        raise ToolError(str(e)) from None
    file_shapes = _shapes_of(c, args.want)
    notes = []
    if args.flags is not None:
        flags, given, ignored = _parse_model_flags(args.flags, c.kind)
        if ignored:
            notes.append(f"ignored non-{_network(c.kind)} flags: " + " ".join(ignored))
        model = _build_model(flags, c.kind)
        want_shapes = {k: _shape_list(v) for k, v in model.state_dict().items()}
        other = "the model built from --flags"
        want_flags = {k: flags[k] for k in given} if c.flags else None
        file_flags = {k: c.flags[k] for k in given if k in c.flags} if c.flags else None
    else:
        try:
            c2 = ckpt.load_file(args.against)
        except ckpt.CheckpointError as e:
            raise ToolError(str(e)) from None
        want_shapes = _shapes_of(c2, args.want)
        other = args.against
        file_flags, want_flags = c.flags, c2.flags
    fit = fit_state_dict(want_shapes, file_shapes, file_flags, want_flags, other="other")
    missing, unexpected, same, hints = fit.missing, fit.unexpected, fit.ok, fit.likely_flags
    reshaped = {k: {"file": list(a), "other": list(b)} for k, (a, b) in fit.reshaped.items()}
    rep = {
        "file": args.file, "other": other, "same": same,
        "file_parameters": sum(int(th.Size(s).numel()) for s in file_shapes.values()),
        "other_parameters": sum(int(th.Size(s).numel()) for s in want_shapes.values()),
        "missing": missing, "unexpected": unexpected, "reshaped": reshaped,
        "likely_flags": hints, "notes": notes,
    }
    if args.json:
        _dump(rep, out)
    else:
        w = out.write
        w(f"{args.file} vs {other}\n")
        w(f"  parameters  file {rep['file_parameters']:,}, other {rep['other_parameters']:,}\n")
        if same:
            w(f"  keys        all {len(file_shapes)} keys and shapes match\n")
        for label, keys, explain in (("missing", missing, "in the other, not in the file"),
                                     ("unexpected", unexpected, "in the file, not in the other")):
            if keys:
                w(f"  {label:<11} {len(keys)} ({explain}): {', '.join(keys[:8])}"
                  f"{', ...' if len(keys) > 8 else ''}\n")
        if reshaped:
            w(f"  reshaped    {len(reshaped)}:\n")
            for k, v in list(reshaped.items())[:8]:
                w(f"              {k}: file {v['file']} vs other {v['other']}\n")
            if len(reshaped) > 8:
                w(f"              ... and {len(reshaped) - 8} more\n")
        for h in hints:
            w(f"  likely flag {h}\n")
        for n in notes:
            w(f"  note        {n}\n")
        w(f"  status      {'same' if same else 'DIFFERENT'}\n")
    return EXIT_OK if same else EXIT_PROBLEM


# ---------------------------------------------------------------------------------------------
# convert


def _source_files(src, step):
    """[(step or None, [paths])] to convert: one group per step of a run dir, or one file."""
    storage.check_store(src, "SRC")
    if storage.isdir(src):
        steps = run_dir.list_steps(src)
        if step is not None:
            steps = [s for s in steps if s.step == step]
            if not steps:
                raise ToolError(f"{src}: no files of step {step}; see `ckpt.py verify {src}`")
        if not steps:
            raise ToolError(f"{src}: no checkpoint files found; check the path")
        return [(s.step, [p for p in s.files if not p.endswith(".json")], s) for s in steps]
    if not storage.exists(src):
        raise ToolError(f"{src}: no such file or directory; check the path")
    return [(None, [src], None)]


def _load(path):
    try:
        return ckpt.load_file(path)
    except ckpt.CheckpointError as e:
        raise ToolError(str(e)) from None


def _step_of(c, path, step_arg):
    if c.step is not None:
        return c.step
    if step_arg is not None:
        return step_arg
    raise ToolError(f"{path}: the step cannot be read from the file or its name; pass --step N")


def _param_names_for_opt(opt_path, files, flags_for, c_opt):
    """[(name, shape)] in model parameter order for an index-keyed optimizer file: from the
    network --flags builds (a classifier's when the step's model file holds one), else from the
    model file of the same step."""
    beside = [p for p in files if ckpt.slot_of(p) == "model"]
    if not beside:
        d = ckpt.dirname(_abspath(opt_path))
        if c_opt.step is not None:
            cand = ckpt.join(d, ckpt.model_filename(c_opt.step))
            if storage.exists(cand):
                beside = [cand]
    c_model = _load(beside[0]) if beside else None
    kind = c_model.kind if c_model is not None else "model"
    flags = flags_for(kind)
    if flags is not None:
        model = _build_model(flags, kind)
        return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if c_model is None:
        raise ToolError(
            f"{opt_path}: index-keyed optimizer state needs the parameter names: put the model "
            "file of the same step beside it or pass --flags \"...\""
        )
    sd = ckpt.model_state_from(c_model)
    return [(n, tuple(t.shape)) for n, t in sd.items()]


class _Payloads(dict):
    """{output file name: payload}; two sources mapping to one name is an error."""

    def __setitem__(self, name, value):
        if name in self:
            raise ToolError(f"{name}: two source files convert to this name; convert them "
                            "one at a time into different --out directories")
        super().__setitem__(name, value)


def _wrong_slot(c, path, notes):
    """True (with a note) when a file's kind contradicts its name's slot: it is not converted."""
    slot = ckpt.slot_of(path)
    if (slot == "opt" and c.kind in ckpt.WEIGHT_KINDS) or (slot in ("model", "ema")
                                                           and c.kind == "opt"):
        notes.append(f"{os.path.basename(path)}: the {_SLOT_PHRASE[slot]} slot holds "
                     f"{ckpt.describe(c)}; not converted (see `ckpt.py inspect`)")
        return True
    return False


def _tagged_payloads(group_files, flags_for, step_arg):
    """{filename: payload} (tagged) for the files of one step; notes. ``flags_for``: _FlagsFor."""
    payloads, notes = _Payloads(), []
    for path in group_files:
        c = _load(path)
        base = os.path.basename(path)
        if _wrong_slot(c, path, notes):
            continue
        step = _step_of(c, path, step_arg)
        if c.tagged:
            payloads[base] = storage.read_bytes(path)
            notes.append(f"{base}: already tagged, copied unchanged")
            continue
        flags = flags_for(c.kind)
        if c.kind == "classifier":
            if flags is not None:
                _check_fits(c.state_dict, flags, path, c.kind)
            payloads[ckpt.model_filename(step)] = ckpt.classifier_payload(
                step, c.state_dict, flags)
        elif c.kind in ("model", "ema"):
            if flags is not None:
                _check_fits(c.state_dict, flags, path)
            if c.kind == "ema":
                rate = c.rate_str or "0.9999"
                payloads[ckpt.ema_filename(rate, step)] = ckpt.ema_payload(
                    step, rate, c.state_dict, flags)
            else:
                payloads[ckpt.model_filename(step)] = ckpt.model_payload(step, c.state_dict, flags)
        elif c.kind == "opt":
            names = _param_names_for_opt(path, group_files, flags_for, c)
            try:
                named = convert_to_named(c.optimizer, names, source=path)
            except OptimizerStateError as e:
                raise ToolError(str(e)) from None
            payload = ckpt.opt_payload(step, named, {})
            payload["converted_from"] = base
            payloads[ckpt.opt_filename(step)] = payload
        elif c.kind == "combined":
            sd = c.state_dict
            stored = flags if flags is not None else c.flags  # DiT's: from its args
            if sd is not None:
                payloads[ckpt.model_filename(step)] = ckpt.model_payload(step, sd, stored)
            ema = ckpt.combined_ema_or_none(c)
            if ema is not None and ema is not sd:
                payloads[ckpt.ema_filename("0.9999", step)] = ckpt.ema_payload(
                    step, "0.9999", ema, stored)
                notes.append(f"{base}: EMA entry written with rate 0.9999 (the file does not say)")
            if c.optimizer is not None and sd is not None:
                named_shapes = [(n, tuple(t.shape)) for n, t in sd.items()]
                try:
                    named = convert_to_named(c.optimizer, named_shapes, source=path)
                    payloads[ckpt.opt_filename(step)] = ckpt.opt_payload(step, named, {})
                except OptimizerStateError as e:
                    notes.append(f"{base}: optimizer entry skipped ({e})")
        else:
            raise ToolError(f"{path}: holds {ckpt.KIND_PHRASES['unknown']}; nothing to convert")
    return payloads, notes


def _check_fits(sd, flags, path, kind="model"):
    fit = fit_state_dict(shapes_of(_build_model(flags, kind).state_dict()), shapes_of(sd))
    if not fit.ok:
        raise ToolError(
            f"{path}: does not fit the model of --flags ({fit.summary()}"
            + (f"; likely {fit.likely_flags[0]}" if fit.likely_flags else "") + "); fix --flags"
        )


def _raw_payloads(group_files, step_arg):
    payloads, notes = _Payloads(), []
    for path in group_files:
        c = _load(path)
        if _wrong_slot(c, path, notes):
            continue
        step = _step_of(c, path, step_arg)
        base = os.path.basename(path)
        if c.kind in ("model", "classifier"):
            payloads[ckpt.model_filename(step)] = dict(c.state_dict)
        elif c.kind == "ema":
            rate = c.rate_str or "0.9999"
            payloads[ckpt.ema_filename(rate, step)] = dict(c.state_dict)
        elif c.kind == "opt":
            if c.optimizer.get("format") == FORMAT:
                try:
                    payloads[ckpt.opt_filename(step)] = named_to_raw(c.optimizer, source=path)
                except OptimizerStateError as e:
                    raise ToolError(str(e)) from None
                if len(c.optimizer.get("param_groups") or []) != 1:
                    notes.append(f"{base}: {len(c.optimizer['param_groups'])} param groups; "
                                 "upstream's AdamW(model.parameters()) has 1")
                if c.trainer:
                    notes.append(f"{base}: trainer state (data position, RNG) is not kept in "
                                 "the raw file")
            else:
                payloads[ckpt.opt_filename(step)] = c.optimizer
        elif c.kind == "combined":  # e.g. DiT's {"model", "ema", "opt", "args"}
            if c.state_dict is not None:
                payloads[ckpt.model_filename(step)] = dict(c.state_dict)
            ema = ckpt.combined_ema_or_none(c)
            if ema is not None and ema is not c.state_dict:
                payloads[ckpt.ema_filename("0.9999", step)] = dict(ema)
                notes.append(f"{base}: EMA entry written with rate 0.9999 (the file does not say)")
            if c.optimizer is not None:
                payloads[ckpt.opt_filename(step)] = c.optimizer
        elif c.kind == "phema":
            notes.append(f"{base}: post-hoc EMA snapshot skipped (a raw state dict cannot carry "
                         "its std and images seen; reconstruct with `ckpt.py phema` first)")
        else:
            raise ToolError(f"{path}: holds {ckpt.KIND_PHRASES['unknown']}; nothing to convert")
    return payloads, notes


def _safetensors_payloads(group_files, step_arg):
    try:
        from safetensors.torch import save as st_save
    except ImportError:
        raise ToolError(
            "converting to safetensors needs the optional package safetensors: "
            "pip install safetensors"
        ) from None
    payloads, notes = _Payloads(), []
    for path in group_files:
        c = _load(path)
        base = os.path.basename(path)
        if _wrong_slot(c, path, notes):
            continue
        if c.kind not in (*ckpt.WEIGHT_KINDS, "combined"):
            notes.append(f"{base}: {c.kind} file skipped (safetensors holds model weights only)")
            continue
        step = _step_of(c, path, step_arg)
        sd = ckpt.model_state_from(c) if c.kind == "combined" else c.state_dict
        meta = {"kind": c.kind, "step": str(step), "source": base}
        if c.flags:
            meta["flags"] = json.dumps(c.flags, sort_keys=True)
        if c.kind == "ema":
            rate = c.rate_str or "0.9999"
            meta["rate"] = rate
            name = f"ema_{rate}_{step:06d}.safetensors"
        else:
            name = f"model{step:06d}.safetensors"
        tensors = {k: v.detach().contiguous().clone() for k, v in sd.items()}
        payloads[name] = st_save(tensors, metadata=meta)
    return payloads, notes


def cmd_convert(args, out):
    storage.check_store(args.src, "SRC")
    storage.check_store(args.out, "--out")
    src = _abspath(args.src)
    out_dir = _abspath(args.out)
    src_dir = src if storage.isdir(src) else ckpt.dirname(src)
    if _same_place(out_dir, src_dir):
        raise UsageError("convert: --out must be a different directory from the source")
    if storage.exists(out_dir) and not storage.isdir(out_dir):
        raise ToolError(f"{args.out}: is a file; --out must be a directory")
    flags_for = _FlagsFor(args.flags)
    if args.flags is not None:
        flags_for("model")  # a malformed --flags is a usage error before anything is read
    groups = _source_files(args.src, args.step)
    written, notes = [], []
    plans = []
    for step, files, status in groups:
        if args.to == "tagged":
            payloads, n = _tagged_payloads(files, flags_for, args.step)
        elif args.to == "raw":
            payloads, n = _raw_payloads(files, args.step)
        else:
            payloads, n = _safetensors_payloads(files, args.step)
        notes += n
        plans.append((step, payloads, status))
    # Check every target name before writing anything.
    for _, payloads, _ in plans:
        for name in payloads:
            if storage.exists(ckpt.join(out_dir, name)):
                raise ToolError(f"{ckpt.join(args.out, name)}: already exists; refusing to "
                                "overwrite (choose another --out)")
    storage.makedirs(out_dir)
    for step, payloads, status in plans:
        whole_step = (args.to == "tagged" and status is not None and status.complete
                      and any(ckpt.slot_of(n) == "opt" for n in payloads)
                      and any(ckpt.slot_of(n) == "model" for n in payloads))
        try:
            if whole_step:
                run_dir.save_step(out_dir, step, payloads)
                written.append(ckpt.join(out_dir, ckpt.manifest_filename(step)))
            else:
                for name, obj in payloads.items():
                    file_writer.atomic_write(ckpt.join(out_dir, name), obj)
                if args.to == "tagged" and payloads:
                    shown = step if step is not None else ", ".join(
                        sorted({str(ckpt.name_info(n).step) for n in payloads
                                if ckpt.name_info(n) and ckpt.name_info(n).step is not None}))
                    notes.append(f"step {shown or '(unknown)'}: written without a manifest (not "
                                 "a complete step: it will not be resumed from)")
        except ckpt.CheckpointError as e:
            raise ToolError(str(e)) from None
        written += [ckpt.join(out_dir, n) for n in payloads]
    rep = {"src": args.src, "to": args.to, "out": args.out, "written": sorted(written),
           "notes": notes}
    if args.flags is None and args.to == "tagged":
        rep["notes"].append("no --flags given: the tagged model files store no flags")
    if args.json:
        _dump(rep, out)
    else:
        for p in sorted(written):
            out.write(f"wrote {p}\n")
        for n in rep["notes"]:
            out.write(f"note: {n}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# adapt


def _adapt_num_classes(args, c, flags):
    """--num_classes of a class-conditional adapt that did not give it: --data_dir's class count
    (as train.py counts it), else a class-conditional file's own count."""
    if args.data_dir:
        from ..image_datasets import folder_class_names

        names = folder_class_names(args.data_dir)
        if not names:
            raise ToolError(f"--data_dir {args.data_dir}: no images with class names; give the "
                            f"training folder, or --num_classes N in --flags")
        return len(names)
    if (c.flags or {}).get("class_cond") and isinstance(c.flags.get("num_classes"), int):
        return c.flags["num_classes"]
    raise ToolError("--flags makes the model class-conditional: pass --data_dir (the training "
                    "folder, whose classes are counted as train.py counts them) or --num_classes "
                    "N in --flags")


def cmd_adapt(args, out):
    """A complete tagged step in a new --out, adapted to the model of --flags (model_change.py)."""
    from ..ckpt.rng import seed_rngs  # the seeding of train.py's build(): the same fresh init

    storage.check_store(args.src, "SRC")
    storage.check_store(args.out, "--out")
    if storage.exists(args.out) and not storage.isdir(args.out):
        raise ToolError(f"{args.out}: is a file; --out must be a directory")
    if run_dir.list_steps(args.out):
        raise ToolError(f"{args.out}: already holds checkpoint files; adapt never writes into a "
                        "run: choose a new --out")
    if not storage.exists(args.src):
        raise ToolError(f"{args.src}: no such file or directory; check the path")
    src = args.src
    if storage.isdir(src) and args.step is not None:
        src = ckpt.join(src, ckpt.model_filename(args.step))
        if not storage.exists(src):
            raise ToolError(f"{args.src}: no model file of step {args.step}; see "
                            f"`ckpt.py verify {args.src}`")
    plan = run_dir.plan_resume(args.out, src)  # the model file and the files beside it
    c = _load(plan.model)
    if c.kind not in ("model", "combined"):
        raise ToolError(f"{plan.model}: holds {ckpt.describe(c)}, not model weights; give a "
                        "model file, a run directory or a combined dict")
    sd = ckpt.model_state_from(c)
    step = _step_of(c, plan.model, args.step)
    beside = plan.files_of(step) if ckpt.slot_of(plan.model) == "model" else {"ema": {},
                                                                              "opt": None}
    opt_path = beside["opt"] or (plan.model if c.optimizer is not None else None)
    opt_file = None if opt_path is None else (c if opt_path == plan.model else _load(opt_path))
    trainer = dict((opt_file.trainer if opt_file is not None else None) or {})

    flags, given, ignored = _parse_model_flags(args.flags)
    for k, v in (c.flags or {}).items():  # flags not given keep the file's values
        if k in flags and k not in given:
            flags[k] = v
    if flags.get("class_cond") and "num_classes" not in given:
        flags["num_classes"] = _adapt_num_classes(args, c, flags)
    seed = args.seed if args.seed is not None else int(trainer.get("seed") or 0)
    seed_rngs(seed, 0, 0)
    model = _build_model(flags)
    fresh = model.state_dict()
    change = model_change.plan_change(shapes_of(fresh), shapes_of(sd), c.flags, flags, step)
    if change.keeps_too_little and not args.force:  # before anything is written
        raise ToolError(model_change.too_little_kept_message(
            plan.model, change, "--flags", "pass --force to write it anyway",
            give='give all its model flags, --flags "--image_size N --num_channels N ..."'))
    notes = [f"ignored non-model flags: {' '.join(ignored)}"] if ignored else []
    if c.flags is None:
        notes.append(f"{os.path.basename(plan.model)} stores no model flags: those --flags does "
                     "not give are the defaults")
    notes.append(f"new and reshaped tensors: a fresh model built from the flags with --seed "
                 f"{seed}")

    def adapted(weights):
        taken = model_change.take_matching(fresh, weights)
        return {k: v.detach().clone() for k, v in taken.items()}

    files = {ckpt.model_filename(step): ckpt.model_payload(step, adapted(sd), flags)}
    emas = {rate: ckpt.model_state_from(_load(p), want="ema") for rate, p in beside["ema"].items()}
    if not emas and c.kind == "combined":
        ema = ckpt.combined_ema_or_none(c)
        if ema is not None:
            emas["0.9999"] = ema
            notes.append(f"{os.path.basename(plan.model)}: EMA entry written with rate 0.9999 "
                         "(the file does not say)")
    for rate, ema in emas.items():
        files[ckpt.ema_filename(rate, step)] = ckpt.ema_payload(step, rate, adapted(ema), flags)
    if not emas:
        notes.append("no EMA weights in SRC: a resume starts the EMA from the model weights")
    if opt_file is not None:
        try:
            by_name = model_change.optimizer_by_name(opt_file.optimizer,
                                                     list(shapes_of(sd).items()), str(opt_path))
            named, report = convert_with_report(
                by_name, [(n, tuple(p.shape)) for n, p in model.named_parameters()],
                source=str(opt_path))
        except OptimizerStateError as e:
            raise ToolError(f"{e}; adapt needs usable optimizer state (or remove the file to "
                            "start a fresh optimizer)") from None
        change.optimizer = model_change.moments_text(report, os.path.basename(str(opt_path)))
        if change.changed:
            trainer["model_changes"] = list(trainer.get("model_changes") or []) + [
                change.record()]
        files[ckpt.opt_filename(step)] = ckpt.opt_payload(step, named, trainer)
    else:
        notes.append("no optimizer state in SRC: a resume starts a fresh optimizer")
    storage.makedirs(args.out)
    try:
        # the source step's run settings (its manifest's, else its trainer state's): a resume
        # of --out takes them as it would the source's (--max_steps, --lr, the batch ...)
        run_dir.save_step(args.out, step, files,
                          settings=dict(run_dir.step_settings(plan.model)) or None)
    except ckpt.CheckpointError as e:
        raise ToolError(str(e)) from None
    written = [ckpt.join(args.out, n) for n in list(files) + [ckpt.manifest_filename(step)]]
    rep = {"src": args.src, "out": args.out, "step": step, "seed": seed, "written": written,
           "change": change.record(), "summary": change.lines(), "notes": notes}
    if args.json:
        _dump(rep, out)
    else:
        for line in change.lines():
            out.write(line + "\n")
        for p in written:
            out.write(f"wrote {p}\n")
        for n in notes:
            out.write(f"note: {n}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# prune


def cmd_prune(args, out):
    """Keep the newest --keep resumable steps (run_dir.prune), holding the run dir's lock
    meanwhile: a run that a training job holds is refused (its save in progress, its own
    prunes), and no job starts in it until the prune is done."""
    if args.keep < 1:
        raise UsageError("prune: --keep must be at least 1")
    _require_dir(args.dir, "DIR")
    lock = run_lock.LogDirLock(args.dir, wait_s=0)
    try:
        lock.acquire(log=lambda line: None)
    except run_lock.LogDirLockedError as e:
        raise ToolError(f"{args.dir} is in use by {run_lock.describe_owner(e.holder)} (a "
                        f"training job holds its lock); nothing was pruned: prune once that job "
                        f"has ended, or let the job prune as it saves (--keep_checkpoints "
                        f"{args.keep})") from None
    try:
        return _prune_locked(args, out)
    finally:
        lock.release()


def _prune_locked(args, out):
    steps = run_dir.list_steps(args.dir)
    if not any(s.complete for s in steps):
        raise ToolError(f"{args.dir}: no complete step; nothing pruned (see `ckpt.py verify`)")
    deleted = run_dir.prune(args.dir, args.keep, snapshots=args.delete_snapshots)
    kept = sorted({s.step for s in run_dir.list_steps(args.dir)}, reverse=True)
    snaps = run_dir.list_snapshots(args.dir)
    rep = {"dir": args.dir, "keep": args.keep, "deleted": deleted, "remaining_steps": kept,
           "snapshots_left": len(snaps)}
    if args.json:
        _dump(rep, out)
    else:
        for p in deleted:
            out.write(f"deleted {p}\n")
        out.write(f"{len(deleted)} file(s) deleted; steps left: "
                  f"{', '.join(map(str, kept)) or 'none'}\n")
        if snaps and not args.delete_snapshots:
            out.write(f"{len(snaps)} post-hoc EMA snapshot(s) kept (the history `ckpt.py phema` "
                      "reconstructs from; --delete_snapshots deletes those of pruned steps)\n")
    return EXIT_OK


def cmd_consolidate(args, out):
    """A sharded step as the full layout's files (model/ema/opt .pt + manifest, through
    run_dir.write_step: exactly today's format), in this one process. The files the step keeps
    whole beside its folder (post-hoc EMA snapshots, sharded.write_beside) are written into
    --out too, in its manifest as the full layout lists them."""
    _require_dir(args.dir, "RUN")
    st = sharded.verify(args.dir, args.step)
    if st.layout != sharded.LAYOUT:
        raise ToolError(f"{args.dir}: step {args.step} is in the full layout already; nothing "
                        f"to consolidate")
    if not st.complete:
        raise ToolError(f"{args.dir}: step {args.step} cannot be consolidated: {st.problem}; "
                        f"use another step (see `ckpt.py verify {args.dir}`)")
    payloads = sharded.consolidate(st.sharded_path)
    holds = st.manifest.get("holds")
    if list(payloads) != holds:
        raise ToolError(f"{st.sharded_path}: holds {list(payloads)}, its manifest says {holds}; "
                        f"the step is damaged: use another step")
    for name in run_dir.beside_files(st.manifest, args.step):  # verified with the folder
        payloads[name] = ckpt.load_file(ckpt.join(args.dir, name)).raw
    storage.makedirs(args.out)
    run_dir.write_step(args.out, args.step, payloads, settings=st.manifest.get("run_flags"))
    rep = {"dir": args.dir, "step": args.step, "out": args.out,
           "written": [*payloads, ckpt.manifest_filename(args.step)]}
    if args.json:
        _dump(rep, out)
    else:
        for name in rep["written"]:
            out.write(f"wrote {ckpt.join(args.out, name)}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# phema


def cmd_phema(args, out):
    _require_dir(args.dir, "DIR")
    stds = phema.parse_stds(args.std, "--std")
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: must be at least 1")
    if not args.max_profile_error > 0:
        raise UsageError(f"--max_profile_error {args.max_profile_error}: must be positive")
    if args.evaluate is not None:
        return _phema_sweep(args, stds, out)
    given = [f for f in _SWEEP_FLAGS if getattr(args, f) is not None]
    if given:
        raise UsageError(f"--{given[0]} is for the sweep: give --evaluate REF.npz too")
    if args.out is None:
        raise UsageError("--out FILE_OR_DIR is required (where the reconstructions go), or "
                         "--evaluate REF.npz to score the widths instead")
    targets = _phema_targets(args, stds)
    plan = phema.plan_reconstruction(args.dir, stds, step=args.step,
                                     max_error=args.max_profile_error)
    if plan.warning:
        args.err.write(plan.warning + "\n")
    paths = {std: targets(std, plan.step) for std in stds}
    for p in paths.values():
        if storage.exists(p):
            raise ToolError(f"{p}: already exists; refusing to overwrite (choose another --out)")
    storage.makedirs(ckpt.dirname(next(iter(paths.values()))))
    written = []
    for std, payload in phema.reconstruct(plan, batch=args.batch):
        file_writer.atomic_write(paths[std], payload)
        del payload
        written.append({"std": std, "path": paths[std],
                        "profile_error": float(plan.errors[plan.stds.index(std)])})
    rep = {"dir": args.dir, "step": plan.step, "nimg": plan.nimg,
           "inputs": [os.path.basename(s.path) for s in plan.inputs], "written": written,
           "left_out": [{"step": step, "why": why} for step, why in plan.left_out]}
    if args.json:
        _dump(rep, out)
    else:
        for w in written:
            out.write(f"wrote {w['path']}: std {phema.std_str(w['std'])} at step {plan.step} "
                      f"({plan.nimg:,} images) from {len(plan.inputs)} snapshots (profile error "
                      f"{w['profile_error']:.1%})\n")
    return EXIT_OK


# the sweep's own flags (None when not given) and their values otherwise
_SWEEP_FLAGS = {"num_samples": 1000, "features": "inception", "inception_weights": None,
                "sample_steps": 25, "sample_batch": 64, "seed": 0}
SWEEP_PLOT = "phema_sweep.png"


def _phema_sweep(args, stds, out):
    """`ckpt.py phema DIR --std A,B,C --evaluate REF`: reconstruct, sample, score each width;
    the table std -> FID (IS), the best named, phema_sweep.png in DIR or --out."""
    from .. import evaluation, inception

    opts = {k: (v if getattr(args, k) is None else getattr(args, k))
            for k, v in _SWEEP_FLAGS.items()}
    for k in ("sample_steps", "sample_batch"):
        if opts[k] < 1:
            raise UsageError(f"--{k} {opts[k]}: must be at least 1")
    if opts["num_samples"] < 2:
        raise UsageError(f"--num_samples {opts['num_samples']}: a FID needs at least 2 samples")
    if opts["features"] not in evaluation.FEATURES:
        raise UsageError(f"--features {opts['features']}: must be one of "
                         f"{', '.join(evaluation.FEATURES)}")
    out_dir = args.out if args.out is not None else args.dir
    storage.check_store(out_dir, "--out")
    if storage.exists(out_dir) and not storage.isdir(out_dir):
        raise ToolError(f"--out {out_dir}: is a file; give a directory for {SWEEP_PLOT}")
    try:
        evaluation.open_batch(args.evaluate).close()
    except evaluation.EvaluationError as e:
        raise evaluation.EvaluationError(f"--evaluate {e}") from None
    if opts["features"] == "inception":
        inception.check_weights_file(opts["inception_weights"])
    plan = phema.plan_reconstruction(args.dir, stds, step=args.step,
                                     max_error=args.max_profile_error)
    if plan.warning:
        args.err.write(plan.warning + "\n")
    features = evaluation.feature_network(opts["features"], opts["inception_weights"])
    device = "cuda" if th.cuda.is_available() else "cpu"
    rows = phema.evaluate_stds(
        plan, args.evaluate, features, opts["num_samples"], opts["sample_steps"],
        batch_size=opts["sample_batch"], seed=opts["seed"], device=device,
        recon_batch=args.batch, log=lambda line: (args.err.write(line + "\n"),
                                                  args.err.flush()))  # --json too: progress
    plot = _plot_sweep_to(out_dir, rows, plan.step, features.name)
    best = phema.best_row(rows)
    rep = {"dir": args.dir, "step": plan.step, "nimg": plan.nimg, "ref_batch": args.evaluate,
           "features": features.identity, "num_samples": opts["num_samples"],
           "sample_steps": opts["sample_steps"], "seed": opts["seed"],
           "table": [vars(r) for r in rows], "best": None if best is None else vars(best),
           "plot": plot, "inputs": [os.path.basename(s.path) for s in plan.inputs],
           "left_out": [{"step": step, "why": why} for step, why in plan.left_out]}
    if args.json:
        _dump(rep, out)
    else:
        out.write("\n".join(phema.sweep_table(rows)) + f" at step {plan.step}\n")
        out.write(f"wrote {plot}\n")
    return EXIT_OK


def _plot_sweep_to(out_dir, rows, step, features_name):
    """phema_sweep.png in ``out_dir`` (a local directory, made when missing, or an object-store
    prefix: drawn in a local temp folder, then put whole); returns its path."""
    if not storage.is_remote(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        return phema.plot_sweep(rows, os.path.join(out_dir, SWEEP_PLOT), step, features_name)
    import tempfile

    plot = ckpt.join(out_dir, SWEEP_PLOT)
    with tempfile.TemporaryDirectory() as tmp:
        local = phema.plot_sweep(rows, os.path.join(tmp, SWEEP_PLOT), step, features_name)
        storage.put(plot, storage.read_bytes(local))
    return plot


def _phema_targets(args, stds):
    """(std, step) -> output path for --out: a .pt file (one --std), else a directory (made when
    missing) holding ckpt.posthoc_ema_filename(std, step) per std; never the run dir itself."""
    target = args.out
    storage.check_store(target, "--out")
    as_file = target.endswith(".pt") and not storage.isdir(target)
    if as_file and len(stds) > 1:
        raise UsageError(f"--out {target}: {len(stds)} --std values need a directory (one file "
                         "each); give a directory")
    if storage.exists(target) and not storage.isdir(target) and not as_file:
        raise ToolError(f"--out {target}: is a file; give a directory or a new .pt file")
    where = ckpt.dirname(_abspath(target)) if as_file else target
    if _same_place(where, args.dir):
        raise UsageError(f"--out {target}: inside the run directory the files would join its "
                         "steps; write them elsewhere (a subdirectory is fine)")
    if as_file:
        return lambda std, step: target
    return lambda std, step: ckpt.join(target, ckpt.posthoc_ema_filename(std, step))


# ---------------------------------------------------------------------------------------------
# main


def _dump(obj, out):
    out.write(json.dumps(obj, indent=1, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, th.Tensor):
        return o.tolist() if o.numel() <= 16 else f"tensor{list(o.shape)}"
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def build_parser():
    p = _Parser(prog="ckpt.py", description=__doc__.strip(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sp = sub.add_parser("inspect", help="what a checkpoint file is, with diagnoses")
    sp.add_argument("files", nargs="+", metavar="FILE")
    sp = sub.add_parser("verify", help="every step of a run directory and whether it resumes")
    sp.add_argument("dir", metavar="DIR")
    sp.add_argument("--quick", action="store_true",
                    help="only names, sizes and manifests; do not load files or check checksums")
    sp = sub.add_parser("diff", help="missing / unexpected / reshaped keys vs flags or a file")
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("--flags", default=None, help='model flags, e.g. "--image_size 32 ..." (a '
                    'classifier file: the classifier flags, "--classifier_width 128 ...")')
    sp.add_argument("--against", default=None, metavar="FILE2")
    sp.add_argument("--want", choices=("model", "ema"), default="model",
                    help="which weights of a combined file")
    sp = sub.add_parser("convert", help="upstream -> tagged, tagged -> raw, weights -> safetensors")
    sp.add_argument("src", metavar="SRC", help="a checkpoint file or a run directory")
    sp.add_argument("--to", choices=("tagged", "raw", "safetensors"), required=True)
    sp.add_argument("--out", required=True, metavar="DIR", help="output directory (new files)")
    sp.add_argument("--flags", default=None, help="model flags to store in tagged files (a "
                    "classifier's: the classifier flags)")
    sp.add_argument("--step", type=int, default=None,
                    help="only this step of a run dir (or the step of a file without one)")
    sp = sub.add_parser("adapt", help="a complete step adapted to other model flags: matching "
                        "tensors kept, the others fresh")
    sp.add_argument("src", metavar="SRC",
                    help="a model file, a run directory (its newest complete step) or a combined "
                    "dict")
    sp.add_argument("--flags", required=True,
                    help='the new model flags, e.g. "--class_cond True" (others: the file\'s)')
    sp.add_argument("--out", required=True, metavar="DIR",
                    help="a new directory (one holding checkpoint files is refused)")
    sp.add_argument("--seed", type=int, default=None,
                    help="seed of the fresh model whose initialisation new tensors take (default: "
                    "the run's --seed from the opt file, else 0)")
    sp.add_argument("--step", type=int, default=None,
                    help="this step of a run dir (or the step of a file without one)")
    sp.add_argument("--data_dir", default="",
                    help="the training folder: a class-conditional model gets its class count "
                    "(as train.py counts it) unless --flags gives --num_classes")
    sp.add_argument("--force", action="store_true",
                    help="write the step even when the new model keeps less than half of the "
                    "file's tensors (refused otherwise: flags of another model, most likely)")
    sp = sub.add_parser("prune", help="delete old steps, keeping the newest K resumable ones "
                        "(checksums read) and every post-hoc EMA snapshot; refused while a "
                        "training job holds DIR")
    sp.add_argument("dir", metavar="DIR")
    sp.add_argument("--keep", type=int, required=True, metavar="K")
    sp.add_argument("--delete_snapshots", action="store_true",
                    help="also delete the post-hoc EMA snapshots (phema_*.pt) of the pruned steps")
    sp = sub.add_parser("consolidate", help="a sharded step (DCP) as the full layout's model/ema/"
                        "opt files and manifest")
    sp.add_argument("dir", metavar="RUN")
    sp.add_argument("--step", type=int, required=True, metavar="N")
    sp.add_argument("--out", required=True, metavar="DIR",
                    help="where to write them (created; refuses to overwrite files)")
    sp = sub.add_parser("phema", help="reconstruct EMAs of any width from a run's post-hoc EMA "
                        "snapshots (EDM2), as ordinary EMA files")
    sp.add_argument("dir", metavar="DIR", help="the run directory (its phema_STD_STEP.pt files)")
    sp.add_argument("--std", action="append", required=True, metavar="STD",
                    help="relative width to reconstruct, e.g. 0.07 (repeat it or give 0.05,0.1)")
    sp.add_argument("--step", type=int, default=None, metavar="S",
                    help="the step to reconstruct at, one with snapshots (default: the newest)")
    sp.add_argument("--out", default=None, metavar="FILE_OR_DIR",
                    help="a .pt file (one --std) or a directory: ema_phemaSTD_STEP.pt per std "
                    "(with --evaluate: the directory of phema_sweep.png, default DIR)")
    sp.add_argument("--batch", type=int, default=1, metavar="B",
                    help="stds reconstructed per pass over the snapshots (memory: B + 1 models)")
    sp.add_argument("--max_profile_error", type=float, default=phema.MAX_PROFILE_ERROR,
                    metavar="E", help="refuse a std whose reconstructed profile is further than "
                    "this (relative L2) from its target")
    sp.add_argument("--evaluate", default=None, metavar="REF",
                    help="the sweep: sample each --std and print its FID (and IS) against this "
                    "reference batch (npz, arr_0 uint8 NHWC), name the best, write "
                    "phema_sweep.png; writes no EMA files")
    sp.add_argument("--num_samples", type=int, default=None, metavar="M",
                    help="samples per --std for --evaluate (default 1000)")
    sp.add_argument("--features", choices=("inception", "digits"), default=None,
                    help="--evaluate's feature network (default inception)")
    sp.add_argument("--inception_weights", default=None, metavar="PATH",
                    help="the FID Inception's weights (default $ID_INCEPTION_WEIGHTS)")
    sp.add_argument("--sample_steps", type=int, default=None, metavar="K",
                    help="DDIM steps of --evaluate's samples (default 25)")
    sp.add_argument("--sample_batch", type=int, default=None, metavar="B",
                    help="images per sampling batch of --evaluate (default 64)")
    sp.add_argument("--seed", type=int, default=None,
                    help="seed of --evaluate's samples (sample i from its own seeds; default 0)")
    return p


_COMMANDS = {"inspect": cmd_inspect, "verify": cmd_verify, "diff": cmd_diff,
             "convert": cmd_convert, "adapt": cmd_adapt, "prune": cmd_prune,
             "phema": cmd_phema, "consolidate": cmd_consolidate}


def main(argv=None, out=None, err=None):
    """Run the CLI; returns the exit status (0 healthy, 1 problem found, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    err = err or sys.stderr
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        if not args.command:
            raise UsageError("ckpt.py: give a command: inspect, verify, diff, convert, adapt, "
                             "prune, phema or consolidate")
        args.json = as_json
        args.err = err
        return _COMMANDS[args.command](args, out)
    except UsageError as e:
        _fail(str(e) if "--help" in str(e) else f"{e} (see ckpt.py --help)", as_json, out, err)
        return EXIT_USAGE
    except UserError as e:  # ToolError, CheckpointError, OptimizerStateError, ...
        _fail(str(e), as_json, out, err)
        return e.exit_code
    except KeyboardInterrupt:
        _fail("interrupted", as_json, out, err)
        return EXIT_PROBLEM
    except BrokenPipeError:  # the reader left (`ckpt.py inspect F | head`): end quietly
        _drop_stdout(out)
        return EXIT_PROBLEM
    except Exception:  # a bug: keep its traceback (files' faults are UserErrors above)
        traceback.print_exc(file=err)
        _fail("unexpected error (traceback above)", as_json, out, err)
        return EXIT_PROBLEM


def _drop_stdout(out):
    """After the reader of ``out`` closed the pipe: point stdout at /dev/null, so that the
    interpreter's flush at exit does not print a second BrokenPipeError (Python's advice in
    its signal module documentation)."""
    if out is sys.stdout:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _fail(message, as_json, out, err):
    message = " ".join(str(message).split())
    err.write(f"error: {message}\n")
    if as_json:
        _dump({"ok": False, "error": message}, out)


if __name__ == "__main__":
    from ..infra.process_exit import exit_process

    exit_process(main())
