"""
Resume into a changed model: which tensors of a checkpoint a model built from other flags takes.

One rule for the model, every EMA and the Adam moments, used by `train.py --allow_model_change
True` (train_util.TrainLoop) and by `ckpt.py adapt` (ckpt_tool), so the two agree tensor for
tensor:

- a tensor whose name and shape match is **kept**, bit for bit;
- a tensor the model has and the file lacks (**new**), or has with another shape (**reshaped**),
  keeps the fresh model's initialisation;
- a tensor of the file that the model no longer has is **dropped**.

A change that keeps less than half of the file's tensors (`ModelChange.keeps_too_little`) is
refused by both, naming what did not fit (`too_little_kept_message`): such flags describe another
model rather than a change of this one (a raw upstream file adapted without its flags built the
default model and kept 1 of its 166 tensors). `ckpt.py adapt --force` writes it anyway; a resume
starts from what that writes.

The decision is made from names and shapes alone (state_fit.fit_state_dict), so every rank,
given the same broadcast bytes, decides the same. A `ModelChange` carries it, its log block
(`lines()`) and the record the next save keeps in the trainer state (`record()`, appended to
trainer["model_changes"], shown by `ckpt.py inspect`).

    change = plan_change(shapes_of(model.state_dict()), shapes_of(sd), file_flags, flags, step)
    model.load_state_dict(take_matching(model.state_dict(), sd))
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import optim_state, state_fit

# How many names of each list the log block and `ckpt.py inspect` show.
SHOWN = 4

# A change that keeps fewer than this share of the file's tensors is refused unless forced.
MIN_KEPT_SHARE = 0.5


@dataclass
class ModelChange:
    """
    What a changed model takes from a checkpoint.

    kept:      names taken from the file (name and shape match).
    new:       names of the model the file lacks (fresh initialisation).
    dropped:   names of the file the model no longer has.
    reshaped:  {name: (file shape, model shape)}: fresh initialisation, the file's tensor dropped.
    flags:     {flag: (file value, run value)} of the model flags that differ; None when the file
               stores no flags (upstream's files).
    step:      the step resumed (or adapted) at.
    regrouped: {parameter: (file group, run group)}: optimizer parameters whose param group
               index changed (their moments follow the name; hyperparameters are the run's).
    optimizer: one line on what became of the Adam moments (set by the caller).
    notes:     further lines for the log block (e.g. an EMA file that differs from the model's).
    file_tensors: how many tensors the file's weights hold.
    likely_flags: state_fit's hints at the flag that explains the change, most likely first.
    """

    kept: List[str] = field(default_factory=list)
    new: List[str] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    reshaped: Dict[str, Tuple[tuple, tuple]] = field(default_factory=dict)
    flags: Optional[Dict[str, Tuple[Any, Any]]] = None
    step: Optional[int] = None
    regrouped: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    optimizer: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    file_tensors: int = 0
    likely_flags: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the model's tensors differ from the file's (names or shapes)."""
        return bool(self.new or self.dropped or self.reshaped)

    @property
    def keeps_too_little(self) -> bool:
        """True when less than half (MIN_KEPT_SHARE) of the file's tensors are kept: flags that
        describe another model, most likely, rather than a change of this one."""
        return len(self.kept) < MIN_KEPT_SHARE * self.file_tensors

    def misfit_text(self) -> str:
        """What did not fit, for one line: "15 reshaped (a [64] -> [128], ...), 150 dropped
        (b, c, ...), 140 new (d, ...)"."""
        parts = []
        if self.reshaped:
            shown = [f"{k} {list(a)} -> {list(b)}" for k, (a, b) in self.reshaped.items()]
            parts.append(f"{len(shown)} reshaped ({_first(shown, 2)})")
        for label, names in (("dropped", self.dropped), ("new", self.new)):
            if names:
                parts.append(f"{len(names)} {label} ({_first(names, 2)})")
        return ", ".join(parts)

    def counts(self) -> str:
        return (f"{len(self.kept)} kept, {len(self.new)} new, {len(self.dropped)} dropped, "
                f"{len(self.reshaped)} reshaped")

    def lines(self) -> List[str]:
        """The summary block for the log (one headline, then one line per non-empty item)."""
        at = f" at step {self.step}" if self.step is not None else ""
        out = [f"model change{at}: {self.counts()} tensor(s); new and reshaped ones keep the "
               f"fresh model's initialisation, dropped ones are not used"]
        for label, names in (("new", self.new), ("dropped", self.dropped)):
            if names:
                out.append(f"  {label:<10}{len(names)}: {_first(names)}")
        if self.reshaped:
            shown = [f"{k} {list(a)} -> {list(b)}" for k, (a, b) in self.reshaped.items()]
            out.append(f"  {'reshaped':<10}{len(shown)}: {_first(shown)}")
        out.append(f"  {'flags':<10}{self.flags_text()}")
        if self.optimizer:
            out.append(f"  {'optimizer':<10}{self.optimizer}")
        if self.regrouped:
            out.append(f"  {'groups':<10}{regrouped_text(self.regrouped)}")
        out += [f"  {'note':<10}{n}" for n in self.notes]
        return out

    def flags_text(self) -> str:
        if self.flags is None:
            return "the file stores no model flags"
        if not self.flags:
            return "no model flag differs from the file's"
        return ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in self.flags.items())

    def record(self) -> dict:
        """The entry appended to trainer["model_changes"] (weights_only-loadable data)."""
        return {
            "step": self.step,
            "kept": len(self.kept),
            "new": list(self.new),
            "dropped": list(self.dropped),
            "reshaped": list(self.reshaped),
            "regrouped": list(self.regrouped),
            "flags": None if self.flags is None else {k: [a, b] for k, (a, b) in
                                                        self.flags.items()},
        }


def _first(items, n=SHOWN):
    more = f", +{len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def moments_text(report, file_name) -> str:
    """The log block's optimizer line from an optim_state.LoadReport."""
    return (f"Adam moments {report.matched} kept, {report.fresh} fresh, {report.dropped} dropped "
            f"({file_name}, {report.layout})")


def regrouped_text(regrouped) -> str:
    """"2 parameter(s) changed param group: a.bias (0 -> 1), b.bias (0 -> 1)"."""
    shown = [f"{k} ({a} -> {b})" for k, (a, b) in regrouped.items()]
    return f"{len(shown)} parameter(s) changed param group: {_first(shown)}"


def record_text(rec) -> str:
    """One line for a trainer["model_changes"] entry (ckpt.py inspect)."""
    if not isinstance(rec, dict):
        return f"unreadable entry {rec!r}"[:120]

    def names(key):
        v = rec.get(key)
        return v if isinstance(v, list) else []

    parts = [f"step {rec.get('step')}: {rec.get('kept')} kept"]
    for key in ("new", "dropped", "reshaped"):
        parts.append(f"{len(names(key))} {key}" + (f" ({_first(names(key), 2)})"
                                                   if names(key) else ""))
    if names("regrouped"):
        parts.append(f"{len(names('regrouped'))} changed param group")
    flags = rec.get("flags")
    if isinstance(flags, dict) and flags:
        parts.append("; ".join(f"--{k} {v[0]} -> {v[1]}" for k, v in flags.items()
                               if isinstance(v, (list, tuple)) and len(v) == 2))
    elif flags is None:
        parts.append("no flags in the file")
    return ", ".join(parts)


def plan_change(model_shapes, file_shapes, file_flags=None, run_flags=None,
                step=None) -> ModelChange:
    """
    The change from a file's tensors to a model's, by name and shape.

    :param model_shapes: {name: shape} of the model (`state_fit.shapes_of(model.state_dict())`).
    :param file_shapes: {name: shape} of the file's weights.
    :param file_flags: the model flags stored in the file (None: none stored).
    :param run_flags: the flags the model was built from.
    """
    fit = state_fit.fit_state_dict(model_shapes, file_shapes, file_flags, run_flags)
    return ModelChange(
        kept=[k for k in model_shapes if k in file_shapes and k not in fit.reshaped],
        new=list(fit.missing), dropped=list(fit.unexpected), reshaped=dict(fit.reshaped),
        flags=state_fit.differing_flags(file_flags, run_flags), step=step,
        file_tensors=len(file_shapes), likely_flags=list(fit.likely_flags))


def too_little_kept_message(source, change, given, force, give="give them"):
    """
    The one line that refuses a change keeping less than half of the file's tensors
    (``change.keeps_too_little``): what did not fit, the likely flag, and how to force it.

    :param source: the file as the caller names it (a path, "--resume_checkpoint PATH").
    :param given: where the model flags came from, e.g. "--flags" or "the command line".
    :param force: the way to go ahead anyway, e.g. "pass --force to write it anyway".
    :param give: how to give the flags a file without flags was trained with.
    """
    likely = "; ".join(change.likely_flags)
    if change.flags is None:  # upstream's raw files: every flag not given took its default
        check = (f"the file stores no model flags, so those {given} does not give took their "
                 f"defaults: {give} as it was trained"
                 + (f" (likely {likely})" if likely else ""))
    else:
        check = f"check {likely or given}"
    return (f"{source}: the model of these flags keeps only {len(change.kept)} of the file's "
            f"{change.file_tensors} tensors ({change.misfit_text()}): the flags of another "
            f"model, most likely; {check}, or {force}")


def take_matching(fresh, saved) -> dict:
    """
    The model's state dict after the change: `fresh`'s keys in its order, each `saved[k]` where the
    name and shape match, else `fresh[k]` (the fresh model's initialisation).
    """
    return {k: saved[k] if k in saved and tuple(saved[k].shape) == tuple(v.shape) else v
            for k, v in fresh.items()}


def optimizer_by_name(payload, file_shapes, source="FILE"):
    """
    A file's optimizer payload keyed by parameter name, so that its moments can follow the names
    into a changed model: named-v1 is returned as it is; upstream's index-keyed or flattened
    layouts are matched to the FILE's own parameters (`file_shapes`: [(name, shape)] in the
    file's parameter order, i.e. its model state dict's, as upstream built
    `AdamW(model.parameters())`).

    :raises optim_state.OptimizerStateError: the payload does not fit the file's parameters.
    """
    if optim_state.is_named(payload):
        return payload
    return optim_state.convert_to_named(payload, list(file_shapes), source=source)


def too_little_kept_for_resume(path, change):
    """`too_little_kept_message` for a resume with --allow_model_change True (train.py): no flag
    of its own forces it; `ckpt.py adapt --force` writes that step, and a resume from it fits."""
    return too_little_kept_message(
        path, change, "the command line",
        f"to start from those tensors anyway, write that step with `ckpt.py adapt {path} --flags "
        f"\"MODEL FLAGS\" --force --out DIR` and resume it (--resume_checkpoint DIR)")
