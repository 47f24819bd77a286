"""Under --fsdp True, what a DDP run has while training (issue 45, item 1): sample grids, FID/IS
with the digits and the Inception features, post-hoc EMA snapshots, in both layouts.

Through the real scripts on 2 ranks with a loader worker, one tiny UNet trained 4 steps (saves
at 2 and 4) in five jobs:

- ``seen``: --fsdp True, --phema_stds, straight to 4, with grids and the Inception FID while
  training (full layout);
- ``full``: ``seen``'s step 2 (a copy of its log dir without step 4) resumed to step 4 without
  grids or FID, with --async_save False (its saves gathered and written one file at a time);
- ``sharded``: the same training in the sharded layout with grids and the digits FID, to step
  2, then resumed to 4;
- ``ddp``: the same training under DDP (--fsdp False).

``seen``'s model, EMA, opt and snapshot files of step 4 are ``full``'s byte for byte (the grids
and FID of step 4 change nothing, nor do step 2's carry over into the steps after it; the
resumed opt file: every tensor and value; a resume continues the post-hoc EMA exactly);
``sharded`` writes the same snapshots beside its DCP folders; ``ckpt.py phema`` gives the same
bytes from both layouts and the DDP run's weights to the order of the reductions; each grid is
what sample.py's functions draw from the EMA file of its step. The checks that only read a step
run the doctor's ``main`` in this process (scripts/ckpt.py itself: test_fsdp.py,
test_sharded_layout.py, and here ``phema`` once).
"""
import csv
import json
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import redraw
from conftest import (ckpt_in_process, deep_diff, run_mpi, run_script,
                      write_digits_and_ref)
from improved_diffusion import evaluation, sampling

MODEL = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
         "--attention_resolutions", "4", "--diffusion_steps", "20", "--noise_schedule", "cosine"]
RUN = ["--batch_size", "2", "--save_interval", "2", "--log_interval", "2", "--ema_rate", "0.99",
       "--num_workers", "1", "--phema_stds", "0.05,0.1", "--sample_steps", "3"]
GRIDS = ["--sample_interval", "2", "--sample_count", "4"]
SNAPSHOTS = [f"phema_{std}_{step:06d}.pt" for step in (2, 4) for std in ("0.050", "0.100")]
FID, IS = "fid_ema_0.99", "is_ema_0.99"
pytestmark = pytest.mark.timeout(2400)  # the module fixture: 5 jobs of 2 ranks (each bounded)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def pixels(png):
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB")).astype(np.int64)



def without_step_4(src, dst):
    """A copy of a log dir (steps 2 and 4) as the job that stopped at step 2 left it: step 4's
    files, snapshots, grid and FID record left out (progress.csv's row of step 4: the resume
    drops it)."""
    shutil.copytree(src, dst, ignore=lambda d, names: [
        n for n in names if "000004" in n and not n.startswith("events.")])
    return dst


def rows(log):
    with open(log / "progress.csv") as f:
        return list(csv.DictReader(f))


def evals(ref, features, n):
    return ["--eval_interval", "2", "--eval_ref_batch", ref, "--eval_num_samples", str(n),
            "--eval_features", features]


def train(data, log, *extra, fsdp=True, steps=4):
    return run_mpi(2, "train.py", "--data_dir", data, "--log_dir", log, *MODEL, *RUN,
                   "--fsdp", str(fsdp), "--max_steps", str(steps), *extra, timeout=400).stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    data, ref = write_digits_and_ref(d)
    weights = d / "inception_random.pt"  # test_evaluation.py's random-weights Inception
    torch.save(redraw.inception_state_dict(), weights)
    logs = {k: d / k for k in ("full", "seen", "sharded", "ddp")}
    out = {}
    out["seen"] = train(data, logs["seen"], *GRIDS, *evals(ref, "inception", 3),
                        "--inception_weights", weights)
    out["full"] = train(data, without_step_4(logs["seen"], logs["full"]), "--sample_interval",
                        "0", "--eval_interval", "0",
                        "--async_save", "False")  # streamed, file by file
    sharded = [*GRIDS, *evals(ref, "digits", 5), "--save_layout", "sharded"]
    train(data, logs["sharded"], *sharded, steps=2)
    out["sharded"] = train(data, logs["sharded"], *sharded)
    out["ddp"] = train(data, logs["ddp"], fsdp=False)
    return logs, out, ref


def test_grids_and_fid_under_fsdp_leave_the_training_bitwise_and_snapshots_resume_exactly(runs):
    logs, out, _ = runs
    assert "resumed at step 2" in out["full"] and "resumed at step 2" in out["sharded"]
    names = sorted(p.name for p in logs["seen"].iterdir() if p.suffix == ".pt")
    assert names == sorted(p.name for p in logs["full"].iterdir() if p.suffix == ".pt")
    assert set(SNAPSHOTS) <= set(names) and len(names) == 10  # model, EMA, opt, 2 snapshots
    # byte for byte; but the resumed job's opt file: its pickle shares fewer key strings (the
    # loaded optimizer state's), so there every tensor and value is compared
    differ = [n for n in names if n != "opt000004.pt"
              and (logs["full"] / n).read_bytes() != (logs["seen"] / n).read_bytes()]
    differ += deep_diff(load(logs["full"] / "opt000004.pt"), load(logs["seen"] / "opt000004.pt"))
    assert not differ, f"grids or the FID changed the training, or the resume: {differ[:6]}"
    full = rows(logs["full"])
    assert [r["step"] for r in full] == ["2", "4"]
    for p, e in zip(full, rows(logs["seen"])):  # the same losses (full's FID cells: empty)
        p = {k: v for k, v in p.items() if v != ""}
        assert {k: v for k, v in e.items() if k in p} == p
    seen = rows(logs["seen"])
    assert [r["step"] for r in seen] == ["2", "4"]
    assert all(np.isfinite(float(r[FID])) and float(r[IS]) >= 1 for r in seen)  # Inception's
    assert sorted(p.name for p in (logs["seen"] / "eval").iterdir()) == [
        "fid_000002.json", "fid_000004.json"]


def test_the_sharded_layout_writes_the_snapshots_beside_its_folders_as_the_full_layout_does(
        runs, tmp_path):
    logs, out, _ = runs
    sharded = logs["sharded"]
    assert sorted(p.name for p in sharded.iterdir() if "000004" in p.name) == [
        "manifest000004.json", "phema_0.050_000004.pt", "phema_0.100_000004.pt",
        "step000004.dcp"]
    for name in SNAPSHOTS:  # written at step 2, and after the sharded resume at step 4
        assert (sharded / name).read_bytes() == (logs["full"] / name).read_bytes(), name
    rc, text = ckpt_in_process("verify", sharded)
    assert rc == 0 and re.search(r"step +4 +ok", text), text
    rc, text = ckpt_in_process("consolidate", sharded, "--step", "4", "--out", tmp_path / "c")
    assert rc == 0, text
    for name in ("model000004.pt", "ema_0.99_000004.pt", "opt000004.pt"):
        assert deep_diff(load(logs["full"] / name), load(tmp_path / "c" / name)) == [], name
    for name in ("phema_0.050_000004.pt", "phema_0.100_000004.pt"):  # beside: written too
        assert (tmp_path / "c" / name).read_bytes() == (logs["full"] / name).read_bytes(), name
    listed = json.loads((tmp_path / "c" / "manifest000004.json").read_text())["files"]
    assert sorted(listed) == sorted(json.loads(
        (logs["full"] / "manifest000004.json").read_text())["files"]), listed


def test_ckpt_phema_gives_the_same_bytes_from_both_layouts_and_the_ddp_runs_weights(runs,
                                                                                   tmp_path):
    logs, _, _ = runs
    got = {}
    for name in ("full", "sharded", "ddp"):
        got[name] = tmp_path / f"{name}.pt"
        args = ("phema", logs[name], "--std", "0.07", "--out", got[name])
        if name == "full":  # the script once, its main for the others
            run_script("ckpt.py", *args)
        else:
            rc, text = ckpt_in_process(*args)
            assert rc == 0, text
    assert got["full"].read_bytes() == got["sharded"].read_bytes()
    fsdp, ddp = load(got["full"])["state_dict"], load(got["ddp"])["state_dict"]
    assert fsdp.keys() == ddp.keys()
    assert any(not torch.equal(fsdp[k], ddp[k]) for k in fsdp)  # FSDP reduces in another order
    for k, t in ddp.items():  # as test_fsdp.py's DDP -> FSDP run: the order of the reductions
        torch.testing.assert_close(fsdp[k], t, rtol=1e-4, atol=1e-5)


def test_each_sharded_grid_is_what_sample_py_draws_from_the_ema_file_of_its_step(runs):
    """The tolerance: none. The sharded forward all-gathers the EMA's exact float32 weights and
    runs the same modules on them as the unsharded copy; DDIM's loop, the per-sample noise and
    the uint8 rounding are the same code in the same order, so the pixels are equal. (A
    tolerance of one level of 255 would be what a last-bit difference of the float order could
    flip, and the DDP run's grid, of weights that differ in the last bits, stays within it.)"""
    logs, out, _ = runs
    for name in ("seen", "sharded"):
        assert sorted(p.name for p in (logs[name] / "samples").iterdir()) == [
            "grid_000002.png", "grid_000004.png"], name
    model, diffusion, _, _ = sampling.load_for_sampling(
        str(logs["full"] / "ema_0.99_000004.pt"), {"timestep_respacing": "3"},
        device=torch.device("cpu"))
    images, _ = sampling.generate(model, diffusion, num_samples=4, batch_size=4, shape=(3, 8, 8),
                                  use_ddim=True, progress=False)
    want = sampling.grid_image(images, ncol=4).astype(np.int64)
    for name in ("seen", "sharded"):
        assert np.array_equal(pixels(logs[name] / "samples" / "grid_000004.png"), want), name
    assert "(4 samples of the EMA 0.99, 3 DDIM steps)" in out["sharded"]


def test_the_sharded_digits_fid_is_the_one_of_the_ema_file(runs):
    """5 samples on 2 ranks in batches of 2: rank 1's last batch is empty and padded (the
    collective forward), its samples dropped; the figures are those of the EMA's 5 samples."""
    logs, _, ref = runs
    model, diffusion, _, _ = sampling.load_for_sampling(
        str(logs["full"] / "ema_0.99_000004.pt"), {"timestep_respacing": "3"},
        device=torch.device("cpu"))
    images, _ = sampling.generate(model, diffusion, num_samples=5, batch_size=2, shape=(3, 8, 8),
                                  use_ddim=True, progress=False)
    features = evaluation.digits_features()
    pool, _, logits = features(images)
    fid = evaluation.compute_statistics(pool).frechet_distance(
        evaluation.compute_statistics(features(np.load(ref)["arr_0"])[0]), method="auto")
    last = rows(logs["sharded"])[-1]
    assert last["step"] == "4"
    assert abs(float(last[FID]) - fid) <= 1e-6 * fid
    assert abs(float(last[IS]) - evaluation.compute_inception_score(logits)) <= 1e-6 * float(
        last[IS])
