"""
Does a state dict fit a model, and if not, which flag most likely explains it.

One answer, as data, for every caller: the training loop (resume), sampling (`--model_path`) and
the checkpoint doctor (`ckpt.py diff` / `convert --flags`), each of which wraps it in its own
error. Compares names and shapes only, so it needs no model object:

    fit = fit_state_dict(shapes_of(model.state_dict()), shapes_of(sd), file_flags, flags)
    if not fit.ok:
        raise MyError(f"{path} does not fit the model: {fit.summary()}")
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch as th

from ..script_util import same_flag_value

# The model flags that change a parameter's name or shape (tests/test_state_fit.py checks this
# against the model builder). The others (dropout, diffusion steps, noise schedule, number of
# heads, ...) change numerics only, so they are never named for a missing or reshaped key.
SHAPE_FLAGS = (
    "image_size", "num_channels", "num_res_blocks", "attention_resolutions", "channel_mult",
    "learn_sigma", "class_cond", "num_classes", "use_scale_shift_norm", "resblock_updown",
    "arch", "in_channels", "dit_depth", "dit_hidden_size",
    "class_dropout_prob",
)


@dataclass
class Fit:
    """
    How a state dict's keys and shapes compare with a model's.

    missing:      model keys the state dict lacks.
    unexpected:   state dict keys the model lacks.
    reshaped:     {key: (state dict shape, model shape)} for keys in both with different shapes.
    likely_flags: "--flag (file: X, model: Y)" hints, most likely first (empty when it fits or
                  nothing stands out).
    """

    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    reshaped: Dict[str, Tuple[tuple, tuple]] = field(default_factory=dict)
    likely_flags: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.reshaped)

    def summary(self, other="model") -> str:
        """One line: "2 missing (a, b), 1 reshaped (out.2.weight: [6, 32] in the file, ...)"."""
        parts = []
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            if keys:
                parts.append(f"{len(keys)} {label} ({_first(keys)})")
        if self.reshaped:
            k, (have, want) = next(iter(self.reshaped.items()))
            more = f", +{len(self.reshaped) - 1} more" if len(self.reshaped) > 1 else ""
            parts.append(f"{len(self.reshaped)} reshaped ({k}: {list(have)} in the file, "
                         f"{list(want)} in the {other}{more})")
        return ", ".join(parts) or "all keys and shapes match"


def _first(keys, n=3):
    more = f", +{len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def tied_parameter_names(module) -> Dict[str, str]:
    """
    {state-dict name: name in ``module.named_parameters()``} for each second (third, ...) name
    of a parameter that several layers share: after ``self.b.weight = self.a.weight`` the state
    dict holds the one tensor as ``a.weight`` and ``b.weight``, named_parameters() only as
    ``a.weight``, so this gives ``{"b.weight": "a.weight"}``. A state dict made from a list of
    parameters (an EMA) must put the same tensor under every name of each (else
    ``load_state_dict`` puts the later name's tensor into the shared parameter). Empty for a
    model without shared parameters.
    """
    first, tied = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def shapes_of(state_dict) -> Dict[str, Optional[tuple]]:
    """{key: shape tuple} of a state dict (None for a value that is not a tensor)."""
    return {k: tuple(v.shape) if isinstance(v, th.Tensor) else None
            for k, v in state_dict.items()}


def fit_state_dict(model_shapes, sd_shapes, file_flags=None, given_flags=None,
                   other="model") -> Fit:
    """
    Compare a state dict with a model by key names and shapes.

    :param model_shapes: {key: shape} the model expects (e.g. `shapes_of(model.state_dict())`;
                         pass only the parameters to ignore buffers).
    :param sd_shapes: {key: shape} of the state dict (a file's weights).
    :param file_flags: the model flags stored in the file, if any.
    :param given_flags: the model flags the model was built from, if known.
    :param other: what the model side is called in hints ("model", or "other" for a file).
    :return: a Fit; `likely_flags` names differing flags that can change shapes when both flag
             sets are known, else reads upstream's UNet key layout.
    """
    model_shapes = {k: _shape(v) for k, v in model_shapes.items()}
    sd_shapes = {k: _shape(v) for k, v in sd_shapes.items()}
    fit = Fit(
        missing=[k for k in model_shapes if k not in sd_shapes],
        unexpected=[k for k in sd_shapes if k not in model_shapes],
        reshaped={k: (sd_shapes[k], model_shapes[k]) for k in sd_shapes
                  if k in model_shapes and sd_shapes[k] != model_shapes[k]},
    )
    if not fit.ok:
        fit.likely_flags = (_flag_differences(file_flags, given_flags, other)
                            or _layout_hints(sd_shapes, model_shapes, other))
    return fit


def _shape(v):
    return None if v is None else tuple(int(s) for s in v)


def _flag_differences(file_flags, given_flags, other):
    diffs = differing_flags(file_flags, given_flags) or {}
    return [f"--{k} (file: {a}, {other}: {b})" for k, (a, b) in diffs.items()
            if k in SHAPE_FLAGS]


def differing_flags(file_flags, run_flags) -> Optional[Dict[str, Tuple[Any, Any]]]:
    """{flag: (file value, run value)} for the run's model flags whose value the file stores
    differently (SHAPE_FLAGS first); None when the file stores no flags."""
    if not file_flags:
        return None
    run_flags = run_flags or {}
    keys = [k for k in SHAPE_FLAGS if k in run_flags]
    keys += [k for k in run_flags if k not in SHAPE_FLAGS]
    return {k: (file_flags[k], run_flags[k]) for k in keys
            if k in file_flags and not same_flag_value(file_flags[k], run_flags[k], k)}


def _layout_hints(have, want, other):
    """Hints read from upstream's UNet key layout or DiT's (file: `have`, model: `want`)."""
    is_dit_f, is_dit_w = "pos_embed" in have, "pos_embed" in want
    if is_dit_f != is_dit_w:
        arch = {True: "a DiT", False: "the UNet"}
        return [f"--arch (file: {arch[is_dit_f]}, {other}: {arch[is_dit_w]})"]
    if is_dit_f:
        return _dit_hints(have, want, other)
    hints = []
    out_f, out_w = have.get("out.2.weight"), want.get("out.2.weight")
    if out_f and out_w and out_f[0] != out_w[0]:
        hints.append(f"--learn_sigma (file has {out_f[0]} output channels, {other} {out_w[0]})")
    lab_f, lab_w = "label_emb.weight" in have, "label_emb.weight" in want
    if lab_f != lab_w:
        hints.append(f"--class_cond (file: {lab_f}, {other}: {lab_w})")
    elif lab_f and have["label_emb.weight"] and want["label_emb.weight"] and \
            have["label_emb.weight"][0] != want["label_emb.weight"][0]:
        rows_f, rows_w = have["label_emb.weight"][0], want["label_emb.weight"][0]
        hints.append(f"--num_classes (file: {rows_f}, {other}: {rows_w})"
                     + (" or --class_dropout_prob (its null label is one more row)"
                        if abs(rows_f - rows_w) == 1 else ""))
    te_f, te_w = have.get("time_embed.0.weight"), want.get("time_embed.0.weight")
    if te_f and te_w and te_f[1] != te_w[1]:
        hints.append(f"--num_channels (file: {te_f[1]}, {other}: {te_w[1]})")
    if _n_blocks(have) != _n_blocks(want):
        # Block indices shift: the attention and FiLM keys below would differ anyway.
        return hints + ["--num_res_blocks / --channel_mult / --image_size (block layout differs)"]
    diff = set(have) ^ set(want)
    if any(".qkv." in k or ".proj_out." in k for k in diff):
        hints.append("--attention_resolutions (attention blocks differ)")
    for k in have if te_f == te_w else ():
        if k.endswith("emb_layers.1.weight") and k in want and have[k] and want[k]:
            a, b = have[k][0], want[k][0]
            if a != b and (a == 2 * b or b == 2 * a):
                hints.append(f"--use_scale_shift_norm (file: {a == 2 * b}, {other}: {b == 2 * a})")
                break
    reshaped = [k for k in have if k in want and have[k] != want[k]]
    if not hints and any(k.startswith(("input_blocks.", "output_blocks."))
                         for k in diff.union(reshaped)):
        hints.append("--channel_mult / --resblock_updown (block shapes differ)")
    return hints


def _n_blocks(shapes):
    """(number of input blocks, number of output blocks) of an upstream UNet state dict."""
    def count(prefix):
        idx = [int(k.split(".")[1]) for k in shapes
               if k.startswith(prefix) and k.split(".")[1].isdigit()]
        return max(idx) + 1 if idx else 0
    return count("input_blocks."), count("output_blocks.")


def _dit_hints(have, want, other):
    """Hints read from DiT's key layout (file: `have`, model: `want`)."""
    hints = []
    pf, pw = have.get("x_embedder.proj.weight"), want.get("x_embedder.proj.weight")  # [D, C, p, p]
    if pf and pw and pf[1] != pw[1]:
        hints.append(f"--in_channels (file: {pf[1]}, {other}: {pw[1]})")
    if pf and pw and pf[2:] != pw[2:]:
        hints.append(f"--arch (file: patch size {pf[2]}, {other}: {pw[2]})")
    if pf and pw and pf[0] != pw[0]:
        hints.append(f"--arch / --dit_hidden_size (file: width {pf[0]}, {other}: {pw[0]})")
    lf, lw = have.get("final_layer.linear.weight"), want.get("final_layer.linear.weight")
    if pf and pw and lf and lw and pf[1:] == pw[1:] and lf[0] != lw[0]:
        hints.append(f"--learn_sigma (file has {lf[0] // (pf[2] * pf[3])} output channels, "
                     f"{other} {lw[0] // (pw[2] * pw[3])})")
    tf, tw = have.get("y_embedder.embedding_table.weight"), \
        want.get("y_embedder.embedding_table.weight")
    if tf and tw and tf[0] != tw[0]:
        hints.append(f"--class_cond / --num_classes / --class_dropout_prob (file: {tf[0]} label "
                     f"rows, {other}: {tw[0]}; the null label adds one)")
    ef, ew = have.get("pos_embed"), want.get("pos_embed")  # [1, T, D]
    if ef and ew and ef[1] != ew[1] and (not pf or pf[2:] == pw[2:]):
        hints.append(f"--image_size (file: {ef[1]} patches, {other}: {ew[1]})")
    depth_f = len({k.split(".")[1] for k in have if k.startswith("blocks.")})
    depth_w = len({k.split(".")[1] for k in want if k.startswith("blocks.")})
    if depth_f != depth_w:
        hints.append(f"--arch / --dit_depth (file: {depth_f} blocks, {other}: {depth_w})")
    return hints
