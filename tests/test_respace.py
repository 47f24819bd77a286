"""Timestep respacing: space_timesteps and SpacedDiffusion only remap timesteps."""
import numpy as np
import pytest
import torch as th

from improved_diffusion.gaussian_diffusion import (
    GaussianDiffusion,
    LossType,
    ModelMeanType,
    ModelVarType,
    get_named_beta_schedule,
)
from improved_diffusion.respace import SpacedDiffusion, _WrappedModel, space_timesteps


def kwargs(steps=100, rescale=True):
    return dict(
        betas=get_named_beta_schedule("cosine", steps),
        model_mean_type=ModelMeanType.EPSILON,
        model_var_type=ModelVarType.LEARNED_RANGE,
        loss_type=LossType.RESCALED_MSE,
        rescale_timesteps=rescale,
    )


def test_space_timesteps_takes_evenly_strided_steps_per_section():
    assert sorted(space_timesteps(100, [10])) == list(range(0, 100, 11))[:9] + [99]
    steps = space_timesteps(300, "10,10,10")
    assert len(steps) == 30 and min(steps) == 0 and max(steps) == 299
    assert space_timesteps(10, "10") == set(range(10))
    assert space_timesteps(1000, [1000]) == set(range(1000))


def test_ddim_spacing_uses_an_integer_stride():
    assert sorted(space_timesteps(1000, "ddim50")) == list(range(0, 1000, 20))


@pytest.mark.parametrize("spec,match", [
    ("ddim30", "integer stride"),
    ("ddimx", "ddimN"),
    ("ten", "timestep_respacing"),
    ("200", "cannot divide"),
])
def test_impossible_respacing_names_the_flag(spec, match):
    with pytest.raises(ValueError, match=match):
        space_timesteps(100, spec)


def test_spaced_diffusion_over_all_steps_equals_the_base_diffusion():
    base = GaussianDiffusion(**kwargs())
    spaced = SpacedDiffusion(space_timesteps(100, "100"), **kwargs())
    assert spaced.timestep_map == list(range(100)) and spaced.original_num_steps == 100
    np.testing.assert_allclose(spaced.betas, base.betas, rtol=1e-12)


def test_spaced_diffusion_keeps_the_cumulative_alphas_of_the_kept_steps():
    base = GaussianDiffusion(**kwargs())
    use = space_timesteps(100, "ddim10")
    spaced = SpacedDiffusion(use, **kwargs())
    assert spaced.num_timesteps == 10 and spaced.timestep_map == sorted(use)
    np.testing.assert_allclose(
        spaced.alphas_cumprod, base.alphas_cumprod[spaced.timestep_map], rtol=1e-12
    )


@pytest.mark.parametrize("rescale", [True, False])
def test_wrapped_model_sees_original_timesteps(rescale):
    spaced = SpacedDiffusion(space_timesteps(100, "ddim10"), **kwargs(rescale=rescale))
    seen = []

    def model(x, t, **kw):
        seen.append((t.clone(), kw))
        return th.zeros(x.shape[0], x.shape[1] * 2, *x.shape[2:])

    x = th.zeros(2, 3, 4, 4)
    spaced.p_mean_variance(model, x, th.tensor([0, 9]), model_kwargs={"y": th.tensor([1, 2])})
    spaced.training_losses(model, x, th.tensor([3, 4]))
    original = [[0, 90], [30, 40]]
    for (t, _), want in zip(seen, original):
        expected = th.tensor(want, dtype=th.float32) * 10.0 if rescale else th.tensor(want)
        assert t.tolist() == expected.tolist()
    assert seen[0][1]["y"].tolist() == [1, 2]
    assert spaced._scale_timesteps(th.tensor([5])).tolist() == [5]
    assert isinstance(spaced._wrap_model(spaced._wrap_model(model)), _WrappedModel)


def test_spaced_ddim_loop_runs_the_kept_steps_only():
    spaced = SpacedDiffusion(space_timesteps(100, "5"), **kwargs())
    calls = []

    def model(x, t, **kw):
        calls.append(t[0].item())
        return th.zeros(x.shape[0], x.shape[1] * 2, *x.shape[2:])

    out = spaced.ddim_sample_loop(model, (1, 3, 4, 4), noise=th.randn(1, 3, 4, 4),
                                  device=th.device("cpu"))
    assert out.shape == (1, 3, 4, 4)
    assert calls == [990.0, 740.0, 500.0, 250.0, 0.0]
