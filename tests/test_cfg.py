"""Classifier-free guidance (issue 21): --class_dropout_prob gives a class-conditional model the
null label (index num_classes, DiT's rule), training drops labels to it from the trainer's seeded
RNG (a resume stays bitwise), and sampling with --guidance_scale S is one batched forward per
step, S = 1 exactly plain conditional sampling, the variance of a learned-sigma model unguided."""
import numpy as np
import pytest
import torch as th

from conftest import FIXTURES, forward_atol, run_script
from improved_diffusion import guidance, logger, sampling, train_util
from improved_diffusion.ckpt import checkpoint, file_writer
from improved_diffusion.script_util import (
    FlagError,
    create_model_and_diffusion,
    model_and_diffusion_defaults,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(model_and_diffusion_defaults(), image_size=8, num_channels=32, num_res_blocks=1,
            attention_resolutions="", channel_mult="1,2", diffusion_steps=10,
            noise_schedule="cosine", class_cond=True, num_classes=3, learn_sigma=True)
TINY_ARGS = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
             "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
             "--noise_schedule", "cosine", "--class_cond", "True", "--learn_sigma", "True",
             "--batch_size", "4", "--log_interval", "1", "--seed", "3"]


def tiny(**kw):
    """A tiny model whose zero-initialised layers were re-drawn, so that labels matter."""
    th.manual_seed(0)
    model, diffusion = create_model_and_diffusion(**dict(TINY, **kw))
    with th.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.normal_(0, 0.05)
    return model.eval(), diffusion


def tagged_file(d, **kw):
    """tiny(**kw) saved as our model file, with its flags."""
    model, _ = tiny(**kw)
    path = d / "model000001.pt"
    file_writer.atomic_write(str(path), checkpoint.model_payload(1, model.state_dict(),
                                                                dict(TINY, **kw)))
    return path


def class_folder(d, n=12):
    """An image folder with the classes 0, 1, 2 in its file names."""
    from PIL import Image

    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
            d / f"{i % 3}_{i:03d}.png")
    return d


# ---------------------------------------------------------------------------------------------
# the null label


def test_class_dropout_gives_a_conditional_model_one_more_label_row_the_null_label():
    plain, _ = tiny()
    cfg, _ = tiny(class_dropout_prob=0.1)
    assert plain.label_emb.weight.shape[0] == 3 and plain.null_label is None
    assert cfg.label_emb.weight.shape[0] == 4 and cfg.null_label == 3
    assert set(cfg.state_dict()) == set(plain.state_dict())  # same keys, one more row
    x, t = th.randn(2, 3, 8, 8), th.tensor([1, 5])
    with th.no_grad():
        out = cfg(x, t, y=th.tensor([cfg.null_label, 0]))
    assert out.shape == (2, 6, 8, 8)


@pytest.mark.parametrize("flags,message", [
    (dict(class_cond=False, class_dropout_prob=0.1),
     r"--class_dropout_prob 0.1 replaces class labels .* add --class_cond True"),
    (dict(class_dropout_prob=1.0), r"--class_dropout_prob must be in \[0, 1\), got 1.0"),
    (dict(class_dropout_prob=-0.1), r"--class_dropout_prob must be in \[0, 1\)"),
])
def test_class_dropout_needs_a_conditional_model_and_a_probability_below_one(flags, message):
    with pytest.raises(FlagError, match=message):
        create_model_and_diffusion(**dict(TINY, **flags))


# ---------------------------------------------------------------------------------------------
# label dropout in training


def test_label_dropout_follows_dits_rule_under_a_seed():
    ref = th.load(FIXTURES / "dit_small_reference.pt", weights_only=True)
    th.manual_seed(0)
    dropped = guidance.drop_labels(ref["token_drop_seed0_labels"], 0.1, null_label=10)
    assert dropped.tolist() == ref["token_drop_seed0"].tolist()  # [0, 1, 10, 3, ...]


def test_label_dropout_is_deterministic_under_a_seed_and_probability_zero_draws_nothing():
    y = th.arange(200) % 3
    runs = []
    for seed in (7, 7, 8):
        th.manual_seed(seed)
        runs.append(guidance.drop_labels(y, 0.3, null_label=3))
    assert th.equal(runs[0], runs[1]) and not th.equal(runs[0], runs[2])
    dropped = runs[0] == 3
    assert 30 < int(dropped.sum()) < 90  # about 0.3 of 200
    assert th.equal(runs[0][~dropped], y[~dropped])  # the others keep their label
    state = th.get_rng_state()
    assert guidance.drop_labels(y, 0.0, null_label=3) is y
    assert guidance.drop_labels_in({"y": y}, dict(TINY))["y"] is y  # class_dropout_prob 0
    assert th.equal(th.get_rng_state(), state)  # a run without CFG keeps its RNG stream


def test_the_training_loop_feeds_the_model_null_labels_at_the_flags_rate(tmp_path):
    model, diffusion = tiny(class_dropout_prob=0.5)
    seen = []
    forward = model.forward
    model.forward = lambda x, t, y=None: (seen.append(y.clone()), forward(x, t, y=y))[1]

    def data():
        while True:
            yield th.zeros(8, 3, 8, 8), {"y": th.arange(8) % 3}

    with logger.scoped_configure(dir=str(tmp_path), format_strs=[], rank=0):
        loop = train_util.TrainLoop(
            model=model, diffusion=diffusion, data=data(), batch_size=8, microbatch=-1, lr=1e-4,
            ema_rate="0.9999", log_interval=10, save_interval=10000, resume_checkpoint="",
            log_dir=str(tmp_path), model_flags=dict(TINY, class_dropout_prob=0.5), max_steps=4,
            seed=0, async_save=False)
        loop.run_loop()
    labels = th.cat(seen)
    assert len(labels) == 32
    null = labels == 3
    assert 6 <= int(null.sum()) <= 26  # about half
    assert th.equal(labels[~null], (th.arange(32) % 8 % 3)[~null])


@pytest.mark.slow  # make soak: label dropout draws from the RNG every resume test restores
@pytest.mark.timeout(200)
def test_a_cfg_run_resumed_halfway_ends_bitwise_identical_and_stores_the_flag(tmp_path):
    data = class_folder(tmp_path / "data")

    def train(name, steps, prob="0.5"):
        return run_script("train.py", *TINY_ARGS, "--data_dir", data, "--class_dropout_prob",
                          prob, "--save_interval", "1000", "--ema_rate", "0.9",
                          "--log_dir", tmp_path / name, "--max_steps", steps).stdout

    def weights(name, file="model000004.pt"):
        return th.load(tmp_path / name / file, weights_only=True)

    train("straight", "4")
    train("resumed", "2")
    assert "resumed at step 2" in train("resumed", "4")
    for file in ("model000004.pt", "ema_0.9_000004.pt"):
        a, b = weights("straight", file), weights("resumed", file)
        assert a["flags"]["class_dropout_prob"] == 0.5
        for k in a["state_dict"]:
            assert th.equal(a["state_dict"][k], b["state_dict"][k]), (file, k)
    # The null label's row is trained only when labels are really dropped to it (a row that
    # never gets a gradient is skipped by AdamW and keeps its value).
    null_row = [weights("resumed", f"model00000{s}.pt")["state_dict"]["label_emb.weight"][3]
                for s in (2, 4)]
    assert not th.equal(*null_row)


# ---------------------------------------------------------------------------------------------
# guided sampling


def test_scale_one_is_the_models_own_forward_and_scale_zero_the_null_label():
    model, _ = tiny(class_dropout_prob=0.1)
    x, t, y = th.randn(3, 3, 8, 8), th.tensor([0, 4, 9]), th.tensor([0, 1, 2])
    with th.no_grad():
        cond = model(x, t, y=y)
        uncond = model(x, t, y=th.full_like(y, 3))
        assert th.equal(guidance.cfg_forward(model, 1.0, 3)(x, t, y=y), cond)
        assert th.equal(guidance.cfg_forward(model, 0.0, 3)(x, t, y=y), uncond)


def test_a_guided_step_is_one_forward_of_the_doubled_batch_guiding_the_mean_channels_only():
    model, _ = tiny(class_dropout_prob=0.1)
    calls = []

    def forward(x, t, y=None):
        calls.append((tuple(x.shape), y.tolist()))
        return model(x, t, y=y)

    x, t, y = th.randn(3, 3, 8, 8), th.tensor([0, 4, 9]), th.tensor([0, 1, 2])
    with th.no_grad():
        out = guidance.cfg_forward(forward, 4.0, 3)(x, t, y=y)
        cond = model(x, t, y=y)
        uncond = model(x, t, y=th.full_like(y, 3))
    assert calls == [((6, 3, 8, 8), [0, 1, 2, 3, 3, 3])]
    assert out.shape == (3, 6, 8, 8)
    # The doubled batch rounds its sums otherwise than the batches of 3 (by how much depends on
    # the CPU's kernels): float32's error of the forward, the mean's amplified by 1 + 2 * 4.
    atol = forward_atol(model, cond, uncond)
    th.testing.assert_close(out[:, :3], uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3]),
                            rtol=0, atol=9 * atol)
    th.testing.assert_close(out[:, 3:], cond[:, 3:], rtol=0, atol=atol)  # variance: cond's
    assert atol < 1e-3  # far below what guiding a channel, or not, changes:
    assert (out[:, :3] - cond[:, :3]).abs().max() > 100 * 9 * atol
    assert (uncond[:, 3:] + 4.0 * (cond[:, 3:] - uncond[:, 3:]) - cond[:, 3:]).abs().max() \
        > 100 * atol


@pytest.mark.parametrize("use_ddim", [False, True], ids=["ancestral", "ddim"])
def test_a_cfg_model_at_scale_one_samples_exactly_as_plain_conditional_sampling(use_ddim):
    cfg, diffusion = tiny(class_dropout_prob=0.1)
    plain, _ = tiny()  # the same weights without the null label's row
    sd = cfg.state_dict()
    sd["label_emb.weight"] = sd["label_emb.weight"][:3]
    plain.load_state_dict(sd)
    common = dict(num_samples=5, batch_size=2, shape=(3, 8, 8), seed=4, use_ddim=use_ddim,
                  num_classes=3, progress=False)
    flags = dict(TINY, class_dropout_prob=0.1)
    ours = sampling.generate(cfg, diffusion, forward=sampling.sampling_forward(cfg, flags, 1.0),
                             **common)
    base = sampling.generate(plain, diffusion, **common)
    assert np.array_equal(ours[0], base[0]) and np.array_equal(ours[1], base[1])
    # bitwise before the images are rounded to uint8, too
    loop = diffusion.ddim_sample_loop if use_ddim else diffusion.p_sample_loop
    noise, y = th.randn(3, 3, 8, 8), th.tensor([0, 1, 2])
    floats = []
    for forward in (sampling.sampling_forward(cfg, flags, 1.0), plain):
        th.manual_seed(9)
        floats.append(loop(forward, (3, 3, 8, 8), noise=noise, model_kwargs={"y": y},
                           device="cpu"))
    assert th.equal(*floats)
    guided = sampling.generate(cfg, diffusion, **common,
                               forward=sampling.sampling_forward(cfg, flags, 3.0))
    assert not np.array_equal(guided[0], base[0])
    assert np.array_equal(guided[1], base[1])  # the same labels, from the same seeds


def test_guidance_scale_needs_a_model_with_a_null_label():
    model, _ = tiny()
    with pytest.raises(FlagError, match=r"--guidance_scale 2.0: classifier-free guidance needs "
                                        r"a model trained with --class_dropout_prob > 0"):
        sampling.sampling_forward(model, dict(TINY), 2.0)
    assert sampling.sampling_forward(model, dict(TINY), 1.0) is model


@pytest.mark.timeout(200)
def test_sample_py_guides_a_cfg_model_ancestral_and_ddim_and_scale_one_is_plain(tmp_path):
    model = tagged_file(tmp_path, class_dropout_prob=0.2)

    def sample(name, *flags):
        out = tmp_path / name
        proc = run_script("sample.py", "--model_path", model, "--num_samples", "4",
                          "--batch_size", "3", "--log_dir", out, "--progress", "False", *flags)
        with np.load(out / "samples_4x8x8x3.npz") as z:
            return z["arr_0"], z["arr_1"], proc.stdout

    plain, labels, _ = sample("plain")
    one, labels_one, _ = sample("one", "--guidance_scale", "1")
    assert np.array_equal(one, plain) and np.array_equal(labels_one, labels)
    guided, _, out = sample("guided", "--guidance_scale", "4")
    assert "classifier-free guidance scale 4.0" in out
    assert not np.array_equal(guided, plain)
    ddim, _, _ = sample("ddim", "--guidance_scale", "4", "--use_ddim", "True")
    assert ddim.shape == (4, 8, 8, 3) and not np.array_equal(ddim, guided)


def test_sample_py_refuses_a_guidance_scale_for_a_model_without_a_null_label(tmp_path):
    proc = run_script("sample.py", "--model_path", tagged_file(tmp_path), "--guidance_scale", "3",
                      "--log_dir", tmp_path / "s", "--num_samples", "1", check=False)
    assert proc.returncode == 2
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "error: --guidance_scale 3.0: classifier-free guidance needs a model trained with "
        "--class_dropout_prob > 0")


# make soak: inf (nan keeps the not-finite refusal, 1e39 the float32 overflow)
@pytest.mark.parametrize("scale", ["nan", pytest.param("inf", marks=pytest.mark.slow), "1e39"])
def test_sample_py_refuses_a_guidance_scale_that_is_not_a_finite_float32_as_bad_usage(
        tmp_path, scale):
    """An inf or nan scale made every pixel 0 with exit 0 (issue 29); 1e39 is inf in float32."""
    proc = run_script("sample.py", "--model_path", tmp_path / "never_read.pt",
                      "--guidance_scale", scale, "--log_dir", tmp_path / "s", check=False)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.strip().splitlines() == [
        f"error: --guidance_scale {float(scale)}: must be a finite number (1: no guidance; "
        "guided-diffusion's classifier scales are 1-10, DiT's 1.5-4)"]
    assert not (tmp_path / "s").exists()
