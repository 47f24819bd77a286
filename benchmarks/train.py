"""Training step speed: the real TrainLoop vs a bare forward/backward/step loop (issue 11).

Each variant runs in its own process (its peak memory is its own), and the variants alternate
(bare, loop, bare, loop, ...) so that load from other processes hits them alike; the figures are
medians over --repeat runs, and every ratio compares variants measured in the same run.

Variants (all on the same model, diffusion, batch and synthetic data; --variants picks them):

- ``bare``: forward (diffusion.training_losses), backward, AdamW step (the loop's own optimizer,
  train_util.make_adamw: fused where the device has it); under mpiexec wrapped in DDP. Nothing
  else: the reference for the loop's own overhead.
- ``loop``: the real TrainLoop.run_loop (flags exchange, device-side logging, dumpkvs every
  --log_interval steps, foreach EMA, fused AdamW); no checkpoint is written.
- ``upstream``: the step as upstream computed it: einsum attention (legacy order), a per-parameter
  EMA, one `.item()` host read per logged loss value and for the grad norm, a blocking preemption
  all-reduce per step, plain (for-loop) AdamW. The reference for "a step at least 10% faster".
- ``einsum``: the bare loop with upstream's einsum attention instead of SDPA.
- ``compile``: the bare loop with torch.compile of the model (compile time excluded: warm-up).
- ``bf16``: the bare loop under torch.autocast(bfloat16). The figure says which attention kernel
  the model's attention can take there (``sdpa_flash``: true when an AttentionBlock runs with
  only the flash backend allowed, as on CUDA for bf16; false: SDPA falls back to another kernel).

Also printed: the EMA update alone, as a share of the loop's step (the target: at most 2%).

    python benchmarks/train.py --config bench --threads 2
    mpiexec -n 2 python benchmarks/train.py --config tiny --ranks 2   (ranks: how it was launched)
    python benchmarks/train.py --config tiny --variants bare,loop,upstream,einsum,compile
    python benchmarks/train.py --config 10M,60M,250M --variants bare,loop --threads 1

One JSON line per figure, each with the command that reproduces it.
"""
import argparse
import dataclasses
import contextlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from sizes import SIZES  # noqa: E402

CONFIGS = {
    # The bench config: CIFAR-sized, learned sigma, dropout; batch 16.
    "bench": dict(image_size=32, num_channels=64, num_res_blocks=2, attention_resolutions="16,8",
                  learn_sigma=True, dropout=0.1, batch_size=16),
    # README's CIFAR-10 flags (the model of improved-diffusion's CIFAR-10 run); batch 128 per rank.
    "cifar10": dict(image_size=32, num_channels=128, num_res_blocks=3, attention_resolutions="16,8",
                    learn_sigma=True, dropout=0.3, diffusion_steps=4000, noise_schedule="cosine",
                    batch_size=128),
    "tiny": dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="4",
                 learn_sigma=True, dropout=0.1, batch_size=4),
    # benchmarks/sizes.py's models (the checkpoint figures' sizes), at batches that keep a CPU
    # step to a few seconds.
    **{size: dict(SIZES[size], learn_sigma=True, batch_size=batch)
       for size, batch in (("10M", 16), ("60M", 4), ("250M", 1))},
}


def _flags(config):
    from improved_diffusion.script_util import model_and_diffusion_defaults

    cfg = dict(CONFIGS[config])
    batch = cfg.pop("batch_size")
    flags = model_and_diffusion_defaults()
    flags.update(cfg)
    return flags, batch


def _einsum_attention(qkv_attention):
    """Upstream's QKVAttentionLegacy.forward (einsum, softmax in float32): the reference."""
    import torch as th

    def forward(qkv):
        bs, width, length = qkv.shape
        ch = width // (3 * qkv_attention.n_heads)
        q, k, v = qkv.reshape(bs * qkv_attention.n_heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = th.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = th.softmax(weight.float(), dim=-1).type(weight.dtype)
        return th.einsum("bts,bcs->bct", weight, v).reshape(bs, -1, length)
    return forward


def _use_einsum_attention(model):
    from improved_diffusion.unet import QKVAttentionLegacy

    for m in model.modules():
        if isinstance(m, QKVAttentionLegacy):
            m.forward = _einsum_attention(m)


class _Data:
    """Endless synthetic (batch [B, 3, H, W] in [-1, 1], {}) (the loader has its own benchmark)."""

    def __init__(self, batch, size, seed):
        import torch as th

        self.th, self.shape = th, (batch, 3, size, size)
        self.g = th.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self):
        return self.th.rand(self.shape, generator=self.g) * 2 - 1, {}


def setup_rank(args):
    """The start of one benchmark rank (also benchmarks/same_run.py's): torch's threads
    (``args.threads``), the process group when ``args.ranks`` > 1, the seeded model and
    diffusion of ``args.config`` on this rank's device. Returns (rank, world, device, flags,
    batch, model, diffusion). Collective when ``args.ranks`` > 1."""
    import torch as th

    from improved_diffusion import dist_util, train_util
    from improved_diffusion.script_util import create_model_and_diffusion

    th.set_num_threads(args.threads)
    if args.ranks > 1:
        dist_util.setup_dist()
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    device = dist_util.dev()
    flags, batch = _flags(args.config)
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = create_model_and_diffusion(**flags)
    model.to(device)
    return rank, world, device, flags, batch, model, diffusion


def child(args):
    """Run one variant in this process; rank 0 prints {"steps_per_s", "peak_rss_mb", ...}."""
    import torch as th

    from improved_diffusion import dist_util, logger, train_util

    rank, world, device, flags, batch, model, diffusion = setup_rank(args)
    if args.variant in ("einsum", "upstream"):
        _use_einsum_attention(model)
    data = _Data(batch, flags["image_size"], seed=rank)
    steps, warmup = args.steps, args.warmup
    ema_s = None
    tmp = dist_util.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)  # one log dir
    logger.configure(dir=tmp, format_strs=[], rank=rank)
    if args.variant == "loop":
        class NoSave(train_util.TrainLoop):
            def save(self, wait=False):  # the benchmark measures steps, not checkpoints
                pass

        loop = NoSave(model=model, diffusion=diffusion, data=data, batch_size=batch,
                      microbatch=-1, lr=1e-4, ema_rate="0.9999", log_interval=args.log_interval,
                      save_interval=0, resume_checkpoint="", log_dir=tmp, model_flags=flags,
                      max_steps=warmup, seed=0)
        loop.run_loop()
        loop.config = dataclasses.replace(loop.config, max_steps=warmup + steps)
        _sync(device)
        t0 = time.perf_counter()
        loop.run_loop()
        _sync(device)
        elapsed = time.perf_counter() - t0
        reps = 5
        t1 = time.perf_counter()
        for _ in range(reps):
            loop._update_ema()
        _sync(device)
        ema_s = (time.perf_counter() - t1) / reps
        loop.close()
    else:
        step = _bare_step(args.variant, model, diffusion, device, world, batch)
        for _ in range(warmup):
            step(next(data)[0])
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(next(data)[0])
        _sync(device)
        elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        peak = th.cuda.max_memory_allocated(device) / 2 ** 20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = dist_util.all_gather_object(peak)
    if rank == 0:
        print("RESULT " + json.dumps({"steps_per_s": steps / elapsed, "step_s": elapsed / steps,
                                      "params": sum(p.numel() for p in model.parameters()),
                                      "peak_mb_per_rank": [round(p, 1) for p in peaks],
                                      "ema_s": ema_s, "device": device.type,
                                      "sdpa_flash": _flash_takes_attention(model, device)
                                      if args.variant == "bf16" else None,
                                      "threads": th.get_num_threads(), "world": world}),
              flush=True)
    if args.ranks > 1:
        dist_util.barrier()
        dist_util.cleanup()


def _flash_takes_attention(model, device):
    """Whether the model's first attention block runs under bf16 autocast on ``device`` with only
    SDPA's flash backend allowed (False: SDPA would take another kernel there)."""
    import torch as th
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from improved_diffusion.unet import AttentionBlock

    block = next((m for m in model.modules() if isinstance(m, AttentionBlock)), None)
    if block is None:
        return None
    x = th.randn(2, block.channels, 8, 8, device=device)
    try:
        with th.no_grad(), th.autocast(device_type=device.type, dtype=th.bfloat16), \
                sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            block(x)
    except RuntimeError:
        return False
    return True


def _sync(device):
    import torch as th

    if device.type == "cuda":
        th.cuda.synchronize(device)


def _bare_step(variant, model, diffusion, device, world, batch):
    """A function batch -> None doing one bare (or upstream-style) training step."""
    import torch as th
    from torch.nn.parallel.distributed import DistributedDataParallel as DDP

    from improved_diffusion import dist_util, logger, train_util
    from improved_diffusion.resample import UniformSampler

    sampler = UniformSampler(diffusion)
    net = DDP(model, bucket_cap_mb=128) if world > 1 else model
    if variant == "compile":
        net = th.compile(net)
    params = list(model.parameters())
    if variant == "upstream":
        opt = th.optim.AdamW(params, lr=1e-4, foreach=False)
    else:  # the loop's optimizer: the loop's overhead is measured against the same step
        opt = train_util.make_adamw(params, lr=1e-4, weight_decay=0.0)
    ema = [p.detach().clone() for p in params]

    def step(x):
        x = x.to(device)
        opt.zero_grad(set_to_none=True)
        t, weights = sampler.sample(x.shape[0], device)
        amp = (th.autocast(device_type=device.type, dtype=th.bfloat16) if variant == "bf16"
               else contextlib.nullcontext())
        with amp:
            losses = diffusion.training_losses(net, x, t)
        loss = (losses["loss"] * weights).mean()
        loss.backward()
        if variant == "upstream":
            if dist_util.any_rank(False):  # the blocking preemption all-reduce of each step
                raise RuntimeError("unreachable")
            for key, values in losses.items():  # upstream's log_loss_dict: host reads
                values = values * weights
                logger.logkv_mean(key, values.mean().item())
                for sub_t, sub_loss in zip(t.cpu().numpy(), values.detach().cpu().numpy()):
                    logger.logkv_mean(f"{key}_q{int(4 * sub_t / diffusion.num_timesteps)}",
                                      sub_loss)
            sqsum = sum((p.grad.float() ** 2).sum().item() for p in params if p.grad is not None)
            logger.logkv_mean("grad_norm", math.sqrt(sqsum))
        opt.step()
        if variant == "upstream":
            with th.no_grad():
                for targ, src in zip(ema, params):  # upstream's update_ema
                    targ.mul_(0.9999).add_(src, alpha=1 - 0.9999)
    return step


def attention_figures(args):
    """SDPA vs upstream's einsum attention alone (forward + backward of QKVAttentionLegacy at the
    config's attention resolutions), interleaved call by call in this process: a ratio that load
    from other processes disturbs far less than whole steps do."""
    import torch as th

    from improved_diffusion.unet import QKVAttentionLegacy

    th.set_num_threads(args.threads)
    flags, batch = _flags(args.config)
    heads = flags["num_heads"]
    size = flags["image_size"]
    out = []
    for res in [int(r) for r in flags["attention_resolutions"].split(",") if r]:
        ds = size // res
        mult = {32: (1, 2, 2, 2), 64: (1, 2, 3, 4)}.get(size, (1, 2, 2))
        ch = flags["num_channels"] * mult[min(len(mult) - 1, max(0, ds.bit_length() - 1))]
        qkv = th.randn(batch, 3 * ch, res * res, requires_grad=True)
        sdpa = QKVAttentionLegacy(heads)
        einsum = _einsum_attention(sdpa)
        times = {"sdpa": [], "einsum": []}
        for _ in range(args.attention_reps):
            for name, fn in (("sdpa", sdpa), ("einsum", einsum)):
                t0 = time.perf_counter()
                fn(qkv).sum().backward()
                times[name].append(time.perf_counter() - t0)
        sd, es = statistics.median(times["sdpa"]), statistics.median(times["einsum"])
        out.append(dict(figure="attention_einsum_over_sdpa_time", resolution=res, channels=ch,
                        tokens=res * res, heads=heads, batch=batch, value=round(es / sd, 4),
                        sdpa_s=round(sd, 5), einsum_s=round(es, 5), reps=args.attention_reps))
    return out


def parent(args):
    launcher = []
    if args.ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        launcher = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.ranks)]
    variants = args.variants.split(",")
    runs = {v: [] for v in variants}
    for _ in range(args.repeat):
        for v in variants:
            cmd = launcher + [sys.executable, os.path.abspath(__file__), "--child", v,
                              "--config", args.config, "--steps", str(args.steps),
                              "--warmup", str(args.warmup), "--threads", str(args.threads),
                              "--ranks", str(args.ranks), "--log_interval",
                              str(args.log_interval)]
            env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"variant {v} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            runs[v].append(json.loads(lines[-1][len("RESULT "):]))
    command = "python benchmarks/train.py " + " ".join(sys.argv[1:])
    base = dict(config=args.config, ranks=args.ranks, threads=args.threads, steps=args.steps,
                repeat=args.repeat, command=command)
    med = {v: statistics.median(r["step_s"] for r in runs[v]) for v in variants}
    for v in variants:
        r = runs[v]
        batch = _flags(args.config)[1] * args.ranks
        print(json.dumps({"figure": f"train_{v}_steps_per_s", "value": round(1 / med[v], 4),
                          "samples_per_s": round(batch / med[v], 2),
                          **({"sdpa_flash": r[0]["sdpa_flash"]} if v == "bf16" else {}),
                          "peak_mb_per_rank": max((x["peak_mb_per_rank"] for x in r),
                                                  key=max),
                          "device": r[0]["device"], **base}), flush=True)
    if "bare" in med:
        for v in variants:
            if v != "bare":
                goal = {"goal": "<= 1.03"} if v == "loop" else {}
                print(json.dumps({"figure": f"train_{v}_step_time_over_bare",
                                  "value": round(med[v] / med["bare"], 4), **goal,
                                  "params": runs[v][0]["params"], **base}), flush=True)
    if "upstream" in med:
        for v in variants:
            if v != "upstream":
                print(json.dumps({"figure": f"train_{v}_speedup_over_upstream_step",
                                  "value": round(med["upstream"] / med[v], 4), **base}),
                      flush=True)
    if args.attention_reps:
        for fig in attention_figures(args):
            print(json.dumps({**fig, **base}), flush=True)
    if "loop" in runs:
        ema = statistics.median(x["ema_s"] for x in runs["loop"])
        print(json.dumps({"figure": "train_ema_update_share_of_loop_step",
                          "value": round(ema / med["loop"], 5), "ema_s": round(ema, 5),
                          **base}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny",
                    help=f"one of {', '.join(CONFIGS)}, or several, comma-separated (one after "
                         f"the other)")
    ap.add_argument("--variants", default="bare,loop,upstream")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=1, help="run each variant under mpiexec -n N")
    ap.add_argument("--log_interval", type=int, default=10)
    ap.add_argument("--attention_reps", type=int, default=20,
                    help="calls of SDPA and einsum attention alone (0: skip that figure)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    configs = args.config.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--config {','.join(unknown)}: not one of {', '.join(CONFIGS)}")
    for config in configs:
        args.config = config
        parent(args)


if __name__ == "__main__":
    main()
