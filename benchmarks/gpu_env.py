"""What benchmarks/gpu_check.sh runs on: torch, CUDA, the card, this checkout's commit and
upstream's (third_party/); one JSON line (figure gpu_check_env). Exit 1 with ``gpu`` as the
argument when torch sees no CUDA device.

    python benchmarks/gpu_env.py gpu|cpu
"""
import json
import os
import platform
import subprocess
import sys

import torch as th

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM_COMMIT = os.path.join(REPO, "third_party", "improved_diffusion_upstream", "COMMIT")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "gpu"
    cuda = th.cuda.is_available()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=REPO, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None  # the device tool's copy of the tree has no .git
    upstream = None
    if os.path.exists(UPSTREAM_COMMIT):
        with open(UPSTREAM_COMMIT) as f:
            upstream = f.read().strip()
    props = th.cuda.get_device_properties(0) if cuda else None
    print(json.dumps({
        "figure": "gpu_check_env", "mode": mode, "torch": th.__version__,
        "cuda": th.version.cuda, "gpus": th.cuda.device_count(),
        "device_name": props.name if cuda else "cpu",
        "gpu_memory_gib": round(props.total_memory / 2 ** 30, 1) if cuda else None,
        "cudnn": th.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, th.cuda.nccl.version())) if cuda else None,
        "python": platform.python_version(), "cpus": os.cpu_count(), "commit": commit,
        "upstream_commit": upstream,
        "command": "bash benchmarks/gpu_check.sh" + (" --cpu" if mode == "cpu" else "")}),
        flush=True)
    if mode == "gpu" and not cuda:
        sys.exit("gpu_check: no CUDA GPU visible to torch; nothing to check (--cpu checks the "
                 "script)")


if __name__ == "__main__":
    main()
