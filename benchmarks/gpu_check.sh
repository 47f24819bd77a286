#!/usr/bin/env bash
# GPU check (issues 11, 20): at most 5 minutes on one machine with NVIDIA GPUs; not part of CI.
# Prints JSON lines (one per figure, with its command) and ends with "gpu_check: OK in N s" or
# names the failed part (exit 1).
#
#   bash benchmarks/gpu_check.sh          (from the repository root; PY=python to override)
#   bash benchmarks/gpu_check.sh --cpu    (the same parts at tiny sizes on the CPU, gloo: checks
#                                          the script itself where no GPU is lent)
#
# Each part runs under its own timeout, its budget (seconds; the sum is 290 s, under 5 minutes):
#   1. training  70 s: the real TrainLoop vs the bare loop vs upstream's step, NCCL on all GPUs
#                      (bench config, 30 steps after 5 of warm-up, one run of each variant);
#   2. bf16      40 s: bf16 autocast vs fp32, the CIFAR-10 flags, 1 GPU (20 steps after 5), and
#                      whether SDPA's flash kernel takes the attention (sdpa_flash);
#   3. saves     90 s: benchmarks/checkpoint.py at 10M and 60M parameters, one repeat: the sync
#                      save against a raw write, the async pause, what saves every 10 steps cost
#                      a 20-step run (no load figures: their fresh processes cost more than the
#                      budget; 250M alone takes minutes);
#   4. resume    90 s: 2 ranks (NCCL) with --deterministic True, 10 steps straight vs 5 + resume to
#                      10 (30 s per run): the files must be bitwise identical.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
if [ "$MODE" = gpu ]; then
    NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -lt 1 ]; then
        echo "gpu_check: no CUDA GPU visible; nothing to check (--cpu checks the script)" >&2
        exit 1
    fi
    TRAIN_CONFIG=bench BF16_CONFIG=cifar10 RANKS=$NGPU STEPS=(--steps 30 --warmup 5)
    BF16_STEPS=(--steps 20 --warmup 5) SIZES=10M,60M RUN_STEPS=20
else  # the script's own check: every part, at sizes a 2-core CPU runs within the budgets
    NGPU=0 TRAIN_CONFIG=tiny BF16_CONFIG=tiny RANKS=2 STEPS=(--steps 5 --warmup 2)
    BF16_STEPS=(--steps 3 --warmup 1) SIZES=10M RUN_STEPS=20
    export OMP_NUM_THREADS=1
fi
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
fail() { echo "gpu_check: FAILED: $*" >&2; exit 1; }
part() { echo "== $1 (budget $2 s; $((SECONDS - START)) s so far)" >&2; }

part "training ($MODE, $RANKS rank(s))" 70
timeout 70 "$PY" benchmarks/train.py --config "$TRAIN_CONFIG" --ranks "$RANKS" "${STEPS[@]}" \
    --repeat 1 --variants bare,loop,upstream --attention_reps 0 || fail "training benchmark (70 s)"

part "bf16 vs fp32" 40
timeout 40 "$PY" benchmarks/train.py --config "$BF16_CONFIG" "${BF16_STEPS[@]}" --repeat 1 \
    --variants bare,bf16 --attention_reps 0 || fail "bf16 vs fp32 benchmark (40 s)"

part "saves" 90
timeout 90 "$PY" benchmarks/checkpoint.py --sizes "$SIZES" --repeat 1 --figures save,run \
    --run_steps "$RUN_STEPS" --dir "$WORK/ckpt" || fail "checkpoint benchmark (90 s)"

part "2-rank resume with --deterministic True must be bitwise" 90
[ "$MODE" = gpu ] && [ "$NGPU" -lt 2 ] && RANKS=1
[ "$MODE" = gpu ] && [ "$RANKS" -gt 2 ] && RANKS=2
"$PY" datasets/digits.py --out "$WORK/data" --size 16 >/dev/null
FLAGS=(--data_dir "$WORK/data" --image_size 16 --num_channels 32 --num_res_blocks 1
       --attention_resolutions 8 --learn_sigma True --dropout 0.1 --diffusion_steps 50
       --batch_size 4 --ema_rate 0.9999,0.99 --log_interval 1 --save_interval 1000
       --deterministic True)
train() { timeout 30 mpiexec -n "$RANKS" "$PY" scripts/train.py "${FLAGS[@]}" "$@" >"$WORK/log" 2>&1 \
          || { tail -20 "$WORK/log" >&2; fail "train.py $* (30 s)"; }; }
train --log_dir "$WORK/straight" --max_steps 10
train --log_dir "$WORK/resumed" --max_steps 5
train --log_dir "$WORK/resumed" --max_steps 10
"$PY" - "$WORK" "$RANKS" "$MODE" <<'PYEOF' || fail "2-rank resume is not bitwise"
import json, os, sys
import torch as th
work, ranks, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
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
print(json.dumps({"figure": "gpu_resume_bitwise", "device": mode, "ranks": ranks,
                  "deterministic": True, "files": names, "value": not diffs,
                  "differences": diffs[:20], "command": "bash benchmarks/gpu_check.sh"
                  + (" --cpu" if mode == "cpu" else "")}))
sys.exit(1 if diffs or not names else 0)
PYEOF
echo "gpu_check: OK in $((SECONDS - START)) s"
