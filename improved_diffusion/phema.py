"""
Post-hoc EMA (EDM2: Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", NVlabs/edm2 training/phema.py and reconstruct_phema.py): while training, track
a few power-function EMAs and save snapshots of them; after the run, reconstruct the EMA of any
length from the snapshots by least squares, without retraining.

Profiles. At training time ``t`` (images seen), a power-function EMA of exponent ``exp`` is the
average of the weights seen at times ``tau <= t`` under the density
``p(tau) = (exp + 1) / t * (tau / t) ** exp``. Its width relative to ``t`` is ``std`` (EDM2's
sigma_rel; ``exp_to_std`` / ``std_to_exp`` convert): the profile scales with the run's length,
so a std means the same at every time. stds lie in (0, MAX_STD); EDM2 trains with 0.050 and 0.100.

The math is EDM2's, under EDM2's names and signatures: float64 NumPy in and out, arguments
broadcast against each other (``std_to_exp``, ``exp_to_std``, ``power_function_response``,
``power_function_correlation``, ``power_function_beta``, ``solve_posthoc_coefficients``), plus
``profile_error`` (how well the coefficients represent each target); that part knows nothing of
files.

What a training loop and its checkpointer call (nothing else)::

    tracker = PowerFunctionEMA(model.named_parameters(), stds=[0.05, 0.10])  # copies them
    #     (the bare module's parameters: names without DDP's module. prefix)
    ...optimizer step...
    tracker.update(model.parameters(), images_seen_total, batch_images)      # every step
    files = tracker.snapshot_payloads(step, flags, model.state_dict())
    #     -> {"phema_0.050_012000.pt": payload, "phema_0.100_012000.pt": payload}: save them with
    #        the step's other files (run_dir.write_step); they are kept when old steps are pruned
    state = tracker.state_dict()           # {"format", "stds", "names", "nimg", "emas"}
    tracker.load_state_dict(state)         # bitwise; elastic (beta follows images, not ranks)
    tracker.load_state_dict(state_from_snapshots(payloads))  # the same, from one step's snapshots

``images_seen_total`` counts images over all ranks after this step (the global data position) and
``batch_images`` this step's global batch; EDM2's beta is
``power_function_beta(std, images_seen_total, batch_images)``.

train.py's loop (``--phema_stds``) holds a ``RunTracker``: the tracker as one of the
checkpointer's states (its state in every save's trainer state; its snapshots added to the
saves that are due; its tensors checked for NaN/Inf before each save).

Reconstruction (``ckpt.py phema RUN_DIR --std 0.07 --out FILE``)::

    plan = plan_reconstruction(run_dir, [0.07], step=None)    # reads tags only, solves
    for std, payload in reconstruct(plan):                     # streams over the snapshots
        file_writer.atomic_write(out_path, payload)            # an ordinary tagged EMA file

``reconstruct`` holds one snapshot and ``batch`` accumulators at a time (about two models with
``batch=1``) and reads the snapshots once per batch of stds.
"""

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch as th

from .infra import fsdp
from .ckpt import checkpoint, run_dir as run_dir_mod, state_fit
from .infra.errors import UsageError, UserError

# stds must be below this (EDM2's reconstruct_phema.parse_std_list): exp_to_std is at most
# sqrt(1/12) = 0.2887 for exp >= 0.
MAX_STD = 0.289
# A reconstruction whose profile misses the target's by more than this (relative L2 error, see
# profile_error) is refused: the snapshots cannot represent that std.
MAX_PROFILE_ERROR = 0.25
STATE_FORMAT = "phema-v1"


class PhemaError(UserError):
    """A post-hoc EMA problem the user can fix (no snapshots, a --step or --std the snapshots
    cannot serve, a snapshot that contradicts the others); one line naming the flag or file."""


# ---------------------------------------------------------------------------------------------
# EDM2's math (float64 NumPy; equation numbers are the paper's)


def exp_to_std(exp):
    """Relative standard deviation of the power-function profile of exponent ``exp`` (Eq. 123):
    ``sqrt((exp + 1) / ((exp + 2)^2 (exp + 3)))``. ``exp``: array-like [...] -> float64 [...]."""
    exp = np.float64(exp)
    return np.sqrt((exp + 1) / (exp + 2) ** 2 / (exp + 3))


def std_to_exp(std):
    """The exponent whose profile has relative std ``std`` (Eq. 126, Algorithm 2): the largest
    real root of ``exp^3 + 7 exp^2 + (16 - s) exp + (12 - s)``, ``s = std^-2``.
    ``std``: array-like [...] in (0, MAX_STD) -> float64 [...]."""
    std = np.float64(std)
    inv_var = std.reshape(-1) ** -2
    roots = [np.roots([1.0, 7.0, 16.0 - s, 12.0 - s]).real.max() for s in inv_var]
    return np.float64(roots).reshape(std.shape)


def power_function_response(ofs, std, len, axis=0):  # noqa: A002 (EDM2's signature)
    """Discrete response of the profiles ``(ofs, std)`` (broadcast together, shape [...]) over the
    integer times ``0 .. len - 1`` (Eqs. 121, 108), each normalised to sum 1: float64 with a new
    axis ``axis`` of size ``len`` inserted (``[len, ...]`` for axis 0)."""
    ofs, std = np.broadcast_arrays(np.float64(ofs), np.float64(std))
    ofs = np.expand_dims(ofs, axis)
    exp = np.expand_dims(std_to_exp(std), axis)
    shape = [1] * exp.ndim
    shape[axis] = -1
    t = np.arange(len, dtype=np.float64).reshape(shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        resp = np.where(t <= ofs, (t / ofs) ** exp, 0.0) / ofs * (exp + 1)
    return resp / np.sum(resp, axis=axis, keepdims=True)


def power_function_correlation(a_ofs, a_std, b_ofs, b_std):
    """Inner products of pairs of profiles (Eq. 151, Algorithm 3): for profile a (ending at
    ``a_ofs``, width ``a_std``) and b, ``integral p_a(t) p_b(t) dt``
    = ``(a+1)(b+1) / ((a+b+1) max(a_ofs, b_ofs)) * r``, with ``r = (a_ofs/b_ofs)^b`` when
    ``a_ofs < b_ofs``, else ``(a_ofs/b_ofs)^-a`` (a, b: the exponents). Arguments broadcast
    together (shape [...]) -> float64 [...]."""
    a_exp = std_to_exp(a_std)
    b_exp = std_to_exp(b_std)
    a_ofs = np.float64(a_ofs)
    b_ofs = np.float64(b_ofs)
    ratio = a_ofs / b_ofs
    ratio_exp = np.where(a_ofs < b_ofs, b_exp, -a_exp)
    num = (a_exp + 1) * (b_exp + 1) * ratio ** ratio_exp
    den = (a_exp + b_exp + 1) * np.maximum(a_ofs, b_ofs)
    return num / den


def power_function_beta(std, t_next, t_delta):
    """The EMA decay of one training step that keeps a power-function profile of width ``std``
    (Eq. 127): ``(1 - t_delta / t_next) ** (exp + 1)``. ``t_next``: images seen after the step;
    ``t_delta``: images of the step. Broadcast -> float64 [...]; 0 at the first step."""
    return (1 - np.float64(t_delta) / np.float64(t_next)) ** (std_to_exp(std) + 1)


def _gram(in_ofs, in_std, out_ofs, out_std):
    """(A [in, in], B [in, out], C [out]): the correlations of the inputs with each other, of
    the inputs with the targets, and of each target with itself."""
    in_ofs, in_std = np.broadcast_arrays(np.float64(in_ofs), np.float64(in_std))
    out_ofs, out_std = np.broadcast_arrays(np.float64(out_ofs), np.float64(out_std))
    col = lambda x: x.reshape(-1, 1)  # noqa: E731
    row = lambda x: x.reshape(1, -1)  # noqa: E731
    a = power_function_correlation(col(in_ofs), col(in_std), row(in_ofs), row(in_std))
    b = power_function_correlation(col(in_ofs), col(in_std), row(out_ofs), row(out_std))
    c = power_function_correlation(out_ofs.reshape(-1), out_std.reshape(-1),
                                   out_ofs.reshape(-1), out_std.reshape(-1))
    return a, b, c


def solve_posthoc_coefficients(in_ofs, in_std, out_ofs, out_std):
    """
    The least-squares coefficients that combine the input profiles ``(in_ofs, in_std)`` (the
    snapshots: images seen and std, broadcast to [in]) into the target profiles ``(out_ofs,
    out_std)`` (broadcast to [out]) (Algorithm 3): solve ``A X = B`` with the correlations
    ``A = <in_i, in_k>`` and ``B = <in_i, out_j>``, then scale each column to sum 1 (so the
    weights are an average). Returns float64 [in, out]: output j = sum_i X[i, j] * snapshot i.
    """
    a, b, _ = _gram(in_ofs, in_std, out_ofs, out_std)
    x = np.linalg.solve(a, b)
    return x / np.sum(x, axis=0)


def profile_error(in_ofs, in_std, out_ofs, out_std, coefs):
    """
    How far each reconstructed profile ``sum_i coefs[i, j] p_i`` is from its target ``p_j``: the
    relative L2 error ``||sum_i X_ij p_i - p_j|| / ||p_j||``, from the same correlations
    (``sqrt((x'Ax - 2 x'b + c) / c)``). ``coefs``: [in, out] -> float64 [out]; about 0.01 for a
    target between the snapshots' stds, growing as the target leaves their range.
    """
    a, b, c = _gram(in_ofs, in_std, out_ofs, out_std)
    x = np.float64(coefs)
    sq = np.einsum("io,ik,ko->o", x, a, x) - 2 * np.einsum("io,io->o", x, b) + c
    return np.sqrt(np.maximum(sq, 0.0) / c)


def parse_stds(values, flag):
    """``["0.05,0.1", "0.07"]`` (each a comma list) -> sorted unique floats, each in
    (0, MAX_STD) and distinct at 3 decimals (the file names'); UsageError naming ``flag``."""
    out = []
    for text in values:
        for part in str(text).split(","):
            if not part.strip():
                continue
            try:
                std = float(part)
            except ValueError:
                raise UsageError(f"{flag} {text}: {part.strip()!r} is not a number (give "
                                 f"relative widths such as 0.05,0.1)") from None
            if not 0 < std < MAX_STD:  # also NaN and inf
                raise UsageError(f"{flag} {part.strip()}: a relative width must lie strictly "
                                 f"between 0 and {MAX_STD} (EDM2 uses 0.05 and 0.1)")
            out.append(std)
    if not out:
        raise UsageError(f"{flag}: give at least one relative width, e.g. {flag} 0.05,0.1")
    out = sorted(set(out))
    names = [std_str(s) for s in out]
    for a, b in zip(names, names[1:]):
        if a == b:
            raise UsageError(f"{flag}: two widths are both {a} at 3 decimals (the snapshot "
                             f"file names'); give widths that differ by at least 0.001")
    return out


def std_str(std):
    """The std as file names write it: ``0.05`` -> ``"0.050"``."""
    return f"{float(std):.3f}"


# ---------------------------------------------------------------------------------------------
# tracking during training


class PhemaStateError(UserError):
    """Saved post-hoc EMA state that does not fit this run's tracker (other stds, other
    parameters); one line saying which and what to do."""


class PowerFunctionEMA:
    """
    One power-function EMA per std over a list of named parameters (EDM2's PowerFunctionEMA,
    over tensors instead of module copies). Each EMA starts as a copy of the parameters (on their
    device, in their dtype); ``update`` moves it towards the current parameters with EDM2's
    per-step beta, computed from the images seen, so a resume on any number of ranks continues
    the same profile. Not collective: every rank updates its own copy identically (the
    parameters are the same on every rank after the optimizer step). Sharded parameters
    (DTensors, --fsdp True): each EMA is sharded alike, and a rank updates its own slices.

    :param named_params: iterable of (name, tensor), e.g. ``model.named_parameters()``.
    :param stds: relative widths, e.g. ``[0.05, 0.1]`` (parse_stds validates a flag's text).
    """

    def __init__(self, named_params, stds):
        named = [(name, p.detach()) for name, p in named_params]
        self.names = [name for name, _ in named]
        self.stds = [float(s) for s in stds]
        if not self.stds or any(not 0 < s < MAX_STD for s in self.stds):
            raise ValueError(f"stds must be in (0, {MAX_STD}), got {self.stds}")
        if len({std_str(s) for s in self.stds}) != len(self.stds):
            raise ValueError(f"stds must differ at 3 decimals, got {self.stds}")
        self.emas = [[p.clone() for _, p in named] for _ in self.stds]
        self.nimg = 0

    @th.no_grad()
    def update(self, params, images_seen_total, batch_images):
        """
        After an optimizer step: ``ema <- lerp(ema, param, 1 - beta)`` for every std (EDM2's
        update), ``beta = power_function_beta(std, images_seen_total, batch_images)``.

        :param params: the current parameters, in ``named_params`` order (tensors or Parameters).
        :param images_seen_total: images seen over all ranks after this step (> the last call's).
        :param batch_images: images of this step over all ranks (0 < batch <= total).
        """
        params = [p.detach() for p in params]
        if len(params) != len(self.names):
            raise ValueError(f"update got {len(params)} parameters, the tracker has "
                             f"{len(self.names)}")
        t_next, t_delta = int(images_seen_total), int(batch_images)
        if not 0 < t_delta <= t_next or t_next <= self.nimg:
            raise ValueError(f"update(images_seen_total={t_next}, batch_images={t_delta}) after "
                             f"{self.nimg} images: need 0 < batch <= total and a growing total")
        params = [fsdp.local(p) for p in params]  # --fsdp: this rank's slices
        for std, ema in zip(self.stds, self.emas):
            beta = float(power_function_beta(std, t_next, t_delta))
            th._foreach_lerp_([fsdp.local(e) for e in ema], params, 1.0 - beta)
        self.nimg = t_next

    def snapshot_payloads(self, step, flags, model_state, tied=None):
        """
        {file name: payload} of this step's snapshots, one per std (``phema_0.050_012000.pt``):
        tagged ``kind: "phema"`` files (checkpoint.phema_payload) holding ``model_state`` with
        each EMA in place of the parameters (buffers, e.g. BatchNorm statistics, as they are now,
        as EDM2's snapshots take them), the std, the images seen and ``flags``. The payloads hold
        the tracker's own tensors: copy them to the host (as a save does) before the next update.

        :param model_state: the bare module's state dict (no ``module.`` prefixes).
        :param tied: {second state-dict name of a shared parameter: its tracked name}
            (state_fit.tied_parameter_names): those names hold the same EMA.
        """
        missing = [n for n in self.names if n not in model_state]
        if missing:
            raise ValueError(f"model_state lacks tracked parameters: {missing[:3]}")
        out = OrderedDict()
        for std, ema in zip(self.stds, self.emas):
            sd = OrderedDict(model_state)
            for name, t in zip(self.names, ema):
                sd[name] = t
            for alias, name in (tied or {}).items():
                sd[alias] = sd[name]
            out[checkpoint.phema_filename(std, step)] = checkpoint.phema_payload(
                step, std, self.nimg, sd, flags, self.names, tied)
        return out

    def state_dict(self):
        """The state a resume needs (weights_only-loadable; the tracker's own tensors): {"format":
        "phema-v1", "stds": [float], "names": [str], "nimg": int, "emas": [[tensor] per std]}."""
        return {"format": STATE_FORMAT, "stds": list(self.stds), "names": list(self.names),
                "nimg": int(self.nimg), "emas": [list(ema) for ema in self.emas]}

    @th.no_grad()
    def load_state_dict(self, state):
        """Take ``state`` (from ``state_dict`` or ``state_from_snapshots``) bit for bit, into the
        tracker's tensors (their device and dtype; a whole tensor into a sharded one: this
        rank's slice, fsdp.localize). The stds and the parameter names and shapes must be this
        tracker's (PhemaStateError otherwise; nothing is changed then)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise PhemaStateError(f"post-hoc EMA state of an unknown format "
                                  f"{state.get('format') if isinstance(state, dict) else state!r}")
        theirs = [std_str(s) for s in state["stds"]]
        mine = [std_str(s) for s in self.stds]
        if sorted(theirs) != sorted(mine):
            raise PhemaStateError(
                f"the saved post-hoc EMA tracks stds {','.join(theirs)} but this run asks for "
                f"{','.join(mine)}; resume with --phema_stds {','.join(theirs)} (an EMA cannot "
                f"start mid-run: its profile begins at image 0)")
        if list(state["names"]) != self.names:
            gone = [n for n in self.names if n not in state["names"]]
            new = [n for n in state["names"] if n not in self.names]
            raise PhemaStateError(
                f"the saved post-hoc EMA is over other parameters ({len(gone)} missing, e.g. "
                f"{gone[:2]}; {len(new)} unexpected, e.g. {new[:2]}); resume without a model "
                f"change, or drop --phema_stds")
        by_std = dict(zip(theirs, state["emas"]))
        for name_std, ema in zip(mine, self.emas):
            saved = by_std[name_std]
            for name, t, s in zip(self.names, ema, saved):
                if tuple(s.shape) != tuple(t.shape):
                    raise PhemaStateError(f"the saved post-hoc EMA {name_std} has {name} of shape "
                                          f"{list(s.shape)}, the model {list(t.shape)}")
        for name_std, ema in zip(mine, self.emas):
            for t, s in zip(ema, by_std[name_std]):
                t.copy_(s if fsdp.is_dtensor(s) else fsdp.localize(s, like=t))
        self.nimg = int(state["nimg"])


def state_from_snapshots(payloads):
    """
    A ``PowerFunctionEMA.state_dict()`` made from the snapshots of one step (their payloads as
    written or as loaded, one per std): a checkpointer that writes a snapshot of every std at a
    step needs to store nothing else for that step. Raises PhemaStateError when they are not
    the snapshots of one step and one set of parameters.
    """
    payloads = list(payloads)
    if not payloads:
        raise PhemaStateError("no post-hoc EMA snapshots to resume from")
    first = payloads[0]
    for p in payloads:
        if p.get("kind") != "phema":
            raise PhemaStateError(f"not a post-hoc EMA snapshot (kind {p.get('kind')!r})")
        if (p["step"], p["nimg"], list(p["param_names"])) != (
                first["step"], first["nimg"], list(first["param_names"])):
            raise PhemaStateError("the snapshots are not of one step and one set of parameters")
    names = list(first["param_names"])
    return {"format": STATE_FORMAT, "stds": [float(p["std"]) for p in payloads], "names": names,
            "nimg": int(first["nimg"]),
            "emas": [[p["state_dict"][n] for n in names] for p in payloads]}


def check_flags(stds, interval, save_interval):
    """--phema_stds / --phema_interval against --save_interval (UsageError naming the flag):
    snapshots are written with a step's save, so the interval is a multiple of save_interval."""
    if interval < 0:
        raise UsageError(f"--phema_interval must be >= 0 (got {interval})")
    if not str(stds).strip():
        if interval:
            raise UsageError(f"--phema_interval {interval}: no post-hoc EMA to snapshot; give "
                             f"--phema_stds (e.g. 0.05,0.1) or drop --phema_interval")
        return
    parse_stds([stds], "--phema_stds")
    if interval and not save_interval:
        raise UsageError(f"--phema_interval {interval}: snapshots are written with a step's "
                         f"save, and --save_interval 0 saves only at the end; give a "
                         f"--save_interval that divides {interval}, or --phema_interval 0")
    if interval % (save_interval or 1):
        raise UsageError(f"--phema_interval {interval}: snapshots are written with a step's "
                         f"save, so it must be a multiple of --save_interval {save_interval} "
                         f"(e.g. {save_interval * max(1, round(interval / save_interval))}), "
                         f"or 0 for every save")


class RunTracker:
    """
    The post-hoc EMA of a training run, as its loop and its checkpointer use it: a
    PowerFunctionEMA over the model's parameters, updated after every optimizer step, whose
    snapshots join the saves of the steps that are due (``due``). It is one of the checkpointer's
    ``states`` (checkpointer.py): ``state_dict``/``load_state_dict`` carry the whole tracker in
    the trainer state of every save, so a resume from any saved step (a preemption, a crash after
    any save) continues it bit for bit, on any number of ranks; ``save_files``,
    ``finite_tensors`` and ``resume_without_state`` are the optional parts of that interface.

    Time is images: each ``update(global_batch)`` adds the step's images over all ranks to the
    tracker's count (``nimg``, restored on resume) and uses EDM2's beta for it, so the profile
    is the same whatever the world size of each segment of the run. Steps that were skipped
    (--nan_policy skip, a float16 overflow) update nothing and count no images, as for the EMA.

    :param model: the bare module (no DDP/compile wrapper); its parameters are tracked and its
        state dict (buffers included) fills the snapshots.
    :param stds: relative widths (parse_stds).
    :param every: snapshots every this many steps (0: none but the last step's).
    :param last_step: the run's last step (its final save has snapshots too); 0: none.
    :param flags: the model's flags, stored in every snapshot.
    """

    def __init__(self, model, stds, every, last_step, flags):
        self.model = model
        self.tracker = PowerFunctionEMA(model.named_parameters(), stds)
        self.tied = state_fit.tied_parameter_names(model)
        self.every, self.last_step = int(every), int(last_step)
        self.flags = flags

    def check_resume(self, resuming):
        """Refuse a resume that changed the model (``resuming``: the checkpointer's Resume):
        snapshots of two models cannot be combined (PhemaStateError)."""
        if resuming.change is not None:
            raise PhemaStateError(
                f"--allow_model_change with --phema_stds: the model changed at step "
                f"{resuming.step}, and post-hoc EMA snapshots of two models cannot be "
                f"combined; resume without --phema_stds (the snapshots so far stay for "
                f"`ckpt.py phema`), or train the new model in a new --log_dir")

    def due(self, step):
        """Whether the save of ``step`` writes snapshots: a multiple of ``every``, or the last
        step (a save at any other step, e.g. a preemption's, holds the state only)."""
        return bool(self.every and step % self.every == 0) or bool(
            self.last_step and step == self.last_step)

    def update(self, global_batch):
        """After an optimizer step of ``global_batch`` images (over all ranks). Not collective:
        every rank updates its own copy, identically."""
        self.tracker.update(self.model.parameters(), self.tracker.nimg + int(global_batch),
                            global_batch)

    def state_dict(self):
        return self.tracker.state_dict()

    def load_state_dict(self, state):
        self.tracker.load_state_dict(state)

    def save_files(self, step):
        """{phema_STD_STEP.pt: payload} when ``step`` is due, else {} (rank 0, at a save)."""
        if not self.due(step):
            return {}
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        return self.tracker.snapshot_payloads(step, self.flags, sd, self.tied)

    def finite_tensors(self):
        """{"post-hoc EMA 0.050": [tensor, ...], ...}: what a save requires finite."""
        return {f"post-hoc EMA {std_str(s)}": ema
                for s, ema in zip(self.tracker.stds, self.tracker.emas)}

    def resume_without_state(self, step):
        """The resumed step holds no tracker state: refuse (PhemaStateError); an EMA cannot
        start in the middle of a run (its profile begins at the run's first image)."""
        stds = ",".join(std_str(s) for s in self.tracker.stds)
        raise PhemaStateError(
            f"--phema_stds {stds}: the checkpoint of step {step} holds no post-hoc EMA state "
            f"(trained without --phema_stds), and a power-function EMA averages over the run "
            f"from its first image; resume without --phema_stds, or give it from a run's first "
            f"step (a new --log_dir)")


# ---------------------------------------------------------------------------------------------
# reconstruction from a run directory's snapshots


@dataclass
class Snapshot:
    """One snapshot file, as its tags say (its tensors are not held)."""

    path: str
    step: int
    std: float
    nimg: int
    flags: Optional[dict]
    param_names: List[str]
    shapes: dict  # {key: tuple} of the whole state dict
    tied: dict  # {second name of a shared parameter: its name in param_names}


@dataclass
class ReconstructionPlan:
    """What ``reconstruct`` does: the inputs (sorted by images seen, then std, as EDM2 sorts
    them), the target step and its images seen, and the float64 coefficients [in, out]."""

    run_dir: str
    step: int
    nimg: int
    stds: List[float]
    inputs: List[Snapshot]
    coefs: np.ndarray
    errors: np.ndarray  # profile_error per target, [out]
    left_out: list = field(default_factory=list)  # [(step, why)]: snapshots not used

    @property
    def warning(self):
        """One line naming the steps whose snapshots were left out, or None."""
        return (f"warning: post-hoc EMA snapshots: {_left_out_line(self.left_out)}"
                if self.left_out else None)

    @property
    def target(self):
        """The snapshot whose flags and buffers the outputs take (the last input)."""
        return self.inputs[-1]


def read_snapshots(run_dir):
    """``(snapshots, left_out)``: the usable snapshots in ``run_dir`` (Snapshot, sorted by step
    then std; run_dir.usable_snapshots: those their step's manifest lists and verifies, and a
    pruned step's), from their tags: the tensors are memory-mapped, not read
    (checkpoint.peek_file); and ``[(step, why)]`` of the steps left out (an interrupted save, a
    corrupt file). PhemaError when there are none, or when a file's name contradicts its
    content."""
    found, left_out = run_dir_mod.usable_snapshots(run_dir)
    if not found and left_out:
        raise PhemaError(f"{run_dir}: no usable post-hoc EMA snapshots: "
                         f"{_left_out_line(left_out)}")
    if not found:
        raise PhemaError(f"{run_dir}: no post-hoc EMA snapshots (phema_STD_STEP.pt files) in "
                         f"this directory; they are written by a run trained with --phema_stds")
    out = []
    for name in found:
        c = checkpoint.peek_file(name.path)
        if c.kind != "phema":
            raise PhemaError(f"{name.path}: holds {checkpoint.describe(c)}, not a post-hoc EMA "
                             f"snapshot; move it out of the run directory")
        if c.step != name.step or std_str(c.std) != name.std_str:
            raise PhemaError(f"{name.path}: the file holds std {std_str(c.std)} at step "
                             f"{c.step}, its name says otherwise; rename or remove it")
        out.append(Snapshot(path=name.path, step=c.step, std=c.std, nimg=c.nimg, flags=c.flags,
                            param_names=list(c.param_names), tied=dict(c.tied or {}),
                            shapes={k: tuple(v.shape) for k, v in c.state_dict.items()}))
        del c
    return out, left_out


def _left_out_line(left_out):
    """One line for the steps whose snapshots a reconstruction leaves out."""
    return "; ".join(f"step {step} left out: {why}" for step, why in left_out)


def plan_reconstruction(run_dir, stds, step=None, max_error=MAX_PROFILE_ERROR):
    """
    Choose the inputs and solve the coefficients for reconstructing ``stds`` at ``step`` (None:
    the newest snapshot step) from the snapshots of ``run_dir``: those with
    ``0 < images seen <= the target's``. Reads tags only. PhemaError (one line naming --step,
    --std or the file) when: there are no snapshots; ``step`` has none; a snapshot's weights
    differ from the target's (the model changed); a std is outside what the snapshots can
    represent (its profile_error above ``max_error``).
    """
    run_dir = os.fspath(run_dir)
    snaps, left_out = read_snapshots(run_dir)
    steps = sorted({s.step for s in snaps})
    if step is None:
        step = steps[-1]
    elif step not in steps:
        why = dict(left_out).get(step)
        if why:
            raise PhemaError(f"--step {step}: its snapshots in {run_dir} are left out: {why}; "
                             f"give a step with snapshots: {_show_steps(steps)}")
        if step < steps[0]:
            raise PhemaError(f"--step {step}: before the first snapshot in {run_dir} (step "
                             f"{steps[0]}); give a step with snapshots: {_show_steps(steps)}")
        raise PhemaError(f"--step {step}: {run_dir} has no snapshots at that step; give a step "
                         f"with snapshots: {_show_steps(steps)}")
    at_step = [s for s in snaps if s.step == step]
    nimg = at_step[0].nimg
    if any(s.nimg != nimg for s in at_step):
        raise PhemaError(f"{at_step[0].path}: its snapshots at step {step} disagree on the images "
                         f"seen ({sorted({s.nimg for s in at_step})}); remove the stray files")
    inputs = sorted((s for s in snaps if 0 < s.nimg <= nimg), key=lambda s: (s.nimg, s.std))
    if not inputs:
        raise PhemaError(f"--step {step}: the snapshots up to that step hold no training yet "
                         f"(0 images seen); give a later step: {_show_steps(steps)}")
    target = inputs[-1]
    for s in inputs:
        if s.shapes != target.shapes or s.param_names != target.param_names:
            raise PhemaError(_misfit(s, target))
    for a, b in zip(inputs, inputs[1:]):
        if (a.nimg, std_str(a.std)) == (b.nimg, std_str(b.std)):
            raise PhemaError(f"{b.path}: the same std and images seen as {a.path}; remove one")
    in_ofs = np.float64([s.nimg for s in inputs])
    in_std = np.float64([s.std for s in inputs])
    coefs = solve_posthoc_coefficients(in_ofs, in_std, float(nimg), np.float64(stds))
    errors = profile_error(in_ofs, in_std, float(nimg), np.float64(stds), coefs)
    have = ", ".join(sorted({std_str(s.std) for s in inputs}))
    for std, err in zip(stds, errors):
        if not err <= max_error:
            raise PhemaError(
                f"--std {std}: the snapshots in {run_dir} (stds {have}, {len(inputs)} up to step "
                f"{step}) cannot represent it (its reconstructed profile is {err:.0%} off, more "
                f"than {max_error:.0%}); choose a std nearer to {have} (or raise "
                f"--max_profile_error)")
    return ReconstructionPlan(run_dir=run_dir, step=step, nimg=nimg, stds=list(stds),
                              inputs=inputs, coefs=coefs, errors=errors,
                              left_out=left_out)


def _show_steps(steps):
    shown = ", ".join(map(str, steps[:6]))
    return shown + (f", ... {steps[-1]}" if len(steps) > 6 else "")


def _misfit(s, target):
    keys = set(s.shapes) ^ set(target.shapes)
    keys |= {k for k in set(s.shapes) & set(target.shapes) if s.shapes[k] != target.shapes[k]}
    example = sorted(keys)[0] if keys else "the parameter list"
    return (f"{s.path}: its weights differ from those of {os.path.basename(target.path)} "
            f"({len(keys)} key(s), e.g. {example}): the model changed during the run; "
            f"reconstruct with --step before the change")


# checkpoint.load_file's advice is a resume's; a reconstruction's is another
_RESUME_ADVICE = "; replace it or resume from another step"


def _load_snapshot(path):
    """A snapshot file, loaded and checked (every record's CRC): a CkptFile. A damaged one (it
    changed after the plan verified it against its manifest) is a PhemaError saying what to do
    here."""
    try:
        return checkpoint.load_file(path)
    except checkpoint.CheckpointReadError:
        raise
    except checkpoint.CheckpointError as e:
        what = str(e).replace(_RESUME_ADVICE, "")
        raise PhemaError(f"{what}; it changed after its manifest was checked: run the "
                         f"reconstruction again (its step is then left out), or move the file "
                         f"out of the run directory") from None


def _accumulator_dtype(t):
    """float32 for half-precision snapshots (their sums would round badly), else their own."""
    return th.float32 if t.dtype in (th.float16, th.bfloat16) else t.dtype


def reconstruct(plan, batch=1):
    """
    Yield ``(std, payload)`` for each std of ``plan``, in plan order: an ordinary tagged EMA
    payload (checkpoint.posthoc_ema_payload: kind "ema", the target's flags and step) whose
    parameters are ``sum_i coefs[i, j] * snapshot_i`` and whose buffers are the target
    snapshot's. Streams over the snapshot files: at any time one loaded snapshot and ``batch``
    accumulators (of the parameters' dtype; float32 for half-precision ones) are alive, and the
    files are read ``ceil(len(stds) / batch)`` times. PhemaError when a file changed since the
    plan was made.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    names = plan.target.param_names
    for start in range(0, len(plan.stds), batch):
        cols = list(range(start, min(start + batch, len(plan.stds))))
        sums = [None] * len(cols)
        buffers, key_order, dtypes = None, None, None
        for i, snap in enumerate(plan.inputs):
            c = _load_snapshot(snap.path)
            if (c.kind, c.step, c.nimg, std_str(c.std or 0)) != (
                    "phema", snap.step, snap.nimg, std_str(snap.std)):
                raise PhemaError(f"{snap.path}: changed while being read (now {c.kind} at step "
                                 f"{c.step}); run the reconstruction again")
            sd = c.state_dict
            del c
            for j, col in enumerate(cols):
                if sums[j] is None:
                    sums[j] = {n: th.zeros(sd[n].shape, dtype=_accumulator_dtype(sd[n]))
                               for n in names}
                coef = float(plan.coefs[i, col])
                for n in names:
                    sums[j][n].add_(sd[n], alpha=coef)
            if i == len(plan.inputs) - 1:
                key_order = list(sd)
                dtypes = {n: sd[n].dtype for n in names}
                buffers = {k: v for k, v in sd.items() if k not in dtypes}
            del sd
        for j, col in enumerate(cols):
            acc, sums[j] = sums[j], None
            out = OrderedDict(
                (k, acc[k].to(dtypes[k]) if k in dtypes else buffers[k]) for k in key_order)
            for alias, name in plan.target.tied.items():  # a shared parameter's other names
                out[alias] = out[name]
            del acc
            std = plan.stds[col]
            yield std, checkpoint.posthoc_ema_payload(
                plan.step, std, plan.nimg, out, plan.target.flags,
                inputs=[[os.path.basename(s.path), float(plan.coefs[i, col])]
                        for i, s in enumerate(plan.inputs)],
                profile_error=float(plan.errors[col]))
            del out


# ---------------------------------------------------------------------------------------------
# the post-hoc EMA chosen by FID (EDM2's sweep; `ckpt.py phema RUN --std A,B,C --evaluate REF`)


@dataclass
class SweepRow:
    """One reconstructed width's figures."""

    std: float
    fid: float
    inception_score: float
    profile_error: float


def model_of_payload(payload, sample_steps, device="cpu"):
    """(model in eval mode, diffusion respaced to ``sample_steps``) of a reconstructed EMA
    payload (its flags and weights). PhemaError when the snapshots carry no model flags."""
    from . import sampling, script_util

    flags = payload.get("flags")
    if not flags:
        raise PhemaError("the post-hoc EMA snapshots carry no model flags (a TrainLoop without "
                         "model_flags), so no model can be built to sample from them")
    flags = sampling.reconcile_flags(flags, {"timestep_respacing": str(sample_steps)},
                                     script_util.model_and_diffusion_defaults(),
                                     source="the post-hoc EMA snapshots")
    model, diffusion = script_util.create_model_and_diffusion(**flags)
    model.load_state_dict(payload["state_dict"])
    return model.to(device).eval(), diffusion, flags


def sample_for_fid(model, diffusion, flags, num_samples, batch_size=64, seed=0):
    """``num_samples`` images (uint8 [N, H, W, 3]) of ``model`` as train.py --eval_interval and
    sample.py draw them: sample ``i`` from its own seeds, DDIM, labelled ``i % num_classes`` for
    a class-conditional model; gray samples repeated to 3 channels. Collective (sampling.generate:
    rank 0 gets them, the others None)."""
    from . import sampling

    num_classes = flags["num_classes"] if flags.get("class_cond") else None
    shape = (flags["in_channels"], flags["image_size"], flags["image_size"])
    if shape[0] not in (1, 3):
        raise PhemaError(f"--evaluate: the model's samples have {shape[0]} channels (latents?), "
                         f"not an image's 1 or 3; decode them and score them with evaluate.py")
    images, _ = sampling.generate(
        model, diffusion, num_samples=num_samples, batch_size=batch_size, shape=shape, seed=seed,
        use_ddim=True, num_classes=num_classes,
        classes=list(range(num_classes)) if num_classes else None, progress=False)
    if images is not None and images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images


def fid_and_is(images, features, ref_stats, batch_size=64, what="the samples"):
    """(FID against ``ref_stats``, Inception Score) of uint8 images by ``features``.
    EvaluationError (one line naming ``what``) when the activations or the FID are not finite:
    a NaN would silently lose the sweep's best."""
    from . import evaluation

    pools, logits = [], []
    for i in range(0, len(images), batch_size):
        pool, _, logit = features(images[i:i + batch_size])
        pools.append(pool)
        logits.append(logit)
    pool, logit = np.concatenate(pools), np.concatenate(logits)
    weights = getattr(features, "weights_path", None)
    if not (np.isfinite(pool).all() and np.isfinite(logit).all()):
        raise evaluation.EvaluationError(
            f"{what}: the {features.name} activations are not finite (NaN or inf)"
            + (f" with the weights {weights}; check that file" if weights else ""))
    fid = evaluation.compute_statistics(pool).frechet_distance(ref_stats, method="auto")
    if not np.isfinite(fid):
        raise evaluation.EvaluationError(f"{what}: the FID is {fid}, not a number (reference "
                                         "statistics that are not finite?)")
    return fid, evaluation.compute_inception_score(logit)


def reference_statistics(ref_path, features, batch_size=64):
    """The reference batch's FIDStatistics (its precomputed mu/sigma, else from its activations,
    cached beside it). Run in one process."""
    from . import evaluation

    pre, _ = evaluation.read_statistics(ref_path, *features.dims[:2])
    if pre is not None:
        return pre
    acts = evaluation.cached_activations(ref_path, features, batch_size)
    return evaluation.compute_statistics(acts[0])


def evaluate_stds(plan, ref_path, features, num_samples, sample_steps, batch_size=64, seed=0,
                  device="cpu", recon_batch=1, log=None):
    """
    The sweep: each std of ``plan`` reconstructed (``reconstruct``, one at a time), ``num_samples``
    images sampled (sample_for_fid) and scored against ``ref_path`` by ``features``. Returns
    [SweepRow] in plan order. ``log``: called with one line per std. Run in one process.
    """
    ref_stats = reference_statistics(ref_path, features, batch_size)
    rows = []
    for std, payload in reconstruct(plan, batch=recon_batch):
        model, diffusion, flags = model_of_payload(payload, sample_steps, device)
        del payload
        images = sample_for_fid(model, diffusion, flags, num_samples, batch_size, seed)
        del model
        fid, score = fid_and_is(images, features, ref_stats, batch_size,
                                what=f"std {std_str(std)}'s samples")
        rows.append(SweepRow(std=float(std), fid=float(fid), inception_score=float(score),
                             profile_error=float(plan.errors[plan.stds.index(std)])))
        if log is not None:
            log(f"std {std_str(std)}: FID {fid:.6g}, IS {score:.4g}")
    return rows


def best_row(rows):
    """The row of the lowest finite FID (None when there is none)."""
    finite = [r for r in rows if np.isfinite(r.fid)]
    return min(finite, key=lambda r: r.fid) if finite else None


def sweep_table(rows):
    """The table in words: a header ``std  FID  IS``, a line per std, then ``best: ...``."""
    lines = [f"{'std':<7}{'FID':>12}{'IS':>10}"]
    lines += [f"{std_str(r.std):<7}{r.fid:>12.6g}{r.inception_score:>10.4g}" for r in rows]
    best = best_row(rows)
    if best is not None:
        lines.append(f"best: std {std_str(best.std)} (FID {best.fid:.6g})")
    return lines


def plot_sweep(rows, path, step, features_name):
    """``phema_sweep.png`` at ``path``: FID against std (log x), the best marked (matplotlib;
    written under a temporary name, then renamed). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=120)
    xs, ys = [r.std for r in rows], [r.fid for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue")
    best = best_row(rows)
    if best is not None:
        ax.plot([best.std], [best.fid], "*", color="tab:red", markersize=14,
                label=f"best: std {std_str(best.std)}, FID {best.fid:.4g}")
        ax.legend(loc="best", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([std_str(x) for x in xs], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("post-hoc EMA width (std, EDM2's sigma_rel)")
    ax.set_ylabel(f"FID ({features_name} features)")
    ax.set_title(f"post-hoc EMA sweep at step {step}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
