"""The documented Python API for sampling (docs/sampling_api.md, issue 29 item 11): load a file,
sample N images with or without guidance, get uint8 NHWC arrays, with nothing written to disk
(the first call made an openai-... log folder in the system temp dir: the default logger)."""
import tempfile

import numpy as np
import pytest

from conftest import run_script
from improved_diffusion import logger, sampling
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
    with pytest.raises(sampling.FlagError, match="--guidance_scale nan: must be a finite"):
        sampling.sample_images(model, diffusion, flags, 1, guidance_scale=float("nan"))
    # the very images sample.py writes for the same seeds
    run_script("sample.py", "--model_path", path, "--num_samples", "4", "--guidance_scale", "4",
               "--log_dir", tmp_path / "s", "--progress", "False")
    with np.load(tmp_path / "s" / "samples_4x8x8x3.npz") as z:
        assert np.array_equal(z["arr_0"], guided) and np.array_equal(z["arr_1"], labels)
    # a caller that asks for the log dir still gets upstream's temporary one
    assert logger.get_dir().startswith(str(tmp_path / "tmp" / "openai-"))
