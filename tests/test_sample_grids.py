"""Samples while training (issue 24): --sample_interval's grids and --tensorboard.

Through the real scripts: a run with grids is bit for bit the run without them on two ranks (a
model of one's own with BatchNorm, class-conditional), every checkpoint file; a resumed train.py
run writes grids at the same steps, each one what sample.py's functions draw from the EMA file of
its step, and TensorBoard shows every step once across the resume; a grid slower than its budget
stops before the other rank times out. In one process: the copy that samples, the resume's grid,
the budget and the RNG.
"""
import importlib.util
import io
import json

import numpy as np
import pytest
import torch as th
from PIL import Image
from torch import nn

from conftest import deep_diff, run_mpi, run_script, write_class_folder, write_images
from improved_diffusion import logger, sample_grids, sampling
from improved_diffusion.infra.errors import UsageError
from improved_diffusion.script_util import create_gaussian_diffusion

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "10", "--noise_schedule", "cosine",
        "--batch_size", "2", "--log_interval", "1"]
GRIDS = ["--sample_interval", "2", "--sample_steps", "3", "--sample_count", "4"]
OWN_MODEL = ["--image_size", "8", "--dim", "16", "--depth", "1", "--heads", "2",
             "--patch_size", "2", "--diffusion_steps", "10", "--noise_schedule", "cosine",
             "--batch_size", "2", "--log_interval", "1", "--class_cond", "True",
             "--max_steps", "4", "--save_interval", "2"]


def pixels(png):
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def class_data(tmp_path_factory):
    return write_class_folder(tmp_path_factory.mktemp("classes"), per_class=3)


# ------------------------------------------------------------------------ through the scripts


@pytest.mark.timeout(200)
def test_a_run_with_grids_is_bitwise_the_run_without_them_on_two_ranks(tmp_path, class_data):
    """examples/own_model.py (BatchNorm statistics, a frozen parameter, class labels): rank 0
    samples from a copy while rank 1 waits in the next step; every checkpoint file is the same
    byte for byte, and the manifests but for their time."""
    logs = {}
    for name, extra in (("plain", []), ("grids", GRIDS)):
        logs[name] = tmp_path / name
        run_mpi(2, "../examples/own_model.py", "--data_dir", class_data, "--log_dir",
                logs[name], *OWN_MODEL, *extra, timeout=150)
    assert sorted(p.name for p in (logs["grids"] / "samples").iterdir()) == [
        "grid_000002.png", "grid_000004.png"]
    assert not (logs["plain"] / "samples").exists()
    files = sorted(p.name for p in logs["plain"].iterdir()
                   if p.suffix == ".pt" or p.name.startswith("manifest"))
    assert len(files) == 8  # model, EMA, opt and manifest of steps 2 and 4
    differ = [n for n in files if n.endswith(".pt")
              and (logs["plain"] / n).read_bytes() != (logs["grids"] / n).read_bytes()]
    differ += [f"{n}{d}" for n in files if n.endswith(".json") for d in deep_diff(
        *({k: v for k, v in json.loads((logs[run] / n).read_text()).items()
           if k != "run_flags"}  # but its time and the settings (one run names the grids')
          for run in ("plain", "grids")))]
    assert not differ, f"sampling changed the training: {differ}"


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, class_data):
    """train.py (class-conditional UNet) with grids every 2 steps to step 3, killed while saving
    step 3 after logging it (its manifest removed), then resumed to step 5 (from step 2).
    --tensorboard when the package is installed."""
    log = tmp_path_factory.mktemp("resumed") / "log"
    flags = [*TINY, *GRIDS, "--class_cond", "True", "--data_dir", class_data, "--log_dir", log,
             "--save_interval", "2", "--tensorboard", str(HAS_TENSORBOARD)]
    run_script("train.py", *flags, "--max_steps", "3")
    first = {p.name: p.read_bytes() for p in (log / "samples").iterdir()}
    (log / "manifest000003.json").unlink()
    out = run_script("train.py", *flags, "--max_steps", "5").stdout
    assert "resumed at step 2" in out
    return log, first, out


@pytest.mark.timeout(120)
def test_a_resumed_run_writes_the_grids_of_a_straight_one_each_sample_py_s_samples(resumed_run):
    log, first, out = resumed_run
    assert sorted(first) == ["grid_000002.png", "grid_000003.png"]  # every 2 steps, the end
    grids = {p.name: p.read_bytes() for p in (log / "samples").iterdir()}
    assert sorted(grids) == [f"grid_{s:06d}.png" for s in (2, 3, 4, 5)]
    assert grids["grid_000002.png"] == first["grid_000002.png"]  # the resume step's: kept
    assert out.count("samples: ") == 2 and "(4 samples of the EMA 0.9999, 3 DDIM steps)" in out
    # sample.py's functions on the EMA file of step 4, in batches of 3: the same images
    model, diffusion, _, _ = sampling.load_for_sampling(
        str(log / "ema_0.9999_000004.pt"), {"timestep_respacing": "3"}, device=th.device("cpu"))
    images, labels = sampling.generate(
        model, diffusion, num_samples=4, batch_size=3, shape=(3, 8, 8), use_ddim=True,
        num_classes=3, classes=[0, 1, 2], progress=False)
    assert labels.tolist() == [0, 1, 2, 0]
    assert np.array_equal(pixels(log / "samples" / "grid_000004.png"),
                          sampling.grid_image(images, ncol=3))  # a column per class


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard package ('.[tensorboard]')")
def test_tensorboard_shows_every_step_once_across_the_resume_with_its_grids(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, _, _ = resumed_run
    events = EventAccumulator(str(log / "tb"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "steps_per_s", "samples_per_s"} <= scalars
    assert any(tag.startswith("loss_q") for tag in scalars)  # the loss by timestep quartile
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    rows = [r.split(",") for r in (log / "progress.csv").read_text().splitlines()]
    step, value = rows[0].index("step"), rows[0].index("loss")
    again = [float(r[value]) for r in rows[1:] if r[step] == "3"]
    assert len(again) == 1 and loss[3] == pytest.approx(again[0], rel=1e-6)  # the resumed one
    images = events.Images("sample_grid")
    assert [e.step for e in images] == [2, 4, 5]  # step 3's was purged with its steps
    shown = np.asarray(Image.open(io.BytesIO(images[1].encoded_image_string)).convert("RGB"))
    assert np.array_equal(shown, pixels(log / "samples" / "grid_000004.png"))


@pytest.mark.timeout(120)
def test_a_grid_slower_than_its_budget_stops_before_the_other_rank_times_out(tmp_path):
    """Each eval-mode forward sleeps 1 s: 12 DDIM steps would keep rank 1 waiting in a
    collective for 12 s, past --dist_timeout 8; the grid stops after half of it."""
    data = write_images(tmp_path / "data", n=4)
    log = tmp_path / "log"
    out = run_mpi(2, "../tests/train_slow_grids.py", "1.0", *TINY, "--data_dir", data,
                  "--log_dir", log, "--max_steps", "3", "--sample_interval", "1",
                  "--diffusion_steps", "20",
                  "--sample_steps", "12", "--sample_count", "2", "--dist_timeout", "8",
                  timeout=100).stdout
    assert "samples: the grid of step 1 stopped after" in out
    assert "its budget (0.5 x --dist_timeout 8s" in out and out.count("samples: ") == 1
    assert not (log / "samples").exists() or not list((log / "samples").iterdir())
    assert (log / "manifest000003.json").exists()


# ------------------------------------------------------------------------ in one process


class Tiny(nn.Module):
    """A conv net with BatchNorm that draws from the global RNG in every forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x, t, **kwargs):
        th.rand(1)
        return self.norm(self.conv(x))


def tiny_grids(log_dir, **kwargs):
    model = Tiny()
    model(th.randn(4, 3, 8, 8), th.zeros(4))  # some BatchNorm statistics
    ema = [p.detach() + 1 for p in model.parameters()]
    grids = sample_grids.SampleGrids(
        model=model, params=ema, diffusion=create_gaussian_diffusion(steps=10, noise_schedule="cosine"),
        log_dir=str(log_dir), interval=2, count=3, steps=2, **kwargs)
    return model, ema, grids


def test_the_copy_holds_the_ema_and_the_buffers_and_leaves_the_model_as_it_was():
    model, ema, _ = tiny_grids("unused")
    model(th.randn(4, 3, 8, 8), th.zeros(4)).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    copy = sample_grids.copy_with_params(model, ema)
    assert not copy.training and model.training
    assert all(th.equal(p, e) and p.grad is None for p, e in zip(copy.parameters(), ema))
    assert th.equal(copy.norm.running_mean, model.norm.running_mean)
    copy.train()(th.randn(4, 3, 8, 8), th.zeros(4))  # moves the copy's statistics only
    assert not th.equal(copy.norm.running_mean, model.norm.running_mean)
    assert all(th.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all(p.grad is not None for p in model.parameters())


def test_a_resumed_job_draws_the_grid_of_its_resume_step_only_when_it_is_missing(tmp_path):
    _, _, grids = tiny_grids(tmp_path)
    rng = th.get_rng_state()
    assert grids.at_step(0, (3, 8, 8), resumed=True) is None
    assert grids.at_step(3, (3, 8, 8)) is None
    path = tmp_path / "samples" / "grid_000004.png"
    assert grids.at_step(4, (3, 8, 8), resumed=True) == str(path) and path.exists()
    assert th.equal(th.get_rng_state(), rng)  # the model drew from it: put back
    before = path.read_bytes()
    path.write_bytes(b"the file of an earlier job")
    assert grids.at_step(4, (3, 8, 8), resumed=True) is None
    assert grids.at_step(4, (3, 8, 8)) == str(path) and path.read_bytes() == before
    assert grids.at_end(4) is None  # drawn already
    assert grids.at_end(5) == str(tmp_path / "samples" / "grid_000005.png")


def test_a_grid_past_its_budget_writes_nothing_says_so_and_turns_grids_off(tmp_path, capsys,
                                                                       restore_logger):
    ticks = iter(range(100))
    _, _, grids = tiny_grids(tmp_path, budget_s=1.5, clock=lambda: next(ticks))
    logger.configure(dir=str(tmp_path / "logs"), format_strs="stdout", rank=0)
    rng = th.get_rng_state()
    assert grids.at_step(2, (3, 8, 8)) is None
    assert th.equal(th.get_rng_state(), rng)
    assert grids.at_step(4, (3, 8, 8)) is None and grids.at_end(5) is None
    assert not (tmp_path / "samples").exists() or not list((tmp_path / "samples").iterdir())
    out = capsys.readouterr().out
    assert out.count("samples: the grid of step 2 stopped after 3.0s") == 1
    assert "lower --sample_count or --sample_steps, or raise --dist_timeout" in out


def test_latent_samples_are_refused_at_the_first_step_naming_the_flag(tmp_path):
    _, _, grids = tiny_grids(tmp_path)
    with pytest.raises(UsageError, match=r"--sample_interval 2: the samples have 4 channels"):
        grids.at_step(0, (4, 8, 8), resumed=True)


@pytest.mark.parametrize("num_classes, count, columns", [(10, 20, 10), (10, 4, 4), (None, 20, 8),
                                                          (100, 20, 8)])
def test_a_labelled_grid_has_a_column_per_class_so_each_column_is_one_class(
        tmp_path, num_classes, count, columns):
    """Labels are ``i % num_classes``: with a column per class (up to MAX_CLASS_COLUMNS) every
    column shows one class, all of them (the demo's 10 digits, not 8 of them)."""
    model, ema, _ = tiny_grids("unused")
    grids = sample_grids.SampleGrids(
        model=model, params=ema,
        diffusion=create_gaussian_diffusion(steps=10, noise_schedule="cosine"),
        log_dir=str(tmp_path), interval=2, count=count, steps=2, num_classes=num_classes)
    path = grids.at_step(2, (3, 8, 8))
    blank = np.zeros((count, 8, 8, 3), np.uint8)
    assert pixels(path).shape == sampling.grid_image(blank, ncol=columns).shape
