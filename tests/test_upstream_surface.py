"""Code and job scripts written for openai/improved-diffusion or guided-diffusion run here (issue 12,
"Coming from upstream"): TrainLoop's keyword arguments, method names and module functions; the
scripts image_train.py / image_sample.py / image_nll.py with upstream's flags and OPENAI_LOGDIR;
guided's create_model_and_diffusion(use_fp16=...) and UNetModel.convert_to_fp16/convert_to_fp32.
"""
import dataclasses
import inspect

import numpy as np
import pytest
import torch as th

import redraw
from conftest import FIXTURES, run_script, write_images
from improved_diffusion import logger, train_util
from improved_diffusion.ckpt import checkpoint
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# upstream improved-diffusion's TrainLoop(...) keyword arguments (commit 1bc7bbb), in its order.
UPSTREAM_TRAINLOOP_KWARGS = [
    "model", "diffusion", "data", "batch_size", "microbatch", "lr", "ema_rate", "log_interval",
    "save_interval", "resume_checkpoint", "use_fp16", "fp16_scale_growth", "schedule_sampler",
    "weight_decay", "lr_anneal_steps",
]
TINY = dict(model_and_diffusion_defaults(), image_size=8, num_channels=32, num_res_blocks=1,
            attention_resolutions="", diffusion_steps=10, noise_schedule="cosine")
TINY_FLAGS = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
              "--attention_resolutions", "", "--diffusion_steps", "10",
              "--noise_schedule", "cosine"]


def upstream_style_data(batch_size=2):
    """Like upstream's load_data: an endless generator of (float32 [B, 3, 8, 8], {})."""
    g = th.Generator().manual_seed(0)
    while True:
        yield th.rand(batch_size, 3, 8, 8, generator=g) * 2 - 1, {}


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def test_trainloop_takes_upstreams_keyword_arguments_and_needs_no_others():
    params = inspect.signature(train_util.TrainLoop.__init__).parameters
    names = [n for n in params if n != "self"]
    assert names[:len(UPSTREAM_TRAINLOOP_KWARGS)] == UPSTREAM_TRAINLOOP_KWARGS
    ours = [n for n in names[len(UPSTREAM_TRAINLOOP_KWARGS):]
            if params[n].kind is not inspect.Parameter.VAR_KEYWORD]
    assert {"log_dir", "model_flags"} <= set(ours)
    assert all(params[n].default is not inspect.Parameter.empty for n in ours), (
        "an argument of ours without a default breaks upstream-style calls")
    # Every other setting of ours is a TrainConfig field, taken by name; a misspelt one fails.
    fields = {f.name for f in dataclasses.fields(train_util.TrainConfig)}
    assert {"max_steps", "seed", "nan_policy"} <= fields
    with pytest.raises(TypeError, match="max_stpes"):
        train_util.TrainLoop(model=None, diffusion=None, data=None, batch_size=1, microbatch=-1,
                             lr=1e-4, ema_rate="0.9999", log_interval=1, save_interval=1,
                             resume_checkpoint="", max_stpes=3)


class CountingLoop(train_util.TrainLoop):
    """An upstream-style subclass: overrides of upstream's method names must be called."""

    calls = None

    def optimize_normal(self):
        self.calls.append("optimize_normal")
        super().optimize_normal()  # upstream's returned nothing: None counts as a step taken

    def log_step(self):
        self.calls.append("log_step")
        super().log_step()


@pytest.mark.timeout(120)
def test_an_upstream_style_trainloop_saves_into_the_logger_dir_and_resumes_from_it(
        tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFUSION_BLOB_LOGDIR", raising=False)
    log = tmp_path / "log"
    CountingLoop.calls = []
    with logger.scoped_configure(dir=str(log), format_strs=["log"], rank=0):
        assert train_util.find_resume_checkpoint() is None
        train_util.seed_rngs(0)
        model, diffusion = create_model_and_diffusion(**TINY)
        loop = CountingLoop(  # exactly upstream's call, nothing of ours
            model=model, diffusion=diffusion, data=upstream_style_data(), batch_size=2,
            microbatch=-1, lr=1e-3, ema_rate="0.9999", log_interval=1, save_interval=10000,
            resume_checkpoint="", use_fp16=False, fp16_scale_growth=1e-3,
            schedule_sampler=None, weight_decay=0.0, lr_anneal_steps=2,
        )
        assert loop.config.checkpoint.log_dir == str(log)
        start = [p.detach().clone() for p in model.parameters()]
        assert loop.run_loop() == 0
        assert CountingLoop.calls == ["optimize_normal", "log_step"] * 2
        # The EMA moved although the override returned None (upstream's optimize_normal did).
        assert not all(th.equal(e, s) for e, s in zip(loop.ema_params[0], start))

        main = train_util.find_resume_checkpoint()
        assert main == str(log / "model000002.pt")
        assert train_util.parse_resume_step_from_filename(main) == 2
        assert train_util.find_ema_checkpoint(main, 2, 0.9999) == str(log / "ema_0.9999_000002.pt")
        assert train_util.find_ema_checkpoint(main, 2, 0.999) is None
        assert train_util.find_ema_checkpoint(None, 2, 0.9999) is None
        assert load(main)["flags"] == {}  # unknown model flags: the files carry none

        again = train_util.TrainLoop(
            model=model, diffusion=diffusion, data=upstream_style_data(), batch_size=2,
            microbatch=-1, lr=1e-3, ema_rate="0.9999", log_interval=1, save_interval=10000,
            resume_checkpoint="", lr_anneal_steps=3)
        assert (again.step, again.resume_step) == (2, 2)  # our step is global, as files name it
        assert again.run_loop() == 0
    assert (log / "manifest000003.json").exists()
    text = (log / "log.txt").read_text()
    assert text.count("model_flags not given (unknown)") == 2
    assert "resumed at step 2" in text


def test_a_file_name_without_a_step_is_an_error_not_step_zero():
    assert train_util.parse_resume_step_from_filename("runs/a/model000150.pt") == 150
    assert train_util.parse_resume_step_from_filename("ema_0.9999_000150.pt") == 150
    with pytest.raises(checkpoint.CheckpointError, match=r"weights\.pt: cannot read a step"):
        train_util.parse_resume_step_from_filename("runs/a/weights.pt")


def test_get_blob_logdir_is_diffusion_blob_logdir_else_the_loggers(tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFUSION_BLOB_LOGDIR", raising=False)
    with logger.scoped_configure(dir=str(tmp_path / "log"), format_strs=[], rank=0):
        assert train_util.get_blob_logdir() == str(tmp_path / "log")
        monkeypatch.setenv("DIFFUSION_BLOB_LOGDIR", str(tmp_path / "blob"))
        assert train_util.get_blob_logdir() == str(tmp_path / "blob")


# ----------------------------------------------------------------------------------------------
# guided-diffusion's use_fp16 and convert_to_fp16 / convert_to_fp32


# guided-diffusion's create_model_and_diffusion(...) parameters (commit 22e0df8): use_fp16, and
# neither sigma_small nor num_classes.
GUIDED_KWARGS = [
    "image_size", "class_cond", "learn_sigma", "num_channels", "num_res_blocks", "channel_mult",
    "num_heads", "num_head_channels", "num_heads_upsample", "attention_resolutions", "dropout",
    "diffusion_steps", "noise_schedule", "timestep_respacing", "use_kl", "predict_xstart",
    "rescale_timesteps", "rescale_learned_sigmas", "use_checkpoint", "use_scale_shift_norm",
    "resblock_updown", "use_fp16", "use_new_attention_order",
]


def guided_model(name, use_fp16):
    """Built as guided's image_sample.py does: create_model_and_diffusion(**exactly guided's
    keyword arguments), load the state dict, convert_to_fp16() when use_fp16."""
    ref = load(FIXTURES / "guided_small_reference.pt")
    known = dict(model_and_diffusion_defaults(), **ref["configs"][name]["flags"],
                 use_fp16=use_fp16)
    model, diffusion = create_model_and_diffusion(**{k: known[k] for k in GUIDED_KWARGS})
    model.load_state_dict(redraw.upstream_weights("guided_small_models")[name])
    if use_fp16:
        model.convert_to_fp16()
    model.eval()
    kwargs = {"y": ref["y"]} if known["class_cond"] else {}
    return model, diffusion, ref, kwargs


@pytest.mark.parametrize("name", ["updown_headch_neworder_cond", "legacy_heads_updown_uncond"])
def test_a_guided_model_converted_to_fp16_runs_close_to_upstreams_float32_output(name):
    model, diffusion, ref, kwargs = guided_model(name, use_fp16=True)
    assert model.use_fp16 and model.dtype == th.float16
    assert model.input_blocks[0][0].weight.dtype == th.float16
    assert model.out[0].weight.dtype == th.float32  # norms, embeddings and output stay float32
    assert model.time_embed[0].weight.dtype == th.float32
    one = {k: v[:1] for k, v in kwargs.items()}  # one image: float16 convolutions are slow on CPU
    with th.no_grad():
        out = model(ref["x"][:1], diffusion._scale_timesteps(ref["t"][:1]), **one)
    expected = ref["configs"][name]["model_out"][:1]
    assert out.dtype == th.float32
    err = (out - expected).abs()
    assert err.max().item() < 2e-2 * expected.abs().max().item()
    assert err.max().item() > 0  # it really ran in float16


def test_convert_to_fp32_restores_float32_weights_and_outputs():
    name = "updown_headch_neworder_cond"
    model, diffusion, ref, kwargs = guided_model(name, use_fp16=False)
    assert not model.use_fp16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torso_convs = {  # what convert_to_fp16 converts: the convolutions of the three block lists
        f"{m}.{p}" for m, mod in model.named_modules()
        if m.startswith(("input_blocks", "middle_block", "output_blocks"))
        and isinstance(mod, (th.nn.Conv1d, th.nn.Conv2d, th.nn.Conv3d))
        for p, _ in mod.named_parameters(recurse=False)}
    model.convert_to_fp16()
    assert {k for k, v in model.state_dict().items() if v.dtype == th.float16} == torso_convs
    model.convert_to_fp32()
    assert model.dtype == th.float32
    after = model.state_dict()
    for k, v in before.items():  # float32 again, holding what float16 kept of each weight
        expected = v.half().float() if k in torso_convs else v
        assert after[k].dtype == th.float32 and th.equal(after[k], expected), k
    with th.no_grad():
        out = model(ref["x"], diffusion._scale_timesteps(ref["t"]), **kwargs)
    th.testing.assert_close(out, ref["configs"][name]["model_out"], rtol=1e-2, atol=2e-3)


# ----------------------------------------------------------------------------------------------
# upstream's script names


@pytest.mark.timeout(240)
def test_upstreams_three_scripts_run_with_upstreams_flags_and_openai_logdir(tmp_path):
    data = write_images(tmp_path / "data", n=4, size=8)
    run = tmp_path / "run"
    run_script("image_train.py", "--data_dir", data, *TINY_FLAGS, "--batch_size", "2",
               "--lr_anneal_steps", "2", env={"OPENAI_LOGDIR": str(run)})
    for name in ("model000002.pt", "ema_0.9999_000002.pt", "opt000002.pt",
                 "manifest000002.json", "progress.csv"):
        assert (run / name).exists(), name

    samples = tmp_path / "samples"  # guided's MODEL_FLAGS carry --use_fp16 True: taken too
    proc = run_script("image_sample.py", "--model_path", run / "ema_0.9999_000002.pt",
                      *TINY_FLAGS, "--use_fp16", "True", "--timestep_respacing", "4",
                      "--num_samples", "2", "--batch_size", "2", env={"OPENAI_LOGDIR": str(samples)})
    assert "float16 torso" in proc.stdout
    with np.load(samples / "samples_2x8x8x3.npz") as npz:
        assert npz["arr_0"].shape == (2, 8, 8, 3) and npz["arr_0"].dtype == np.uint8

    nll = tmp_path / "nll"
    run_script("image_nll.py", "--data_dir", data, "--model_path", run / "model000002.pt",
               *TINY_FLAGS, "--num_samples", "2", "--batch_size", "2",
               env={"OPENAI_LOGDIR": str(nll)})
    for name in ("vb", "mse", "xstart_mse"):
        with np.load(nll / f"{name}_terms.npz") as npz:
            assert npz["arr_0"].shape == (10,) and np.isfinite(npz["arr_0"]).all(), name
