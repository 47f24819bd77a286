"""ADM's evaluator here (issue 30): the activation pass of the FID Inception (images/s, random
weights: the speed does not depend on them), the seconds of the metrics on --metrics_n x
--metrics_n random features (Inception Score, FID by ADM's sqrtm and by eigh, sFID, precision
and recall), and the peak memory of precision/recall on --pr_ref x --pr_samples features
(the claim: one block of distances, whatever the set sizes), measured in a fresh child process
that samples its resident memory (/proc/self/statm, every 2 ms) above what it held before.
torch-fidelity's network is timed on the same images when it is installed.

One JSON line per figure. Usage (the issue's sizes are the defaults; the quick run shrinks them):

    python benchmarks/evaluate.py [--images 32] [--image_size 64] [--batch_size 16]
        [--threads 1] [--metrics_n 10000] [--pr_ref 10000] [--pr_samples 50000]
    python benchmarks/evaluate.py --metrics_n 2500 --pr_ref 2000 --pr_samples 10000   # quick
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch as th  # noqa: E402

from improved_diffusion import evaluation, inception  # noqa: E402

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from improved_diffusion import evaluation
torch.set_num_threads(int(sys.argv[5]))
rng = np.random.default_rng(0)
n_ref, n_sample, dim = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ref = rng.random((n_ref, dim), dtype=np.float32)
sample = rng.random((n_sample, dim), dtype=np.float32)
inputs = ref.nbytes + sample.nbytes
with open("/proc/self/statm") as f:  # resident now: the interpreter, torch and the inputs
    base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
t0 = time.perf_counter()
p, r = evaluation.compute_prec_recall(ref, sample)
took = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's peak (KiB)
print(json.dumps({"seconds": took, "precision": p, "recall": r, "input_bytes": inputs,
                  "peak_above_inputs_bytes": peak - base}))
"""


def emit(**kw):
    print(json.dumps(kw), flush=True)


def bench_network(args):
    th.manual_seed(0)
    net = inception.FIDInceptionV3()
    for m in net.modules():  # random BatchNorm statistics keep the activations finite
        if isinstance(m, th.nn.BatchNorm2d):
            m.running_var.fill_(1.0)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.images, args.image_size, args.image_size, 3),
                          dtype=np.uint8)
    net(images[:2])  # warm-up (oneDNN primitives)
    t0 = time.perf_counter()
    for i in range(0, len(images), args.batch_size):
        net(images[i:i + args.batch_size])
    took = time.perf_counter() - t0
    emit(figure="activation_pass_images_per_s", value=round(len(images) / took, 2),
         images=args.images, image_size=args.image_size, batch_size=args.batch_size,
         threads=th.get_num_threads(), network="improved_diffusion.inception")
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except Exception as e:  # not installed (it also imports torchvision)
        emit(figure="activation_pass_images_per_s_torch_fidelity", value=None,
             note=f"torch-fidelity not importable here ({type(e).__name__})")
        return
    sd_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_inception_random.pt")
    th.save(net.state_dict(), sd_path)
    tf = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                     feature_extractor_weights_path=sd_path)
    x = th.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    tf(x[:2])
    t0 = time.perf_counter()
    for i in range(0, len(x), args.batch_size):
        tf(x[i:i + args.batch_size])
    took = time.perf_counter() - t0
    emit(figure="activation_pass_images_per_s_torch_fidelity", value=round(len(x) / took, 2),
         images=args.images, image_size=args.image_size, batch_size=args.batch_size)


def bench_metrics(args):
    n = args.metrics_n
    rng = np.random.default_rng(0)

    def feats(d, shift=0.0):
        return (rng.random((n, d), dtype=np.float32) + shift).astype(np.float32)

    ref = (feats(2048), feats(2023))
    sample = (feats(2048, 0.05), feats(2023, 0.05), feats(1008) * 4)
    t0 = time.perf_counter()
    evaluation.compute_inception_score(sample[2])
    emit(figure="metrics_seconds", part="inception_score", n=n,
         value=round(time.perf_counter() - t0, 2))
    for key, i in (("fid", 0), ("sfid", 1)):
        t0 = time.perf_counter()
        a, b = evaluation.compute_statistics(ref[i]), evaluation.compute_statistics(sample[i])
        stats_s = time.perf_counter() - t0
        for method in ("sqrtm", "eigh"):
            if method == "sqrtm" and args.skip_sqrtm:
                continue
            t0 = time.perf_counter()
            value = b.frechet_distance(a, method=method)
            emit(figure="metrics_seconds", part=f"{key}_{method}", n=n, dim=ref[i].shape[1],
                 value=round(stats_s + time.perf_counter() - t0, 2), statistics_s=round(
                     stats_s, 2), result=value)
    t0 = time.perf_counter()
    p, r = evaluation.compute_prec_recall(ref[0], sample[0])
    emit(figure="metrics_seconds", part="precision_recall", n=n, dim=2048,
         value=round(time.perf_counter() - t0, 2), precision=p, recall=r)


def bench_pr_memory(args):
    out = subprocess.run([sys.executable, "-c", CHILD, REPO, str(args.pr_ref),
                          str(args.pr_samples), "2048", str(th.get_num_threads())],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    emit(figure="precision_recall_peak_memory_bytes", value=r["peak_above_inputs_bytes"],
         ref=args.pr_ref, samples=args.pr_samples, dim=2048,
         input_bytes=r["input_bytes"], seconds=round(r["seconds"], 2),
         block=[evaluation.ManifoldEstimator().row_batch_size,
                evaluation.ManifoldEstimator().col_batch_size])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--image_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--metrics_n", type=int, default=10000)
    p.add_argument("--skip_sqrtm", action="store_true", help="time the eigh FID only")
    p.add_argument("--pr_ref", type=int, default=10000)
    p.add_argument("--pr_samples", type=int, default=50000)
    p.add_argument("--only", default="network,metrics,pr_memory")
    args = p.parse_args()
    if args.threads:
        th.set_num_threads(args.threads)
    parts = set(args.only.split(","))
    if "network" in parts:
        bench_network(args)
    if "metrics" in parts:
        bench_metrics(args)
    if "pr_memory" in parts:
        bench_pr_memory(args)


if __name__ == "__main__":
    main()
