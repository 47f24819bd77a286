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
- ``loop_fp16``: the real TrainLoop with ``--use_fp16 True`` (amp.py: float16 autocast and a
  GradScaler on CUDA; bfloat16 on a CPU with bf16 units).
- ``loop_bf16``: the real TrainLoop under bfloat16 autocast without a scaler (the loop's
  ``amp_dtype`` set to bfloat16 after it is built: no flag asks for bf16 on CUDA).
- ``loop_det``: the real TrainLoop with ``--deterministic True`` (dist_util.set_deterministic,
  called first, before CUDA initialises, as train_job does); ``train_loop_det_step_time_over_loop``
  compares it with ``loop`` (goal <= 1.10).
- ``upstream_code`` / ``upstream_code_fp16``: upstream's own TrainLoop (openai/improved-diffusion,
  fp32 / its fp16 master weights), run by benchmarks/upstream_train.py in a process of its own
  from ``third_party/improved_diffusion_upstream`` (see there); ``train_loop_speedup_over_
  upstream_code`` and ``train_loop_fp16_speedup_over_upstream_code_fp16`` (goal >= 2).

The loop variants report the attention kernels SDPA took in one more (profiled) step after the
timed ones (``sdpa_kernels``: torch.profiler's aten op names; ``sdpa_flash``: one of them is a
flash kernel). ``--batch_size max`` (one process per variant): the largest batch of 32, 64, 128,
... (and then half-way to the next) whose step fits in the device's memory, found by one step of
each before the timing (``batch_search``). ``--global_batch_size``/``--microbatch``: the loop
variants' virtual shards (virtual_shards.py).

Also printed: the EMA update alone, as a share of the loop's step (the target: at most 2%).

    python benchmarks/train.py --config bench --threads 2
    mpiexec -n 2 python benchmarks/train.py --config tiny --ranks 2   (ranks: how it was launched)
    python benchmarks/train.py --config tiny --variants bare,loop,upstream,einsum,compile
    python benchmarks/train.py --config 10M,60M,250M --variants bare,loop --threads 1
    python benchmarks/train.py --config cifar10 --variants loop,loop_fp16,upstream_code,upstream_code_fp16
    python benchmarks/train.py --config dit-xl2 --variants loop_bf16 --batch_size max

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
    # the smallest UNet upstream's code builds (it knows 32, 64 and 256 px): the CPU check's
    "tiny32": dict(image_size=32, num_channels=32, num_res_blocks=1, attention_resolutions="16",
                   learn_sigma=True, dropout=0.1, batch_size=2),
    # DiT-XL/2 on 32x32x4 latents (256 px images through SD's VAE), class-conditional, DiT's
    # label dropout; the batch of facebookresearch/DiT's per-GPU runs (256 over 8 GPUs)
    "dit-xl2": dict(arch="DiT-XL/2", image_size=32, in_channels=4, learn_sigma=True,
                    class_cond=True, num_classes=1000, class_dropout_prob=0.1, batch_size=32),
    # the same code at a CPU's size: one DiT block of width 64 on 8x8x4 latents
    "dit-tiny": dict(arch="DiT-S/2", dit_depth=1, dit_hidden_size=64, dit_num_heads=2,
                     image_size=8, in_channels=4, learn_sigma=True, class_cond=True,
                     num_classes=10, class_dropout_prob=0.1, batch_size=2),
    # benchmarks/sizes.py's models (the checkpoint figures' sizes), at batches that keep a CPU
    # step to a few seconds.
    **{size: dict(SIZES[size], learn_sigma=True, batch_size=batch)
       for size, batch in (("10M", 16), ("60M", 4), ("250M", 1))},
}


def _flags(config, batch_size=None):
    """(all model and diffusion flags of ``config``, its batch or ``batch_size`` when that is an
    int)."""
    from improved_diffusion.script_util import model_and_diffusion_defaults

    cfg = dict(CONFIGS[config])
    batch = cfg.pop("batch_size")
    flags = model_and_diffusion_defaults()
    flags.update(cfg)
    if isinstance(batch_size, int):
        batch = batch_size
    return flags, batch


def upstream_flags(config):
    """The flags of ``config`` as upstream's create_model_and_diffusion takes them (its defaults
    for the rest; our defaults equal them)."""
    cfg = dict(CONFIGS[config])
    cfg.pop("batch_size")
    return cfg


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
    """Endless synthetic (batch [B, C, H, W] in [-1, 1], {} or {"y": labels}) (the loader has
    its own benchmark). ``batch`` can be changed between batches (the batch search)."""

    def __init__(self, batch, size, seed, channels=3, num_classes=None):
        import torch as th

        self.th, self.batch, self.size, self.channels = th, batch, size, channels
        self.num_classes = num_classes
        self.g = th.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self):
        x = self.th.rand((self.batch, self.channels, self.size, self.size),
                         generator=self.g) * 2 - 1
        if self.num_classes:
            return x, {"y": self.th.randint(0, self.num_classes, (self.batch,), generator=self.g)}
        return x, {}


LOOP_VARIANTS = ("loop", "loop_fp16", "loop_bf16", "loop_det")
UPSTREAM_CODE = {"upstream_code": False, "upstream_code_fp16": True}  # variant -> --fp16
VARIANTS = ("bare", "upstream", "einsum", "compile", "bf16", *LOOP_VARIANTS, *UPSTREAM_CODE)


def setup_rank(args):
    """The start of one benchmark rank (also benchmarks/same_run.py's): torch's threads
    (``args.threads``), the process group when ``args.ranks`` > 1, the seeded model and
    diffusion of ``args.config`` on this rank's device. Returns (rank, world, device, flags,
    batch, model, diffusion). Collective when ``args.ranks`` > 1."""
    import torch as th

    from improved_diffusion import dist_util, train_util

    th.set_num_threads(args.threads)
    if args.ranks > 1:
        dist_util.setup_dist()
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    device = dist_util.dev()
    flags, batch = _flags(args.config, getattr(args, "batch_size", None))
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = build_on(device, flags)
    return rank, world, device, flags, batch, model, diffusion


def build_on(device, flags):
    """The model and diffusion of ``flags``, the model's weights made (initialised) on
    ``device`` itself when that is a GPU (DiT-XL/2's 675M parameters initialise there in a
    fraction of the CPU's time; the speed does not depend on which random weights)."""
    import contextlib

    import torch as th

    from improved_diffusion.script_util import create_model_and_diffusion

    where = th.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with where:
        model, diffusion = create_model_and_diffusion(**flags)
    return model.to(device), diffusion


def _oom_error():
    import torch as th

    return getattr(th, "OutOfMemoryError", None) or th.cuda.OutOfMemoryError


def largest_batch(run_one, data, device, start, limit):
    """The largest batch (``start``, 2x, 4x, ... up to ``limit``, then half-way to the first
    that did not fit) for which ``run_one()`` (one training step on ``data``'s next batch) runs
    without running out of device memory. Returns (batch, {batch: "ok" | "oom"})."""
    import gc

    import torch as th

    tried, fits, batch = {}, None, start
    while batch <= limit:
        data.batch = batch
        if not _try_step(run_one, device, tried, batch, th, gc):
            break
        fits, batch = batch, batch * 2
    if fits is None:
        raise SystemExit(f"--batch_size max: not even a batch of {start} fits on {device}")
    if batch <= limit and fits * 3 // 2 > fits:  # the first that failed, not the limit
        mid = fits * 3 // 2
        data.batch = mid
        if _try_step(run_one, device, tried, mid, th, gc):
            fits = mid
    data.batch = fits
    return fits, tried


def _try_step(run_one, device, tried, batch, th, gc):
    ok = True
    try:
        run_one()
        _sync(device)
    except _oom_error():
        ok = False
    tried[batch] = "ok" if ok else "oom"
    gc.collect()
    if device.type == "cuda":
        th.cuda.empty_cache()
    return ok


def sdpa_kernels(run_one):
    """The scaled-dot-product-attention ops one call of ``run_one`` ran (torch.profiler's aten op
    names, CPU activity only: which kernel SDPA chose shows in its op's name)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_one()
    keys = {e.key for e in prof.key_averages()}
    return sorted(k for k in keys if k.startswith("aten::") and any(
        w in k for w in ("_scaled_dot_product_", "flash_attention", "efficient_attention",
                         "cudnn_attention")))


def _loop_step_fn(loop):
    """One more step of the real TrainLoop.run_loop."""
    def one():
        loop.config = dataclasses.replace(loop.config, max_steps=loop.step + 1)
        loop.run_loop()
    return one


def child(args):
    """Run one variant in this process; rank 0 prints {"steps_per_s", "peak_rss_mb", ...}."""
    if args.variant == "loop_det":  # before CUDA initialises, as train_job.start_job does
        from improved_diffusion import dist_util as _du

        _du.set_deterministic(True)
    import torch as th

    from improved_diffusion import dist_util, logger, train_util

    rank, world, device, flags, batch, model, diffusion = setup_rank(args)
    if args.variant in ("einsum", "upstream"):
        _use_einsum_attention(model)
    classes = flags["num_classes"] if flags.get("class_cond") else None
    search = args.batch_size == "max"
    if args.global_batch_size and args.variant in LOOP_VARIANTS:
        batch = args.global_batch_size // world  # the loop's shard plan checks it
    if search:
        batch = args.batch_start
    data = _Data(batch, flags["image_size"], seed=rank, channels=flags["in_channels"],
                 num_classes=classes)
    steps, warmup = args.steps, args.warmup
    ema_s = kernels = tried = None
    tmp = dist_util.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)  # one log dir
    logger.configure(dir=tmp, format_strs=[], rank=rank)
    if args.variant in LOOP_VARIANTS:
        class NoSave(train_util.TrainLoop):
            def save(self, wait=False):  # the benchmark measures steps, not checkpoints
                pass

        extra = {}
        if args.global_batch_size:
            extra["global_batch_size"] = args.global_batch_size
        loop = NoSave(model=model, diffusion=diffusion, data=data, batch_size=batch,
                      microbatch=args.microbatch, lr=1e-4, ema_rate="0.9999",
                      log_interval=args.log_interval, save_interval=0, resume_checkpoint="",
                      log_dir=tmp, model_flags=flags, max_steps=0, seed=0,
                      use_fp16=args.variant == "loop_fp16", **extra)
        if args.variant == "loop_bf16":
            loop.amp_dtype, loop.grad_scaler = th.bfloat16, None
        one = _loop_step_fn(loop)
        if search:
            batch, tried = largest_batch(one, data, device, args.batch_start, args.batch_limit)
            loop.batch_size = loop.global_batch = batch  # what its log says; not the step
        loop.config = dataclasses.replace(loop.config, max_steps=loop.step + warmup)
        loop.run_loop()
        loop.config = dataclasses.replace(loop.config, max_steps=loop.step + steps)
        _sync(device)
        t0 = time.perf_counter()
        loop.run_loop()
        _sync(device)
        elapsed = time.perf_counter() - t0
        kernels = sdpa_kernels(one)
        reps = 5
        t1 = time.perf_counter()
        for _ in range(reps):
            loop._update_ema()
        _sync(device)
        ema_s = (time.perf_counter() - t1) / reps
        loop.close()
    else:
        if search:
            raise SystemExit("--batch_size max: only for the loop variants")
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
        flash = (_flash_takes_attention(model, device) if args.variant == "bf16"
                 else None if kernels is None else any("flash" in k for k in kernels))
        print("RESULT " + json.dumps({"steps_per_s": steps / elapsed, "step_s": elapsed / steps,
                                      "params": sum(p.numel() for p in model.parameters()),
                                      "peak_mb_per_rank": [round(p, 1) for p in peaks],
                                      "ema_s": ema_s, "device": device.type,
                                      "device_name": _device_name(device),
                                      "batch": batch, "batch_search": tried,
                                      "sdpa_flash": flash, "sdpa_kernels": kernels,
                                      "threads": th.get_num_threads(), "world": world}),
              flush=True)
    if args.ranks > 1:
        dist_util.barrier()
        dist_util.cleanup()


def _device_name(device):
    import torch as th

    return th.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


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


GOALS = {  # (figure, config or None: any) -> goal
    ("train_loop_speedup_over_upstream_code", None): ">= 2",
    ("train_loop_fp16_speedup_over_upstream_code_fp16", None): ">= 2",
    ("train_loop_det_step_time_over_loop", None): "<= 1.10",
    ("train_loop_step_time_over_bare", None): "<= 1.03",
    ("train_loop_bf16_steps_per_s", "dit-xl2"): "samples_per_s >= 200 on one H100",
}


def _goal(figure, config):
    goal = GOALS.get((figure, config)) or GOALS.get((figure, None))
    return {"goal": goal} if goal else {}


def variant_command(args, v):
    """The command line of one run of variant ``v`` (upstream's own code: upstream_train.py)."""
    if v in UPSTREAM_CODE:
        if args.ranks > 1:
            sys.exit(f"--variants {v}: one rank only (upstream's code runs in one process)")
        batch = _flags(args.config, args.batch_size)[1]
        return [sys.executable, os.path.join(REPO, "benchmarks", "upstream_train.py"),
                "--flags", json.dumps(upstream_flags(args.config)), "--batch", str(batch),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
                str(args.threads), "--log_interval", str(args.log_interval),
                *(["--fp16"] if UPSTREAM_CODE[v] else [])]
    launcher = []
    if args.ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        launcher = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.ranks)]
    return launcher + [sys.executable, os.path.abspath(__file__), "--child", v,
                       "--config", args.config, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--threads", str(args.threads),
                       "--ranks", str(args.ranks), "--log_interval", str(args.log_interval),
                       "--batch_size", str(args.batch_size or "config"),
                       "--batch_start", str(args.batch_start),
                       "--batch_limit", str(args.batch_limit),
                       "--global_batch_size", str(args.global_batch_size),
                       "--microbatch", str(args.microbatch)]


def _variant_line(args, v, r, base):
    """The JSON line of variant ``v`` over its runs ``r``."""
    step_s = statistics.median(x["step_s"] for x in r)
    batch = (r[0].get("batch") or _flags(args.config, args.batch_size)[1]) * args.ranks
    if v in LOOP_VARIANTS and args.global_batch_size:
        batch = args.global_batch_size
    extra = {k: r[0][k] for k in ("sdpa_flash", "sdpa_kernels", "batch_search",
                                  "device_name", "precision", "upstream")
             if r[0].get(k) is not None}
    if v in LOOP_VARIANTS and args.global_batch_size:
        extra.update(global_batch_size=args.global_batch_size, microbatch=args.microbatch)
    figure = f"train_{v}_steps_per_s"
    print(json.dumps({"figure": figure, "value": round(1 / step_s, 4),
                      "samples_per_s": round(batch / step_s, 2), "batch": batch, **extra,
                      **_goal(figure, args.config),
                      "peak_mb_per_rank": max((x["peak_mb_per_rank"] for x in r),
                                              key=lambda p: max(q or 0 for q in p)),
                      "device": r[0]["device"], **base}), flush=True)


def parent(args):
    variants = args.variants.split(",")
    runs, failed = {v: [] for v in variants}, set()
    command = "python benchmarks/train.py " + " ".join(sys.argv[1:])
    base = dict(config=args.config, ranks=args.ranks, threads=args.threads, steps=args.steps,
                repeat=args.repeat, command=command)
    for _ in range(args.repeat):
        for v in variants:
            cmd = variant_command(args, v)
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            if v in UPSTREAM_CODE:  # upstream's package has our package's name: not ours
                env.pop("PYTHONPATH", None)
            else:
                env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not lines:  # the other variants still run
                print(f"variant {v} failed (exit {out.returncode}):\n"
                      f"{(out.stderr or out.stdout)[-3000:]}", file=sys.stderr, flush=True)
                failed.add(v)
                continue
            runs[v].append(json.loads(lines[-1][len("RESULT "):]))
            if len(runs[v]) == args.repeat:  # printed at once: a later variant may not finish
                _variant_line(args, v, runs[v], base)
    variants = [v for v in variants if runs[v]]
    med = {v: statistics.median(r["step_s"] for r in runs[v]) for v in variants}

    def ratio(figure, value):
        print(json.dumps({"figure": figure, "value": round(value, 4),
                          **_goal(figure, args.config), **base}), flush=True)

    if "bare" in med:
        for v in variants:
            if v != "bare" and v not in UPSTREAM_CODE:
                ratio(f"train_{v}_step_time_over_bare", med[v] / med["bare"])
    if "upstream" in med:
        for v in variants:
            if v != "upstream" and v not in UPSTREAM_CODE:
                ratio(f"train_{v}_speedup_over_upstream_step", med["upstream"] / med[v])
    for ours, theirs in (("loop", "upstream_code"), ("loop_fp16", "upstream_code_fp16"),
                         ("loop_bf16", "upstream_code_fp16")):
        if ours in med and theirs in med:
            ratio(f"train_{ours}_speedup_over_{theirs}", med[theirs] / med[ours])
    if "loop" in med and "loop_det" in med:
        ratio("train_loop_det_step_time_over_loop", med["loop_det"] / med["loop"])
    if args.attention_reps:
        for fig in attention_figures(args):
            print(json.dumps({**fig, **base}), flush=True)
    if "loop" in med:
        ema = statistics.median(x["ema_s"] for x in runs["loop"])
        print(json.dumps({"figure": "train_ema_update_share_of_loop_step",
                          "value": round(ema / med["loop"], 5), "ema_s": round(ema, 5),
                          **base}), flush=True)
    if failed:
        sys.exit(f"benchmarks/train.py: variant(s) {', '.join(sorted(failed))} failed (above)")


def _batch_flag(text):
    if text in ("max", "config"):
        return None if text == "config" else text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer, max, or config")
    return value


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
    ap.add_argument("--batch_size", type=_batch_flag, default=None,
                    help="the per-rank batch (default: the config's); max: the largest that "
                         "fits (the loop variants)")
    ap.add_argument("--batch_start", type=int, default=32, help="--batch_size max: from here")
    ap.add_argument("--batch_limit", type=int, default=4096, help="--batch_size max: up to here")
    ap.add_argument("--global_batch_size", type=int, default=0,
                    help="the loop variants' virtual shards (0: off)")
    ap.add_argument("--microbatch", type=int, default=-1)
    ap.add_argument("--attention_reps", type=int, default=20,
                    help="calls of SDPA and einsum attention alone (0: skip that figure)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    if args.batch_size == "max" and args.global_batch_size:
        ap.error("--batch_size max and --global_batch_size: one or the other")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: not one of {', '.join(VARIANTS)}")
    configs = args.config.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--config {','.join(unknown)}: not one of {', '.join(CONFIGS)}")
    for config in configs:
        args.config = config
        parent(args)


if __name__ == "__main__":
    main()
