"""
Steps of ``VirtualShards`` on this job's ranks next to the plain float computation of the same
steps, for tests/test_virtual_shards.py: a tiny model with BatchNorm, G = 8 samples a step in
shards of m = 2 (K = 4), plain SGD between steps.

    mpiexec -n 2 python tests/virtual_shards_job.py OUT      (or 1 rank, or run() in a test)

Before each step every rank computes the reference on a copy of the model: each shard's
gradient in float32 in its own stream (shard_stream), from the step's buffers, their mean in
float64, and the buffers shard 0 leaves. Then the step through VirtualShards. Rank 0 writes
OUT (torch.save): per step {"grads", "reference", "shard0_buffers", "buffers" (every rank's,
gathered), "exponents", "redos", "calls"}.
"""
import copy
import os
import sys

import torch as th
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import dist_util  # noqa: E402
from improved_diffusion.virtual_shards import ShardPlan, VirtualShards, shard_stream  # noqa

G, M, SEED, LR = 8, 2, 5, 0.1


def make_model():
    th.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.SiLU(), nn.Linear(6, 2))


def global_batch(step):
    return th.randn(G, 3, generator=th.Generator().manual_seed(100 + step))


def shard_backward(model, scale, calls):
    """A shard's forward and backward: its noise drawn from the shard's stream, its loss times
    ``scale``; records the noise drawn and counts the calls."""
    def fn(micro, cond):
        calls.append(1)
        noise = th.randn(micro.shape[0], 2)
        loss = ((model(micro) - noise) ** 2).mean() * scale
        loss.backward()
        return {"draw": noise[:, 0]}
    return fn


def reference(model, step, scale):
    """(the float64 mean of the K shard gradients, the buffers shard 0 leaves) of ``step``
    from ``model``'s state, on a copy: nothing of ``model`` changes."""
    net = copy.deepcopy(model)
    start = [b.clone() for b in net.buffers()]
    batch, grads, first = global_batch(step), [], None
    for k in range(G // M):
        with th.no_grad():
            for b, s in zip(net.buffers(), start):
                b.copy_(s)
        net.zero_grad(set_to_none=True)
        with shard_stream(SEED, step, k):
            shard_backward(net, scale, [])(batch[k * M:(k + 1) * M], {})
        grads.append([p.grad.double() for p in net.parameters()])
        if k == 0:
            first = [b.clone() for b in net.buffers()]
    return [th.stack(g).mean(0) for g in zip(*grads)], first


def run(world, rank, scales=(1.0, 1.0)):
    """The records of len(scales) steps (the loss of step s times scales[s-1]) on this rank."""
    model = make_model()
    plan = ShardPlan(G, M, world, rank)
    shards = VirtualShards(plan, model, SEED)
    out = []
    for step, scale in enumerate(scales, start=1):
        ref, first = reference(model, step, scale)
        calls = []
        part = global_batch(step)[rank * plan.rank_batch:(rank + 1) * plan.rank_batch]
        shards.step(step, part, {}, shard_backward(model, scale, calls))
        buffers = [b.clone() for b in model.buffers()]
        if dist_util.is_distributed():
            every = [None] * world
            th.distributed.all_gather_object(every, buffers)
        else:
            every = [buffers]
        out.append({"grads": [p.grad.clone() for p in model.parameters()], "reference": ref,
                    "shard0_buffers": first, "buffers": every,
                    "exponents": shards.sum.exponents.clone(), "redos": shards.sum.redos,
                    "calls": len(calls)})
        with th.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return out


def main():
    dist_util.setup_dist(timeout=60)
    records = run(dist_util.get_world_size(), dist_util.get_rank())
    if dist_util.get_rank() == 0:
        th.save(records, sys.argv[1])
    dist_util.barrier()


if __name__ == "__main__":
    main()
