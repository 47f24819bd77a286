"""Unit tests for the Gaussian diffusion process, on a tiny toy model (independent of unet.py)."""
import itertools

import numpy as np
import pytest
import torch as th
import torch.nn as nn

from improved_diffusion.gaussian_diffusion import (
    GaussianDiffusion,
    LossType,
    ModelMeanType,
    ModelVarType,
    get_named_beta_schedule,
)
from improved_diffusion.losses import (
    approx_standard_normal_cdf,
    discretized_gaussian_log_likelihood,
    normal_kl,
)

N, C, H, W = 3, 2, 4, 4
STEPS = 8


class ToyModel(nn.Module):
    """A per-pixel model: 1x1 conv of x plus a timestep (and optional class) bias."""

    def __init__(self, out_channels, num_classes=None):
        super().__init__()
        self.conv = nn.Conv2d(C, out_channels, 1)
        self.t_proj = nn.Linear(1, out_channels)
        self.emb = nn.Embedding(num_classes, out_channels) if num_classes else None

    def forward(self, x, timesteps, y=None):
        h = self.conv(x) + self.t_proj(timesteps.float()[:, None] / 1000.0)[:, :, None, None]
        if self.emb is not None:
            h = h + self.emb(y)[:, :, None, None]
        return th.tanh(h)


def make(mean_type=ModelMeanType.EPSILON, var_type=ModelVarType.FIXED_LARGE,
         loss_type=LossType.MSE, schedule="cosine", steps=STEPS, rescale=True):
    return GaussianDiffusion(
        betas=get_named_beta_schedule(schedule, steps),
        model_mean_type=mean_type,
        model_var_type=var_type,
        loss_type=loss_type,
        rescale_timesteps=rescale,
    )


def learned(var_type):
    return var_type in (ModelVarType.LEARNED, ModelVarType.LEARNED_RANGE)


def toy(var_type, seed=0, num_classes=None):
    th.manual_seed(seed)
    return ToyModel(C * 2 if learned(var_type) else C, num_classes).eval()


def batch(seed=0):
    g = th.Generator().manual_seed(seed)
    return th.rand(N, C, H, W, generator=g) * 2 - 1


def test_schedules_are_float64_and_in_range():
    for name in ("linear", "cosine"):
        betas = get_named_beta_schedule(name, 50)
        assert betas.dtype == np.float64 and betas.shape == (50,)
        assert (betas > 0).all() and (betas <= 0.999).all()


def test_unknown_schedule_names_the_flag():
    with pytest.raises(ValueError, match="--noise_schedule"):
        get_named_beta_schedule("quadratic", 10)


def test_diffusion_tables_have_one_entry_per_timestep_and_cumprod_shifts():
    d = make(schedule="cosine")
    for name in ("alphas_cumprod", "alphas_cumprod_prev", "alphas_cumprod_next",
                 "posterior_variance", "posterior_log_variance_clipped",
                 "posterior_mean_coef1", "posterior_mean_coef2"):
        arr = getattr(d, name)
        assert arr.dtype == np.float64 and arr.shape == (STEPS,), name
    np.testing.assert_array_equal(d.alphas_cumprod_prev[1:], d.alphas_cumprod[:-1])
    assert d.alphas_cumprod_prev[0] == 1.0 and d.alphas_cumprod_next[-1] == 0.0


def test_q_sample_and_q_mean_variance_shapes_and_t0_is_nearly_clean():
    d = make()
    x0 = batch()
    t = th.tensor([0, 3, STEPS - 1])
    noise = th.randn_like(x0)
    xt = d.q_sample(x0, t, noise=noise)
    assert xt.shape == x0.shape
    mean, var, logvar = d.q_mean_variance(x0, t)
    assert mean.shape == var.shape == logvar.shape == x0.shape
    th.testing.assert_close(xt, mean + var.sqrt() * noise)
    assert (xt[0] - x0[0]).abs().mean() < (xt[2] - x0[2]).abs().mean()


def test_q_posterior_has_input_shapes_and_consistent_log_variance():
    d = make()
    x0, xt = batch(0), batch(1)
    t = th.tensor([1, 4, 7])
    mean, var, logvar = d.q_posterior_mean_variance(x0, xt, t)
    assert mean.shape == var.shape == logvar.shape == x0.shape
    th.testing.assert_close(var.log(), logvar)


@pytest.mark.parametrize(
    "mean_type,var_type", list(itertools.product(ModelMeanType, ModelVarType))
)
def test_p_mean_variance_shapes_for_every_mean_and_var_type(mean_type, var_type):
    d = make(mean_type, var_type)
    model = toy(var_type)
    x = batch()
    t = th.tensor([0, 4, STEPS - 1])
    with th.no_grad():
        out = d.p_mean_variance(model, x, t)
    assert set(out) == {"mean", "variance", "log_variance", "pred_xstart"}
    for v in out.values():
        assert v.shape == x.shape and th.isfinite(v).all()
    assert out["pred_xstart"].abs().max() <= 1.0  # clip_denoised=True
    # (At t=0 the fixed-small variance is 0 while its log is clipped, as upstream.)
    th.testing.assert_close(out["variance"][1:], out["log_variance"][1:].exp(), rtol=1e-5,
                            atol=1e-7)


def test_learned_range_interpolates_between_fixed_small_and_fixed_large_log_variances():
    d = make(var_type=ModelVarType.LEARNED_RANGE)
    x = batch()
    t = th.tensor([1, 4, 7])
    lo, hi = th.full((N, C, H, W), -1.0), th.full((N, C, H, W), 1.0)
    for frac_value, table in ((lo, d.posterior_log_variance_clipped), (hi, np.log(d.betas))):
        model = lambda x_, t_, out=th.cat([th.zeros_like(x), frac_value], 1): out  # noqa: E731
        logvar = d.p_mean_variance(model, x, t)["log_variance"]
        expected = th.tensor(table, dtype=th.float32)[t][:, None, None, None].expand_as(x)
        th.testing.assert_close(logvar, expected)


def test_model_output_of_the_wrong_width_is_a_clear_error():
    d = make(var_type=ModelVarType.LEARNED_RANGE)
    model = toy(ModelVarType.FIXED_LARGE)
    with pytest.raises(ValueError, match="learn_sigma"):
        d.p_mean_variance(model, batch(), th.tensor([1, 2, 3]))


def test_rescale_timesteps_maps_to_the_0_to_1000_range():
    t = th.tensor([0, 4, 7])
    assert make(rescale=True)._scale_timesteps(t).tolist() == [0.0, 500.0, 875.0]
    assert make(rescale=False)._scale_timesteps(t).tolist() == [0, 4, 7]


LOSS_CASES = [
    (LossType.MSE, ModelVarType.FIXED_LARGE, {"loss", "mse"}),
    (LossType.RESCALED_MSE, ModelVarType.FIXED_SMALL, {"loss", "mse"}),
    (LossType.KL, ModelVarType.LEARNED_RANGE, {"loss"}),
    (LossType.RESCALED_KL, ModelVarType.LEARNED, {"loss"}),
    (LossType.MSE, ModelVarType.LEARNED_RANGE, {"loss", "mse", "vb"}),  # hybrid
    (LossType.RESCALED_MSE, ModelVarType.LEARNED_RANGE, {"loss", "mse", "vb"}),  # hybrid
]


@pytest.mark.parametrize("loss_type,var_type,keys", LOSS_CASES)
@pytest.mark.parametrize("mean_type", list(ModelMeanType))
def test_training_losses_return_finite_per_example_terms(loss_type, var_type, keys, mean_type):
    d = make(mean_type, var_type, loss_type)
    model = toy(var_type, num_classes=5)
    x0 = batch()
    t = th.tensor([0, 3, STEPS - 1])
    terms = d.training_losses(model, x0, t, model_kwargs={"y": th.tensor([0, 1, 4])})
    assert set(terms) == keys
    for v in terms.values():
        assert v.shape == (N,) and th.isfinite(v).all()
    terms["loss"].mean().backward()
    assert model.conv.weight.grad is not None


def test_hybrid_loss_is_mse_plus_rescaled_vb_and_vb_does_not_train_the_mean():
    d_raw = make(var_type=ModelVarType.LEARNED_RANGE, loss_type=LossType.MSE)
    d_res = make(var_type=ModelVarType.LEARNED_RANGE, loss_type=LossType.RESCALED_MSE)
    model = toy(ModelVarType.LEARNED_RANGE)
    x0, noise = batch(0), th.randn(N, C, H, W)
    t = th.tensor([1, 3, 5])
    raw = d_raw.training_losses(model, x0, t, noise=noise)
    res = d_res.training_losses(model, x0, t, noise=noise)
    th.testing.assert_close(raw["loss"], raw["mse"] + raw["vb"])
    th.testing.assert_close(res["vb"], raw["vb"] * STEPS / 1000.0)
    th.testing.assert_close(res["mse"], raw["mse"])

    # The vb term's gradient reaches the model only through the variance half of the output.
    x = th.randn(N, C, H, W)
    out = th.cat([th.zeros(N, C, H, W), th.zeros(N, C, H, W)], 1).requires_grad_()
    d_raw.training_losses(lambda *a, **k: out, x, t, noise=noise)["vb"].sum().backward()
    assert out.grad[:, :C].abs().max() == 0 and out.grad[:, C:].abs().max() > 0


def test_rescaled_kl_is_kl_times_num_timesteps():
    model = toy(ModelVarType.LEARNED_RANGE)
    x0, noise, t = batch(), th.randn(N, C, H, W), th.tensor([0, 2, 6])
    kl = make(var_type=ModelVarType.LEARNED_RANGE, loss_type=LossType.KL).training_losses(
        model, x0, t, noise=noise)["loss"]
    rkl = make(var_type=ModelVarType.LEARNED_RANGE, loss_type=LossType.RESCALED_KL
               ).training_losses(model, x0, t, noise=noise)["loss"]
    th.testing.assert_close(rkl, kl * STEPS)


def test_loss_type_is_vb_only_for_kl_losses():
    assert [lt for lt in LossType if lt.is_vb()] == [LossType.KL, LossType.RESCALED_KL]


def test_p_sample_step_adds_no_noise_at_t0_and_noise_otherwise():
    d = make(var_type=ModelVarType.FIXED_SMALL)
    model = toy(ModelVarType.FIXED_SMALL)
    x = batch()
    t = th.tensor([0, 0, 5])
    with th.no_grad():
        mean = d.p_mean_variance(model, x, t)["mean"]
        out = d.p_sample(model, x, t, randn_like=lambda v: th.ones_like(v))
    assert out["sample"].shape == out["pred_xstart"].shape == x.shape
    th.testing.assert_close(out["sample"][:2], mean[:2])
    assert (out["sample"][2] - mean[2]).abs().min() > 0


def test_ddim_step_with_eta0_is_deterministic_and_reverse_step_inverts_it_roughly():
    d = make(schedule="cosine", steps=50)
    model = toy(ModelVarType.FIXED_LARGE)
    x = batch()
    t = th.tensor([20, 20, 20])
    with th.no_grad():
        a = d.ddim_sample(model, x, t, eta=0.0)["sample"]
        b = d.ddim_sample(model, x, t, eta=0.0, randn_like=lambda v: th.randn_like(v) * 100)
        c = d.ddim_sample(model, x, t, eta=1.0)["sample"]
        back = d.ddim_reverse_sample(model, a, t - 1, clip_denoised=False)["sample"]
    assert a.shape == x.shape
    th.testing.assert_close(a, b["sample"])
    assert (a - c).abs().max() > 1e-3
    assert (back - x).abs().max() < 0.2
    with pytest.raises(ValueError, match="eta"):
        d.ddim_reverse_sample(model, a, t, eta=0.5)


def per_sample_randn_like(seeds):
    """A randn_like drawing each sample's noise from its own generator (seeded by `seeds`)."""
    gens = [th.Generator().manual_seed(s) for s in seeds]

    def randn_like(x):
        return th.stack([th.randn(x.shape[1:], generator=g, dtype=x.dtype) for g in gens])

    return randn_like


@pytest.mark.parametrize("loop,kwargs", [
    ("p_sample_loop", {}),
    ("ddim_sample_loop", {"eta": 1.0}),
])
def test_loops_honour_randn_like_so_a_sample_does_not_depend_on_its_batch(loop, kwargs):
    d = make(var_type=ModelVarType.FIXED_SMALL, steps=6)
    model = toy(ModelVarType.FIXED_SMALL)
    sampler = getattr(d, loop)
    th.manual_seed(123)
    three = sampler(model, (3, C, H, W), randn_like=per_sample_randn_like([10, 11, 12]), **kwargs)
    th.manual_seed(456)  # the global generator must not matter
    one = sampler(model, (1, C, H, W), randn_like=per_sample_randn_like([11]), **kwargs)
    assert three.shape == (3, C, H, W) and one.shape == (1, C, H, W)
    th.testing.assert_close(one[0], three[1], rtol=1e-5, atol=1e-6)
    assert (three[0] - three[1]).abs().max() > 1e-3


def test_progressive_loops_yield_every_step_and_progress_bar_runs():
    d = make(steps=5)
    model = toy(ModelVarType.FIXED_LARGE)
    outs = list(d.p_sample_loop_progressive(model, (2, C, H, W), progress=True))
    assert len(outs) == 5 and all(o["sample"].shape == (2, C, H, W) for o in outs)
    noise = th.randn(2, C, H, W)
    outs = list(d.ddim_sample_loop_progressive(model, (2, C, H, W), noise=noise))
    assert len(outs) == 5
    th.testing.assert_close(
        d.ddim_sample_loop(model, (2, C, H, W), noise=noise, progress=True), outs[-1]["sample"]
    )


def test_calc_bpd_loop_returns_per_timestep_terms_and_a_total():
    d = make(var_type=ModelVarType.LEARNED_RANGE, steps=5)
    model = toy(ModelVarType.LEARNED_RANGE)
    out = d.calc_bpd_loop(model, batch())
    assert set(out) == {"total_bpd", "prior_bpd", "vb", "xstart_mse", "mse"}
    assert out["total_bpd"].shape == out["prior_bpd"].shape == (N,)
    for key in ("vb", "xstart_mse", "mse"):
        assert out[key].shape == (N, 5)
    for v in out.values():
        assert th.isfinite(v).all()
    th.testing.assert_close(out["total_bpd"], out["vb"].sum(1) + out["prior_bpd"])
    assert (out["total_bpd"] > 0).all()


def test_normal_kl_is_zero_for_equal_gaussians_and_accepts_scalars():
    m = th.randn(5)
    assert normal_kl(m, th.zeros(5), m, 0.0).abs().max() == 0
    assert (normal_kl(m, 0.0, 0.0, 0.0) >= 0).all()


def test_discretized_likelihood_sums_to_one_over_the_256_bins():
    bins = th.linspace(-1, 1, 256)
    means = th.full_like(bins, 0.3)
    log_scales = th.full_like(bins, np.log(0.2))
    probs = discretized_gaussian_log_likelihood(bins, means=means, log_scales=log_scales).exp()
    assert abs(probs.sum().item() - 1.0) < 1e-3
    assert abs(approx_standard_normal_cdf(th.tensor(0.0)).item() - 0.5) < 1e-7
    with pytest.raises(ValueError, match="shapes"):
        discretized_gaussian_log_likelihood(bins, means=means[:3], log_scales=log_scales)
