"""The documented Python API for sampling (docs/sampling_api.md, issue 29 item 11): load a file,
sample N images with or without guidance, get uint8 NHWC arrays, with nothing written to disk
(the first call made an openai-... log folder in the system temp dir: the default logger)."""
import tempfile

import numpy as np
import pytest

from conftest import run_script
from improved_diffusion import logger, sampling
from improved_diffusion.infra.errors import UserError
from test_cfg import tagged_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(120)
def test_load_and_sample_images_return_arrays_and_write_nothing(tmp_path, monkeypatch):
    path = tagged_file(tmp_path, class_dropout_prob=0.2)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # gettempdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(logger.Logger, "CURRENT", None)  # as in a fresh process
    monkeypatch.setattr(logger.Logger, "DEFAULT", None)
    assert tempfile.gettempdir() == str(tmp_path / "tmp")

    model, diffusion, flags, _ = sampling.load_for_sampling(str(path), device="cpu")
    images, labels = sampling.sample_images(model, diffusion, flags, 4, batch_size=3,
                                            progress=True)  # progress lines go to stdout only
    guided, guided_labels = sampling.sample_images(model, diffusion, flags, 4,
                                                   guidance_scale=4.0)
    assert images.shape == (4, 8, 8, 3) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and np.array_equal(labels, guided_labels)
    assert not np.array_equal(images, guided)
    assert list((tmp_path / "tmp").iterdir()) == [] and list((tmp_path / "cwd").iterdir()) == []
    with pytest.raises(sampling.FlagError, match="guidance_scale=nan: must be a finite"):
        sampling.sample_images(model, diffusion, flags, 1, guidance_scale=float("nan"))
    # the very images sample.py writes for the same seeds
    run_script("sample.py", "--model_path", path, "--num_samples", "4", "--guidance_scale", "4",
               "--log_dir", tmp_path / "s", "--progress", "False")
    with np.load(tmp_path / "s" / "samples_4x8x8x3.npz") as z:
        assert np.array_equal(z["arr_0"], guided) and np.array_equal(z["arr_1"], labels)
    # a caller that asks for the log dir still gets upstream's temporary one
    assert logger.get_dir().startswith(str(tmp_path / "tmp" / "openai-"))


@pytest.mark.timeout(120)
def test_the_apis_errors_name_its_arguments_and_the_scripts_keep_naming_flags(tmp_path):
    """Issue 37, item 12: the Python API's errors named the scripts' flags (--guidance_scale)."""
    path = tagged_file(tmp_path, class_dropout_prob=0.2)

    def error_of(call, *args, **kwargs):
        with pytest.raises(UserError) as e:
            call(*args, **kwargs)
        assert "--" not in str(e.value).replace("--class_dropout_prob", ""), str(e.value)
        return str(e.value)

    assert error_of(sampling.load_for_sampling, str(path), want="best") == (
        "want='best': expected auto, ema or model")
    assert error_of(sampling.load_for_sampling, str(path), {"num_channels": 64}) == (
        f"num_channels=64 contradicts {path}, which was trained with num_channels=32; leave "
        f"num_channels out of the explicit flags (the file's flags are used)")
    assert error_of(sampling.load_for_sampling, str(path), {"timestep_respacing": "50"}) == (
        "timestep_respacing '50': timestep_respacing: cannot divide a section of 10 steps into "
        "50; use fewer steps")
    assert error_of(sampling.load_for_sampling, str(tmp_path / "nope.pt")).startswith(
        f"{tmp_path / 'nope.pt'}: ")
    model, diffusion, flags, _ = sampling.load_for_sampling(str(path), device="cpu")
    assert error_of(sampling.sample_images, model, diffusion, flags, 2,
                    guidance_scale=float("nan")).startswith("guidance_scale=nan: must be a finite")
    assert error_of(sampling.sample_images, model, diffusion, flags, 0).startswith(
        "num_samples=0: must be at least 1")
    assert error_of(sampling.sample_images, model, diffusion, flags, 2, classes=[0, 7]) == (
        "classes=[0, 7]: class 7 is out of range for a model with num_classes=3 (use 0..2)")
    assert error_of(sampling.sample_images, model, diffusion, flags, 1, guidance_scale=1e38,
                    clip_denoised=False).startswith(
        "guidance_scale=1e+38: the guided samples overflowed to inf/nan")
    images, labels = sampling.sample_images(model, diffusion, flags, 1)
    sampling.save_samples(str(tmp_path / "out"), images, labels, grid=False)
    assert error_of(sampling.save_samples, str(tmp_path / "out"), images, labels).endswith(
        "already exists; pass another log_dir or overwrite=True")
    # the scripts name their flags, as they did
    proc = run_script("sample.py", "--model_path", path, "--num_channels", "64", "--log_dir",
                      tmp_path / "s", check=False)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1] == (
        f"error: --num_channels 64 contradicts {path}, which was trained with num_channels=32; "
        f"drop --num_channels (the file's flags are used)"), proc.stdout
