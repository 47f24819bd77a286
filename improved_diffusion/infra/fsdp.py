"""
Sharded training (FSDP2, ``torch.distributed.fsdp.fully_shard``): the wrapping and the state-dict
plumbing, beside dist_util. What the rest of the code sees of a sharded model is here alone.

Under ``--fsdp True`` every parameter is a DTensor: each rank holds one slice (dim 0, torch.chunk's
split; on 3 ranks the slices are uneven and some may be empty), and so do its gradient, its Adam
moments (AdamW over the sharded parameters) and its EMAs (clones of the parameters, updated on the
local slices). Once sharded, nothing of the training holds the whole model on one rank (it is
built whole on every rank, from the same seed, then sharded). The sharded layout of a step
(ckpt/sharded.py) saves the DTensors as they are; the full layout meets them in two places, both
here:

- a save (collective): ``gather_full(files)`` turns every DTensor in the step's payloads
  (checkpointer.step_files: weights, EMAs, the optimizer state keyed by parameter name) into the
  whole tensor on rank 0, on the CPU, one tensor at a time; the other ranks get ``None`` for the
  payloads. Rank 0 then writes today's model/ema/opt files, which any tool reads. A synchronous
  save calls it once per file (checkpointer._save_streamed: gathered, written, dropped), so rank
  0 holds one file's tensors at most; an asynchronous one once for the whole step, each whole
  tensor copied straight into the background writer's host copy (``alloc``), so that rank 0
  holds that copy and no other whole one.
- a load (not collective): every rank reads the same full file (as on DDP); ``localize_*`` cut each whole tensor to
  this rank's slice of the live DTensor it goes to (no communication: each rank takes its own
  slice of the tensor it already holds). A file written on any number of ranks, by DDP or FSDP,
  loads on any number.

Worked example, 3 ranks, a parameter of shape [5, 4]: the slices are rows 0-1, 2-3 and 4 (torch.
chunk); ``gather_full`` on rank 0 gives the [5, 4] tensor; ``localize(full, like=param)`` gives
rank 1 the DTensor whose local tensor is ``full[2:4]``.

The grad norm and the finiteness decision are taken over all slices (``grad_norm``,
``grads_finite``): the same number on every rank, so every rank takes or skips a step alike.

Buffers (BatchNorm's running statistics) are not sharded: each rank keeps its own, as the ranks
of an unsharded run without DDP's buffer broadcast would; the full layout saves rank 0's.
"""
import contextlib
import warnings

import torch as th
import torch.distributed as dist

# The classes whose instances are FSDP units of their own (each all-gathered just before its
# forward and freed after), by name so that this module imports no model: the UNet's residual and
# attention blocks, DiT's blocks. Other models: the root alone, or a model's own
# ``fsdp_blocks()`` (an iterable of submodules).
BLOCK_CLASSES = ("ResBlock", "AttentionBlock", "DiTBlock")
# Layers gathered in float32 under a float16/bfloat16 policy (shard_model).
NORM_TYPES = (th.nn.GroupNorm, th.nn.LayerNorm, th.nn.modules.batchnorm._BatchNorm)


def check_flags(config):
    """UsageError when a setting of ``config`` (a TrainConfig) cannot run under --fsdp True:
    --find_unused_parameters True (FSDP2 reduces only the gradients a rank has)."""
    from .errors import UsageError
    if config.find_unused_parameters:
        raise UsageError(
            "--find_unused_parameters True does not work with --fsdp True: FSDP2 reduces only "
            "the gradients a rank has, so a parameter left out of the loss on some ranks breaks "
            "the reduction; train such a model with DDP (--fsdp False)")


def check_layout(fsdp_on, save_layout):
    """UsageError for --save_layout sharded without --fsdp True (a whole model per rank has no
    shards to write): checked with the other flags, before the job writes anything."""
    from .errors import UsageError
    if save_layout == "sharded" and not fsdp_on:
        raise UsageError("--save_layout sharded needs --fsdp True (every rank writes its shards "
                         "of a sharded model); without --fsdp, use --save_layout full")


def active_line(world, save_layout):
    """The log line of a job that trains under --fsdp True: its rank count and save layout."""
    where = ("every rank writes its shards of stepNNNNNN.dcp/" if save_layout == "sharded"
             else "gathered to rank 0, which writes the model/ema/opt files")
    return (f"--fsdp True: parameters, gradients, Adam moments and EMAs sharded over {world} "
            f"rank(s); steps saved in the {save_layout} layout ({where})")


def _dtensor_cls():
    from torch.distributed.tensor import DTensor
    return DTensor


def is_dtensor(t):
    """Whether ``t`` is a DTensor (a sharded parameter, gradient, moment or EMA)."""
    return isinstance(t, _dtensor_cls())


def is_sharded(model):
    """Whether ``model`` holds sharded (DTensor) parameters."""
    return any(is_dtensor(p) for p in model.parameters())


def local(t):
    """This rank's slice of ``t`` if it is a DTensor (a view: writing it writes ``t``), else
    ``t``."""
    return t.to_local() if is_dtensor(t) else t


def ensure_process_group(device):
    """A one-rank process group when this process runs alone (FSDP needs one; a run launched
    with several ranks has it from dist_util.setup_dist)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def blocks_of(model):
    """The submodules that become FSDP units of their own: ``model.fsdp_blocks()`` if the model
    defines it, else every module whose class is named in BLOCK_CLASSES (outermost first)."""
    if hasattr(model, "fsdp_blocks"):
        return list(model.fsdp_blocks())
    return [m for m in model.modules() if m is not model and type(m).__name__ in BLOCK_CLASSES]


def shard_model(model, device, param_dtype=None):
    """Shard ``model`` in place with FSDP2 over all ranks: each of blocks_of(model), then the
    root (its remaining parameters: embeddings, input and output layers). ``param_dtype``
    (--use_fp16's autocast dtype, or None): FSDP's MixedPrecisionPolicy gathers the parameters in
    that dtype for the forward and reduces the gradients in float32; the sharded parameters, the
    optimizer state and the EMAs stay float32. Normalisation layers with parameters (GroupNorm,
    LayerNorm, BatchNorm) are then units of their own gathered in float32: the models normalise
    in float32 (the UNet's GroupNorm32 upcasts its input), which a float16 weight breaks on the
    CPU. Returns ``model``.

    Collective: call from all ranks with the same model (the same initial weights: call after
    dist_util.sync_params).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ensure_process_group(device)
    # FSDP warns of a block that returns a view (the UNet's AttentionBlock: a reshape): an
    # in-place op on it would skip the all-gather. Our models apply none to a block's output.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=th.float32,
                                  output_dtype=None)
    if param_dtype is not None:
        full = MixedPrecisionPolicy(param_dtype=th.float32, reduce_dtype=th.float32)
        for norm in [m for m in model.modules() if isinstance(m, NORM_TYPES)
                     and any(True for _ in m.parameters(recurse=False))]:
            fully_shard(norm, mesh=mesh, mp_policy=full)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


# ---------------------------------------------------------------------- whole tensors to rank 0


def gather_full(tree, dst=0, alloc=None):
    """``tree`` (nested dicts/lists/tuples of tensors and plain values) with every DTensor made
    whole: on rank ``dst`` each becomes the full tensor on the CPU (a copy), plain tensors are
    copied to the CPU too; the other ranks get ``None``. Leaves are visited in the tree's order,
    which must be the same on every rank (the same dicts built the same way). One DTensor at a
    time, so a rank holds at most one whole tensor beyond the slices.

    ``alloc`` (rank ``dst`` only): ``alloc(nbytes)`` gives a flat uint8 CPU tensor of that many
    bytes that a whole tensor is copied into, in place of new memory: an asynchronous save
    gathers the step straight into its background writer's shared memory, which is then the
    host copy itself (no second copy of the whole state on rank 0). Tensors of no bytes get new
    memory.

    Collective: call from all ranks with trees of the same structure.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = _gather(tree, rank == dst, alloc)
    return out if rank == dst else None


def _gather(node, keep, alloc):
    if isinstance(node, dict):
        return {k: _gather(v, keep, alloc) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_gather(v, keep, alloc) for v in node]
        return items if isinstance(node, list) else tuple(items)
    if is_dtensor(node):
        whole = node.detach().full_tensor()  # collective (an all-gather)
        return _host_copy(whole, alloc) if keep else None
    if isinstance(node, th.Tensor):
        return _host_copy(node.detach(), alloc) if keep else None
    return node


def _host_copy(t, alloc):
    """A copy of tensor ``t`` on the CPU, contiguous, in ``alloc``'s memory when given."""
    nbytes = t.numel() * t.element_size()
    if alloc is None or nbytes == 0:
        return t.to("cpu", copy=True)
    out = alloc(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


# ---------------------------------------------------------------------- whole tensors to slices


def localize(full, like):
    """``full`` (the whole tensor, on every rank) as a DTensor sharded as ``like``, this rank's
    slice copied to ``like``'s device and dtype; ``full`` itself if ``like`` is not a DTensor. No
    communication."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor
    full = full.detach().to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def localize_state_dict(sd, model):
    """``sd`` (whole tensors by name) with each tensor that the live ``model`` holds as a
    DTensor cut to this rank's slice (``localize``); the others as they are. No communication."""
    mine = model.state_dict()
    return {k: localize(v, mine[k]) if k in mine and isinstance(v, th.Tensor) else v
            for k, v in sd.items()}


def localize_optimizer_state(payload, named_params):
    """A named optimizer payload (optim_state's "named-v1": ``state`` by parameter name) with
    each per-parameter tensor of the parameter's shape (Adam's moments) cut to this rank's slice
    of that parameter; scalars (``step``) as they are. No communication."""
    params = dict(named_params)
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), dict):
        return payload
    state = {}
    for name, entry in payload["state"].items():
        p = params.get(name)
        if p is None or not is_dtensor(p) or not isinstance(entry, dict):
            state[name] = entry
            continue
        state[name] = {k: (localize(v, p) if isinstance(v, th.Tensor)
                           and tuple(v.shape) == tuple(p.shape) else v)
                       for k, v in entry.items()}
    return {**payload, "state": state}


# ---------------------------------------------------------------------- norms over all slices


def grad_norm(grads):
    """The global L2 norm of ``grads``, DTensors or plain (a 0-d float32 tensor, the same on
    every rank; NaN/Inf propagate). Sharded gradients: each rank's sum of squares of its slices,
    summed over the ranks (one all-reduce). Collective when any gradient is a DTensor."""
    if not any(is_dtensor(g) for g in grads):
        norms = th._foreach_norm([g.float() if g.dtype != th.float32 else g for g in grads])
        return th.linalg.vector_norm(th.stack(norms))
    parts = [local(g).float() for g in grads]
    parts = [p for p in parts if p.numel()]
    device = local(grads[0]).device
    sq = (th.stack(th._foreach_norm(parts)).square().sum() if parts
          else th.zeros((), device=device))
    dist.all_reduce(sq)
    return sq.sqrt()


def any_non_finite(tensors):
    """Whether a tensor of ``tensors`` holds a NaN/Inf on any rank (one all-reduce; a host sync).
    Collective."""
    tensors = list(tensors)
    bad = any(not bool(th.isfinite(local(t)).all()) for t in tensors)
    device = local(tensors[0]).device if tensors else "cpu"
    flag = th.tensor([1.0 if bad else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# ---------------------------------------------------------------------- sampling other weights


@contextlib.contextmanager
def params_swapped_in(model, params):
    """Within: ``model`` in eval mode holding ``params`` (tensors in ``model.parameters()``
    order, e.g. an EMA: DTensors sharded as the parameters) in place of its parameters, this
    rank's slices copied into the live shards (no whole copy of the model on any rank). On exit,
    whatever ran: the parameters bit for bit, the buffers (BatchNorm statistics) and every
    module's training mode as they were, and every FSDP unit resharded (none keeps the swapped
    weights gathered for the next training forward). A sharded model's forward is collective:
    every rank enters and calls the model alike (the same number of calls, in the same order).
    Not collective itself."""
    _reshard(model)  # model.parameters() are the shards only while no unit is gathered
    own, params = list(model.parameters()), list(params)
    if len(own) != len(params):
        raise ValueError(f"{len(params)} tensors for a model of {len(own)} parameters")
    saved = [local(p).detach().clone() for p in own]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        with th.no_grad():
            for p, q in zip(own, params):
                if p is not q:
                    local(p).copy_(local(q.detach()))
        model.eval()
        yield model
    finally:
        _reshard(model)
        with th.no_grad():
            for p, s in zip(own, saved):
                local(p).copy_(s)
            for b, s in buffers:
                b.copy_(s)
        for m, mode in modes:
            m.training = mode


def _reshard(model):
    """Free the gathered weights of every FSDP unit of ``model`` (the root keeps its own after
    a forward without backward), so that its parameters are the sharded DTensors again."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
