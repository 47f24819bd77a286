"""A --data_dir of precomputed latents (.npy / .npz, one [C, H, W] array per image): read as they
are, classes from the file names, rank-sharded and resumable like an image folder."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO
from improved_diffusion.image_datasets import (
    DataError,
    LatentDataset,
    folder_class_names,
    load_data,
)

sys.path.insert(0, str(REPO / "datasets"))
import vae_latents  # noqa: E402


def write_latents(d, n_per_class=3, classes=("3", "7"), shape=(4, 8, 8), seed=0, npz=False):
    """{path: array} of latent files "{class}_{i}.npy" (or .npz) written into `d`."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for c in classes:
        for i in range(n_per_class):
            arr = rng.standard_normal(shape).astype(np.float32) * 3.0  # not in [-1, 1]
            path = d / f"{c}_{i:02d}.{'npz' if npz else 'npy'}"
            if npz:
                np.savez(path, latent=arr)
            else:
                np.save(path, arr)
            out[path] = arr
    return out


@pytest.mark.parametrize("npz", [False, True], ids=["npy", "npz"])
def test_a_latent_folder_gives_its_arrays_unchanged_with_classes_from_the_names(tmp_path, npz):
    files = write_latents(tmp_path / "lat", npz=npz)
    loader = load_data(data_dir=str(tmp_path / "lat"), batch_size=6, image_size=8,
                       class_cond=True, deterministic=True, in_channels=4)
    assert isinstance(loader.dataset, LatentDataset)
    batch, cond = next(loader)
    assert batch.shape == (6, 4, 8, 8) and str(batch.dtype) == "torch.float32"
    for row, (path, arr) in zip(batch, sorted(files.items())):
        assert np.array_equal(row.numpy(), arr)  # no scaling, no clipping
    assert cond["y"].tolist() == [0, 0, 0, 1, 1, 1]
    assert folder_class_names(str(tmp_path / "lat")) == ["3", "7"]


def test_fast_dits_batch_of_one_arrays_are_read_as_c_h_w(tmp_path):
    d = tmp_path / "lat"
    d.mkdir()
    arr = np.arange(4 * 8 * 8, dtype=np.float32).reshape(1, 4, 8, 8)
    np.save(d / "0_00000.npy", arr)
    x, _ = next(load_data(data_dir=str(d), batch_size=1, image_size=8))
    assert np.array_equal(x[0].numpy(), arr[0])


def test_two_ranks_share_each_global_batch_and_a_resume_continues_on_one(tmp_path):
    write_latents(tmp_path / "lat", n_per_class=5)  # 10 latents
    kw = dict(data_dir=str(tmp_path / "lat"), batch_size=2, image_size=8, seed=3)
    ranks = [load_data(rank=r, world_size=2, **kw) for r in range(2)]
    seen = []
    for _ in range(2):  # 2 steps x global batch 4
        for loader in ranks:
            next(loader)
            seen += loader.last_indices.tolist()
    assert len(set(seen)) == 8  # disjoint: no latent twice within the epoch
    one = load_data(rank=0, world_size=1, **dict(kw, batch_size=2))
    one.load_state_dict(ranks[0].state_dict())
    next(one)
    assert set(one.last_indices.tolist()) == set(range(10)) - set(seen)
    assert one.fingerprint()["num_files"] == 10


@pytest.mark.parametrize("case, match", [
    ("mixed", r"holds both images \(1, .*\) and latents \(6, "),
    ("channels", r"holds latents with 4 channels .* --in_channels 3; pass --in_channels 4"),
    ("size", r"has shape \[4, 8, 8\]; this model takes \[C, 16, 16\] \(--image_size is the "
             r"latent side\)"),
    ("two_arrays", r"holds 2 arrays \(a, b\); give one array per file"),
    ("ints", r"holds a int64 array of shape \[4, 8, 8\]; expected a float array"),
])
def test_unusable_latent_folders_are_one_line_data_errors(tmp_path, case, match):
    d = tmp_path / "lat"
    write_latents(d)
    kw = dict(data_dir=str(d), batch_size=1, image_size=8, deterministic=True)
    if case == "mixed":
        (d / "cat_0.png").write_bytes(b"")
    elif case == "channels":
        kw["in_channels"] = 3
    elif case == "size":
        kw["image_size"] = 16
    elif case == "two_arrays":
        np.savez(d / "0_00.npz", a=np.zeros((4, 8, 8)), b=np.zeros(1))
        for p in d.glob("*.npy"):
            p.unlink()
    elif case == "ints":
        np.save(d / "0_00.npy", np.zeros((4, 8, 8), dtype=np.int64))
    with pytest.raises(DataError, match=match) as e:
        next(load_data(**kw))
    assert "\n" not in str(e.value)


class _WritesMarker:
    """Unpickling this object opens (creates) the file it names: code run from the data."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_object_array_is_refused_and_never_unpickled(tmp_path):
    d, marker = tmp_path / "lat", tmp_path / "MARKER"
    write_latents(d)
    np.save(d / "3_00.npy", np.array([_WritesMarker(str(marker))], dtype=object),
            allow_pickle=True)
    with pytest.raises(DataError, match=r"cannot read latent .*3_00\.npy: .*allow_pickle"):
        next(load_data(data_dir=str(d), batch_size=6, image_size=8, deterministic=True))
    assert not marker.exists(), "reading a latent ran code from it"
    np.load(d / "3_00.npy", allow_pickle=True)  # the payload is real: unsafe loading runs it
    assert marker.exists()


# ---------------------------------------------------------------------------------------------
# datasets/vae_latents.py (diffusers' AutoencoderKL elsewhere; here a stand-in with its interface)


class _StandInVAE:
    """AutoencoderKL's interface: encode(x [N, 3, H, W]).latent_dist.sample(generator) ->
    [N, 4, H/8, W/8]; decode(z).sample -> [N, 3, 8h, 8w]. Deterministic."""

    def encode(self, x):
        import torch.nn.functional as F

        mean = F.avg_pool2d(x, 8)
        mean = torch.cat([mean, mean[:, :1]], dim=1)
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=lambda generator=None: mean))

    def decode(self, z):
        import torch.nn.functional as F

        return SimpleNamespace(sample=F.interpolate(z[:, :3], scale_factor=8))


def test_vae_latents_encodes_an_image_folder_into_a_latent_folder_the_trainer_reads(tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("3_0.png", "3_1.png", "sub/7_0.png"):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images / name)
    lat = tmp_path / "latents"
    assert vae_latents.encode_folder(str(images), str(lat), _StandInVAE(), image_size=16,
                                     batch_size=2, log=lambda *a: None) == 3
    assert sorted(str(p.relative_to(lat)) for p in lat.rglob("*.npy")) == [
        "3_0.npy", "3_1.npy", "sub/7_0.npy"]
    assert vae_latents.encode_folder(str(images), str(lat), _StandInVAE(), image_size=16,
                                     log=lambda *a: None) == 0  # a rerun skips what is there
    batch, cond = next(load_data(data_dir=str(lat), batch_size=3, image_size=2,
                                 class_cond=True, deterministic=True, in_channels=4))
    assert batch.shape == (3, 4, 2, 2) and cond["y"].tolist() == [0, 0, 1]
    assert np.allclose(batch[0, 0].numpy(), np.load(lat / "3_0.npy")[0])
    assert abs(float(batch[0, 0, 0, 0]) / vae_latents.LATENT_SCALE) <= 1  # scaled pixel means

    np.savez(tmp_path / "samples_3x4x2x2.npz", arr_0=batch.numpy(), arr_1=np.arange(3))
    shape = vae_latents.decode_samples(tmp_path / "samples_3x4x2x2.npz", tmp_path / "img.npz",
                                       _StandInVAE())
    z = np.load(tmp_path / "img.npz")
    assert shape == (3, 16, 16, 3) and z["arr_0"].dtype == np.uint8
    assert z["arr_1"].tolist() == [0, 1, 2]
