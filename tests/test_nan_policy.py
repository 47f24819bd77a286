"""NaN/Inf in the loss, gradients or weights (issue 9, item 10), through the real train.py.

NaN is injected deterministically by tests/nan_train.py (a batch of NaN at chosen steps, on
chosen ranks; or a NaN written into an EMA), with real `mpiexec -n 2` where ranks are involved.
Each test checks what is on disk afterwards: which steps exist, that they verify, and the weights.
"""
import json
import re

import numpy as np
import pytest
import torch as th
from PIL import Image

from cluster_sim import matches_manifest
from conftest import MPIEXEC, PY, REPO, _run

DRIVER = REPO / "tests" / "nan_train.py"
TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--lr", "1e-3", "--ema_rate", "0.9",
]


def images(folder, n=8):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
            folder / f"img_{i:03d}.png")
    return folder


def train(tmp_path, ranks, *flags, env=None, timeout=90):
    """tests/nan_train.py with TINY flags on `ranks` ranks; returns (CompletedProcess, log dir)."""
    log = tmp_path / "log"
    args = [*TINY, "--data_dir", images(tmp_path / "data"), "--log_dir", log, *flags]
    cmd = [PY, DRIVER, *args] if ranks == 1 else [MPIEXEC, "-n", str(ranks), PY, DRIVER, *args]
    return _run(cmd, timeout=timeout, env=env, check=False), log


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


def steps_on_disk(log):
    """{step: [file names]} of every checkpoint or manifest file in `log`."""
    out = {}
    for p in log.iterdir():
        digits = "".join(c for c in p.stem.split("_")[-1] if c.isdigit())
        if p.suffix in (".pt", ".json") and digits:
            out.setdefault(int(digits), []).append(p.name)
    return out


def assert_step_verifies(log, step):
    """The step's manifest lists its files with their sizes and checksums, and they match."""
    manifest = json.loads((log / f"manifest{step:06d}.json").read_text())
    assert len(manifest["files"]) == 3  # model, one EMA, opt
    for name, info in manifest["files"].items():
        data = (log / name).read_bytes()
        assert matches_manifest(data, info)


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def assert_all_finite(sd, what):
    for k, v in sd.items():
        assert th.isfinite(v).all(), f"{what}: {k} is not finite"


def assert_same_tensors(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        assert th.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.timeout(120)
# make soak: one rank (two ranks, the NaN on one of them, is the harder case)
@pytest.mark.parametrize("ranks,nan_ranks", [pytest.param(1, "0", marks=pytest.mark.slow), (2, "1")])
def test_a_nan_loss_with_policy_stop_ends_every_rank_naming_the_step_and_saves_nothing_new(
        tmp_path, ranks, nan_ranks):
    proc, log = train(tmp_path, ranks, "--save_interval", "2", "--max_steps", "6",
                      env={"NAN_LOSS_STEPS": "5", "NAN_RANKS": nan_ranks})
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout  # the same on every rank: printed once for the job
    assert errors[0].startswith("error: step 5: the loss or gradients are not finite")
    assert "--nan_policy skip" in errors[0] and "the last saved step is 4" in errors[0]
    assert "Traceback" not in proc.stdout and "aborting" not in proc.stdout
    assert sorted(steps_on_disk(log)) == [2, 4]
    assert_step_verifies(log, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks,nan_ranks,extra", [
    pytest.param(1, "0", [], marks=pytest.mark.slow),  # make soak: two ranks are the harder case
    (2, "1", ["--schedule_sampler", "loss-second-moment"]),
])
def test_a_nan_loss_with_policy_skip_leaves_weights_moments_and_ema_unchanged_and_goes_on(
        tmp_path, ranks, nan_ranks, extra):
    proc, log = train(tmp_path, ranks, "--save_interval", "2", "--max_steps", "6",
                      "--nan_policy", "skip", *extra,
                      env={"NAN_LOSS_STEPS": "3,4", "NAN_RANKS": nan_ranks})
    assert proc.returncode == 0, proc.stdout
    for step in (3, 4):
        assert f"step {step}: the loss or gradients are not finite" in proc.stdout
        assert "optimizer step skipped (--nan_policy skip)" in proc.stdout
    assert sorted(steps_on_disk(log)) == [2, 4, 6]
    for step in (2, 4, 6):
        assert_step_verifies(log, step)
        assert_all_finite(load(log / f"model{step:06d}.pt")["state_dict"], f"model {step}")
        assert_all_finite(load(log / f"ema_0.9_{step:06d}.pt")["state_dict"], f"EMA {step}")
    # Steps 3 and 4 were skipped: step 4 holds exactly the state of step 2.
    assert_same_tensors(load(log / "model000002.pt")["state_dict"],
                        load(log / "model000004.pt")["state_dict"], "model")
    assert_same_tensors(load(log / "ema_0.9_000002.pt")["state_dict"],
                        load(log / "ema_0.9_000004.pt")["state_dict"], "EMA")
    opt2, opt4 = load(log / "opt000002.pt"), load(log / "opt000004.pt")
    for name, st in opt2["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert th.equal(st[k], opt4["optimizer"]["state"][name][k]), f"{name}.{k}"
    # The step counter and the data position still advanced past the skipped batches.
    assert opt4["trainer"]["step"] == 4
    assert opt4["trainer"]["data"]["position"] == 4 * 2 * ranks
    # Step 6 trained on: its weights moved.
    m4, m6 = load(log / "model000004.pt")["state_dict"], load(log / "model000006.pt")["state_dict"]
    assert any(not th.equal(m4[k], m6[k]) for k in m4)
    sampler = opt4["trainer"]["schedule_sampler"]
    if "_loss_history" in sampler:  # NaN losses never enter the resampler's history
        assert th.isfinite(sampler["_loss_history"]).all()


@pytest.mark.timeout(120)
def test_a_checkpoint_whose_ema_went_nan_on_one_rank_is_never_written(tmp_path):
    proc, log = train(tmp_path, 2, "--save_interval", "2", "--max_steps", "6",
                      env={"NAN_EMA_AFTER_STEP": "3", "NAN_RANKS": "1"})
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout
    assert errors[0].startswith("error: step 4: not saved: the weights hold non-finite values")
    assert "(finite on rank 0; EMA 0.9: 1 tensor(s) on rank 1)" in errors[0]
    assert "the last saved step is 2" in errors[0]
    assert sorted(steps_on_disk(log)) == [2]
    assert_step_verifies(log, 2)


@pytest.mark.timeout(120)
def test_with_fp16_the_grad_scaler_skips_a_nan_step_and_the_policy_stays_out_of_it(tmp_path):
    # float16 autocast + GradScaler: forced on any CPU (on one with bfloat16 units, --use_fp16
    # would be bf16 without a scaler: the next test).
    proc, log = train(tmp_path, 1, "--use_fp16", "True", "--max_steps", "4",
                      env={"NAN_LOSS_STEPS": "2", "CPU_BF16": "0"})
    if "float16 autocast unsupported" in proc.stdout:
        pytest.skip("this torch has no float16 autocast with a GradScaler on CPU")
    assert proc.returncode == 0, proc.stdout
    assert "bfloat16 autocast" not in proc.stdout and "loss_scale" in proc.stdout, proc.stdout
    assert re.search(r"step 2 skipped: NaN/inf float16 gradients", proc.stdout), proc.stdout
    assert "--nan_policy" not in proc.stdout
    assert sorted(steps_on_disk(log)) == [4]
    assert_all_finite(load(log / "model000004.pt")["state_dict"], "model")
    assert load(log / "opt000004.pt")["trainer"]["grad_scaler"]["scale"] < 2.0 ** 20


@pytest.mark.timeout(120)
def test_with_bf16_autocast_there_is_no_grad_scaler_and_the_nan_policy_stops_the_run(tmp_path):
    # As on a CPU with bfloat16 units (forced on any CPU): no loss scaling, so a NaN step is
    # --nan_policy's to handle, as without --use_fp16.
    proc, log = train(tmp_path, 1, "--use_fp16", "True", "--max_steps", "4",
                      env={"NAN_LOSS_STEPS": "2", "CPU_BF16": "1"})
    assert "--use_fp16: bfloat16 autocast" in proc.stdout, proc.stdout
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout
    assert errors[0].startswith("error: step 2: the loss or gradients are not finite")
    assert "(--nan_policy stop)" in errors[0] and "none saved" in errors[0]
    assert "skipped: NaN/inf float16" not in proc.stdout
    assert not log.exists() or steps_on_disk(log) == {}


@pytest.mark.timeout(120)
def test_a_huge_lr_stops_the_run_with_one_line_before_any_nan_checkpoint(tmp_path):
    proc, log = train(tmp_path, 1, "--lr", "1e6", "--save_interval", "0", "--max_steps", "20")
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1 and "--nan_policy skip" in errors[0], proc.stdout
    assert "none saved" in errors[0]
    assert not log.exists() or steps_on_disk(log) == {}


def test_an_unknown_nan_policy_is_a_usage_error_naming_the_choices(tmp_path, capsys):
    import runpy

    main = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")["main"]
    code = main(["--data_dir", str(tmp_path), "--log_dir", str(tmp_path / "log"),
                 "--nan_policy", "ignore"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --nan_policy must be one of stop, skip (got 'ignore')"]
