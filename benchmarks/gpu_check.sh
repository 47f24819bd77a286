#!/usr/bin/env bash
# The prepared GPU run (issue 53, item 2): at most 6 minutes on one H100 or H200, start-up and
# every process's import of torch included; not part of CI. Prints one JSON line per figure,
# each with its "command" (and a "gpu_check_part" line per part: its command, exit, seconds),
# also into $OUT/gpu_check.jsonl when OUT is set (the device tool brings $OUT back). Ends with
# "gpu_check: OK in N s" or "gpu_check: FAILED part(s) ..."; exit 1 if any part failed. A part
# that fails or runs out of its budget is named on stderr, and the next part runs.
#
# Through the device tool (the device machine has torch with CUDA and no network; nothing here
# installs or downloads anything):
#
#   run(command="bash benchmarks/gpu_check.sh", carry=["third_party/"], timeout_s=420)
#
# third_party/improved_diffusion_upstream/ must hold upstream's improved_diffusion/ package
# (openai/improved-diffusion, its COMMIT beside it; git-ignored through .git/info/exclude
# "/third_party/"): the training part times upstream's own TrainLoop from there, and says so
# in one line when it is missing (then only our variants run, and that part counts as failed).
#
#   bash benchmarks/gpu_check.sh          (from anywhere; PY=python3 by default)
#   bash benchmarks/gpu_check.sh --cpu    (every part, the same scripts and flags, at tiny
#                                          sizes on the CPU with gloo: checks this script where
#                                          no GPU is lent; tests/test_gpu_check.py runs it)
#   GPU_CHECK_PARTS=dit_save,fsdp bash benchmarks/gpu_check.sh   (those parts alone, and env)
#
# The parts, each under its own timeout (GPU budgets in seconds; they sum to 345, and a
# deadline of 360 s from the script's start cuts any part's timeout to what is left):
#   env           8  benchmarks/gpu_env.py: torch, CUDA, the card (gpu_check_env)
#   unet_train   85  benchmarks/train.py, the README's CIFAR-10 UNet at batch 128: our TrainLoop
#                    in fp32 (loop), --use_fp16 (loop_fp16: autocast + GradScaler) and
#                    --deterministic True (loop_det), upstream's own TrainLoop in fp32 and with
#                    its fp16 master weights (upstream_code, upstream_code_fp16); each variant's
#                    sdpa_kernels / sdpa_flash; goals: >= 2x upstream, deterministic <= 1.10x
#   dit_train    50  benchmarks/train.py, DiT-XL/2 on 32x32x4 latents, bf16 autocast, the
#                    largest batch that fits (--batch_size max); goal >= 200 img/s on an H100
#   dit_save     65  benchmarks/bg_save.py --figures pause,after: DiT-XL/2's whole training
#                    state (~10.8 GB) saved asynchronously: the pause over a pinned
#                    device-to-host copy of the same bytes (<= 1.2), the 10 steps after the save
#                    over 10 without (<= 1.03), the NaN/Inf check (a planted inf is refused)
#   determinism  40  benchmarks/conformance.py --chain 1,1 --deterministic: scripts/train.py
#                    with --global_batch_size/--microbatch on one GPU, interrupted (SIGTERM)
#                    and resumed, bitwise equal to a straight run
#   fsdp         35  benchmarks/fsdp_resume.py --ranks 1: --fsdp True on a one-rank NCCL group,
#                    both layouts (full, sharded), saved, resumed and trained one more step
#   sample_unet  15  benchmarks/sampling.py, DDIM-50 img/s, the CIFAR-10 UNet (fp32)
#   sample_dit   20  benchmarks/sampling.py, DDIM-50 img/s, DiT-XL/2 (fp32)
#   cuda_tests   27  pytest -m cuda on the test files that carry the marker
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PY:-python3}
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
JSONL=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && JSONL="$OUT/gpu_check.jsonl" && : >"$JSONL"; fi
START=$SECONDS
SCALE=1     # budgets x SCALE: the CPU's run is slower, its timeouts only hang detectors
DEADLINE=360
UPSTREAM=third_party/improved_diffusion_upstream
FAILED=()

if [ "$MODE" = gpu ]; then
    UNET=(--config cifar10 --steps 10 --warmup 3 --threads 4)
    DIT=(--config dit-xl2 --batch_size max --batch_start 64 --batch_limit 1024 --steps 6
         --warmup 1 --threads 4)
    SAVE=(--model dit-xl2 --amp bf16 --batch 32 --steps_after 10 --warm_saves 1)
    CONFORM=(--steps 40 --timeout 30)
    FSDP=(--num_channels 64)
    SAMPLE_UNET=(--config cifar10 --num_samples 256 --batch 256 --warmup 2)
    SAMPLE_DIT=(--config dit-xl2 --num_samples 32 --batch 32 --warmup 2)
else  # every part at the sizes a loaded 2-core CPU runs in a few minutes
    SCALE=${GPU_CHECK_SCALE:-5}
    UNET=(--config tiny32 --steps 1 --warmup 1 --threads 1)
    DIT=(--config dit-tiny --batch_size max --batch_start 2 --batch_limit 8 --steps 1
         --warmup 1 --threads 1)
    SAVE=(--model dit-tiny --amp bf16 --steps_after 3 --warm_saves 1 --save_writer process)
    CONFORM=(--timeout 120)
    FSDP=(--num_channels 32)
    SAMPLE_UNET=(--config tiny --num_samples 2 --batch 2 --warmup 1)
    SAMPLE_DIT=(--config dit-tiny --num_samples 2 --batch 2 --warmup 1)
    export OMP_NUM_THREADS=1
fi

# part NAME BUDGET_S CMD...: run CMD under min(BUDGET_S*SCALE, what the deadline leaves);
# its JSON lines (stdout lines that begin with '{') to stdout and $JSONL, the rest to stderr.
part() {
    local name=$1 budget=$(($2 * SCALE)); shift 2
    if [ -n "${GPU_CHECK_PARTS:-}" ] && [ "$name" != env ] &&
            [[ ",$GPU_CHECK_PARTS," != *",$name,"* ]]; then
        return 0
    fi
    local left=$((DEADLINE * SCALE - (SECONDS - START)))
    [ "$budget" -gt "$left" ] && budget=$left
    local t0=$SECONDS rc
    echo "== $name (budget $budget s; $((SECONDS - START)) s so far): $*" >&2
    if [ "$budget" -lt 5 ]; then
        rc=124
        echo "gpu_check: part $name FAILED: no time left before the ${DEADLINE}x$SCALE s deadline" >&2
    else
        timeout -k 5 "$budget" "$@" 2>"$WORK/$name.err" | while IFS= read -r line; do
            case $line in
                '{'*) printf '%s\n' "$line"; printf '%s\n' "$line" >>"$JSONL" ;;
                *) printf '%s\n' "$line" >&2 ;;
            esac
        done
        rc=${PIPESTATUS[0]}
    fi
    local took=$((SECONDS - t0)) ok=true
    if [ "$rc" -ne 0 ]; then
        ok=false
        FAILED+=("$name")
        [ -s "$WORK/$name.err" ] && tail -25 "$WORK/$name.err" >&2
        local why="exit $rc"
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="ran out of its $budget s (exit $rc)"
        echo "gpu_check: part $name FAILED: $why; going on with the next part" >&2
    fi
    local line
    line=$("$PY" -c 'import json, sys; print(json.dumps({"figure": "gpu_check_part",
        "part": sys.argv[1], "ok": sys.argv[2] == "true", "exit": int(sys.argv[3]),
        "seconds": int(sys.argv[4]), "budget_s": int(sys.argv[5]), "mode": sys.argv[6],
        "command": " ".join(sys.argv[7:])}))' "$name" "$ok" "$rc" "$took" "$budget" "$MODE" "$@")
    printf '%s\n' "$line"
    printf '%s\n' "$line" >>"$JSONL"
}

part env 8 "$PY" benchmarks/gpu_env.py "$MODE"
if [ "$MODE" = gpu ] && [ "${FAILED[*]:-}" = env ]; then
    echo "gpu_check: FAILED: no GPU (see above)" >&2
    exit 1
fi

VARIANTS=loop,upstream_code,loop_fp16,upstream_code_fp16,loop_det
if [ ! -f "$UPSTREAM/improved_diffusion/train_util.py" ] &&
        [[ -z "${GPU_CHECK_PARTS:-}" || ",$GPU_CHECK_PARTS," == *",unet_train,"* ]]; then
    echo "gpu_check: upstream's code is missing: $REPO/$UPSTREAM/improved_diffusion/ not found" \
         "(copy openai/improved-diffusion's improved_diffusion/ folder there and pass" \
         "carry=[\"third_party/\"] to the device tool); timing our variants only" >&2
    VARIANTS=loop,loop_fp16,loop_det
    FAILED+=("upstream_missing")
fi
part unet_train 85 "$PY" benchmarks/train.py "${UNET[@]}" --variants "$VARIANTS" --repeat 1 \
    --attention_reps 0
part dit_train 50 "$PY" benchmarks/train.py "${DIT[@]}" --variants loop_bf16 --repeat 1 \
    --attention_reps 0
part dit_save 65 "$PY" benchmarks/bg_save.py --figures pause,after "${SAVE[@]}" --dir "$WORK"
part determinism 40 "$PY" benchmarks/conformance.py --chain 1,1 --launchers python \
    --deterministic --json --work "$WORK/conformance" "${CONFORM[@]}"
part fsdp 35 "$PY" benchmarks/fsdp_resume.py --ranks 1 --repeats 1 --more_steps 1 "${FSDP[@]}"
part sample_unet 15 "$PY" benchmarks/sampling.py --samplers ddim50 "${SAMPLE_UNET[@]}"
part sample_dit 20 "$PY" benchmarks/sampling.py --samplers ddim50 "${SAMPLE_DIT[@]}"
CUDA_TESTS=$(grep -l "pytest.mark.cuda" tests/test_*.py | tr '\n' ' ')
# shellcheck disable=SC2086  # the file names: one word each
part cuda_tests 27 "$PY" -m pytest -q -p no:cacheprovider -m cuda $CUDA_TESTS

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED part(s): ${FAILED[*]} ($((SECONDS - START)) s, mode $MODE)" >&2
    exit 1
fi
echo "gpu_check: OK in $((SECONDS - START)) s (mode $MODE)" >&2
