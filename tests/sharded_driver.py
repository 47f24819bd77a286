"""
Drives ckpt/sharded.py as the FSDP trainer will, for tests/test_sharded_layout.py and
benchmarks/sharded_save.py: a tiny model under ``fully_shard`` (gloo on CPU, a 1-D mesh over the
world), an AdamW stepped once per step, EMAs as DTensor clones, and ``{file: payload}`` built with
the real checkpoint.model_payload / ema_payload / opt_payload and the named-v1 optimizer state.

    mpiexec -n 2 python tests/sharded_driver.py save --log_dir D --steps 1,2 --ref R
        saves steps 1 and 2 (sharded) and, on rank 0, R/ref{step}.pt (the full tensors, gathered)
        and R/full/ (the full layout of the same state, run_dir.write_step)
    mpiexec -n 3 python tests/sharded_driver.py load --log_dir D --step 2 --ref R
        loads step 2 into a fresh model of this world and compares with R/ref2.pt bitwise
    ... save ... --die_rank 1 --die_step 2      rank 1 kill -9's itself while writing step 2
    ... save ... --leave_free N                 fills the disk to N free bytes before the last
    ... load ... --rank_log_dir 1 D2            rank 1 reads D2 instead (another host's copy);
        a load that fails prints "LOAD FAILED rank R: <line>" on each rank and exits 3
"""
import argparse
import os
import signal
import sys

import torch as th
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion import dist_util  # noqa: E402
from improved_diffusion.ckpt import checkpoint as ck, optim_state, run_dir, sharded  # noqa
from improved_diffusion.infra.errors import UserError  # noqa: E402

RATES = ("0.9999", "0.999")
FLAGS = {"width": None, "learn_sigma": False}


def build(width, seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    th.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.GroupNorm(1, width), nn.SiLU(),
                          nn.Linear(width, width), nn.Linear(width, 5))
    model.register_buffer("count", th.arange(3, dtype=th.int64) + seed)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = th.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    emas = {r: [p.detach().clone() for p in model.parameters()] for r in RATES}
    return model, opt, emas


def train_step(model, opt, emas, step):
    g = th.Generator().manual_seed(100 + step)
    x = th.randn(8, 6, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    with th.no_grad():
        for r, params in emas.items():
            for e, p in zip(params, model.parameters()):
                e.mul_(float(r)).add_(p.detach(), alpha=1 - float(r))


def files_of(model, opt, emas, step, trainer=None):
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    flags = dict(FLAGS, width=model[0].out_features)
    files = {ck.model_filename(step): ck.model_payload(
        step, {k: v.detach() for k, v in model.state_dict().items()}, flags)}
    for r in RATES:
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        sd.update(dict(zip(names, emas[r])))
        files[ck.ema_filename(r, step)] = ck.ema_payload(step, r, sd, flags)
    files[ck.opt_filename(step)] = ck.opt_payload(
        step, optim_state.named_optimizer_state(opt, named, copy=False),
        trainer or {"step": step, "data": {"epoch": 0, "seen": [1, 2, step]}, "empty": {},
                    "rng": [3.5, None, "x"]})
    return files


def full_copy(obj):
    """The structure with every DTensor gathered to a plain tensor (collective, same order)."""
    from torch.distributed.tensor import DTensor
    if isinstance(obj, dict):
        return {k: full_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_copy(v) for v in obj]
    if isinstance(obj, DTensor):
        return obj.full_tensor().clone()
    if isinstance(obj, th.Tensor):
        return obj.detach().clone()
    return obj


def same(a, b, where="files"):
    """None when ``a`` and ``b`` are equal bitwise (tensors: dtype, shape, values), key order
    included; else where they differ."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return f"{where}: keys {list(a)[:5]} != {list(b)[:5] if isinstance(b, dict) else b}"
        for k in a:
            d = same(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where}: {a!r:.80} != {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, th.Tensor):
        ok = (isinstance(b, th.Tensor) and a.dtype == b.dtype and a.shape == b.shape
              and th.equal(a.reshape(-1).view(th.uint8) if a.dtype.is_floating_point else a,
                           b.reshape(-1).view(th.uint8) if b.dtype.is_floating_point else b))
        return None if ok else f"{where}: tensors differ"
    return None if (type(a) is type(b) and a == b) else f"{where}: {a!r} != {b!r}"


def die_while_writing(step):
    """Make this rank kill -9 itself as DCP writes its first item of ``step``."""
    from torch.distributed.checkpoint import filesystem
    real = filesystem._write_item

    def write_item(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    filesystem._write_item = write_item


def cmd_save(args):
    import torch.distributed as dist
    rank = dist_util.get_rank()
    model, opt, emas = build(args.width, seed=0)
    steps = [int(s) for s in args.steps.split(",")]
    done = 0
    for step in steps:
        while done < step:
            done += 1
            train_step(model, opt, emas, done)
        files = files_of(model, opt, emas, step)
        if args.ref:
            ref = full_copy(files)
            if rank == 0:
                os.makedirs(os.path.join(args.ref, "full"), exist_ok=True)
                th.save(ref, os.path.join(args.ref, f"ref{step}.pt"))
                run_dir.write_step(os.path.join(args.ref, "full"), step, ref,
                                   settings={"lr": 0.01})
        if step == steps[-1] and args.leave_free is not None and rank == 0:
            st = os.statvfs(args.log_dir)
            fill = st.f_bavail * st.f_frsize - args.leave_free
            with open(os.path.join(args.log_dir, "filler"), "wb") as f:
                f.write(b"\0" * max(fill, 0))
        if args.die_step == step and args.die_rank == rank:
            die_while_writing(step)
        if dist.is_initialized():
            dist.barrier()
        try:
            pending = sharded.start_save(args.log_dir, step, files, {"lr": 0.01},
                                         mode=args.mode)
            if args.mode != "sync":  # training goes on while it writes: must not show
                train_step(model, opt, emas, done + 1000)
            pending.collect()
            if args.mode != "sync":
                model, opt, emas = build(args.width, seed=0)  # start over, then replay
                for s in range(1, done + 1):
                    train_step(model, opt, emas, s)
        except UserError as e:
            print(f"SAVE FAILED rank {rank}: {e}", flush=True)
            return 3
        print(f"rank {rank} saved step {step}", flush=True)
    return 0


def cmd_load(args):
    import torch.distributed as dist
    model, opt, emas = build(args.width, seed=7)
    sharded.init_optim_state(opt)
    rank = dist_util.get_rank()
    log_dir = args.log_dir
    if args.rank_log_dir and int(args.rank_log_dir[0]) == rank:
        log_dir = args.rank_log_dir[1]
    step_dir = sharded.step_path(log_dir, args.step)
    template = files_of(model, opt, emas, args.step,
                        trainer={"step": 0, "data": {"epoch": 9, "seen": [0, 0, 0]},
                                 "empty": {}, "rng": [0.0, None, ""]})
    try:
        sharded.read_step(step_dir, template)
    except UserError as e:
        print(f"LOAD FAILED rank {rank}: {e}", flush=True)
        return 3
    got = full_copy(template)
    # the optimizer itself holds the loaded state (template tensors are its own)
    named = list(model.named_parameters())
    live = full_copy(optim_state.named_optimizer_state(opt, named, copy=False))
    if dist_util.get_rank() == 0:
        ref = th.load(os.path.join(args.ref, f"ref{args.step}.pt"), weights_only=True)
        diff = same(ref, got) or same(ref[ck.opt_filename(args.step)]["optimizer"], live, "opt")
        if diff:
            print(f"LOAD MISMATCH: {diff}", flush=True)
            return 4
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"LOAD OK world {world}", flush=True)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["save", "load"])
    p.add_argument("--log_dir", required=True)
    p.add_argument("--steps", default="1")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--ref", default="")
    p.add_argument("--mode", default="sync", choices=sharded.MODES)
    p.add_argument("--width", type=int, default=12)
    p.add_argument("--die_rank", type=int, default=None)
    p.add_argument("--die_step", type=int, default=None)
    p.add_argument("--leave_free", type=int, default=None)
    p.add_argument("--rank_log_dir", nargs=2, default=None, metavar=("RANK", "DIR"))
    args = p.parse_args()
    dist_util.setup_dist(timeout=30)
    return cmd_save(args) if args.cmd == "save" else cmd_load(args)


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(main())
