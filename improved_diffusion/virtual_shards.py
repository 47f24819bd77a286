"""
The same run on any number of ranks (``--global_batch_size G --microbatch m``): a step is G
samples cut into K = G/m *virtual shards*, numbered 0..K-1, and everything a shard does is a
function of the shard, not of the rank that runs it. On W ranks (W divides K) rank r runs the
shards r*b .. (r+1)*b - 1 (b = K/W) one after another; the gradient of the step is combined by an
exact integer sum, whose result does not depend on W or on the order of the adds.

Worked example: G=12, m=2, so K=6 shards of 2 samples. The loader gives each rank its contiguous
slice of the step's 12 global samples (image_datasets.ResumableLoader with a per-rank batch of
G/W), so shard k is global samples [2k, 2k+2) of the step on every W:

    W=1: rank 0 runs shards 0 1 2 3 4 5
    W=2: rank 0 runs 0 1 2, rank 1 runs 3 4 5
    W=3: rank 0 runs 0 1, rank 1 runs 2 3, rank 2 runs 4 5
    W=4: refused in one line (4 does not divide 6): the rank counts that work are 1, 2, 3, 6.

What makes a shard's gradient the same wherever it runs:

- its samples: the global sample order (the loader's, with or without loader workers, whose
  loading draws nothing);
- its randomness: ``shard_stream(seed, step, k)`` seeds python, numpy and torch (CPU and CUDA)
  from (seed, step, k) around the shard (timesteps, noise, dropout, classifier-free label dropout)
  and puts the process's own streams back afterwards;
- the model's buffers (BatchNorm running statistics): each shard starts from the step's buffers;
  the step ends with the buffers as shard 0 left them, rank 0's, sent to every rank (the promise
  for buffers: bitwise on any W too, but they follow one shard of each step, not all of them);
- the loss-aware schedule sampler: it draws from the weights of the step's start, and its history
  is updated after the step with every shard's (t, loss) in shard order (``gather``).

The reduction (FixedPointSum): per parameter an int64 accumulator. After each shard's backward,
each gradient tensor g_t is rounded to integers q = round(g_t * 2**(P - E_t)) and added (exact
integer adds: order-free). After the rank's shards one all-reduce MAX of each tensor's largest
binary exponent (and non-finiteness), then one all-reduce SUM of the accumulators (exact on gloo
and NCCL in any order), and grad_t = (acc_t * 2**(E_t - P)) / K: the mean of the shard gradients
(each shard's loss is a mean over its m samples, so the step's gradient is that of the mean loss
over the G samples). E_t is the exponent of the tensor's largest |g| of the step before plus
HEADROOM_BITS; P = 61 - ceil(log2 K), so K values below 2**E_t never overflow int64. When a
gradient of the step reaches 2**E_t (the exact maxima say so, on every rank alike), or at the
first step (no E yet), the step's shards run again with E from this step's maxima: the shard
streams and buffers make the second pass the same computation. The exponents are part of the
checkpoint (``state_dict``), so a resume on any W continues identically.

Cost: two float32 gradient copies of memory per rank (the int64 accumulators), one extra
elementwise pass per shard, and an all-reduce of int64 (twice float32's bytes) per step. Under
--fsdp the shards, streams and sampler hold, but FSDP reduce-scatters the gradients itself (in
float, in its own order): there the weights are not bitwise the same across rank counts.
"""
import contextlib
import math
import random

import numpy as np
import torch as th
import torch.distributed as dist

from . import dist_util, logger
from .ckpt.rng import get_rng_state, set_rng_state
from .infra.errors import UsageError

# Bits above the largest |gradient| of the step before that a tensor's fixed-point range keeps:
# a gradient may grow 2**HEADROOM_BITS-fold in one step before the step runs its shards again.
HEADROOM_BITS = 8
# The lowest exponent E_t: a range of at least (-1, 1), for tensors whose gradients were zero or
# tiny (a zero-initialised output layer leaves every other gradient 0 at the first step), so that
# their growth needs no second pass; its resolution, 2**-P (P >= 51 up to 1024 shards), keeps
# every float32 gradient above 2**-27 exact.
MIN_EXPONENT = 0
# The exponent MAX-reduced for a tensor with a NaN/Inf gradient (above any finite one).
NON_FINITE = 1 << 20


def working_world_sizes(num_shards):
    """The rank counts that divide ``num_shards``: [1, 2, 3, 6] for 6."""
    return [w for w in range(1, num_shards + 1) if num_shards % w == 0]


class ShardPlan:
    """Which virtual shards this rank runs: G samples a step, shards of m, on W ranks.

    Raises UsageError (one line, naming the flags) when m is not given, m does not divide G, or
    W does not divide K = G/m (naming the rank counts that work)."""

    def __init__(self, global_batch, microbatch, world_size, rank=0):
        G, m, W = int(global_batch), int(microbatch), int(world_size)
        if G < 1:
            raise UsageError(f"--global_batch_size must be >= 1 (got {G}; 0 = off)")
        if m < 1:
            raise UsageError(f"--global_batch_size {G} needs --microbatch m (the samples of one "
                             f"virtual shard, dividing {G}), e.g. --microbatch 1")
        if G % m:
            raise UsageError(f"--global_batch_size {G} is not a multiple of --microbatch {m}")
        K = G // m
        if K % W:
            raise UsageError(
                f"--global_batch_size {G} / --microbatch {m} = {K} virtual shards do not split "
                f"over {W} ranks; run on {', '.join(map(str, working_world_sizes(K)))} rank(s), "
                f"or change --microbatch")
        self.global_batch, self.microbatch, self.world_size, self.rank = G, m, W, int(rank)
        self.num_shards = K
        self.per_rank = K // W
        self.rank_batch = G // W  # the loader's per-rank batch: this rank's shards, in order
        self.shards = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def global_slices(self):
        """The slices of shards 0..K-1 in the step's global sample order (gather_records')."""
        m = self.microbatch
        return [slice(k * m, (k + 1) * m) for k in range(self.num_shards)]

    def describe(self):
        return (f"global batch {self.global_batch}, microbatch {self.microbatch}: "
                f"{self.num_shards} virtual shards per step, {self.per_rank} on each of "
                f"{self.world_size} rank(s)")


def plan_from_flags(global_batch_size, microbatch, world_size=None, rank=None):
    """The ShardPlan of the flags, or None when --global_batch_size is 0 (off). ``world_size``
    and ``rank``: the process group's by default."""
    if not global_batch_size:
        return None
    return ShardPlan(global_batch_size, microbatch,
                     dist_util.get_world_size() if world_size is None else world_size,
                     dist_util.get_rank() if rank is None else rank)


def resolve_batch_flags(args):
    """With --global_batch_size G (typed or taken from a resumed checkpoint): check the plan on
    this job's ranks (UsageError) and set ``args.batch_size`` to G/W, the loader's per-rank
    batch. Nothing without G. Also before the process group exists (the rank count is the
    launcher's). Not collective (every rank decides alike)."""
    G = getattr(args, "global_batch_size", 0)
    if G:
        args.batch_size = ShardPlan(G, args.microbatch, dist_util.launch_world_size()).rank_batch


def from_flags(args, model, exact=True):
    """The VirtualShards of ``args``' --global_batch_size, --microbatch and --seed for ``model``
    on this process group's ranks, or None without G. Not collective."""
    plan = plan_from_flags(args.global_batch_size, args.microbatch)
    return None if plan is None else VirtualShards(plan, model, args.seed, exact=exact)


def refuse_batch_size(args, given):
    """UsageError when --batch_size was typed (``given``: the names typed) for a run with a
    global batch (typed, or the resumed checkpoint's). Not collective."""
    G = getattr(args, "global_batch_size", 0)
    if G and "batch_size" in given:
        raise UsageError(f"--batch_size and --global_batch_size {G} together: the global batch "
                         f"defines the run (each rank gets G/ranks); leave out --batch_size "
                         f"(or pass --global_batch_size 0 for a per-rank --batch_size)")


# ---------------------------------------------------------------------- randomness of a shard


# The kinds of shard streams: a shard's training draws, and its evaluation draws (a loop's
# validation batch cut into the same shards), apart from each other.
TRAIN_STREAM, EVAL_STREAM = 1, 2


def shard_seed(seed, step, shard, kind=TRAIN_STREAM):
    """One 32-bit seed from (seed, step, shard, kind): a stream of its own for every shard of
    every step (kind >= 1 keeps these streams apart from rng.seed_rngs' (seed, step, rank))."""
    return int(np.random.SeedSequence([int(seed), int(step), int(shard), int(kind)])
               .generate_state(1)[0])


@contextlib.contextmanager
def shard_stream(seed, step, shard, kind=TRAIN_STREAM):
    """Within: python's, numpy's and torch's (CPU and CUDA) global generators draw the stream of
    (seed, step, shard, kind); on exit they are what they were on entry. Not collective."""
    saved = get_rng_state()
    s = shard_seed(seed, step, shard, kind)
    random.seed(s)
    np.random.seed(s)
    th.manual_seed(s)  # every CUDA device too
    try:
        yield
    finally:
        set_rng_state(saved)


# ---------------------------------------------------------------------- the exact reduction


class FixedPointSum:
    """The order-free sum of the shard gradients of ``params`` (see the module docstring).

        fx.begin()                      # accumulators to 0
        fx.add()                        # after each shard's backward: its .grad, quantized
        ok = fx.reduce()                # collective: False -> run the step's shards again
        fx.write_grads()                # .grad = the mean over the K shards

    Its state (the exponents, the count of second passes) goes into the checkpoint."""

    def __init__(self, params, num_shards, headroom=HEADROOM_BITS):
        self.params = [p for p in params if p.requires_grad]
        self.num_shards = int(num_shards)
        self.headroom = int(headroom)
        self.precision = 61 - math.ceil(math.log2(self.num_shards)) if self.num_shards > 1 else 61
        device = self.params[0].device if self.params else th.device("cpu")
        # one flat buffer (one all-reduce), a view of it per parameter
        self.flat = th.zeros(sum(p.numel() for p in self.params), dtype=th.int64, device=device)
        self.acc, at = [], 0
        for p in self.params:
            self.acc.append(self.flat[at:at + p.numel()].view(p.shape))
            at += p.numel()
        self.exponents = None  # int64 [n] of E_t (None: not known yet)
        self.redos = 0
        self.first_range = False  # whether the last reduce() ran with no range known yet
        self._local_max = None
        self._scales = None

    def begin(self):
        """Start a step (or its second pass): zero accumulators and maxima. Not collective."""
        self.flat.zero_()
        self._local_max = th.full((len(self.params),), -(1 << 30), dtype=th.int64,
                                  device=self.flat.device)
        self._used = (self.exponents if self.exponents is not None
                      else th.zeros(len(self.params), dtype=th.int64))
        self._scales = [2.0 ** (self.precision - int(e)) for e in self._used.tolist()]

    def add(self):
        """Quantize each parameter's .grad (None: zeros) into its accumulator, and note its
        largest binary exponent (NON_FINITE for NaN/Inf). Not collective."""
        exps = []
        for p, a, scale in zip(self.params, self.acc, self._scales):
            g = p.grad
            if g is None:
                exps.append(th.full((), -(1 << 30), dtype=th.int64, device=a.device))
                continue
            g = g.detach()
            top = g.abs().max().float()
            exp = th.frexp(top)[1].long()  # top < 2**exp (0 for top == 0)
            exp = th.where(top > 0, exp, -(1 << 30))
            exps.append(th.where(th.isfinite(top), exp, NON_FINITE))
            q = th.round(th.nan_to_num(g.double(), 0.0, 0.0, 0.0) * scale)
            a.add_(q.clamp_(-2.0 ** 62, 2.0 ** 62).long())
        if exps:
            th.maximum(self._local_max, th.stack(exps), out=self._local_max)

    def reduce(self):
        """Combine the ranks' sums: True when every gradient of the step was within range (then
        the accumulators hold the exact global sums), False when the step must run its shards
        again (the exponents are then this step's: the second pass fits). Non-finite gradients
        need no second pass (the step is not taken: write_grads gives NaN there). Collective:
        call from all ranks."""
        top = self._local_max.clone()
        if dist_util.is_distributed():
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        top = top.cpu()
        bad = top >= NON_FINITE
        self.first_range = self.exponents is None  # no range yet: a first pass, not a fault
        fits = not self.first_range and bool(((top <= self._used) | bad).all())
        if not fits:
            self.exponents = self._next_exponents(top, bad)
            self.redos += 1
            return False
        if dist_util.is_distributed():  # integer sums: exact in any order
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
        self._bad = bad
        self.exponents = self._next_exponents(top, bad)
        return True

    def _next_exponents(self, top, bad):
        """E_t for the next step: this step's largest exponent plus the headroom (the old E for a
        non-finite tensor; at least MIN_EXPONENT)."""
        new = (top + self.headroom).clamp(min=MIN_EXPONENT)
        if self.exponents is not None:
            new = th.where(bad, self.exponents, new)
        else:
            new = th.where(bad, th.full_like(new, MIN_EXPONENT), new)
        return new

    def write_grads(self):
        """Each parameter's .grad = (its integer sum * 2**(E_t - P)) / K, float32, computed alike
        on every rank; NaN for a tensor some shard had non-finite. Not collective."""
        for i, (p, a, e) in enumerate(zip(self.params, self.acc, self._used.tolist())):
            if bool(self._bad[i]):
                g = th.full(p.shape, float("nan"), dtype=p.dtype, device=p.device)
            else:
                g = (a.double() * 2.0 ** (int(e) - self.precision) / self.num_shards).to(p.dtype)
            p.grad = g

    def state_dict(self):
        return {"exponents": None if self.exponents is None else self.exponents.clone(),
                "redos": int(self.redos)}

    def load_state_dict(self, sd):
        exps = sd.get("exponents")
        if exps is not None and th.as_tensor(exps).numel() == len(self.params):
            self.exponents = th.as_tensor(exps, dtype=th.int64).clone()
        else:  # no exponents, or another model (--allow_model_change): found again at the next step
            self.exponents = None
        self.redos = int(sd.get("redos", 0))


# ---------------------------------------------------------------------- a step of shards


class VirtualShards:
    """One training step as its virtual shards, for any loop (TrainLoop, classifier_train, an own
    loop):

        shards = VirtualShards(plan, model, seed)
        records = shards.step(step, batch, cond, shard_backward)   # collective
        # every parameter's .grad is now the step's gradient, the same on every rank and every W;
        # records: {name: tensor [G]} of every sample of the step, in global order (all ranks)
        rows = shards.records(step, val_batch, val_cond, shard_eval)  # no backward, collective

    ``shard_backward(micro, micro_cond)`` runs one shard's forward and backward (into .grad) and
    returns {name: float tensor [m]} of per-sample numbers to gather (losses, timesteps); it is
    called inside the shard's RNG stream. ``batch`` [G/W, ...] and ``cond`` are this rank's part
    of the global batch (the loader's slice). Also a Checkpointer state (state_dict /
    load_state_dict), under the name ``virtual_shards``.

    ``exact=False`` (--fsdp, whose backward reduce-scatters the gradients itself): the shards
    accumulate into .grad, each loss times ``loss_scale`` (1 / shards per rank, so that FSDP's
    mean over the ranks is the mean over the K shards); samples, streams, buffers and records
    are as above, the reduction is FSDP's (float, its own order)."""

    name = "virtual_shards"

    def __init__(self, plan, model, seed, headroom=HEADROOM_BITS, exact=True):
        self.plan, self.model, self.seed = plan, model, int(seed)
        self.sum = FixedPointSum(model.parameters(), plan.num_shards, headroom) if exact else None

    @property
    def loss_scale(self):
        """What each shard's loss is multiplied by before its backward (None: nothing)."""
        return None if self.sum is not None else 1.0 / self.plan.per_rank

    def step(self, step, batch, cond, shard_backward):
        """Run this rank's shards of ``step`` (the 1-based number of the step being taken),
        reduce, and gather the records. Collective: call from all ranks."""
        plan, m = self.plan, self.plan.microbatch
        self._check(batch)
        buffers = [b for b in self.model.buffers()]
        start = [b.detach().clone() for b in buffers]
        first = None
        while True:
            if self.sum is not None:
                self.sum.begin()
            records = []
            for j, k in enumerate(plan.shards):
                with th.no_grad():
                    for b, s in zip(buffers, start):
                        b.copy_(s)
                if self.sum is not None or j == 0:
                    for p in self.model.parameters():
                        p.grad = None
                sub = slice(j * m, (j + 1) * m)
                with shard_stream(self.seed, step, k):
                    rec = shard_backward(batch[sub], {n: v[sub] for n, v in cond.items()})
                if k == 0:
                    first = [b.detach().clone() for b in buffers]
                if self.sum is not None:
                    self.sum.add()
                records.append(rec)
            if self.sum is None or self.sum.reduce():
                break
            if self.sum.first_range:  # the run's first step (or the first of a changed model)
                logger.log(f"step {step}: the exact gradient sum takes each gradient's "
                           f"fixed-point range from this first step: its shards run twice")
            else:
                logger.log(f"step {step}: a gradient outgrew its fixed-point range; the step's "
                           f"shards run again at the exact range ({self.sum.redos} step(s) of "
                           f"this run ran twice, its first step included)")
        if self.sum is not None:
            self.sum.write_grads()
        self._end_buffers(buffers, first)
        return gather_records(records)

    def records(self, step, batch, cond, shard_fn, kind=EVAL_STREAM):
        """Run ``shard_fn(micro, micro_cond)`` (no backward: an evaluation) on this rank's shards
        of ``batch``, each in the stream (seed, step, shard, ``kind``), and gather its records
        as ``step`` does: the same numbers on every W. Collective: call from all ranks."""
        self._check(batch)
        m, out = self.plan.microbatch, []
        for j, k in enumerate(self.plan.shards):
            sub = slice(j * m, (j + 1) * m)
            with shard_stream(self.seed, step, k, kind):
                out.append(shard_fn(batch[sub], {n: v[sub] for n, v in cond.items()}))
        return gather_records(out)

    def _check(self, batch):
        if batch.shape[0] != self.plan.rank_batch:
            raise ValueError(f"virtual shards: a batch of {batch.shape[0]} on rank "
                             f"{self.plan.rank}, expected G/W = {self.plan.rank_batch}")

    def _end_buffers(self, buffers, first):
        """The buffers shard 0 left (rank 0 ran it), on every rank. Collective."""
        if not buffers:
            return
        with th.no_grad():
            if first is not None:
                for b, f in zip(buffers, first):
                    b.copy_(f)
            if dist_util.is_distributed():
                for b in buffers:
                    dist.broadcast(b, 0)

    def state_dict(self):
        return dict(self.sum.state_dict() if self.sum is not None else {},
                    global_batch=self.plan.global_batch,
                    microbatch=self.plan.microbatch, name=self.name)

    def load_state_dict(self, sd):
        if (sd.get("global_batch"), sd.get("microbatch")) != (self.plan.global_batch,
                                                              self.plan.microbatch):
            logger.log(f"resume: the virtual shards were G={sd.get('global_batch')}, "
                       f"m={sd.get('microbatch')}; now G={self.plan.global_batch}, "
                       f"m={self.plan.microbatch} (another run from here)")
        if self.sum is not None:
            self.sum.load_state_dict(sd)

    def resume_line(self, old_world_size):
        """The resume's line for the rank count (instead of the batch-size change); under
        --fsdp (no exact sum) it says what holds and what does not."""
        W = self.plan.world_size
        was = f" (saved on {old_world_size})" if old_world_size not in (None, W) else ""
        shards = f"global batch {self.plan.global_batch}, microbatch {self.plan.microbatch}"
        if self.sum is None and was:
            return (f"resume: the same global batch and shards on {W} rank(s){was} ({shards}); "
                    f"--fsdp reduce-scatters the gradients in float, in its own order: the "
                    f"weights differ from the {old_world_size}-rank run's in the last bits")
        return f"resume: same run on {W} rank(s){was} ({shards})"


def gather_records(records):
    """This rank's per-shard records (a list of {name: tensor [m]}, in shard order) -> {name:
    float64 tensor [G]} of every rank's, in global sample order (rank order is shard order).
    Collective: call from all ranks (with the same names)."""
    if not records:
        return {}
    names = sorted(records[0])
    local = th.stack([th.cat([r[n].detach().double().reshape(-1) for r in records])
                      for n in names], 1)  # [b*m, names]
    parts = dist_util.all_gather_varlen(local.reshape(-1))
    rows = th.cat(parts).reshape(-1, len(names))
    return {n: rows[:, i] for i, n in enumerate(names)}
