"""scripts/classifier_sample.py (issue 21): guided-diffusion's flags, upstream's raw files as they
are, our files' stored flags, per-sample seeds (ranks and batch size do not matter), labels of
the classifier's classes, classifier guidance together with classifier-free guidance, and
one-line errors for files that do not go together."""
import functools
import re

import numpy as np
import pytest
import torch as th

import redraw
from conftest import FIXTURES, run_mpi, run_script, run_script_here
from improved_diffusion import guidance, sampling
from improved_diffusion.ckpt import checkpoint, file_writer
from improved_diffusion import script_util as su

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The reference's UNet and classifier (tests/fixtures/README.md), as guided's flags say them.
GUIDED_MODEL_FLAGS = ["--image_size", "64", "--num_channels", "32", "--num_res_blocks", "1",
                      "--channel_mult", "1,2", "--attention_resolutions", "32,16,8",
                      "--learn_sigma", "True", "--diffusion_steps", "100",
                      "--noise_schedule", "cosine", "--rescale_timesteps", "False",
                      "--rescale_learned_sigmas", "False"]
GUIDED_CLASSIFIER_FLAGS = ["--classifier_width", "32", "--classifier_depth", "1",
                           "--classifier_channel_mult", "1,2"]
TINY = dict(su.model_and_diffusion_defaults(), image_size=8, num_channels=32, num_res_blocks=1,
            attention_resolutions="", channel_mult="1,2", diffusion_steps=10,
            noise_schedule="cosine")
TINY_CLASSIFIER = dict(su.classifier_and_diffusion_defaults(), image_size=8, classifier_width=32,
                       classifier_depth=1, classifier_attention_resolutions="4",
                       classifier_num_classes=3, diffusion_steps=10, noise_schedule="cosine")


def redrawn(module, seed=0):
    """``module`` with its all-zero parameters re-drawn, so that outputs are informative."""
    g = th.Generator().manual_seed(seed)
    with th.no_grad():
        for p in module.parameters():
            if not p.abs().sum():
                p.copy_(th.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def tiny_model(**kw):
    th.manual_seed(0)
    model, diffusion = su.create_model_and_diffusion(**dict(TINY, **kw))
    return redrawn(model), diffusion


def tiny_classifier(**kw):
    th.manual_seed(1)
    flags = dict(TINY_CLASSIFIER, **kw)
    return redrawn(su.create_classifier(**{k: flags[k] for k in su.CLASSIFIER_FLAG_KEYS}), 1)


@pytest.fixture
def files(tmp_path):
    """write(name, kind, module, flags) -> the path of a tagged file (ours, with its flags)."""
    def write(name, module, flags, kind="model"):
        payload = (checkpoint.classifier_payload if kind == "classifier"
                   else checkpoint.model_payload)(5, module.state_dict(), flags)
        (tmp_path / name).mkdir()
        path = tmp_path / name / "model000005.pt"
        file_writer.atomic_write(str(path), payload)
        return path
    return write


def npz(out):
    (path,) = out.glob("samples_*.npz")
    with np.load(path) as z:
        return z["arr_0"], z["arr_1"]


@functools.lru_cache(maxsize=None)
def upstream_weights():
    return redraw.upstream_weights("guided_classifier_small")


@pytest.mark.timeout(150)
def test_upstreams_raw_files_guide_as_they_are_with_guideds_flags(tmp_path):
    weights = upstream_weights()
    model_file, classifier_file = tmp_path / "64x64_diffusion.pt", tmp_path / "classifier.pt"
    th.save(weights["diffusion_unet"], model_file)  # upstream's layout: raw state dicts
    th.save(weights["classifier_attention"], classifier_file)
    proc = run_script("classifier_sample.py", "--model_path", model_file, *GUIDED_MODEL_FLAGS,
                      "--classifier_path", classifier_file, *GUIDED_CLASSIFIER_FLAGS,
                      "--classifier_scale", "300", "--timestep_respacing", "2",
                      "--num_samples", "2", "--batch_size", "2", "--log_dir", tmp_path / "out",
                      "--progress", "False", timeout=120)
    assert "classifier: 1000 classes" in proc.stdout  # upstream's files have 1000
    images, labels = npz(tmp_path / "out")

    # The same, in this process, from the library: the script wires guided's cond_fn.
    flags = dict(su.model_and_diffusion_defaults(), image_size=64, num_channels=32,
                 num_res_blocks=1, channel_mult="1,2", attention_resolutions="32,16,8",
                 learn_sigma=True, diffusion_steps=100, noise_schedule="cosine",
                 rescale_timesteps=False, rescale_learned_sigmas=False, timestep_respacing="2")
    model, diffusion = su.create_model_and_diffusion(**flags)
    model.load_state_dict(weights["diffusion_unet"])
    classifier = su.create_classifier(**dict(su.classifier_defaults(), classifier_width=32,
                                             classifier_depth=1, classifier_channel_mult="1,2"))
    classifier.load_state_dict(weights["classifier_attention"])
    common = dict(num_samples=2, batch_size=2, shape=(3, 64, 64), seed=0, num_classes=1000,
                  progress=False, forward=sampling.sampling_forward(model.eval(), flags))
    ours = sampling.generate(model, diffusion, **common, cond_fn=guidance.classifier_cond_fn(
        classifier.eval(), 300.0, timesteps=diffusion.original_timesteps))
    assert np.array_equal(images, ours[0]) and np.array_equal(labels, ours[1])
    unguided = sampling.generate(model, diffusion, **common)
    assert not np.array_equal(images, unguided[0])
    assert np.array_equal(labels, unguided[1])  # the same per-sample labels


@pytest.mark.slow  # make soak: test_sample.py keeps the rank/batch invariance of the sampler
@pytest.mark.timeout(200)
def test_our_files_sample_from_their_flags_alike_on_one_and_two_ranks_and_any_batch(
        tmp_path, files):
    model, _ = tiny_model()
    model_file = files("run", model, TINY)
    classifier_file = files("cls", tiny_classifier(), TINY_CLASSIFIER, kind="classifier")
    common = ["--model_path", model_file, "--classifier_path", classifier_file,
              "--classifier_scale", "10", "--num_samples", "5", "--seed", "3",
              "--progress", "False"]
    run_script("classifier_sample.py", *common, "--batch_size", "5", "--log_dir", tmp_path / "a")
    run_mpi(2, "classifier_sample.py", *common, "--batch_size", "2", "--log_dir", tmp_path / "b")
    (a, labels_a), (b, labels_b) = npz(tmp_path / "a"), npz(tmp_path / "b")
    assert np.array_equal(a, b) and np.array_equal(labels_a, labels_b)
    assert set(labels_a.tolist()) <= {0, 1, 2}  # the classifier's 3 classes
    # The model sees rescaled timesteps (--rescale_timesteps True); the classifier is given the
    # original indices, as guided-diffusion's classifiers are trained.
    model, diffusion = tiny_model()
    assert diffusion.rescale_timesteps
    seen = []
    classifier = tiny_classifier()

    def recording(x, t):
        seen.append(t.tolist())
        return classifier(x, t)

    ours = sampling.generate(
        model, diffusion, num_samples=5, batch_size=5, shape=(3, 8, 8), seed=3, num_classes=3,
        progress=False, forward=sampling.sampling_forward(model, TINY),
        cond_fn=guidance.classifier_cond_fn(recording, 10.0,
                                            timesteps=diffusion.original_timesteps))
    assert seen[0] == [9] * 5 and seen[-1] == [0] * 5
    assert np.array_equal(ours[0], a) and np.array_equal(ours[1], labels_a)
    run_script("classifier_sample.py", *common, "--batch_size", "5", "--log_dir", tmp_path / "c",
               "--classes", "2,0", "--use_ddim", "True")
    images, labels = npz(tmp_path / "c")
    assert labels.tolist() == [2, 0, 2, 0, 2] and images.shape == (5, 8, 8, 3)


def test_classifier_guidance_raises_the_classifiers_probability_of_the_label():
    model, diffusion = tiny_model()
    classifier = tiny_classifier()
    common = dict(num_samples=12, batch_size=12, shape=(3, 8, 8), seed=1, num_classes=3,
                  progress=False, forward=sampling.sampling_forward(model, TINY))

    def judged(scale):
        """(mean log p(label | sample), share of samples classified as their label)."""
        cond_fn = guidance.classifier_cond_fn(classifier, scale) if scale else None
        images, labels = sampling.generate(model, diffusion, **common, cond_fn=cond_fn)
        x = th.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        with th.no_grad():
            log_p = th.log_softmax(classifier(x, th.zeros(len(x), dtype=th.long)), -1)
        y = th.from_numpy(labels)
        return log_p[th.arange(len(x)), y].mean(), (log_p.argmax(-1) == y).float().mean()

    (plain_log_p, plain_hits), (log_p, hits) = judged(0), judged(300.0)
    # (this random classifier is nearly uniform: log p is about log 1/3 either way)
    assert log_p > plain_log_p + 0.03
    assert hits >= plain_hits + 0.25


@pytest.mark.timeout(120)
def test_classifier_guidance_combines_with_classifier_free_guidance(tmp_path, files, capsys):
    """In this process, through the script's entry point (launched: upstream's files above)."""
    model, _ = tiny_model(class_cond=True, num_classes=3, class_dropout_prob=0.1)
    model_file = files("run", model, dict(TINY, class_cond=True, num_classes=3,
                                          class_dropout_prob=0.1))
    classifier_file = files("cls", tiny_classifier(), TINY_CLASSIFIER, kind="classifier")
    outs = []
    for scale in ("1", "0"):
        code, out = run_script_here("classifier_sample.py", "--model_path", model_file,
                                    "--classifier_path", classifier_file, "--classifier_scale",
                                    "10", "--guidance_scale", scale, "--num_samples", "3",
                                    "--log_dir", tmp_path / scale, "--progress", "False",
                                    capsys=capsys)
        assert code == 0, out[-3000:]
        outs.append(npz(tmp_path / scale))
    assert "classifier scale 10.0, classifier-free guidance scale 0.0" in out
    assert not np.array_equal(outs[0][0], outs[1][0])  # the null label: unconditional + guided
    assert np.array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("case,message", [
    ("no_classifier", r"error: --classifier_path is required"),
    ("model_as_classifier", r"error: --classifier_path .* holds a model state dict, not a "
                            r"noised classifier"),
    ("classifier_as_model", r"error: --model_path .* holds noised-classifier weights, not a "
                            r"diffusion model; guide with it through classifier_sample.py"),
    ("other_size", r"error: --classifier_path .* classifies 16x16 images, the model makes 8x8"),
    ("other_noise", r"error: --classifier_path .* was trained on another noise process "
                    r"\(diffusion_steps=20\) than the model \(diffusion_steps=10\)"),
    ("other_classes", r"error: --classifier_path .* has 3 classes but the model 5"),
    ("contradicting_flag", r"error: --classifier_width 64 contradicts .*classifier_width=32"),
])
def test_files_that_do_not_go_together_are_one_line_errors(tmp_path, files, capsys, case,
                                                           message):
    model, _ = tiny_model()
    model_file = files("run", model, TINY)
    classifier_file = files("cls", tiny_classifier(), TINY_CLASSIFIER, kind="classifier")
    args = ["--model_path", model_file, "--classifier_path", classifier_file]
    if case == "no_classifier":
        args = args[:2]
    elif case == "model_as_classifier":
        args[3] = model_file
    elif case == "classifier_as_model":
        args[1] = classifier_file
    elif case == "other_size":
        args[3] = files("cls16", tiny_classifier(image_size=16),
                        dict(TINY_CLASSIFIER, image_size=16), kind="classifier")
    elif case == "other_noise":
        args[3] = files("cls20", tiny_classifier(), dict(TINY_CLASSIFIER, diffusion_steps=20),
                        kind="classifier")
    elif case == "other_classes":
        cond, _ = tiny_model(class_cond=True, num_classes=5)
        args[1] = files("cond", cond, dict(TINY, class_cond=True, num_classes=5))
    else:
        args += ["--classifier_width", "64"]
    # in this process (the entry point's run(), no launch): the launched script's one-line
    # errors are the overflowing scale's below, on 2 ranks
    code, out = run_script_here("classifier_sample.py", *args, "--log_dir", tmp_path / "s",
                                "--num_samples", "1", capsys=capsys)
    assert code in (1, 2)
    last = out.strip().splitlines()[-1]
    assert re.match(message, last), last


def test_help_covers_both_kinds_of_guidance(capsys):
    from test_cli import parser_of

    for script in ("classifier_sample.py", "sample.py"):
        with pytest.raises(SystemExit):
            parser_of(script).parse_args(["--help"])
        text = capsys.readouterr().out
        assert "--guidance_scale X" in text and "classifier-free guidance" in text
        if script == "classifier_sample.py":
            assert "classifier flags:" in text and "grad_x log p(y | x_t)" in text
            for flag in ("--classifier_path", "--classifier_scale", "--classifier_width",
                         "--classifier_depth", "--classifier_attention_resolutions",
                         "--classifier_pool", "--classifier_channel_mult",
                         "--classifier_num_classes", "--classifier_use_fp16"):
                assert flag in text, flag
        else:
            assert "--classifier_path" not in text and "classifier_sample.py" in text


@pytest.mark.timeout(150)
def test_a_classifier_scale_not_finite_or_overflowing_the_samples_is_bad_usage_on_every_rank(
        tmp_path, files, capsys):
    """--classifier_scale nan was exit 0 with every pixel 0, and so was 1e38, a finite scale whose
    guided steps overflow float32 (issue 29): both exit 2 with one line naming the flag (nan in
    this process, a flag check; 1e38 launched on 2 ranks)."""
    model, _ = tiny_model()
    args = ["--model_path", files("run", model, TINY), "--classifier_path",
            files("cls", tiny_classifier(), TINY_CLASSIFIER, kind="classifier"),
            "--num_samples", "2", "--batch_size", "1", "--progress", "False"]
    code, out = run_script_here("classifier_sample.py", *args, "--classifier_scale", "nan",
                                "--log_dir", tmp_path / "nan", capsys=capsys)
    assert code == 2, out
    assert out.strip().splitlines() == [
        "error: --classifier_scale nan: must be a finite number (1: no guidance; "
        "guided-diffusion's classifier scales are 1-10, DiT's 1.5-4)"]
    proc = run_mpi(2, "classifier_sample.py", *args, "--classifier_scale", "1e38",
                   "--log_dir", tmp_path / "big", check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --classifier_scale 1e+38: the guided samples overflowed to inf/nan (in the batch "
        "from sample 0), the scale is too large for this model; use a smaller one "
        "(guided-diffusion's classifier scales are 1-10, DiT's 1.5-4)"], proc.stdout
    assert "Traceback" not in proc.stdout
    assert not list((tmp_path / "big").glob("samples_*"))
