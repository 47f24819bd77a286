"""What the same run on any rank count costs (issue 44, item 5): the real TrainLoop's step with
the fixed-order reduction (``--global_batch_size G --microbatch m``: virtual shards, an exact
int64 sum of the gradients, improved_diffusion/virtual_shards.py) against the plain DDP
all-reduce (G off: ``--batch_size G/W`` per rank, the same ``--microbatch m``, so the same
samples per step and the same count of forwards and backwards), at each --ranks (mpiexec).

    python benchmarks/same_run.py --config bench --ranks 2,3 --global_batch 24 --microbatch 4
    python benchmarks/same_run.py --ranks 1 ...   (one process, no launcher: the shards' own
                                                   passes against plain accumulation, on a GPU)

Each variant runs in its own process (its peak memory is its own), the variants alternate run by
run (ddp, fixed, ddp, fixed, ...; as benchmarks/train.py does) so that load from other processes
hits them alike, and the figures are medians over --repeat runs. Synthetic data
(benchmarks/train.py's), no checkpoint written; --warmup steps before the timed --steps (the
fixed variant's first step always runs its shards twice: no fixed-point range is known yet).

One JSON line per figure and rank count, each with its command:

- ``same_run_ddp_steps_per_s`` / ``same_run_fixed_steps_per_s``: steps per second of each
  variant (median), samples per second (G per step);
- ``same_run_fixed_step_time_over_ddp``: the fixed variant's step time over DDP's (goal <= 1.15);
- ``same_run_fixed_point_share_of_step``: the seconds per step the fixed variant spends in its
  own passes, timed inside the step (FixedPointSum.add: quantising each shard's gradients into
  the int64 accumulators; write_grads: back to float32), over its step time (the largest rank's);
  beside it each rank's seconds in ``reduce`` (the exponents' MAX all-reduce and the int64 SUM
  all-reduce, waits for slower ranks included, as DDP's all-reduce has them). A share of the
  same step in the same process: on a loaded machine far steadier than the ratio of two runs;
- ``same_run_peak_rss_mb``: each variant's peak resident memory per rank (the maximum over the
  runs, each rank's ru_maxrss: the model, Adam moments, EMA, activations and torch itself; on a
  GPU torch.cuda.max_memory_allocated instead), the
  extra memory of the fixed variant per rank (its largest rank's peak minus DDP's), and the
  gradient bytes (one float32 copy of every trained parameter; the goal: extra <= 2 of them);
- ``same_run_double_steps``: how many timed steps ran their shards twice (a gradient outgrew
  its fixed-point range; 0 expected after the first step), and in the whole run (warm-up too).

At 64 ranks on NCCL, on paper (from the algorithm in virtual_shards.py; P trained parameters in
float32, T parameter tensors, S = G/(m*W) shards per rank; the figures above are gloo on a CPU):

- communication: DDP all-reduces 4P bytes of float32 per step in buckets, overlapped with the
  backward of the last microbatch. The fixed variant all-reduces the int64 accumulators, 8P
  bytes, in one flat buffer after the rank's last shard: a ring all-reduce moves 2(W-1)/W of the
  bytes through each link, so twice DDP's bytes at any W (at 64 ranks 2*63/64 ~ 2 times 8P per
  link), and none of it hidden behind compute. Before it, one MAX all-reduce of T int64
  exponents (T = 334 for the bench model: latency only), and at the end a broadcast of the
  buffers (none in a UNet without BatchNorm). NCCL's int64 SUM is exact in any order, so the
  ring's (or a tree's) order does not matter. For the bench model (9.9M parameters: 40 MB
  float32, 80 MB int64) at ~25 GB/s of bus bandwidth per GPU across nodes (InfiniBand): about
  6 ms exposed per step against DDP's 3 ms, mostly hidden; within a node (NVLink, ~150+ GB/s)
  about 1 ms. It grows with the model, not with W: a 1B-parameter model moves 8 GB of int64 per
  step, ~0.6 s exposed at 25 GB/s, where DDP's 4 GB hide behind the backward as far as the
  backward is long; there the all-reduce, not the quantisation, decides the ratio.
- compute: per shard, FixedPointSum.add runs about eight elementwise kernels per parameter
  tensor (abs-max, float64 cast, nan_to_num, scale, round, clamp, int64 cast, add): ~100 bytes
  of memory traffic per parameter, ~1 GB per shard for the bench model, ~0.3 ms at an H100's
  3 TB/s; but T*8 ~ 2,700 kernel launches per shard (~5 us each: ~13 ms), which for a small
  model's 30-50 ms shard would be 25-40% unless the pass is fused (one flat gradient buffer, or
  torch._foreach ops: a handful of launches). write_grads: a few kernels per tensor once per
  step. S shards per rank cost S such passes; S shrinks as W grows for a fixed G (at 64 ranks,
  G=1024, m=16: one shard per rank), so the share of the step stays as measured at S shards.
- the rare double step: when a gradient outgrows 2**8 times the last step's largest value
  (HEADROOM_BITS) the step's shards run again: one step's forward and backward, at the first
  step of a run (no range known yet: a resume keeps the range in the checkpoint) and at loss
  spikes; ``same_run_double_steps`` counts them. It does not grow with W: the decision is one MAX
  all-reduce that every rank reads alike.
- memory: the int64 accumulators, 8P bytes (two float32 gradient copies) per rank, plus during
  add() the float64 temporaries of one tensor at a time (the largest tensor x 8-16 bytes);
  DDP keeps its bucket copy of the gradients (4P) instead, which the fixed variant does not
  make. On a GPU: about one gradient copy more than DDP, independent of W (within the issue's
  goal of two). On this CPU the fixed variant's peak RSS came out below DDP's
  (``same_run_peak_rss_mb``): gloo's and the allocator's buffers count there too.
"""
import argparse
import dataclasses
import json
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

from train import CONFIGS, _Data, _sync, setup_rank  # noqa: E402  (benchmarks/train.py)

VARIANTS = ("ddp", "fixed")
COMMAND = "python benchmarks/same_run.py"


def child(args):
    """One variant's TrainLoop in this process (a rank of an mpiexec job); rank 0 prints RESULT
    {...}: the timed steps' seconds, each rank's peak RSS, the gradient bytes, the double steps."""
    import torch as th

    from improved_diffusion import dist_util, logger, train_util

    rank, world, device, flags, _, model, diffusion = setup_rank(args)
    G, m = args.global_batch, args.microbatch
    data = _Data(G // world, flags["image_size"], seed=rank)
    tmp = dist_util.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)  # one log dir
    logger.configure(dir=tmp, format_strs=[], rank=rank)

    class NoSave(train_util.TrainLoop):
        def save(self, wait=False):  # the benchmark measures steps, not checkpoints
            pass

    fixed = args.variant == "fixed"
    loop = NoSave(model=model, diffusion=diffusion, data=data, batch_size=G // world,
                  microbatch=m, lr=1e-4, ema_rate="0.9999", log_interval=args.log_interval,
                  save_interval=0, resume_checkpoint="", log_dir=tmp, model_flags=flags,
                  max_steps=args.warmup, seed=0, global_batch_size=G if fixed else 0)
    assert (loop.virtual_shards is not None) == fixed and loop.use_ddp == (not fixed and world > 1)
    redos = lambda: loop.virtual_shards.sum.redos if fixed else 0  # noqa: E731
    spent = _time_fixed_point(loop.virtual_shards.sum) if fixed else {}
    loop.run_loop()
    before = redos()
    spent.update((k, 0.0) for k in spent)  # the timed steps' alone
    loop.config = dataclasses.replace(loop.config, max_steps=args.warmup + args.steps)
    _sync(device)
    t0 = time.perf_counter()
    loop.run_loop()
    _sync(device)
    elapsed = time.perf_counter() - t0
    timed_redos, all_redos = redos() - before, redos()
    loop.close()
    if device.type == "cuda":  # the accelerator's memory, as benchmarks/train.py reports it
        peak = th.cuda.max_memory_allocated(device) / 2 ** 20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = dist_util.all_gather_object(peak)
    spent = dist_util.all_gather_object({k: v / args.steps for k, v in spent.items()})
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                         if p.requires_grad)
        print("RESULT " + json.dumps({
            "step_s": elapsed / args.steps, "peak_mb_per_rank": [round(p, 1) for p in peaks],
            "grad_bytes": grad_bytes, "params": sum(p.numel() for p in model.parameters()),
            "double_steps_timed": timed_redos, "double_steps_all": all_redos, "world": world,
            "threads": th.get_num_threads(), "device": device.type,
            "fixed_point_s_per_rank": spent if fixed else None}), flush=True)
    if args.ranks > 1:
        dist_util.barrier()
        dist_util.cleanup()


def _time_fixed_point(fx):
    """Wrap the FixedPointSum ``fx``'s add, reduce and write_grads with timers: returns {name:
    seconds spent in it} (the dict the wrappers add to)."""
    spent = {}
    for name in ("add", "reduce", "write_grads"):
        def timed(*a, _call=getattr(fx, name), _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _call(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t0
        spent[name] = 0.0
        setattr(fx, name, timed)
    return spent


def parent(args, ranks):
    """Run the variants alternately --repeat times on ``ranks`` ranks; print the figures."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = ([mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks)]
                if ranks > 1 else [])
    runs = {v: [] for v in VARIANTS}
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(args.threads))
    for _ in range(args.repeat):
        for v in VARIANTS:
            cmd = launcher + [sys.executable, os.path.abspath(__file__), "--child", v,
                              "--config", args.config, "--ranks", str(ranks),
                              "--global_batch", str(args.global_batch),
                              "--microbatch", str(args.microbatch), "--steps", str(args.steps),
                              "--warmup", str(args.warmup), "--threads", str(args.threads),
                              "--log_interval", str(args.log_interval)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"variant {v} on {ranks} ranks failed (exit {out.returncode}):\n"
                         f"{(out.stdout + out.stderr)[-3000:]}")
            runs[v].append(json.loads(lines[-1][len("RESULT "):]))
    base = dict(config=args.config, ranks=ranks, global_batch=args.global_batch,
                microbatch=args.microbatch, shards_per_rank=args.global_batch // args.microbatch
                // ranks, threads=args.threads, steps=args.steps, warmup=args.warmup,
                repeat=args.repeat, device=runs["ddp"][0]["device"],
                command=f"{COMMAND} " + " ".join(sys.argv[1:]))
    med = {v: statistics.median(r["step_s"] for r in runs[v]) for v in VARIANTS}
    for v in VARIANTS:
        print(json.dumps({"figure": f"same_run_{v}_steps_per_s", "value": round(1 / med[v], 4),
                          "samples_per_s": round(args.global_batch / med[v], 2),
                          "step_s_runs": [round(r["step_s"], 4) for r in runs[v]], **base}),
              flush=True)
    print(json.dumps({"figure": "same_run_fixed_step_time_over_ddp",
                      "value": round(med["fixed"] / med["ddp"], 4), "goal": "<= 1.15",
                      "params": runs["fixed"][0]["params"], **base}), flush=True)
    # seconds per step in the fixed-point passes, each rank's median over the runs
    per_rank = [{k: statistics.median(r["fixed_point_s_per_rank"][i][k] for r in runs["fixed"])
                 for k in ("add", "reduce", "write_grads")} for i in range(ranks)]
    own = max(x["add"] + x["write_grads"] for x in per_rank)
    print(json.dumps({"figure": "same_run_fixed_point_share_of_step",
                      "value": round(own / med["fixed"], 4),
                      "quantise_and_write_s": round(own, 4),
                      "reduce_s_per_rank": [round(x["reduce"], 4) for x in per_rank],
                      "add_s_per_rank": [round(x["add"], 4) for x in per_rank],
                      "write_grads_s_per_rank": [round(x["write_grads"], 4) for x in per_rank],
                      "fixed_step_s": round(med["fixed"], 4), **base}), flush=True)
    peak = {v: [max(r["peak_mb_per_rank"][i] for r in runs[v]) for i in range(ranks)]
            for v in VARIANTS}
    grad_mb = runs["fixed"][0]["grad_bytes"] / 2 ** 20
    extra = max(peak["fixed"]) - max(peak["ddp"])
    print(json.dumps({"figure": "same_run_peak_rss_mb", "ddp_per_rank": peak["ddp"],
                      "fixed_per_rank": peak["fixed"], "extra_mb": round(extra, 1),
                      "grad_bytes": runs["fixed"][0]["grad_bytes"], "grad_mb": round(grad_mb, 1),
                      "extra_in_gradient_copies": round(extra / grad_mb, 2),
                      "goal": "extra <= 2 gradient copies", **base}), flush=True)
    print(json.dumps({"figure": "same_run_double_steps",
                      "value": sum(r["double_steps_timed"] for r in runs["fixed"]),
                      "timed_steps": args.steps * args.repeat,
                      "in_whole_runs": sum(r["double_steps_all"] for r in runs["fixed"]),
                      "all_steps": (args.steps + args.warmup) * args.repeat, **base}),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="bench", help=f"one of {', '.join(CONFIGS)} "
                                                      f"(benchmarks/train.py's)")
    ap.add_argument("--ranks", default="2,3", help="rank counts, comma-separated (mpiexec -n)")
    ap.add_argument("--global_batch", type=int, default=24, help="G: samples per step")
    ap.add_argument("--microbatch", type=int, default=4,
                    help="m: samples per virtual shard (and DDP's microbatch)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--log_interval", type=int, default=10)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        args.ranks = int(args.ranks)
        child(args)
        return
    if args.config not in CONFIGS:
        ap.error(f"--config {args.config}: not one of {', '.join(CONFIGS)}")
    rank_counts = [int(r) for r in args.ranks.split(",")]
    K = args.global_batch // args.microbatch if args.microbatch else 0
    bad = [r for r in rank_counts if not K or args.global_batch % args.microbatch or K % r]
    if bad:
        ap.error(f"--global_batch {args.global_batch} / --microbatch {args.microbatch} does not "
                 f"split into shards over {', '.join(map(str, bad))} rank(s)")
    for ranks in rank_counts:
        parent(args, ranks)


if __name__ == "__main__":
    main()
