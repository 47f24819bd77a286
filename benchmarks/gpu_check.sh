#!/usr/bin/env bash
# GPU check (issue 11): under 5 minutes on a machine with NVIDIA GPUs; not part of CI, and not
# runnable on a CPU-only machine. Prints JSON lines (one per figure, with its command) and ends
# with "gpu_check: OK" or names the failed part (exit 1).
#
#   bash benchmarks/gpu_check.sh            (from the repository root; PY=python to override)
#
# 1. training: the real TrainLoop vs the bare loop vs upstream's step, NCCL on all GPUs (bench
#    config), then bf16 autocast + SDPA vs fp32 on the CIFAR-10 flags (1 GPU);
# 2. checkpoints: benchmarks/checkpoint.py when present (its own figures);
# 3. a 2-rank resume (NCCL): 10 steps straight vs 5 + resume to 10 must be bitwise identical.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA GPU visible; nothing to check" >&2; exit 1; fi
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
fail() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

echo "== training (NCCL, $NGPU GPU(s))" >&2
timeout 120 "$PY" benchmarks/train.py --config bench --ranks "$NGPU" --steps 30 --warmup 5 \
    --repeat 1 --variants bare,loop,upstream || fail "training benchmark"
timeout 90 "$PY" benchmarks/train.py --config cifar10 --steps 20 --warmup 5 --repeat 1 \
    --variants bare,bf16 || fail "bf16 vs fp32 benchmark"

if [ -f benchmarks/checkpoint.py ]; then
    echo "== checkpoints" >&2
    timeout 90 "$PY" benchmarks/checkpoint.py || fail "checkpoint benchmark"
fi

echo "== 2-rank resume must be bitwise" >&2
RANKS=2; [ "$NGPU" -lt 2 ] && RANKS=1
"$PY" datasets/digits.py --out "$WORK/data" --size 16 >/dev/null
FLAGS=(--data_dir "$WORK/data" --image_size 16 --num_channels 32 --num_res_blocks 1
       --attention_resolutions 8 --learn_sigma True --dropout 0.1 --diffusion_steps 50
       --batch_size 4 --ema_rate 0.9999,0.99 --log_interval 1 --save_interval 1000)
train() { timeout 60 mpiexec -n "$RANKS" "$PY" scripts/train.py "${FLAGS[@]}" "$@" >"$WORK/log" 2>&1 \
          || { tail -20 "$WORK/log" >&2; fail "train.py $*"; }; }
train --log_dir "$WORK/straight" --max_steps 10
train --log_dir "$WORK/resumed" --max_steps 5
train --log_dir "$WORK/resumed" --max_steps 10
"$PY" - "$WORK" "$RANKS" <<'PYEOF' || fail "2-rank resume is not bitwise"
import json, os, sys
import torch as th
work, ranks = sys.argv[1], int(sys.argv[2])
names = sorted(n for n in os.listdir(f"{work}/straight") if n.endswith("000010.pt"))
diffs = []
def walk(a, b, path):
    if isinstance(a, dict):
        if a.keys() != b.keys():
            diffs.append(path + " keys"); return
        for k in a: walk(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b): diffs.append(path + " len"); return
        for i, (x, y) in enumerate(zip(a, b)): walk(x, y, f"{path}[{i}]")
    elif isinstance(a, th.Tensor):
        if not (a.shape == b.shape and a.dtype == b.dtype and th.equal(a, b)): diffs.append(path)
    elif path.endswith(("time", "timestamp", "created", "hostname", "pid")):
        pass
    elif a != b:
        diffs.append(path)
for n in names:
    load = lambda d: th.load(f"{work}/{d}/{n}", map_location="cpu", weights_only=True)
    walk(load("straight"), load("resumed"), n)
print(json.dumps({"figure": "gpu_resume_bitwise", "ranks": ranks, "files": names,
                  "value": not diffs, "differences": diffs[:20],
                  "command": "bash benchmarks/gpu_check.sh"}))
sys.exit(1 if diffs or not names else 0)
PYEOF
echo "gpu_check: OK"
