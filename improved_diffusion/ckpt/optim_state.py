"""
Optimizer state keyed by parameter name, and a loader that accepts upstream's layouts.

torch's `optimizer.state_dict()` keys its state by parameter *index*, so a saved state only fits an
optimizer built over exactly the same parameters in the same order. We store it keyed by parameter
*name* instead ("named-v1"), with every parameter's shape:

    {"format": "named-v1",
     "optimizer": "AdamW",
     "param_groups": [{"lr": ..., "betas": ..., "eps": ..., "weight_decay": ..., ...,
                       "params": [param names]}],
     "state": {param_name: {"step": tensor [], "exp_avg": tensor [*shape],
                            "exp_avg_sq": tensor [*shape]}},
     "shapes": {param_name: [*shape]}}

`load_optimizer_state` reads that format and also upstream's files:

- improved-diffusion / guided-diffusion without fp16: a raw torch optimizer state dict whose indices
  follow `model.parameters()` order (upstream built `AdamW(model.parameters())`);
- improved-diffusion with fp16: one param whose value is the flat concatenation of all parameters
  (`_flatten_dense_tensors`), so `exp_avg` is [N] with N = total parameter count;
- guided-diffusion with fp16: two flat master params, first the parameters with ndim <= 1
  (shape [N1]), then those with ndim > 1 (shape [1, N2]) (`get_param_groups_and_shapes`).

Flat layouts are unflattened into per-parameter moments using the model's parameter order and
shapes. Parameters whose name and shape match keep their state; new or reshaped ones start fresh;
saved ones the model lacks are dropped. A payload that is not optimizer state for this optimizer at
all raises `OptimizerStateError` with a one-line message naming the file and what it holds.

Loading is exact: `load_optimizer_state(fresh_opt, named_optimizer_state(opt, params), params)`
makes `fresh_opt.state_dict()` equal `opt.state_dict()` tensor for tensor.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch as th

from ..infra.errors import UserError
from .checkpoint import (
    LAYOUT_FLAT1,
    LAYOUT_FLAT2,
    LAYOUT_INDEXED,
    LAYOUT_NAMED,
    LAYOUT_PHRASES,
    SCHEMA,
    describe_object,
    opt_layout,
)

FORMAT = LAYOUT_NAMED

# The param-group hyperparameters restored from a saved state (others stay as constructed).
HYPERPARAM_KEYS = ("lr", "betas", "eps", "weight_decay")

# Per-parameter state keys that identify an optimizer family.
_FAMILY_STATE_KEYS = {
    "Adam": {"exp_avg", "exp_avg_sq"},
    "SGD": {"momentum_buffer"},
    "RMSprop": {"square_avg"},
    "Adagrad": {"sum"},
    "Adadelta": {"acc_delta"},
    "Adamax": {"exp_inf"},
}
_CLASS_FAMILY = {
    "Adam": "Adam",
    "AdamW": "Adam",
    "NAdam": "Adam",
    "RAdam": "Adam",
    "SGD": "SGD",
    "RMSprop": "RMSprop",
    "Adagrad": "Adagrad",
    "Adadelta": "Adadelta",
    "Adamax": "Adamax",
}

class OptimizerStateError(UserError):
    """The payload is not usable optimizer state; the message is one line naming the file."""


@dataclass
class LoadReport:
    """
    What `load_optimizer_state` did.

    matched:  model parameters whose saved state (name and shape equal) was restored.
    fresh:    model parameters that start with fresh state (new ones and reshaped ones).
    dropped:  saved parameters the model no longer has.
    reshaped: model parameters saved with a different shape (counted in `fresh` too).
    regrouped: {name: (saved group index, current group index)} of the parameters that sit in
              another param group than in the file (their state follows the name all the same).
    """

    matched: int = 0
    fresh: int = 0
    dropped: int = 0
    reshaped: int = 0
    source: str = "FILE"
    layout: str = LAYOUT_PHRASES[LAYOUT_NAMED]  # the phrase of checkpoint.opt_layout's value
    fresh_names: List[str] = field(default_factory=list)
    dropped_names: List[str] = field(default_factory=list)
    reshaped_names: List[str] = field(default_factory=list)
    regrouped: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    def summary(self) -> str:
        line = (
            f"optimizer state from {self.source}, {self.layout}: "
            f"{self.matched} parameters restored, {self.fresh} fresh"
        )
        if self.reshaped:
            line += f" ({self.reshaped} reshaped)"
        line += f", {self.dropped} dropped"
        if self.regrouped:
            line += f", {len(self.regrouped)} in another param group than in the file"
        return line

    @property
    def complete(self) -> bool:
        """True when every parameter was restored and nothing was dropped."""
        return self.fresh == 0 and self.dropped == 0


def _as_named_list(named_params) -> List[Tuple[str, th.Tensor]]:
    named = list(named_params)
    seen = set()
    for name, _ in named:
        if name in seen:
            raise ValueError(f"duplicate parameter name {name!r} in named_params")
        seen.add(name)
    return named


def _family_of_class(optimizer) -> Optional[str]:
    for cls in type(optimizer).__mro__:
        if cls.__name__ in _CLASS_FAMILY:
            return _CLASS_FAMILY[cls.__name__]
    return None


def family_of_state(states, groups) -> Optional[str]:
    keys = set()
    for entry in states:
        if isinstance(entry, dict):
            keys.update(entry.keys())
    for family, needed in _FAMILY_STATE_KEYS.items():
        if needed <= keys:
            return family
    if keys:
        return None
    # No per-parameter state yet (never stepped): guess from the hyperparameters.
    gkeys = set()
    for g in groups:
        if isinstance(g, dict):
            gkeys.update(g.keys())
    if "betas" in gkeys:
        return "Adam"
    if "momentum" in gkeys and "dampening" in gkeys:
        return "SGD"
    return None


def named_optimizer_state(optimizer, named_params, copy=True) -> dict:
    """
    The optimizer's state keyed by parameter name (format "named-v1"; see the module docstring).

    :param optimizer: a torch optimizer whose params all appear in `named_params`.
    :param named_params: list of (name, parameter), e.g. `list(model.named_parameters())`.
    :param copy: False: the optimizer's own tensors, uncopied, where they live (for a caller that
             copies them itself, e.g. a checkpoint snapshot).
    :return: a dict of plain python data and CPU tensors (copies: later optimizer steps do not
             change it), loadable with `torch.load(..., weights_only=True)`.
    """
    named = _as_named_list(named_params)
    id_to_name = {id(p): n for n, p in named}
    sd = optimizer.state_dict()
    groups = []
    state = {}
    for group, saved_group in zip(optimizer.param_groups, sd["param_groups"]):
        names = []
        for p, index in zip(group["params"], saved_group["params"]):
            name = id_to_name.get(id(p))
            if name is None:
                raise ValueError(
                    "named_optimizer_state: the optimizer holds a parameter that is not in "
                    "named_params (build the optimizer over model.parameters())"
                )
            names.append(name)
            entry = sd["state"].get(index)
            if entry is not None:
                state[name] = {
                    k: ((v.detach().to("cpu", copy=True) if copy else v.detach())
                        if isinstance(v, th.Tensor) else v)
                    for k, v in entry.items()
                }
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        hyper["params"] = names
        groups.append(hyper)
    return {
        "format": FORMAT,
        "optimizer": type(optimizer).__name__,
        "param_groups": groups,
        "state": state,
        "shapes": {n: list(p.shape) for n, p in named},
    }


def is_named(payload, source="FILE") -> bool:
    """True when `payload` (or the optimizer entry of a whole opt file / combined dict) is
    named-v1 optimizer state, keyed by parameter name."""
    inner = _unwrap(payload, source)
    return isinstance(inner, dict) and inner.get("format") == FORMAT


def _describe_non_optimizer(payload) -> str:
    """What a payload that is not optimizer state holds, for a one-line message."""
    return f"{describe_object(payload)}, not optimizer state"


def _unwrap(payload, source):
    """Accept a whole opt file (tagged) or a combined dict; return the optimizer payload."""
    if isinstance(payload, dict) and payload.get("schema") == SCHEMA:
        if payload.get("kind") == "opt" and isinstance(payload.get("optimizer"), dict):
            return payload["optimizer"]
        raise OptimizerStateError(f"{source} holds {_describe_non_optimizer(payload)}")
    if isinstance(payload, dict) and "format" not in payload and not (
        "state" in payload and "param_groups" in payload
    ):
        for key in ("opt", "optimizer"):
            inner = payload.get(key)
            if isinstance(inner, dict) and (
                inner.get("format") == FORMAT or ("state" in inner and "param_groups" in inner)
            ):
                return inner
    return payload


class _Plan:
    """The per-name state and per-name hyperparameters to load, and the report."""

    def __init__(self, report, state_by_name, hyper_by_name, default_hyper, group_by_name):
        self.report = report
        self.state_by_name = state_by_name
        self.hyper_by_name = hyper_by_name
        self.default_hyper = default_hyper
        self.group_by_name = group_by_name  # {name: index of its param group in the file}


def _malformed(source, what):
    return OptimizerStateError(f"{source} holds malformed optimizer state: {what}")


def _show(v) -> str:
    """A short description of a value for a message."""
    if isinstance(v, th.Tensor):
        dtype = str(v.dtype).replace("torch.", "")
        if v.dim() == 0:
            return f"a {dtype} tensor {v.item()!r}"
        return f"a {dtype} tensor of shape {list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 40 else f"a {type(v).__name__}"


def _number(v) -> Optional[float]:
    """`v` as a finite float when it is a real number (or a one-element real tensor), else None."""
    if isinstance(v, th.Tensor):
        if v.numel() != 1 or v.dtype == th.bool or v.is_complex():
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _check_hyper(group, where, source):
    """The restored hyperparameters of one param group have the types torch's AdamW expects."""
    for k in HYPERPARAM_KEYS:
        if k not in group:
            continue
        v = group[k]
        if k == "betas":
            ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(
                _number(b) is not None and 0.0 <= _number(b) < 1.0 for b in v)
            want = "two numbers in [0, 1)"
        else:
            ok = _number(v) is not None and _number(v) >= 0.0
            want = "a non-negative number"
        if not ok:
            raise _malformed(source, f"{where}[{k!r}] is {_show(v)}, not {want}")


def _check_groups(groups, source, key_ok, key_what):
    """param_groups is a non-empty list of dicts whose 'params' lists keys once each."""
    if not isinstance(groups, list) or not groups:
        what = "empty" if isinstance(groups, list) else f"{_show(groups)}, not a list"
        raise _malformed(source, f"'param_groups' is {what}")
    seen = set()
    for i, g in enumerate(groups):
        where = f"param_groups[{i}]"
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise _malformed(source, f"{where} has no 'params' list")
        for key in g["params"]:
            if not key_ok(key):
                raise _malformed(source, f"{where}['params'] holds {_show(key)}, not {key_what}")
            if key in seen:
                raise _malformed(source, f"{key!r} is listed by two param groups")
            seen.add(key)
        _check_hyper(g, where, source)
    return seen


def _check_state_container(state, source):
    if not isinstance(state, dict):
        raise _malformed(source, f"'state' is {_show(state)}, not a dict")
    for key, entry in state.items():
        if not isinstance(entry, dict):
            raise _malformed(source, f"state[{key!r}] is {_show(entry)}, not a dict of tensors")


def _needed_keys(family, optimizer) -> Tuple[str, ...]:
    """The per-parameter state keys the target optimizer reads at its next step."""
    if family is None:
        return ()
    keys = tuple(sorted(_FAMILY_STATE_KEYS[family]))
    if family == "Adam":
        amsgrad = optimizer is not None and any(
            g.get("amsgrad") for g in optimizer.param_groups)
        keys = ("step",) + keys + (("max_exp_avg_sq",) if amsgrad else ())
    return keys


def _check_step(v, where, source):
    n = _number(v)
    if n is None or n < 0:
        raise _malformed(source, f"{where}['step'] is {_show(v)}, not a non-negative number")


def _check_entry(entry, where, needed, shape, source):
    """
    One parameter's state: every key the optimizer reads is there, 'step' is a non-negative
    number, moments are floating-point tensors of one shape (`shape` when given).
    Returns the moments' shape (None when the entry has no moment).
    """
    for k in needed:
        if k not in entry:
            raise _malformed(source, f"{where} has no {k!r}")
    seen = None
    for k, v in entry.items():
        if not isinstance(k, str):
            raise _malformed(source, f"{where} has a key {k!r} that is not a string")
        if k == "step":
            _check_step(v, where, source)
            continue
        if not isinstance(v, th.Tensor):
            if k in needed or _number(v) is None and v is not None:
                raise _malformed(source, f"{where}[{k!r}] is {_show(v)}, not a tensor")
            continue
        if not v.is_floating_point():
            raise _malformed(source, f"{where}[{k!r}] is {_show(v)}, not floating point")
        if k not in needed:
            continue
        want = shape if shape is not None else seen
        if want is not None and tuple(v.shape) != tuple(want):
            whose = "the parameter has" if shape is not None else "its other moments have"
            raise _malformed(source, f"{where}[{k!r}] has shape {list(v.shape)} but {whose} "
                                     f"shape {list(want)}")
        seen = tuple(v.shape)
    return seen


def _check_shapes(shapes, source):
    if not isinstance(shapes, dict):
        raise _malformed(source, f"'shapes' is {_show(shapes)}, not a dict of parameter shapes")
    for name, shape in shapes.items():
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise _malformed(source, f"shapes[{name!r}] is {_show(shape)}, not a list of sizes")


def _check_named(payload, source, needed):
    """The whole named-v1 structure (see the module docstring), before anything is loaded."""
    if not isinstance(payload.get("optimizer", ""), str):
        raise _malformed(source, f"'optimizer' is {_show(payload['optimizer'])}, not a name")
    shapes = payload.get("shapes")
    _check_shapes(shapes, source)
    names = _check_groups(payload.get("param_groups"), source,
                          lambda k: isinstance(k, str), "parameter names")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise _malformed(source, f"param group parameter {unknown[0]!r} is not in 'shapes'")
    state = payload.get("state")
    _check_state_container(state, source)
    for name, entry in state.items():
        if name not in names:
            raise _malformed(source, f"state[{name!r}] belongs to no param group")
        _check_entry(entry, f"state[{name!r}]", needed, tuple(shapes[name]), source)


def _check_raw(payload, source, needed):
    """The whole index-keyed torch structure, before anything is loaded."""
    indices = _check_groups(payload["param_groups"], source,
                            lambda k: isinstance(k, int) and not isinstance(k, bool),
                            "parameter indices")
    state = payload["state"]
    _check_state_container(state, source)
    for index, entry in state.items():
        if index not in indices:
            raise _malformed(source, f"state[{index!r}] belongs to no param group")
        _check_entry(entry, f"state[{index!r}]", needed, None, source)


def _entry_shape(entry) -> Optional[Tuple[int, ...]]:
    """The parameter shape implied by a per-parameter state entry (its largest tensor)."""
    shape = None
    for k, v in entry.items():
        if k == "step" or not isinstance(v, th.Tensor):
            continue
        if shape is None or v.numel() > int(th.Size(shape).numel()):
            shape = tuple(v.shape)
    return shape


def _as_step_tensor(entry):
    """The entry with 'step' as a float tensor, as torch's Adam keeps it (old torch saved ints)."""
    step = entry.get("step")
    if step is None or isinstance(step, th.Tensor) and step.is_floating_point() \
            and step.dim() == 0:
        return entry
    out = dict(entry)
    out["step"] = th.tensor(_number(step), dtype=th.float32)
    return out


def _plan_named(payload, source) -> Tuple[dict, dict, dict, str]:
    """(state_by_name, shape_by_name, hyper_by_name, optimizer name) from a checked payload."""
    hyper_by_name = {}
    for g in payload["param_groups"]:
        hyper = {k: v for k, v in g.items() if k != "params"}
        for name in g["params"]:
            hyper_by_name[name] = hyper
    shapes = payload["shapes"]
    shape_by_name = {n: tuple(shapes[n]) for n in hyper_by_name}
    state = {n: _as_step_tensor(e) for n, e in payload["state"].items()}
    return state, shape_by_name, hyper_by_name, str(payload.get("optimizer", "?"))


def _flat_parts(layout, states, raw_params, named):
    """[(parameter names, flat entry)] of a flattened fp16 layout (see checkpoint.opt_layout)."""
    if layout == LAYOUT_FLAT1:
        return [([n for n, _ in named], states[raw_params[0]])]
    vec = [n for n, p in named if p.ndim <= 1]
    mat = [n for n, p in named if p.ndim > 1]
    return [(vec, states[raw_params[0]]), (mat, states[raw_params[1]])]


def _unflatten(parts, named, source, layout, saved_numel, model_numel):
    shapes = {n: p.shape for n, p in named}
    if saved_numel != model_numel:
        raise OptimizerStateError(
            f"{source} holds {layout} for {saved_numel} values but the model has {model_numel} "
            "parameters; it cannot be unflattened (were the model flags changed?)"
        )
    state_by_name = {}
    for names, entry in parts:
        n_part = sum(shapes[n].numel() for n in names)
        flat = {k: v for k, v in entry.items() if k != "step" and isinstance(v, th.Tensor)}
        for k, v in flat.items():
            if v.numel() != n_part:
                raise OptimizerStateError(
                    f"{source} holds {layout} whose {k!r} has {v.numel()} values where the "
                    f"model's matching parameters have {n_part}; it cannot be unflattened"
                )
        offset = 0
        for name in names:
            numel = shapes[name].numel()
            new_entry = {}
            for k, v in entry.items():
                if k in flat:
                    piece = v.reshape(-1)[offset:offset + numel]
                    new_entry[k] = piece.reshape(shapes[name]).clone()
                elif isinstance(v, th.Tensor):
                    new_entry[k] = v.clone()
                else:
                    new_entry[k] = v
            state_by_name[name] = new_entry
            offset += numel
    return state_by_name


def _plan_raw(payload, named, source):
    """(state_by_name, shape_by_name, hyper_by_name, layout) from a checked raw torch state dict."""
    groups = payload["param_groups"]
    states = {i: _as_step_tensor(e) for i, e in payload["state"].items()}
    raw_params = [i for g in groups for i in g["params"]]
    hyper_of_index = {}
    for g in groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        for i in g["params"]:
            hyper_of_index[i] = hyper
    names = [n for n, _ in named]
    layout = opt_layout(payload, len(named))
    if len(raw_params) != len(named):
        if layout in (LAYOUT_FLAT1, LAYOUT_FLAT2):
            parts = _flat_parts(layout, states, raw_params, named)
            saved_numel = sum(_entry_shape(e)[-1] for _, e in parts)
            model_numel = sum(p.numel() for _, p in named)
            state_by_name = _unflatten(parts, named, source, LAYOUT_PHRASES[layout], saved_numel,
                                       model_numel)
            shape_by_name = {n: tuple(p.shape) for n, p in named}
            hyper = hyper_of_index[raw_params[0]]
            return state_by_name, shape_by_name, {n: hyper for n in names}, LAYOUT_PHRASES[layout]
        raise OptimizerStateError(
            f"{source} holds index-keyed optimizer state for {len(raw_params)} parameters but the "
            f"model has {len(named)}; it cannot be matched to parameters by name "
            "(were the model flags changed?)"
        )
    state_by_name, shape_by_name, hyper_by_name = {}, {}, {}
    for index, name in zip(raw_params, names):
        hyper_by_name[name] = hyper_of_index[index]
        entry = states.get(index)
        if entry is None:
            # Never stepped: its shape is unknown, assume the model's (no state to mismatch).
            shape_by_name[name] = tuple(dict(named)[name].shape)
        else:
            state_by_name[name] = entry
            shape_by_name[name] = _entry_shape(entry)
    return state_by_name, shape_by_name, hyper_by_name, LAYOUT_PHRASES[LAYOUT_INDEXED]


def _target(optimizer) -> Tuple[Optional[str], str]:
    """(family, class name) of the optimizer to load into; None means our trainer's AdamW."""
    if optimizer is None:
        return "Adam", "AdamW"
    return _family_of_class(optimizer), type(optimizer).__name__


def _checked(payload, source, optimizer):
    """
    The unwrapped payload and its layout ("named" or "raw"), after checking its WHOLE structure
    (types, keys, moment shapes, hyperparameters) against what the target optimizer reads at its
    next step: a payload that passes cannot fail later in `optimizer.step()`.
    """
    payload = _unwrap(payload, source)
    family, target_name = _target(optimizer)
    needed = _needed_keys(family, optimizer)
    if isinstance(payload, dict) and "format" in payload:
        if payload.get("format") != FORMAT:
            raise OptimizerStateError(
                f"{source} holds optimizer state in format {payload.get('format')!r}, which this "
                f"version does not read (it reads {FORMAT!r}); upgrade improved_diffusion"
            )
        _check_state_container(payload.get("state"), source)
        saved_opt = payload.get("optimizer")
        saved_opt = saved_opt if isinstance(saved_opt, str) else None
        groups = payload.get("param_groups")
        saved_family = _CLASS_FAMILY.get(saved_opt) or family_of_state(
            payload["state"].values(), groups if isinstance(groups, list) else [])
        _check_family(saved_family, family, target_name, source, saved_opt)
        _check_named(payload, source, needed)
        return payload, "named"
    if isinstance(payload, dict) and "state" in payload and "param_groups" in payload:
        _check_state_container(payload["state"], source)
        groups = payload["param_groups"]
        saved_family = family_of_state(payload["state"].values(),
                                        groups if isinstance(groups, list) else [])
        _check_family(saved_family, family, target_name, source)
        _check_raw(payload, source, needed)
        return payload, "raw"
    raise OptimizerStateError(f"{source} holds {_describe_non_optimizer(payload)}")


def _make_plan(payload, named, source, optimizer=None) -> _Plan:
    """Check the payload against the model's parameters; raise OptimizerStateError if unusable."""
    payload, kind = _checked(payload, source, optimizer)
    if kind == "named":
        state_by_name, shape_by_name, hyper_by_name, _ = _plan_named(payload, source)
        layout = LAYOUT_PHRASES[LAYOUT_NAMED]
    else:
        state_by_name, shape_by_name, hyper_by_name, layout = _plan_raw(payload, named, source)

    model_shapes = {n: tuple(p.shape) for n, p in named}
    report = LoadReport(source=source, layout=layout)
    usable = {}
    for name, shape in model_shapes.items():
        if name not in shape_by_name:
            report.fresh_names.append(name)
            continue
        saved_shape = shape_by_name[name]
        if saved_shape is not None and tuple(saved_shape) != shape:
            report.reshaped_names.append(name)
            report.fresh_names.append(name)
            continue
        entry = state_by_name.get(name)
        if entry is not None:
            bad = [
                k for k, v in entry.items()
                if k != "step" and isinstance(v, th.Tensor) and v.dim() > 0
                and tuple(v.shape) != shape
            ]
            if bad:
                report.reshaped_names.append(name)
                report.fresh_names.append(name)
                continue
            usable[name] = entry
        report.matched += 1
    report.dropped_names = [n for n in shape_by_name if n not in model_shapes]
    report.fresh = len(report.fresh_names)
    report.reshaped = len(report.reshaped_names)
    report.dropped = len(report.dropped_names)
    if report.matched == 0 and shape_by_name:
        example = next(iter(shape_by_name))
        raise OptimizerStateError(
            f"{source} holds optimizer state for none of this model's parameters "
            f"({len(shape_by_name)} saved, e.g. {example!r}); is it from another model?"
        )
    default_hyper = next(iter(hyper_by_name.values()), {}) if hyper_by_name else {}
    group_index = _group_index(hyper_by_name)
    return _Plan(report, usable, hyper_by_name, default_hyper, group_index)


def _group_index(hyper_by_name):
    """{name: index of its saved param group}: the groups are the distinct hyperparameter dicts
    (one per saved group), numbered in order of first appearance, as the file lists them."""
    index_of, out = {}, {}
    for name, hyper in hyper_by_name.items():
        out[name] = index_of.setdefault(id(hyper), len(index_of))
    return out


def _check_family(saved_family, target_family, target_name, source, saved_name=None):
    if saved_family is None or target_family is None:
        return
    if saved_family != target_family:
        what = saved_name if saved_name and saved_name in _CLASS_FAMILY else saved_family
        keys = ", ".join(sorted(_FAMILY_STATE_KEYS[saved_family]))
        raise OptimizerStateError(
            f"{source} holds {what} optimizer state ({keys}), but this run uses {target_name}"
        )


def validate_optimizer_payload(payload, named_params=None, optimizer=None) -> Optional[str]:
    """
    Check, without loading, that `payload` is optimizer state usable for these parameters.

    :param payload: named-v1 dict, upstream raw torch optimizer state dict, or anything else.
    :param named_params: list of (name, parameter) in the model's order; None checks the
                         payload's whole structure only (no model at hand, as in `ckpt.py`).
    :param optimizer: the target optimizer (its type is checked); None means AdamW.
    :return: None when usable, else the one-line reason (as OptimizerStateError would say), with
             "FILE" for the file name.
    """
    try:
        if named_params is None:
            _checked(payload, "FILE", optimizer)
        else:
            _make_plan(payload, _as_named_list(named_params), "FILE", optimizer)
    except OptimizerStateError as e:
        return str(e)
    return None


def load_optimizer_state(optimizer, payload, named_params, source="FILE",
                         hyperparams="saved") -> LoadReport:
    """
    Load saved optimizer state into `optimizer`, matching parameters by name.

    Parameters whose name and shape match keep their state, whatever param group they sit in now
    (the report's `regrouped` names those whose group index changed); others start fresh. Nothing
    is changed when the payload is rejected.

    :param hyperparams: "saved": the param groups' hyperparameters (lr, betas, eps,
                        weight_decay) are restored from the payload (a parameter's group takes
                        those of its first parameter's saved group); "current": they stay as the
                        optimizer was built (the trainer's choice: they come from the run's flags,
                        and groups may differ from the file's).

    :param optimizer: a torch optimizer over (a subset of) the parameters in `named_params`.
    :param payload: named-v1 state, upstream's index-keyed torch state dict (indices in
                    `named_params` order), or upstream's flattened fp16 layouts; a whole tagged opt
                    file or a combined {"opt": ...} dict is unwrapped.
    :param named_params: list of (name, parameter), e.g. `list(model.named_parameters())`.
    :param source: the file name used in messages.
    :return: a LoadReport.
    :raises OptimizerStateError: the payload is not optimizer state for this optimizer.
    """
    if hyperparams not in ("saved", "current"):
        raise ValueError(f"hyperparams must be 'saved' or 'current', not {hyperparams!r}")
    named = _as_named_list(named_params)
    plan = _make_plan(payload, named, source, optimizer)
    id_to_name = {id(p): n for n, p in named}
    current = optimizer.state_dict()
    new_groups = []
    new_state = {}
    for gi, (group, saved_group) in enumerate(zip(optimizer.param_groups,
                                                  current["param_groups"])):
        names = []
        for p, index in zip(group["params"], saved_group["params"]):
            name = id_to_name.get(id(p))
            if name is None:
                raise ValueError(
                    "load_optimizer_state: the optimizer holds a parameter that is not in "
                    "named_params"
                )
            names.append(name)
            was = plan.group_by_name.get(name)
            if was is not None and was != gi and name not in plan.report.reshaped_names:
                plan.report.regrouped[name] = (was, gi)
            entry = plan.state_by_name.get(name)
            if entry is not None:
                new_state[index] = {
                    k: (v.detach().clone() if isinstance(v, th.Tensor) else v)
                    for k, v in entry.items()
                }
        hyper = None
        for name in names:
            if name in plan.hyper_by_name:
                hyper = plan.hyper_by_name[name]
                break
        if hyper is None:
            hyper = plan.default_hyper
        g = dict(saved_group)
        for k in HYPERPARAM_KEYS if hyperparams == "saved" else ():
            if k in hyper and k in g:
                v = hyper[k]
                g[k] = tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v
        new_groups.append(g)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
    return plan.report


def _group_names_by_hyper(names, hyper_by_name, default_hyper):
    """Consecutive param groups [(hyper, [names])] in first-appearance order."""
    groups = []
    index_of = {}
    for name in names:
        hyper = hyper_by_name.get(name, default_hyper)
        key = id(hyper)
        if key not in index_of:
            index_of[key] = len(groups)
            groups.append((hyper, []))
        groups[index_of[key]][1].append(name)
    return groups


def convert_to_named(payload, named_shapes, source="FILE", optimizer_name="AdamW") -> dict:
    """
    Convert any accepted optimizer payload (named-v1, upstream index-keyed, flattened fp16) to
    named-v1 for the parameters `named_shapes`, without building a model or an optimizer.

    :param named_shapes: list of (name, shape) in the model's parameter order.
    :return: a named-v1 dict (tensors shared with `payload` where no reshaping was needed).
    :raises OptimizerStateError: as load_optimizer_state.
    """
    return convert_with_report(payload, named_shapes, source, optimizer_name)[0]


def convert_with_report(payload, named_shapes, source="FILE",
                        optimizer_name="AdamW") -> Tuple[dict, LoadReport]:
    """`convert_to_named`, and the LoadReport of what was kept: parameters of `named_shapes`
    whose saved name and shape match keep their state, the others have none (fresh), saved ones
    not in `named_shapes` are dropped (as a model change does; `ckpt.py adapt`)."""
    named = [(n, th.empty(tuple(s), device="meta")) for n, s in named_shapes]
    plan = _make_plan(payload, _as_named_list(named), source, None)
    names = [n for n, _ in named]
    groups = []
    for hyper, group_names in _group_names_by_hyper(names, plan.hyper_by_name,
                                                    plan.default_hyper):
        g = dict(hyper)
        g["params"] = group_names
        groups.append(g)
    unwrapped = _unwrap(payload, source)
    if isinstance(unwrapped, dict) and unwrapped.get("format") == FORMAT:
        optimizer_name = unwrapped.get("optimizer", optimizer_name)
    return {
        "format": FORMAT,
        "optimizer": optimizer_name,
        "param_groups": groups,
        "state": {n: plan.state_by_name[n] for n in names if n in plan.state_by_name},
        "shapes": {n: list(s) for n, s in named_shapes},
    }, plan.report


def named_to_raw(payload, source="FILE") -> dict:
    """
    A named-v1 payload as a plain torch optimizer state dict (index-keyed) that
    `optimizer.load_state_dict` of an optimizer built over `model.parameters()` accepts: indices
    run over the param groups in order, as torch numbers them (upstream builds one group over
    `model.parameters()`, which our single-group payloads match).

    :raises OptimizerStateError: the payload is not named-v1 optimizer state.
    """
    payload = _unwrap(payload, source)
    if isinstance(payload, dict) and "state" in payload and "param_groups" in payload \
            and "format" not in payload:
        raise OptimizerStateError(
            f"{source} already holds an index-keyed torch optimizer state dict"
        )
    if isinstance(payload, dict) and "format" in payload and payload["format"] != FORMAT:
        raise OptimizerStateError(
            f"{source} holds optimizer state in format {payload['format']!r}, which this "
            f"version does not read (it reads {FORMAT!r}); upgrade improved_diffusion"
        )
    if not isinstance(payload, dict) or "format" not in payload:
        raise OptimizerStateError(f"{source} holds {_describe_non_optimizer(payload)}")
    _checked(payload, source, None)
    state = payload["state"]
    groups = []
    raw_state = {}
    index = 0
    for g in payload["param_groups"]:
        indices = []
        for name in g["params"]:
            if name in state:
                raw_state[index] = state[name]
            indices.append(index)
            index += 1
        raw_group = {k: v for k, v in g.items() if k != "params"}
        raw_group["params"] = indices
        groups.append(raw_group)
    return {"state": raw_state, "param_groups": groups}
