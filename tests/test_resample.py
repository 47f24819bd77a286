"""Timestep samplers: uniform, loss-second-moment (warm-up, importance sampling), and state."""
import io
import textwrap

import numpy as np
import pytest
import torch as th

from conftest import run_module_mpi
from improved_diffusion.infra.errors import UsageError
from improved_diffusion.resample import (
    LossSecondMomentResampler,
    UniformSampler,
    create_named_schedule_sampler,
)

T = 6


class FakeDiffusion:
    num_timesteps = T


def warm_up(sampler, scale=None):
    """Give every timestep a full history; timestep t has losses ~ scale[t]."""
    scale = np.arange(1, T + 1, dtype=np.float64) if scale is None else scale
    for _ in range(sampler.history_per_term):
        ts = list(range(T))
        sampler.update_with_all_losses(ts, [float(scale[t]) for t in ts])


def roundtrip(obj):
    buf = io.BytesIO()
    th.save(obj, buf)
    buf.seek(0)
    return th.load(buf, weights_only=True)


def test_named_samplers_and_unknown_name_names_the_flag():
    assert isinstance(create_named_schedule_sampler("uniform", FakeDiffusion()), UniformSampler)
    assert isinstance(
        create_named_schedule_sampler("loss-second-moment", FakeDiffusion()),
        LossSecondMomentResampler,
    )
    with pytest.raises(UsageError, match="--schedule_sampler"):
        create_named_schedule_sampler("importance", FakeDiffusion())


def test_uniform_sampler_draws_every_timestep_with_unit_weights():
    np.random.seed(0)
    t, w = UniformSampler(FakeDiffusion()).sample(600, th.device("cpu"))
    assert t.dtype == th.long and t.shape == (600,) and w.shape == (600,)
    assert set(t.tolist()) == set(range(T))
    assert (w == 1).all()


def test_loss_second_moment_is_uniform_until_every_timestep_has_full_history():
    s = LossSecondMomentResampler(FakeDiffusion(), history_per_term=3)
    s.update_with_all_losses(list(range(T)) * 2, [1.0] * (2 * T))
    s.update_with_all_losses(list(range(T - 1)), [5.0] * (T - 1))
    assert not s._warmed_up()
    np.testing.assert_array_equal(s.weights(), np.ones(T))
    s.update_with_all_losses([T - 1], [5.0])
    assert s._warmed_up()


def test_loss_second_moment_samples_in_proportion_to_rms_loss_and_reweights():
    s = LossSecondMomentResampler(FakeDiffusion(), history_per_term=4, uniform_prob=0.0)
    scale = np.array([1, 1, 1, 1, 1, 10], dtype=np.float64)
    warm_up(s, scale)
    np.testing.assert_allclose(s.weights(), scale / scale.sum())
    np.random.seed(1)
    t, w = s.sample(3000, th.device("cpu"))
    frac_last = (t == T - 1).float().mean().item()
    assert abs(frac_last - 10 / 15) < 0.03
    # weights 1 / (T p(t)) keep the objective unbiased
    p = scale / scale.sum()
    np.testing.assert_allclose(w.numpy(), 1 / (T * p[t.numpy()]), rtol=1e-6)


def test_history_keeps_only_the_newest_losses():
    s = LossSecondMomentResampler(FakeDiffusion(), history_per_term=2)
    s.update_with_all_losses([0, 0, 0], [1.0, 2.0, 3.0])
    assert s._loss_history[0].tolist() == [2.0, 3.0] and s._loss_counts[0] == 2


def test_update_with_local_losses_works_without_a_process_group():
    s = LossSecondMomentResampler(FakeDiffusion(), history_per_term=2)
    s.update_with_local_losses(th.tensor([1, 2, 2]), th.tensor([0.5, 1.5, 2.5]))
    assert s._loss_counts.tolist() == [0, 1, 2, 0, 0, 0]
    assert s._loss_history[2].tolist() == [1.5, 2.5]


@pytest.mark.parametrize("make", [
    lambda: UniformSampler(FakeDiffusion()),
    lambda: LossSecondMomentResampler(FakeDiffusion()),
])
def test_state_dict_round_trip_restores_identical_draws(make):
    a = make()
    if isinstance(a, LossSecondMomentResampler):
        warm_up(a)
        a.update_with_all_losses([0, 3, 3], [7.0, 0.1, 0.3])
    state = roundtrip(a.state_dict())
    b = make()
    b.load_state_dict(state)
    if isinstance(a, LossSecondMomentResampler):
        assert set(state) >= {"name", "_loss_history", "_loss_counts"}
        assert b._warmed_up()
    else:
        assert state == {"name": "uniform"}
    np.random.seed(7)
    ta, wa = a.sample(50, th.device("cpu"))
    np.random.seed(7)
    tb, wb = b.sample(50, th.device("cpu"))
    assert ta.tolist() == tb.tolist() and wa.tolist() == wb.tolist()
    # the state is a copy: updating the original does not change what was saved
    if isinstance(a, LossSecondMomentResampler):
        a.update_with_all_losses([1], [99.0])
        assert 99.0 not in state["_loss_history"].tolist()[1]


def test_loading_state_of_another_kind_or_size_is_a_clear_error():
    s = LossSecondMomentResampler(FakeDiffusion())
    with pytest.raises(ValueError, match="--schedule_sampler"):
        s.load_state_dict({"name": "uniform"})
    class Big:
        num_timesteps = T + 1
    with pytest.raises(ValueError, match="--diffusion_steps"):
        s.load_state_dict(LossSecondMomentResampler(Big()).state_dict())


@pytest.mark.timeout(120)
def test_update_with_local_losses_gathers_unequal_batches_from_all_ranks():
    code = textwrap.dedent("""
        import torch as th
        from improved_diffusion import dist_util
        from improved_diffusion.resample import LossSecondMomentResampler
        class D: num_timesteps = 4
        dist_util.setup_dist()
        r = dist_util.get_rank()
        s = LossSecondMomentResampler(D(), history_per_term=3)
        ts = th.tensor([r] * (r + 1))          # rank 0: 1 loss, rank 1: 2 losses
        s.update_with_local_losses(ts, ts.float() + 0.5)
        mine = (s._loss_counts.tolist(), s._loss_history[:2].tolist())
        states = dist_util.all_gather_object(mine)
        if r == 0:
            for i, (counts, hist) in enumerate(states):
                print("RANK", i, counts, hist, flush=True)
        dist_util.cleanup()
    """)
    out = run_module_mpi(2, code, timeout=100).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("RANK"))
    assert len(lines) == 2, out
    expected = "[1, 2, 0, 0] [[0.5, 0.0, 0.0], [1.5, 1.5, 0.0]]"
    assert lines[0] == "RANK 0 " + expected and lines[1] == "RANK 1 " + expected
