"""Our diffusion math and UNet reproduce upstream's numbers beyond the small reference
(test_upstream_numerics.py): six more diffusion variants of improved-diffusion, and
guided-diffusion's UNet with the options it added (tests/fixtures/README.md).

upstream_variants_reference.pt: for 32x32 UNets (upstream_variants_model_{learned,fixed}, their
weights drawn again by tests/redraw.py; the learned-sigma model for the variants with learn_sigma)
and each variant's flags over
``base_flags``: q_sample, p_mean_variance (clip_denoised=True) on x_t = the variant's q_sample,
training_losses with the given noise, _vb_terms_bpd (clip_denoised=False), p_sample and
ddim_sample(eta=0.5) right after torch.manual_seed(1234), and under timestep_respacing="10" a
p_sample_loop right after torch.manual_seed(4321) and a DDIM loop (eta 0), both from ``noise``.
The models are unconditional and called as upstream's code calls them.

Tolerances: single-step outputs to 1e-4 (they agree to ~1e-5); pred_xstart and the loops to 3e-3,
because at t=99 pred_xstart multiplies float32 rounding of the model output by ~7000 (they agree
to ~1e-3 at worst), with the loops' mean error bounded at 1e-5 (it is ~1e-6).
"""
import functools

import pytest
import torch as th

import redraw
from conftest import FIXTURES
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ["xstart_learned_cosine", "kl_learned_linear", "mse_learned_norescale",
            "xstart_fixedlarge_cosine", "eps_fixedsmall_linear", "eps_fixedlarge_unscaled_t"]
SINGLE_STEP = dict(rtol=1e-5, atol=1e-4)
AMPLIFIED = dict(rtol=1e-5, atol=3e-3)


@functools.lru_cache(maxsize=None)
def ref():
    return th.load(FIXTURES / "upstream_variants_reference.pt", weights_only=True)


@functools.lru_cache(maxsize=None)
def build(name, respacing=""):
    """(model in eval mode with upstream's weights, diffusion) for variant ``name``."""
    flags = dict(model_and_diffusion_defaults(), **ref()["base_flags"])
    flags.update(ref()["variants"][name]["flags"], timestep_respacing=respacing)
    model, diffusion = create_model_and_diffusion(**flags)
    kind = "learned" if flags["learn_sigma"] else "fixed"
    model.load_state_dict(redraw.upstream_weights(f"upstream_variants_model_{kind}"))
    return model.eval(), diffusion


def test_the_fixture_holds_the_six_variants_and_their_distinguishing_flags():
    variants = ref()["variants"]
    assert sorted(variants) == sorted(VARIANTS)
    flags = {name: v["flags"] for name, v in variants.items()}
    assert flags["xstart_learned_cosine"]["predict_xstart"] and \
        flags["xstart_fixedlarge_cosine"]["predict_xstart"]
    assert flags["kl_learned_linear"]["use_kl"]
    assert flags["mse_learned_norescale"]["rescale_learned_sigmas"] is False
    assert flags["eps_fixedsmall_linear"]["sigma_small"]
    assert flags["eps_fixedlarge_unscaled_t"]["rescale_timesteps"] is False


@pytest.mark.parametrize("name", VARIANTS)
def test_single_step_outputs_match_upstream(name):
    model, diffusion = build(name)
    r, v = ref(), ref()["variants"][name]
    checked = set()

    def check(key, actual, tol=SINGLE_STEP):
        th.testing.assert_close(actual, v[key], **tol, msg=lambda m: f"{name} {key}: {m}")
        checked.add(key)

    with th.no_grad():
        check("q_sample", diffusion.q_sample(r["x0"], r["t"], noise=r["noise"]))
        out = diffusion.p_mean_variance(model, v["q_sample"], r["t"], clip_denoised=True)
        for key in ("mean", "variance", "log_variance"):
            check(f"p_mean_variance_{key}", out[key])
        check("p_mean_variance_pred_xstart", out["pred_xstart"], AMPLIFIED)
        terms = diffusion.training_losses(model, r["x0"], r["t"], noise=r["noise"])
        for key in ("loss", "mse", "vb"):
            if f"training_losses_{key}" in v:  # upstream's terms for this loss type
                check(f"training_losses_{key}", terms[key])
        assert set(terms) == {k[len("training_losses_"):] for k in v
                              if k.startswith("training_losses_")}
        vb = diffusion._vb_terms_bpd(model, r["x0"], v["q_sample"], r["t"], clip_denoised=False)
        check("vb_terms_bpd_output", vb["output"])
    assert checked == {k for k in v if k != "flags" and "seed" not in k and "loop" not in k}


@pytest.mark.parametrize("name", VARIANTS)
def test_seeded_p_sample_and_ddim_step_match_upstream(name):
    model, diffusion = build(name)
    r, v = ref(), ref()["variants"][name]
    with th.no_grad():
        th.manual_seed(1234)
        sample = diffusion.p_sample(model, v["q_sample"], r["t"])["sample"]
        th.testing.assert_close(sample, v["p_sample_seed1234"], **SINGLE_STEP)
        th.manual_seed(1234)
        sample = diffusion.ddim_sample(model, v["q_sample"], r["t"], eta=0.5)["sample"]
        th.testing.assert_close(sample, v["ddim_sample_eta0.5_seed1234"], **SINGLE_STEP)


@pytest.mark.parametrize("name", VARIANTS)
def test_short_sampling_loops_match_upstream(name):
    model, diffusion = build(name, "10")
    r, v = ref(), ref()["variants"][name]
    shape = tuple(r["noise"].shape)
    with th.no_grad():
        th.manual_seed(4321)
        ancestral = diffusion.p_sample_loop(model, shape, noise=r["noise"])
        ddim = diffusion.ddim_sample_loop(model, shape, noise=r["noise"], eta=0.0)
    for key, sample in (("spaced10_p_sample_loop_seed4321", ancestral),
                        ("spaced10_ddim_loop_eta0", ddim)):
        th.testing.assert_close(sample, v[key], **AMPLIFIED, msg=lambda m: f"{key}: {m}")
        assert (sample - v[key]).abs().mean().item() < 1e-5, key


# ----------------------------------------------------------------------------------------------
# guided-diffusion's UNet options


@functools.lru_cache(maxsize=None)
def guided():
    return (th.load(FIXTURES / "guided_small_reference.pt", weights_only=True),
            redraw.upstream_weights("guided_small_models"))


@pytest.mark.parametrize("name", ["updown_headch_neworder_cond", "legacy_heads_updown_uncond"])
def test_guided_unet_outputs_match_upstream(name):
    gref, models = guided()
    config = gref["configs"][name]
    flags = dict(model_and_diffusion_defaults(), **config["flags"])
    model, diffusion = create_model_and_diffusion(**flags)
    model.load_state_dict(models[name])  # strict: guided's keys and shapes
    model.eval()
    kwargs = {"y": gref["y"]} if flags["class_cond"] else {}
    with th.no_grad():
        out = model(gref["x"], diffusion._scale_timesteps(gref["t"]), **kwargs)
    th.testing.assert_close(out, config["model_out"], rtol=1e-5, atol=1e-5)
