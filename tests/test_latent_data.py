"""A --data_dir of precomputed latents (.npy / .npz, one [C, H, W] array per image): read as they
are, classes from the file names, rank-sharded and resumable like an image folder."""
import json
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


class _StandInVAE(torch.nn.Module):
    """AutoencoderKL's interface: encode(x [N, 3, H, W]).latent_dist.sample(generator) ->
    [N, 4, H/8, W/8]; decode(z).sample -> [N, 3, 8h, 8w]. Deterministic; its weights (a gain,
    1 by default) are its identity."""

    def __init__(self, gain=1.0):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.full((1,), float(gain)))
        self.register_buffer("bias", torch.zeros(4))

    def encode(self, x):
        import torch.nn.functional as F

        mean = F.avg_pool2d(x, 8) * self.gain.detach()
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


def test_a_vaes_identity_is_the_sha256_of_its_weights_whatever_dtype_they_were_loaded_in():
    a, same, other = _StandInVAE(0.5), _StandInVAE(0.5).half(), _StandInVAE(0.25)
    ident = vae_latents.vae_identity(a)
    assert len(ident) == 64 and int(ident, 16) >= 0
    assert vae_latents.vae_identity(same) == ident  # the same values in float16: the same VAE
    assert vae_latents.vae_identity(other) != ident
    other.bias.data[0] = 1.0
    assert vae_latents.vae_identity(other) != vae_latents.vae_identity(_StandInVAE(0.25))
    with pytest.raises(TypeError, match="no state_dict"):
        vae_latents.vae_identity(SimpleNamespace(encode=None))


def _images(folder, names, size=64):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(names))
    for name in names:
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / name)
    return folder


def test_encode_records_its_vae_in_the_latent_folder_and_refuses_latents_of_another(tmp_path):
    lat, quiet = tmp_path / "lat", dict(image_size=16, log=lambda *a: None)
    a, b = _StandInVAE(), _StandInVAE(2.0)
    vae_latents.encode_folder(str(_images(tmp_path / "i1", ["3_0.png"], 16)), str(lat), a,
                              source="/vaes/a", **quiet)
    rec = json.loads((lat / "vae.json").read_text())
    assert rec == {"source": "/vaes/a", "sha256": vae_latents.vae_identity(a),
                   "scale": vae_latents.LATENT_SCALE}
    # more images of the same VAE: added
    more = _images(tmp_path / "i2", ["3_0.png", "7_0.png"], 16)
    assert vae_latents.encode_folder(str(more), str(lat), a, **quiet) == 1
    # another VAE: refused, naming both ids and the folder's vae.json; nothing added
    more_b = _images(tmp_path / "i3", ["9_0.png"], 16)
    with pytest.raises(vae_latents.VAEMismatchError) as e:
        vae_latents.encode_folder(str(more_b), str(lat), b, source="/vaes/b", **quiet)
    msg = str(e.value)
    assert vae_latents.vae_identity(a) in msg and vae_latents.vae_identity(b) in msg
    assert str(lat / "vae.json") in msg and "/vaes/b" in msg and "\n" not in msg
    assert sorted(p.name for p in lat.glob("*.npy")) == ["3_0.npy", "7_0.npy"]
    # latents of an unknown VAE (no vae.json): refused too
    (lat / "vae.json").unlink()
    with pytest.raises(vae_latents.VAEMismatchError, match=r"no vae.json"):
        vae_latents.encode_folder(str(more), str(lat), a, **quiet)
    # the trainer's loader reads the record
    vae_latents.encode_folder(str(more), str(tmp_path / "lat2"), a, source="/vaes/a", **quiet)
    loader = load_data(data_dir=str(tmp_path / "lat2"), batch_size=1, image_size=2)
    assert loader.vae["sha256"] == vae_latents.vae_identity(a)
    assert load_data(data_dir=str(lat), batch_size=1, image_size=2).vae is None


@pytest.mark.timeout(240)
def test_the_vae_travels_from_the_latent_folder_through_training_and_sampling_to_decode(
        tmp_path, capsys, monkeypatch):
    """latent folder (vae.json) -> train.py's model and EMA files (the "vae" tag) -> sample.py's
    npz (vae_sha256) -> decode: the same VAE decodes, another is one line, exit 1, no output."""
    from conftest import run_script

    a, b = _StandInVAE(), _StandInVAE(3.0)
    lat = tmp_path / "lat"
    vae_latents.encode_folder(str(_images(tmp_path / "img", ["0_0.png", "1_0.png"])), str(lat),
                              a, source="/vaes/a.safetensors", image_size=64, log=lambda *x: None)
    run = tmp_path / "run"
    run_script("train.py", "--data_dir", lat, "--log_dir", run, "--image_size", "8",
               "--in_channels", "4", "--num_channels", "32", "--channel_mult", "1",
               "--attention_resolutions", "", "--num_res_blocks", "1", "--diffusion_steps", "20",
               "--noise_schedule", "cosine",
               "--learn_sigma", "False", "--batch_size", "2", "--max_steps", "1",
               "--save_interval", "1", "--ema_rate", "0.9", timeout=150)
    ident = vae_latents.vae_identity(a)
    for name in ("model000001.pt", "ema_0.9_000001.pt"):
        tag = torch.load(run / name, weights_only=True, map_location="cpu")["vae"]
        assert tag == {"source": "/vaes/a.safetensors", "sha256": ident,
                       "scale": vae_latents.LATENT_SCALE}, name
    out = tmp_path / "samples"
    run_script("sample.py", "--model_path", run / "ema_0.9_000001.pt", "--log_dir", out,
               "--num_samples", "2", "--batch_size", "2", "--clip_denoised", "False",
               "--use_ddim", "True", "--timestep_respacing", "ddim2",
               timeout=120)
    npz = out / "samples_2x4x8x8.npz"
    with np.load(npz, allow_pickle=False) as z:
        assert str(z["vae_sha256"]) == ident and z["arr_0"].shape == (2, 4, 8, 8)
    # decode with the VAE that made the latents: images
    monkeypatch.setattr(vae_latents, "load_vae", lambda spec, device: (a, spec))
    assert vae_latents.main(["decode", str(npz), "--out", str(tmp_path / "a.npz"),
                             "--vae", "/vaes/a.safetensors", "--device", "cpu"]) == 0
    assert np.load(tmp_path / "a.npz")["arr_0"].shape == (2, 64, 64, 3)
    # with another VAE: one line naming both ids and the files, exit 1, nothing written
    capsys.readouterr()
    monkeypatch.setattr(vae_latents, "load_vae", lambda spec, device: (b, spec))
    assert vae_latents.main(["decode", str(npz), "--out", str(tmp_path / "b.npz"),
                             "--vae", "/vaes/b", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert ident in err and vae_latents.vae_identity(b) in err
    assert str(npz) in err and "/vaes/b" in err
    assert not (tmp_path / "b.npz").exists()


def test_vae_takes_a_local_folder_or_a_single_weights_file_offline(tmp_path):
    diffusers = pytest.importorskip(
        "diffusers", reason="diffusers is not installed (pip install diffusers to test the local "
                            "folder / single file loading of --vae)")
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4,
                                  layers_per_block=1, sample_size=16)
    folder = tmp_path / "vae_folder"
    vae.save_pretrained(folder)
    loaded, source = vae_latents.load_vae(str(folder), "cpu")
    assert source == str(folder) and not loaded.training
    ident = vae_latents.vae_identity(vae)
    assert vae_latents.vae_identity(loaded) == ident
    # one weights file with its config.json beside it: the same weights, the same id
    from safetensors.torch import save_file

    save_file(vae.state_dict(), str(folder / "vae.safetensors"))
    loaded, source = vae_latents.load_vae(str(folder / "vae.safetensors"), "cpu")
    assert source == str(folder / "vae.safetensors") and vae_latents.vae_identity(loaded) == ident
    # without a config (offline, nothing cached) or a path that is not there: one line
    lone = tmp_path / "lone"
    lone.mkdir()
    save_file(vae.state_dict(), str(lone / "vae.safetensors"))
    with pytest.raises(vae_latents.DataError, match=r"config.json") as e:
        vae_latents.load_vae(str(lone / "vae.safetensors"), "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(vae_latents.DataError, match=r"--vae .*missing: no such folder or file"):
        vae_latents.load_vae(str(tmp_path / "missing"), "cpu")
