"""A model of one's own with the edges users' models have (issue 29, items 2, 4, 15 and 18),
through train.py's machinery on 2 ranks (tests/edge_model_train.py): two layers sharing one
weight, a parameter left out of the loss on some steps and ranks, BatchNorm buffers.

- Without ``--find_unused_parameters True`` the job ends with one line naming the flag (before:
  the ranks waited in different collectives until --dist_timeout, then gloo tracebacks).
- With it (the flag, or ``train_job.Parts(find_unused_parameters=True)``), a run stopped and
  resumed ends bitwise equal to a straight one.
- Every state-dict name of the shared weight carries the EMA in the EMA and post-hoc EMA files
  and in ``ckpt.py phema``'s output (before: the second name held the live weight, and
  ``load_state_dict`` put it into the shared tensor); the EMA file holds the model's buffers
  (upstream's rule); a reconstruction takes the target step's buffers.
"""
import io

import pytest
import torch

from conftest import MPIEXEC, PY, REPO, _run, deep_diff, resumed_step, write_images
from improved_diffusion.apps.ckpt_tool import main as ckpt_main
from test_phema_train import stopped_at

DRIVER = REPO / "tests" / "edge_model_train.py"
FLAGS = ["--image_size", "8", "--diffusion_steps", "20", "--noise_schedule", "cosine",
         "--batch_size", "2", "--log_interval", "1", "--seed", "0", "--ema_rate", "0.9",
         "--save_interval", "2", "--phema_stds", "0.05,0.1", "--dist_timeout", "30",
         "--num_workers", "1"]  # loader workers: the GPU default
BUFFERS = ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked")


def train(data, log_dir, *extra, check=True):
    return _run([MPIEXEC, "-n", "2", PY, DRIVER, *FLAGS, "--data_dir", data, "--log_dir",
                 log_dir, *map(str, extra)], timeout=150, check=check)


def load(path):
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run to 6 (the flag), and a run stopped after step 2 (a copy of the straight
    run's log dir as a job killed then left it) resumed to 6 (train_job.Parts)."""
    d = tmp_path_factory.mktemp("edges")
    data = write_images(d / "images", n=14)
    train(data, d / "straight", "--max_steps", 6, "--find_unused_parameters", "True")
    stopped_at(d / "straight", d / "resumed", 2)
    out = train(data, d / "resumed", "--max_steps", 6, "--parts_find_unused", "True").stdout
    assert resumed_step(out) == 2, out[-2000:]
    return data, d / "straight", d / "resumed"


@pytest.mark.timeout(200)
def test_a_parameter_unused_on_some_steps_without_the_flag_is_one_line_naming_it(
        tmp_path, runs):
    data = runs[0]
    proc = train(data, tmp_path / "run", "--max_steps", 6, check=False)
    out = proc.stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1, out[-3000:]
    assert len(errors) == 1 and "--find_unused_parameters True" in errors[0], out[-3000:]
    assert "rare.weight" in errors[0] and "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(300)
def test_with_find_unused_parameters_a_resumed_run_ends_bitwise_like_a_straight_one(runs):
    _, straight, resumed = runs
    for name in ("model000006.pt", "ema_0.9_000006.pt", "opt000006.pt",
                 "phema_0.050_000006.pt", "phema_0.100_000006.pt"):
        diffs = list(deep_diff(load(straight / name), load(resumed / name)))
        assert not diffs, f"{name}: {diffs[:10]}"


@pytest.mark.timeout(120)
def test_every_name_of_a_shared_weight_carries_the_ema_and_ema_files_keep_the_buffers(
        tmp_path, runs):
    _, straight, _ = runs
    model = load(straight / "model000006.pt")["state_dict"]
    ema = load(straight / "ema_0.9_000006.pt")["state_dict"]
    assert not torch.equal(ema["a.weight"], model["a.weight"])  # an EMA, not the live weight
    assert torch.equal(ema["b.weight"], ema["a.weight"])
    for b in BUFFERS:  # upstream's rule: EMA parameters, the model's buffers
        assert torch.equal(ema[b], model[b]), b
    from edge_model_train import EdgeModel

    net = EdgeModel(20)
    net.load_state_dict(ema)  # what the README says to do with an EMA file
    assert torch.equal(net.a.weight, ema["a.weight"]) and net.b.weight is net.a.weight
    for std in ("0.050", "0.100"):
        snap = load(straight / f"phema_{std}_000006.pt")["state_dict"]
        assert torch.equal(snap["b.weight"], snap["a.weight"]), std
        assert not torch.equal(snap["a.weight"], model["a.weight"]), std

    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main(["phema", str(straight), "--std", "0.07", "--out", str(tmp_path / "p.pt")],
                     out=out, err=err)
    assert code == 0, err.getvalue()
    made = load(tmp_path / "p.pt")["state_dict"]
    assert torch.equal(made["b.weight"], made["a.weight"])
    first = load(straight / "model000002.pt")["state_dict"]
    for b in BUFFERS:  # the target step's buffers, not the first snapshot's
        assert torch.equal(made[b], model[b]) and not torch.equal(first[b], model[b]), b
