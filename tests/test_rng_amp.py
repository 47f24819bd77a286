"""The RNG state a checkpoint keeps per rank (rng.py) and --use_fp16's setup on any torch
(amp.py), with CUDA faked: which device's generator is saved and restored, and what happens when
the device layout changed; a GradScaler where torch.amp has none (torch 2.1/2.2)."""
import random

import numpy as np
import pytest
import torch as th

from improved_diffusion import amp, logger
from improved_diffusion.ckpt import rng


class FakeCuda:
    """torch.cuda as seen by a process whose own device is ``device`` (None: no CUDA)."""

    def __init__(self, monkeypatch, device):
        self.device, self.set_calls = device, []
        monkeypatch.setattr(th.cuda, "is_available", lambda: device is not None)
        monkeypatch.setattr(th.cuda, "current_device", lambda: device)
        monkeypatch.setattr(th.cuda, "get_rng_state",
                            lambda d: th.tensor([10 + d], dtype=th.uint8))
        monkeypatch.setattr(th.cuda, "set_rng_state",
                            lambda state, d: self.set_calls.append((int(state[0]), d)))
        monkeypatch.setattr(th.cuda, "manual_seed_all", lambda seed: None)


def test_each_rank_saves_the_generator_of_its_own_device_only(monkeypatch):
    FakeCuda(monkeypatch, device=3)
    state = rng.get_rng_state()
    assert state["cuda_device"] == 3 and int(state["cuda"][0]) == 13


def test_a_rank_on_another_device_after_the_resume_gets_its_saved_generator(monkeypatch):
    FakeCuda(monkeypatch, device=3)
    saved = rng.get_rng_state()  # written by a rank on cuda:3 (say node 0 of 2x4)
    now = FakeCuda(monkeypatch, device=1)  # the same rank now on cuda:1 (1x8, or per-task GPUs)
    assert rng.set_rng_state(saved) is None
    assert now.set_calls == [(13, 1)]


def test_files_with_every_devices_state_give_each_rank_its_own_devices_entry(monkeypatch):
    FakeCuda(monkeypatch, device=None)
    saved = rng.get_rng_state()
    saved["cuda"] = [th.tensor([20 + d], dtype=th.uint8) for d in range(4)]  # the old layout
    saved.pop("cuda_device")
    now = FakeCuda(monkeypatch, device=2)
    assert rng.set_rng_state(saved) is None and now.set_calls == [(22, 2)]
    now = FakeCuda(monkeypatch, device=5)  # more devices now than the file knew
    note = rng.set_rng_state(saved)
    assert now.set_calls == [] and "not restored" in note and "cuda:5" in note


def test_a_cuda_generator_that_cannot_be_restored_is_said_not_silently_dropped(monkeypatch):
    FakeCuda(monkeypatch, device=0)
    saved = rng.get_rng_state()
    FakeCuda(monkeypatch, device=None)  # resumed on a machine without CUDA
    note = rng.set_rng_state(saved)
    assert "CUDA RNG state was not restored" in note and "no CUDA device" in note
    cpu_only = rng.get_rng_state()
    now = FakeCuda(monkeypatch, device=0)  # saved without CUDA, resumed with it
    assert "checkpoint: none" in rng.set_rng_state(cpu_only) and now.set_calls == []


def test_the_cpu_generators_round_trip_exactly(monkeypatch):
    FakeCuda(monkeypatch, device=None)
    rng.seed_rngs(5, 2, 1)
    state = rng.get_rng_state()
    a = (th.rand(3), np.random.rand(), random.random())
    rng.seed_rngs(0)
    assert rng.set_rng_state(state) is None
    b = (th.rand(3), np.random.rand(), random.random())
    assert th.equal(a[0], b[0]) and a[1:] == b[1:]


# ------------------------------------------------------------------------------ amp


def test_without_torch_amp_gradscaler_cuda_takes_torch_cuda_amps_and_a_cpu_falls_back_to_bf16(
        monkeypatch, tmp_path, capsys):
    monkeypatch.delattr(th.amp, "GradScaler", raising=False)
    made = []

    class CudaScaler:
        def __init__(self, **kw):
            made.append(kw)

    monkeypatch.setattr(th.cuda.amp, "GradScaler", CudaScaler, raising=False)
    assert isinstance(amp.grad_scaler("cuda", init_scale=2.0 ** 20), CudaScaler)
    assert made == [{"init_scale": 2.0 ** 20}]
    with pytest.raises(RuntimeError, match="no GradScaler for cpu"):
        amp.grad_scaler("cpu")
    monkeypatch.setattr(amp, "cpu_has_fast_bf16", lambda: False)
    logger.configure(dir=str(tmp_path), format_strs=["stdout"], rank=0)
    assert amp.make_amp(th.device("cpu"), True, 1e-3) == (th.bfloat16, None)
    assert "using bfloat16" in capsys.readouterr().out
