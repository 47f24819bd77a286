"""The embedded digits data set, its evaluator, and the CIFAR-10 writer (offline)."""
import io
import json
import os
import pickle
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, run_script
from improved_diffusion.image_datasets import list_image_files, load_data

sys.path.insert(0, str(REPO / "datasets"))
import cifar10  # noqa: E402
import digits  # noqa: E402


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    assert digits.write_digits_folder(str(out), size=16, log=lambda *a: None) == 1797
    return out


@pytest.fixture(scope="module")
def real_samples(digits_dir):
    """The written 16px digits as sample.py would save them: uint8 NHWC RGB and labels."""
    files = list_image_files(str(digits_dir))
    images = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    labels = np.array([int(os.path.basename(f).split("_")[0]) for f in files])
    return images, labels


def test_digits_folder_has_one_named_png_per_real_digit(digits_dir):
    X, y = digits.load_real_digits()
    names = sorted(os.listdir(digits_dir))
    assert len(names) == len(y) == 1797
    assert names == sorted(f"{label}_{i:04d}.png" for i, label in enumerate(y))
    assert np.bincount([int(n.split("_")[0]) for n in names]).tolist() == np.bincount(y).tolist()
    with Image.open(digits_dir / names[0]) as im:
        assert im.size == (16, 16)


def test_writing_again_into_a_complete_folder_changes_nothing(digits_dir):
    before = {p.name: p.stat().st_mtime_ns for p in digits_dir.iterdir()}
    said = []
    assert digits.write_digits_folder(str(digits_dir), size=16, log=said.append) == 1797
    assert "nothing to do" in said[0]
    assert {p.name: p.stat().st_mtime_ns for p in digits_dir.iterdir()} == before


def test_digits_cli_rejects_a_size_below_eight(tmp_path, capsys):
    assert digits.main(["--out", str(tmp_path / "d"), "--size", "4"]) == 2
    assert "error: --size must be" in capsys.readouterr().err


def test_the_loader_reads_the_digit_as_the_class(digits_dir):
    data = load_data(data_dir=str(digits_dir), batch_size=16, image_size=16, class_cond=True,
                     seed=1, rank=0, world_size=1)
    batch, cond = next(data)
    assert batch.shape == (16, 3, 16, 16)
    files = list_image_files(str(digits_dir))
    expected = [int(os.path.basename(files[i]).split("_")[0]) for i in data.last_indices]
    assert cond["y"].tolist() == expected


def test_real_digits_score_high_and_noise_scores_low(real_samples):
    images, labels = real_samples
    real = digits.evaluate_samples(images, labels)
    assert real["mean_confidence"] > 0.9
    assert real["label_agreement"] > 0.95
    assert sum(real["histogram"]) == 1797 and min(real["histogram"]) > 150
    noise_imgs = np.random.default_rng(0).integers(0, 256, (200, 16, 16, 3), dtype=np.uint8)
    noise = digits.evaluate_samples(noise_imgs, labels[:200])
    assert noise["mean_confidence"] < 0.4
    assert noise["label_agreement"] < 0.3
    # Real halves are close; real vs noise is far; upsampled-and-back real digits stay close.
    assert real["fid_real_halves"] < 0.05 * noise["fid_real_vs_generated"]
    assert real["fid_real_vs_generated"] < 0.05 * noise["fid_real_vs_generated"]


def test_frechet_distance_is_zero_for_identical_sets_and_grows_with_a_shift():
    a = np.random.default_rng(0).normal(size=(500, 4))
    assert digits.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert digits.frechet_distance(a, a + 2.0) == pytest.approx(16.0, rel=1e-6)


def test_eval_script_prints_a_summary_and_writes_json(tmp_path, real_samples):
    images, labels = real_samples
    pick = np.arange(0, 1797, 18)  # 100 samples, as the demo makes
    npz = tmp_path / "samples_100x16x16x3.npz"
    np.savez(npz, images[pick], labels[pick])
    out = run_script("eval_digits.py", str(npz), "--json", str(tmp_path / "f.json"), timeout=60)
    assert "mean top-class confidence" in out.stdout and "label agreement" in out.stdout
    assert "real half vs half" in out.stdout
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["num_samples"] == 100 and figures["mean_confidence"] > 0.9
    assert figures["label_agreement"] > 0.9


def test_eval_without_labels_reports_no_agreement_and_missing_files_fail_in_one_line(
    tmp_path, real_samples, capsys
):
    images, _ = real_samples
    np.savez(tmp_path / "s.npz", images[:10, :, :, :1])  # one channel, no labels
    assert digits.eval_main([str(tmp_path / "s.npz")]) == 0
    assert "n/a (no labels" in capsys.readouterr().out
    assert digits.eval_main([str(tmp_path / "missing.npz")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: samples file") and "\n" not in err


def _fake_cifar_archive(path):
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        for name, n in [*[(f"data_batch_{i}", 2) for i in range(1, 6)], ("test_batch", 3)]:
            data = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)
            blob = pickle.dumps({b"data": data, b"labels": [i % 10 for i in range(n)]})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def test_cifar10_writer_dumps_an_archive_as_named_image_folders(tmp_path, capsys):
    _fake_cifar_archive(tmp_path / "c.tar.gz")
    out = tmp_path / "out"
    assert cifar10.main(["--out_dir", str(out), "--archive", str(tmp_path / "c.tar.gz")]) == 0
    assert sorted(os.listdir(out / "cifar_train")) == sorted(
        f"{cifar10.CLASSES[i % 2]}_{i:05d}.png" for i in range(10)
    )
    assert sorted(os.listdir(out / "cifar_test")) == [
        "bird_00002.png", "car_00001.png", "plane_00000.png"
    ]
    with Image.open(out / "cifar_test" / "plane_00000.png") as im:
        assert im.size == (32, 32) and im.mode == "RGB"
    assert cifar10.main(["--out_dir", str(out), "--archive", "/nonexistent"]) == 0  # all skipped
    assert "skipping split train" in capsys.readouterr().out
