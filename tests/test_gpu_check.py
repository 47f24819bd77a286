"""benchmarks/gpu_check.sh, the prepared GPU run, checked where no GPU is lent: ``--cpu`` runs
every part (the same scripts and flags, tiny sizes, gloo) and must print every figure with its
command, into $OUT too; a part that fails is named and the next parts still run; the batch
search of ``--batch_size max`` finds the largest batch that fits."""
import json
import os
import stat
import subprocess
import sys

import pytest
import torch as th

from conftest import PY, REPO, child_env, hang_s

sys.path.insert(0, str(REPO / "benchmarks"))

import train as train_bench  # noqa: E402  (benchmarks/train.py)

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
UPSTREAM = REPO / "third_party" / "improved_diffusion_upstream" / "improved_diffusion"


def run_check(tmp_path, *args, env=None, timeout=1800):
    out = tmp_path / "out"
    e = child_env({"OUT": str(out), "PY": PY, **(env or {})})
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True,
                          timeout=hang_s(timeout), stdin=subprocess.DEVNULL)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    saved = (out / "gpu_check.jsonl").read_text().splitlines()
    return proc, lines, [json.loads(x) for x in saved]


def parts_of(lines):
    return {x["part"]: x for x in lines if x["figure"] == "gpu_check_part"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_cpu_mode_runs_every_part_and_prints_every_figure_with_its_command(tmp_path):
    proc, lines, saved = run_check(tmp_path, "--cpu")
    assert saved == lines  # $OUT/gpu_check.jsonl holds what stdout printed
    assert all(x.get("command") for x in lines), [x for x in lines if not x.get("command")]
    parts = parts_of(lines)
    assert list(parts) == ["env", "unet_train", "dit_train", "dit_save", "determinism", "fsdp",
                           "sample_unet", "sample_dit", "cuda_tests"], parts
    failed = sorted(p for p, x in parts.items() if not x["ok"])
    assert failed == [], proc.stderr[-6000:]
    figures = {}
    for x in lines:
        figures.setdefault(x["figure"], []).append(x)
    assert {"train_loop_steps_per_s", "train_loop_fp16_steps_per_s", "train_loop_det_steps_per_s",
            "train_loop_det_step_time_over_loop", "train_loop_bf16_steps_per_s",
            "save_pause_over_pinned_copy", "save_steps_after_over_without",
            "save_background_write_s", "conformance_bitwise", "fsdp_resume_job_s",
            "sampling_images_per_s"} <= set(figures), sorted(figures)
    assert figures["train_loop_bf16_steps_per_s"][0]["batch_search"]  # --batch_size max ran
    assert figures["train_loop_steps_per_s"][0]["sdpa_kernels"]  # which attention kernel ran
    assert figures["save_refuses_non_finite"][0]["value"] == 1.0
    assert figures["conformance_bitwise"][0]["value"] is True
    assert figures["conformance_bitwise"][0]["deterministic"] is True
    assert figures["conformance_bitwise"][0]["segments"][0]["exit"] in (75, 0)
    assert {x["layout"] for x in figures["fsdp_resume_job_s"]} == {"full", "sharded"}
    assert {x["config"] for x in figures["sampling_images_per_s"]} == {"tiny", "dit-tiny"}
    if UPSTREAM.is_dir():  # (git-ignored: a checkout without it says so and fails, below)
        assert proc.returncode == 0, proc.stderr[-6000:]
        speedup = figures["train_loop_speedup_over_upstream_code"][0]
        assert speedup["goal"] == ">= 2"
        up = figures["train_upstream_code_fp16_steps_per_s"][0]["upstream"]
        assert os.path.realpath(up["imported_from"]) == os.path.realpath(UPSTREAM)
        assert "gpu_check: OK in" in proc.stderr
    else:
        assert proc.returncode == 1
        assert "upstream's code is missing" in proc.stderr
        assert "FAILED part(s): upstream_missing" in proc.stderr


def test_a_part_that_fails_is_named_and_the_parts_after_it_still_run(tmp_path):
    """The fsdp part's script fails for real (a python that refuses it); the sampling part after
    it still runs and prints its figure, and the run ends with exit 1 naming the part."""
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/sh\n"
                       'case "$1" in *fsdp_resume.py) echo "refused: $*" >&2; exit 3;; esac\n'
                       f'exec {PY} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    proc, lines, saved = run_check(tmp_path, "--cpu", timeout=300,
                                   env={"PY": str(wrapper),
                                        "GPU_CHECK_PARTS": "fsdp,sample_dit"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    parts = parts_of(lines)
    assert list(parts) == ["env", "fsdp", "sample_dit"], parts
    assert parts["fsdp"]["ok"] is False and parts["fsdp"]["exit"] == 3
    assert parts["sample_dit"]["ok"] is True and parts["env"]["ok"] is True
    assert "gpu_check: part fsdp FAILED: exit 3; going on with the next part" in proc.stderr
    assert "refused:" in proc.stderr  # the part's own stderr, shown
    assert any(x["figure"] == "sampling_images_per_s" for x in lines)
    assert "FAILED part(s): fsdp" in proc.stderr
    assert saved == lines


def test_a_part_past_its_budget_is_stopped_and_named(tmp_path):
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/sh\n"
                       'case "$1" in *sampling.py) exec sleep 600;; esac\n'  # the script, not a command naming it
                       f'exec {PY} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    proc, lines, _ = run_check(tmp_path, "--cpu", timeout=300,
                               env={"PY": str(wrapper), "GPU_CHECK_PARTS": "sample_unet",
                                    "GPU_CHECK_SCALE": "1"})
    assert proc.returncode == 1
    part = parts_of(lines)["sample_unet"]
    assert part["ok"] is False and part["exit"] in (124, 137) and part["budget_s"] == 15
    assert "part sample_unet FAILED: ran out of its 15 s" in proc.stderr


class _Data:
    batch = None


def test_the_batch_search_takes_the_largest_batch_that_fits_then_half_way_to_the_next():
    data, seen = _Data(), []

    def one_step():  # a device of room for 40 samples
        seen.append(data.batch)
        if data.batch > 40:
            raise th.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    batch, tried = train_bench.largest_batch(one_step, data, th.device("cpu"), 8, 4096)
    assert (batch, data.batch) == (32, 32)  # 8, 16, 32 fit, 64 does not, 48 does not
    assert tried == {8: "ok", 16: "ok", 32: "ok", 64: "oom", 48: "oom"}
    data2 = _Data()

    def room_for_50():
        if data2.batch > 50:
            raise th.OutOfMemoryError("CUDA out of memory.")

    assert train_bench.largest_batch(room_for_50, data2, th.device("cpu"), 8, 4096)[0] == 48
    with pytest.raises(SystemExit, match="not even a batch of 64"):
        train_bench.largest_batch(room_for_50, data2, th.device("cpu"), 64, 4096)
