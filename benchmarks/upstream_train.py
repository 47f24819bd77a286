"""Upstream's own training step, timed: openai/improved-diffusion's TrainLoop (its code, not ours)
on the same synthetic data and model flags as benchmarks/train.py's variants (issue 53).

Upstream's package is also called ``improved_diffusion``, so this runs in a process of its own
with a sys.path of its own: ``third_party/improved_diffusion_upstream`` (upstream's
``improved_diffusion/`` folder as its repository has it, git-ignored; see ``find_upstream``)
first, this checkout's folder nowhere on it. benchmarks/train.py runs it for its
``upstream_code`` and ``upstream_code_fp16`` variants and reads its ``RESULT`` line:

    python benchmarks/upstream_train.py --flags '{"image_size": 32, ...}' --batch 128 \
        --steps 20 --warmup 5 [--fp16]

What stands in for upstream's surroundings, and why it does not change the step:

- ``mpi4py``: upstream's dist_util imports it for its rank (``dev()``: ``cuda:RANK % 8``) and
  its broadcasts; one process of rank 0 of 1 replaces it (``_OneRankMPI``), so no MPI library is
  needed (the GPU machine has none).
- ``blobfile``: imported by upstream's dist_util and train_util for its checkpoint files, which
  this benchmark never reads or writes; a local-file stand-in.
- the process group: upstream's ``setup_dist`` asks DNS for this host's address; a one-rank
  group on an in-process store replaces it (NCCL on CUDA, gloo on a CPU, as upstream chooses).

The loop is upstream's ``run_loop`` body (``run_step``, ``logger.dumpkvs`` every
``--log_interval`` steps), without its saves; upstream's ``DDP`` wrapper on CUDA (it wraps even
one rank), its fp16 master weights with ``--fp16`` (``use_fp16=True``: the model's blocks in
float16, float32 master copies, a dynamic loss scale checked per parameter), its per-step
``.item()`` reads, its per-parameter EMA and its ``AdamW`` as they are.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM_DIR = os.path.join(REPO, "third_party", "improved_diffusion_upstream")
UPSTREAM_REPO = "github:openai/improved-diffusion"


def find_upstream(path=UPSTREAM_DIR):
    """The folder holding upstream's ``improved_diffusion`` package, or a SystemExit naming what
    to do when it is missing."""
    if not os.path.isfile(os.path.join(path, "improved_diffusion", "train_util.py")):
        raise SystemExit(
            f"upstream's code is missing: {path}/improved_diffusion/train_util.py not found. "
            f"Put openai/improved-diffusion's improved_diffusion/ folder there (git clone "
            f"https://github.com/openai/improved-diffusion and copy it; the folder is "
            f"git-ignored, and the device tool takes it along with carry=[\"third_party/\"])")
    return path


class _OneRankComm:
    rank, size = 0, 1

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, obj, root=0):
        return obj

    def gather(self, obj, root=0):
        return [obj]

    def allgather(self, obj):
        return [obj]

    def Barrier(self):
        pass

    barrier = Barrier


def _install_stand_ins():
    """mpi4py and blobfile as upstream imports them (see the module docstring)."""
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = _OneRankComm()
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi
    sys.modules["mpi4py"], sys.modules["mpi4py.MPI"] = pkg, mpi
    bf = types.ModuleType("blobfile")
    bf.BlobFile, bf.join, bf.dirname = open, os.path.join, os.path.dirname
    bf.exists, bf.listdir, bf.basename = os.path.exists, os.listdir, os.path.basename
    sys.modules["blobfile"] = bf


def _import_upstream(path):
    """Upstream's modules, from ``path`` only (this checkout's package off sys.path)."""
    here = {os.path.realpath(p) for p in (REPO, os.path.join(REPO, "benchmarks"))}
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) not in here]
    sys.path.insert(0, path)
    for name in [m for m in sys.modules if m == "improved_diffusion" or
                 m.startswith("improved_diffusion.")]:
        del sys.modules[name]
    _install_stand_ins()
    import improved_diffusion
    from improved_diffusion import dist_util, logger, script_util, train_util

    where = os.path.realpath(os.path.dirname(improved_diffusion.__file__))
    if not where.startswith(os.path.realpath(path) + os.sep):
        raise SystemExit(f"imported improved_diffusion from {where}, not upstream's {path}")
    return dist_util, logger, script_util, train_util, where


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flags", required=True,
                    help="JSON: the model and diffusion flags (upstream's defaults for the rest)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fp16", action="store_true", help="upstream's use_fp16=True")
    ap.add_argument("--log_interval", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--upstream_dir", default=UPSTREAM_DIR)
    args = ap.parse_args()
    path = find_upstream(args.upstream_dir)

    import torch as th
    import torch.distributed as dist

    if args.threads:
        th.set_num_threads(args.threads)
    dist_util, logger, script_util, train_util, where = _import_upstream(path)
    device = dist_util.dev()
    if device.type == "cuda":  # before the NCCL group: its communicator's device
        th.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    tmp = tempfile.mkdtemp(prefix="upstream_train_")
    logger.configure(dir=tmp, format_strs=["log", "csv"])

    flags = script_util.model_and_diffusion_defaults()
    given = json.loads(args.flags)
    unknown = sorted(set(given) - set(flags))
    if unknown:
        raise SystemExit(f"--flags: upstream has no flag {', '.join(unknown)}")
    flags.update(given)
    th.manual_seed(0)
    model, diffusion = script_util.create_model_and_diffusion(**flags)
    model.to(device)
    size = flags["image_size"]
    gen = th.Generator().manual_seed(0)

    def data():
        while True:
            yield th.rand((args.batch, 3, size, size), generator=gen) * 2 - 1, {}

    loop = train_util.TrainLoop(model=model, diffusion=diffusion, data=data(),
                                batch_size=args.batch, microbatch=-1, lr=1e-4,
                                ema_rate="0.9999", log_interval=args.log_interval,
                                save_interval=10 ** 9, resume_checkpoint="",
                                use_fp16=args.fp16)

    def sync():
        if device.type == "cuda":
            th.cuda.synchronize(device)

    def steps(n):  # upstream's run_loop body, without its saves
        for _ in range(n):
            batch, cond = next(loop.data)
            loop.run_step(batch, cond)
            if loop.step % loop.log_interval == 0:
                logger.dumpkvs()
            loop.step += 1

    steps(args.warmup)
    sync()
    t0 = time.perf_counter()
    steps(args.steps)
    sync()
    elapsed = time.perf_counter() - t0
    import resource

    peak = (th.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    with open(os.path.join(path, "COMMIT")) if os.path.exists(os.path.join(path, "COMMIT")) \
            else open(os.devnull) as f:
        commit = f.read().strip() or None
    print("RESULT " + json.dumps({
        "steps_per_s": args.steps / elapsed, "step_s": elapsed / args.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "peak_mb_per_rank": [round(peak, 1)],
        "device": device.type, "sdpa_kernels": None, "sdpa_flash": None,
        "precision": "fp16 master weights" if args.fp16 else "fp32",
        "upstream": {"repo": UPSTREAM_REPO, "commit": commit, "imported_from": where},
        "threads": th.get_num_threads(), "world": 1}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
