"""Promises that no test named directly before (issue 29, items 16, 17, 20 and 21): each test
here fails on the change it names (checked by making it).

- 16: an elastic resume (another rank count) reseeds every rank from (seed, step, rank) instead
  of restoring a rank's old RNG state; the same rank count restores it.
- 17: a rerun of a finished run writes nothing (not that step again).
- 20: ``--lock_wait`` bounds the wait for a held log dir at its value.
- 21: the lock's file goes with its release; the fallback data position (no trainer state) is
  step * global batch; ``--fp16_scale_growth`` sets the GradScaler's growth interval.
"""
import hashlib
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import run_script, write_images
from improved_diffusion import amp, image_datasets
from improved_diffusion.ckpt import checkpointer as ckpt_mod
from improved_diffusion.ckpt import rng, run_lock


def fake_ckpt(**kw):
    base = dict(seed=3, rank=0, world_size=1, global_batch=4, batch_size=4, data=None,
                states={}, emas={}, run_flags={}, settings={})
    return SimpleNamespace(**dict(base, **kw))


def draws():
    return torch.rand(4).tolist()


# ------------------------------------------------------------------------------ 16: reseed


def test_an_elastic_resume_reseeds_every_rank_and_a_same_size_one_restores_its_state():
    rng.seed_rngs(11, 0, 0)
    saved = [rng.get_rng_state(), rng.get_rng_state()]  # "two ranks" of a 2-rank run
    expected_saved = draws()
    rng.seed_rngs(3, 7, 0)
    expected_reseed = draws()

    rng.seed_rngs(99, 0, 0)
    ckpt_mod.restore_rng(fake_ckpt(world_size=1), saved, 2, step=7)  # 2 -> 1 ranks
    assert draws() == expected_reseed  # (seed 3, step 7, rank 0), not rank 0's old state
    rng.seed_rngs(99, 0, 0)
    ckpt_mod.restore_rng(fake_ckpt(world_size=2), saved, 2, step=7)  # same size
    assert draws() == expected_saved


# --------------------------------------------------------------------- 21: fallback position


def test_without_trainer_state_the_data_goes_on_at_step_times_the_global_batch(tmp_path):
    loader = image_datasets.load_data(data_dir=str(write_images(tmp_path / "d", n=6)),
                                      batch_size=2, image_size=8, seed=0)
    ckpt = fake_ckpt(data=loader, global_batch=6)
    ckpt_mod.restore_trainer_state(ckpt, None, 5)
    assert loader.position == 30


# ---------------------------------------------------------------------- 21: --fp16_scale_growth


@pytest.mark.parametrize("growth,interval", [(0.5, 2), (1e-3, 1000), (0.25, 4)])
def test_fp16_scale_growth_is_the_grad_scalers_growth_interval(monkeypatch, growth, interval):
    monkeypatch.setattr(amp, "cpu_has_fast_bf16", lambda: False)  # the float16 + scaler branch
    dtype, scaler = amp.make_amp(torch.device("cpu"), True, growth)
    assert dtype == torch.float16 and scaler.get_growth_interval() == interval
    if interval == 2:  # and it acts: two good steps double the scale
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        start = scaler.get_scale()
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 2 * start


# -------------------------------------------------------------------------- 20, 21: the lock


def test_the_lock_file_goes_with_the_release_and_lock_wait_bounds_the_wait(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    holder = run_lock.LogDirLock(d, 0).acquire(log=lambda s: None)
    assert (d / ".lock").exists()
    waiter = run_lock.LogDirLock(d, 1.0)
    began = time.monotonic()
    with pytest.raises(run_lock.LogDirLockedError):
        waiter.acquire(log=lambda s: None)
    waited = time.monotonic() - began
    assert 1.0 <= waited < 5.0, waited  # its value, not a multiple of it
    holder.release()
    assert not (d / ".lock").exists()


# -------------------------------------------------------------------- 17: a finished run


@pytest.mark.timeout(120)
def test_a_rerun_of_a_finished_run_writes_nothing(tmp_path):
    data = write_images(tmp_path / "d", n=6)
    flags = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
             "--attention_resolutions", "", "--diffusion_steps", "20", "--batch_size", "2",
             "--data_dir", data, "--log_dir", tmp_path / "run", "--max_steps", 2]
    run_script("train.py", *flags)

    def files():
        return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
                for p in sorted((tmp_path / "run").iterdir())
                if p.suffix in (".pt", ".json")}

    before = files()
    out = run_script("train.py", *flags).stdout
    assert "already at step 2; nothing to train" in out, out[-2000:]
    assert files() == before


def test_a_resume_with_another_batch_on_the_same_ranks_names_the_batch_not_the_world(
        monkeypatch):
    """Issue 29, item 13: before, ``resume: world size 2 -> 2, ...`` when only --batch_size
    changed."""
    lines = []
    monkeypatch.setattr(ckpt_mod.logger, "log", lambda *a, **k: lines.append(" ".join(map(str, a))))
    trainer = {"world_size": 2, "global_batch": 4, "batch_size": 2, "seed": 3, "rng": None}
    ckpt_mod.restore_trainer_state(fake_ckpt(world_size=2, global_batch=8, batch_size=4),
                                   trainer, 5)
    out = "\n".join(lines)
    assert "resume: --batch_size 2 -> 4 (global batch size 4 -> 8 on 2 rank(s))" in out, out
    assert "world size 2 -> 2" not in out
