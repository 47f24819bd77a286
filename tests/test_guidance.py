"""Classifier guidance (issue 21): guided-diffusion's cond_fn, condition_mean / condition_score,
seeded p_sample, DDIM and whole 10-step loops give guided-diffusion's numbers at classifier scales
3 and 300 (tests/fixtures/guided_classifier_reference.pt), and SpacedDiffusion hands cond_fn the
original timesteps as guided's does."""
import functools

import pytest
import torch as th

import redraw
from conftest import FIXTURES, float32_atol, forward_atol, hang_s
from improved_diffusion import guidance
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults
from improved_diffusion.unet import EncoderUNetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCALES = [pytest.param(3.0, "", id="scale3"), pytest.param(300.0, "_scale300", id="scale300")]
# guided-diffusion's diffusion defaults (its diffusion_defaults()), where they differ from ours.
GUIDED_DIFFUSION_DEFAULTS = dict(rescale_timesteps=False, rescale_learned_sigmas=False)
# The reference's model and sampling loops: float32 rounding at t=99 is amplified (see the
# fixtures' README), so compare those at ~1e-3.
LOOP = dict(rtol=0, atol=1e-3)


@functools.lru_cache(maxsize=None)
def reference():
    ref = th.load(FIXTURES / "guided_classifier_reference.pt", weights_only=True)
    weights = redraw.upstream_weights("guided_classifier_small")
    return ref, weights


def diffusion_and_model(respacing=""):
    """guided's UNet and diffusion of the reference, built from its flags with our builder."""
    ref, weights = reference()
    flags = dict(model_and_diffusion_defaults(), **GUIDED_DIFFUSION_DEFAULTS,
                 **ref["guidance_setup"]["diffusion_flags"], timestep_respacing=respacing)
    model, diffusion = create_model_and_diffusion(**flags)
    model.load_state_dict(weights["diffusion_unet"], strict=True)
    model.eval()

    def model_fn(x, t, y=None):  # guided's script: an unconditional model drops y
        return model(x, t, None)

    model_fn.module = model  # for forward_atol
    return diffusion, model_fn


def cond_fn_at(scale):
    ref, weights = reference()
    kwargs = dict(ref["classifiers"]["classifier_attention"]["ctor_kwargs"])
    kwargs.update(attention_resolutions=tuple(kwargs["attention_resolutions"]),
                  channel_mult=tuple(kwargs["channel_mult"]))
    classifier = EncoderUNetModel(**kwargs)
    classifier.load_state_dict(weights["classifier_attention"])
    classifier.eval()
    cond_fn = guidance.classifier_cond_fn(classifier, scale)
    cond_fn.module = classifier  # for forward_atol
    return cond_fn


def guided(key):
    return reference()[0]["guidance"][key]


def inputs():
    ref = reference()[0]
    return ref["x"], ref["t"], {"y": ref["y"]}


@pytest.mark.parametrize("scale,suffix", SCALES)
def test_cond_fn_is_the_scaled_gradient_of_the_classifiers_log_probability(scale, suffix):
    x, t, kw = inputs()
    grad = cond_fn_at(scale)(x, t, **kw)
    th.testing.assert_close(grad, guided("cond_fn" + suffix), rtol=1e-5, atol=1e-9 * scale)


@pytest.mark.parametrize("scale,suffix", SCALES)
def test_condition_mean_and_score_of_upstreams_p_mean_variance_are_upstreams(scale, suffix):
    # Applied to upstream's own p_mean_variance, only the conditioning math is compared.
    x, t, kw = inputs()
    diffusion, _ = diffusion_and_model()
    out = {k: guided("p_mean_variance_" + k)
           for k in ("mean", "variance", "log_variance", "pred_xstart")}
    cond_fn = cond_fn_at(scale)
    mean = diffusion.condition_mean(cond_fn, out, x, t, model_kwargs=kw)
    # float32's error of the shift (the classifier's gradient; the reference was made on
    # another machine) and of adding it to the mean
    shift = mean - out["mean"]
    atol = forward_atol(cond_fn.module, shift) + float32_atol(out["mean"].abs().max())
    th.testing.assert_close(mean, guided("condition_mean" + suffix), rtol=0, atol=atol)
    assert shift.abs().max() > 100 * atol  # the shift is well above the tolerance
    score = diffusion.condition_score(cond_fn, out, x, t, model_kwargs=kw)
    th.testing.assert_close(score["mean"], guided("condition_score_mean" + suffix),
                            rtol=0, atol=forward_atol(cond_fn.module, score["mean"]))
    ref_x0 = guided("condition_score_pred_xstart" + suffix)
    th.testing.assert_close(score["pred_xstart"][:2], ref_x0[:2], rtol=0,
                            atol=forward_atol(cond_fn.module, ref_x0[:2]))
    # t=99: x / sqrt(alpha_bar) is ~1e3, so one float32 ulp of it is ~2e-4 (fixtures' README)
    th.testing.assert_close(score["pred_xstart"][2], ref_x0[2], **LOOP)
    assert th.equal(score["variance"], out["variance"])  # the rest of the dict is kept


def test_p_mean_variance_of_the_reference_model_is_upstreams():
    x, t, kw = inputs()
    diffusion, model_fn = diffusion_and_model()
    with th.no_grad():
        out = diffusion.p_mean_variance(model_fn, x, t, clip_denoised=True, model_kwargs=kw)
    for k in ("mean", "variance", "log_variance"):
        th.testing.assert_close(out[k], guided("p_mean_variance_" + k), rtol=0,
                                atol=forward_atol(model_fn.module, out[k]))
    th.testing.assert_close(out["pred_xstart"], guided("p_mean_variance_pred_xstart"), **LOOP)


@pytest.mark.parametrize("scale,suffix", SCALES)
def test_seeded_p_sample_and_ddim_sample_with_cond_fn_are_upstreams(scale, suffix):
    x, t, kw = inputs()
    diffusion, model_fn = diffusion_and_model()
    cond_fn = cond_fn_at(scale)
    th.manual_seed(1234)
    with th.no_grad():
        out = diffusion.p_sample(model_fn, x, t, clip_denoised=True, model_kwargs=kw,
                                 cond_fn=cond_fn)
    atol = forward_atol(model_fn.module, out["sample"])  # the UNet, the deeper of the two
    th.testing.assert_close(out["sample"], guided("p_sample_seed1234_sample" + suffix),
                            rtol=0, atol=atol)
    with th.no_grad():
        out = diffusion.ddim_sample(model_fn, x, t, clip_denoised=True, model_kwargs=kw,
                                    cond_fn=cond_fn, eta=0.0)
    th.testing.assert_close(out["sample"], guided("ddim_sample_eta0_sample" + suffix),
                            rtol=0, atol=forward_atol(model_fn.module, out["sample"]))
    th.testing.assert_close(out["pred_xstart"], guided("ddim_sample_eta0_pred_xstart" + suffix),
                            **LOOP)


def reference_rows(n):
    """``randn_like`` for the first ``n`` rows of the reference's batch of 3: its noise was drawn
    for all three, so draw three and keep ours (a loop over one sample costs a third)."""
    return lambda x: th.randn((3,) + tuple(x.shape[1:]))[:n]


# make soak: scale 300 (scale 3 keeps the whole respaced loops; the seeded steps above keep 300)
@pytest.mark.parametrize("scale,suffix", [SCALES[0], pytest.param(*SCALES[1].values,
                                                                  id="scale300",
                                                                  marks=pytest.mark.slow)])
def test_respaced_condition_mean_and_whole_10_step_loops_are_upstreams(scale, suffix):
    ref = reference()[0]
    x, _, kw = inputs()
    diffusion, model_fn = diffusion_and_model("10")
    assert diffusion.timestep_map == ref["guidance_setup"]["spaced10_timestep_map"]
    cond_fn = cond_fn_at(scale)
    t = ref["guidance_setup"]["spaced10_t"]
    with th.no_grad():
        out = diffusion.p_mean_variance(model_fn, x, t, clip_denoised=True, model_kwargs=kw)
    mean = diffusion.condition_mean(cond_fn, out, x, t, model_kwargs=kw)
    ref_mean = guided("spaced10_condition_mean" + suffix)
    th.testing.assert_close(mean[:2], ref_mean[:2], rtol=0, atol=1e-4)
    # The last sample is at the last spaced step (t=9, 99 of the original 100): its x /
    # sqrt(alpha_bar) is ~1e3, whose float32 ulps (~2e-4) reach the mean (fixtures' README), so
    # another CPU's kernels put it off by ~1.05e-4 (seen on an AMD EPYC without AVX-512).
    th.testing.assert_close(mean[2], ref_mean[2], **LOOP)
    # The whole loops, for the first sample of the reference's batch (label 1).
    noise, kw = ref["noise"][:1], {"y": ref["y"][:1]}
    th.manual_seed(4321)
    # guided-diffusion's own call (its scripts/classifier_sample.py), keywords and all
    sample = diffusion.p_sample_loop(model_fn, tuple(noise.shape), noise=noise,
                                     clip_denoised=True, model_kwargs=kw, cond_fn=cond_fn,
                                     device="cpu", progress=False, randn_like=reference_rows(1))
    th.testing.assert_close(sample, guided("spaced10_p_sample_loop_seed4321" + suffix)[:1],
                            **LOOP)
    steps = list(diffusion.ddim_sample_loop_progressive(
        model_fn, tuple(noise.shape), noise=noise, clip_denoised=True, model_kwargs=kw,
        cond_fn=cond_fn, device="cpu", eta=0.0))
    assert len(steps) == 10
    # DDIM's ten guided steps carry the last step's rounding (above) through every later one:
    # 1.13e-3 on an AMD EPYC with AVX2 only, against 1e-3 on the machine of the reference.
    th.testing.assert_close(steps[-1]["sample"],
                            guided("spaced10_ddim_sample_loop_eta0" + suffix)[:1], rtol=0,
                            atol=2 * LOOP["atol"])


def test_spaced_diffusion_hands_cond_fn_the_original_timesteps_as_the_model_gets_them():
    x, _, kw = inputs()
    seen = {}

    def recording(name):
        def fn(x, t, y=None):
            seen[name] = t.tolist()
            return th.zeros_like(x)
        return fn

    for rescale in (False, True):
        flags = dict(model_and_diffusion_defaults(), image_size=64, num_channels=32,
                     num_res_blocks=1, attention_resolutions="", diffusion_steps=100,
                     timestep_respacing="10", rescale_timesteps=rescale)
        _, diffusion = create_model_and_diffusion(**flags)
        t = th.tensor([0, 4, 9])
        out = diffusion.p_mean_variance(recording("model"), x, t, model_kwargs=kw)
        diffusion.condition_mean(recording("cond_fn"), out, x, t, model_kwargs=kw)
        diffusion.condition_score(recording("cond_fn_score"), out, x, t, model_kwargs=kw)
        assert seen["cond_fn"] == seen["cond_fn_score"] == seen["model"]
        assert seen["model"] == ([0, 44, 99] if not rescale else [0.0, 440.0, 990.0])
        # what a classifier trained on original indices (as guided's) is given back
        back = diffusion.original_timesteps(th.tensor(seen["cond_fn"]))
        assert back.tolist() == [0, 44, 99]


def test_without_cond_fn_the_samplers_are_unchanged_and_the_guided_one_differs():
    x, t, kw = inputs()
    diffusion, model_fn = diffusion_and_model()
    cond_fn = cond_fn_at(300.0)
    results = []
    for fn in (None, cond_fn):
        th.manual_seed(5)
        with th.no_grad():
            results.append(diffusion.p_sample(model_fn, x, t, model_kwargs=kw, cond_fn=fn))
    th.manual_seed(5)
    with th.no_grad():
        plain = diffusion.p_sample(model_fn, x, t, model_kwargs=kw)
    assert th.equal(results[0]["sample"], plain["sample"])
    assert not th.allclose(results[1]["sample"], plain["sample"], rtol=0, atol=1e-3)
    assert th.equal(results[1]["pred_xstart"], plain["pred_xstart"])  # ancestral: mean only


@pytest.mark.timeout(150)
def test_a_guidance_overflow_is_raised_on_every_rank_each_ending_with_exit_2(tmp_path):
    """Issue 37, item 26 (a promise): the overflow of guided samples is raised on every rank alike
    (a broadcast), so that each rank ends with its own usage error; one rank raising while the
    others go on ends the job by an abort, which the job's exit code and its one error line do
    not show. A shell prints each rank's own exit code after sample.py (2 ranks)."""
    import re
    import subprocess

    from conftest import MPIEXEC, PY, REPO, child_env
    from test_cfg import tagged_file

    path = tagged_file(tmp_path, class_dropout_prob=0.2)
    each_rank = '"$0" "$@"; echo "rank $PMI_RANK exit $?"'
    proc = subprocess.run(
        [str(a) for a in (MPIEXEC, "-n", 2, "sh", "-c", each_rank, PY, REPO / "scripts" /
                          "sample.py", "--model_path", path, "--num_samples", 2, "--batch_size",
                          1, "--guidance_scale", "1e38", "--clip_denoised", "False",
                          "--log_dir", tmp_path / "s", "--progress", "False")],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=hang_s(120), stdin=subprocess.DEVNULL)
    assert sorted(re.findall(r"^rank (\d) exit (\d+)$", proc.stdout, re.M)) == [
        ("0", "2"), ("1", "2")], proc.stdout
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --guidance_scale 1e+38: the guided samples overflowed to inf/nan (in the batch "
        "from sample 0), the scale is too large for this model; use a smaller one "
        "(guided-diffusion's classifier scales are 1-10, DiT's 1.5-4)"], proc.stdout
    assert "aborting" not in proc.stdout and "Traceback" not in proc.stdout
    assert not list((tmp_path / "s").glob("samples_*"))
