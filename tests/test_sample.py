"""scripts/sample.py (and nll.py, super-res) on our files, upstream's raw files and under mpiexec."""
import numpy as np
import pytest
import torch as th
from PIL import Image

from conftest import FIXTURES, run_mpi, run_script, run_script_here
from improved_diffusion import sampling

UPSTREAM_EMA = FIXTURES / "upstream_run_small" / "ema_0.9999_000010.pt"
UPSTREAM_FLAGS = [
    "--image_size", "32", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "16", "--learn_sigma", "True", "--diffusion_steps", "100",
    "--noise_schedule", "cosine",
]
TINY_FLAGS = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1", "--channel_mult", "1,2",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--class_cond", "True", "--num_classes", "3",
]


def _write_images(folder, n=6, size=8):
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(arr).save(folder / f"{i % 3}_{i:03d}.png")
    return folder


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A class-conditional 8px model trained 2 steps by scripts/train.py (one process)."""
    root = tmp_path_factory.mktemp("tiny_run")
    data = _write_images(root / "data")
    run = root / "run"
    run_script("train.py", "--data_dir", data, "--log_dir", run, *TINY_FLAGS,
               "--batch_size", "2", "--max_steps", "2", "--ema_rate", "0.9", timeout=120)
    ema = run / "ema_0.9_000002.pt"
    assert ema.exists(), sorted(p.name for p in run.iterdir())
    return {"data": data, "run": run, "ema": ema, "model": run / "model000002.pt"}


def _load(npz):
    with np.load(npz) as z:
        return {k: z[k] for k in z.files}


# ---------------------------------------------------------------------------------------------
# end to end (launched: our file, one and two ranks; the other files' loading in this process)


@pytest.mark.timeout(120)
def test_our_file_samples_without_repeating_model_flags_and_honours_classes(tiny_run, tmp_path):
    out = tmp_path / "s"
    # --num_channels/--class_cond agree with the file: accepted; --timestep_respacing is free
    proc = run_script("sample.py", "--model_path", tiny_run["ema"], "--log_dir", out,
                      "--num_samples", "5", "--batch_size", "2", "--timestep_respacing", "5",
                      "--classes", "2,0", "--num_channels", "32", "--class_cond", "True",
                      timeout=90)
    z = _load(out / "samples_5x8x8x3.npz")
    assert z["arr_0"].shape == (5, 8, 8, 3) and z["arr_0"].dtype == np.uint8
    assert z["arr_1"].tolist() == [2, 0, 2, 0, 2]
    assert (out / "samples_5x8x8x3.png").exists()
    assert "flags stored in the file" in proc.stdout


@pytest.mark.timeout(150)
def test_same_seed_gives_identical_samples_on_one_and_two_ranks_and_any_batch_size(tiny_run,
                                                                                    tmp_path):
    common = ["--model_path", tiny_run["ema"], "--num_samples", "5", "--timestep_respacing", "5",
              "--use_ddim", "False", "--seed", "7", "--progress", "False"]
    run_script("sample.py", *common, "--batch_size", "5", "--log_dir", tmp_path / "one",
               timeout=90)
    run_mpi(2, "sample.py", *common, "--batch_size", "1", "--log_dir", tmp_path / "two",
            timeout=120)
    one = _load(tmp_path / "one" / "samples_5x8x8x3.npz")
    two = _load(tmp_path / "two" / "samples_5x8x8x3.npz")
    assert two["arr_0"].shape == (5, 8, 8, 3) and two["arr_0"].dtype == np.uint8
    np.testing.assert_array_equal(one["arr_0"], two["arr_0"])
    np.testing.assert_array_equal(one["arr_1"], two["arr_1"])  # random labels, per-sample seeds
    assert one["arr_0"].std() > 0


@pytest.mark.timeout(120)
def test_upstream_raw_ema_file_samples_with_its_flags_given(tmp_path, capsys):
    out = tmp_path / "s"  # (in this process, as the combined dict's below)
    code, text = run_script_here("sample.py", "--model_path", UPSTREAM_EMA, *UPSTREAM_FLAGS,
                                 "--log_dir", out, "--num_samples", "2", "--batch_size", "2",
                                 "--use_ddim", "True", "--timestep_respacing", "ddim5",
                                 capsys=capsys)
    assert code == 0, text[-3000:]
    z = _load(out / "samples_2x32x32x3.npz")
    assert z["arr_0"].shape == (2, 32, 32, 3) and z["arr_0"].dtype == np.uint8
    assert "arr_1" not in z


@pytest.mark.timeout(120)
def test_combined_dict_samples_from_its_ema_entry(tiny_run, tmp_path, capsys):
    raw = th.load(tiny_run["ema"], weights_only=True)
    combined = tmp_path / "combined.pt"
    th.save({"model": raw["state_dict"], "ema": raw["state_dict"], "flags": raw["flags"]},
            combined)
    out = tmp_path / "s"
    code, text = run_script_here("sample.py", "--model_path", combined, "--log_dir", out,
                                 "--num_samples", "2", "--timestep_respacing", "3", capsys=capsys)
    assert code == 0, text[-3000:]
    assert _load(out / "samples_2x8x8x3.npz")["arr_0"].shape == (2, 8, 8, 3)


# ---------------------------------------------------------------------------------------------
# user mistakes: one line, non-zero exit


# (in this process: run(), the scripts' entry point, with no launch; the launched script's own
# one-line errors: test_classifier_sample's overflowing scale on 2 ranks)


def test_explicit_flag_contradicting_the_file_is_an_error_naming_both_values(tiny_run, tmp_path,
                                                                             capsys):
    code, out = run_script_here("sample.py", "--model_path", tiny_run["ema"], "--num_channels",
                                "64", "--log_dir", tmp_path, "--num_samples", "1", capsys=capsys)
    assert code == 2
    err = out.strip().splitlines()[-1]
    assert err.startswith("error: --num_channels 64") and "num_channels=32" in err


def test_upstream_file_without_its_flags_says_to_pass_them(tmp_path, capsys):
    code, out = run_script_here("sample.py", "--model_path", UPSTREAM_EMA, "--log_dir", tmp_path,
                                "--num_samples", "1", capsys=capsys)
    assert code == 1
    err = out.strip().splitlines()[-1]
    assert err.startswith("error: --model_path") and "pass the model flags" in err
    assert "Traceback" not in out


def test_missing_file_and_out_of_range_classes_are_one_line_errors(tiny_run, tmp_path, capsys):
    code, out = run_script_here("sample.py", "--model_path", tmp_path / "nope.pt", "--log_dir",
                                tmp_path, capsys=capsys)
    assert code == 1 and "Traceback" not in out
    assert out.strip().splitlines()[-1].startswith("error: --model_path")
    code, out = run_script_here("sample.py", "--model_path", tiny_run["ema"], "--classes", "1,5",
                                "--log_dir", tmp_path, capsys=capsys)
    assert code == 2
    assert "--classes 1,5: class 5 is out of range" in out


# ---------------------------------------------------------------------------------------------
# nll.py and super-resolution


@pytest.mark.timeout(90)
def test_nll_logs_bits_per_dim_terms_for_an_image_folder(tiny_run, tmp_path):
    proc = run_script("nll.py", "--model_path", tiny_run["model"], "--data_dir",
                      tiny_run["data"], "--num_samples", "3", "--batch_size", "2",
                      "--log_dir", tmp_path, timeout=90)
    assert "done 3 samples: bpd=" in proc.stdout
    for key in ("total_bpd", "prior_bpd", "vb", "mse", "xstart_mse"):
        assert f"| {key}" in proc.stdout
    assert np.load(tmp_path / "vb_terms.npz")["arr_0"].shape == (20,)


@pytest.mark.timeout(150)
def test_super_res_trains_and_upsamples_base_samples(tiny_run, tmp_path):
    run_script("super_res_train.py", "--data_dir", tiny_run["data"], "--log_dir", tmp_path / "sr",
               "--large_size", "8", "--small_size", "4", "--num_channels", "32",
               "--num_res_blocks", "1", "--channel_mult", "1,2", "--attention_resolutions", "",
               "--diffusion_steps", "10", "--noise_schedule", "cosine", "--batch_size", "2",
               "--max_steps", "1", "--sample_interval", "5", "--sample_steps", "2",
               "--sample_count", "3", timeout=90)
    # the end's grid: upsampled from the first 3 images of --data_dir at --small_size
    with Image.open(tmp_path / "sr" / "samples" / "grid_000001.png") as grid:
        assert grid.size == (3 * 64 + 4 * 4, 64 + 2 * 4)  # 8 pixels scaled up 8 times, padded
    base = tmp_path / "base.npz"
    np.savez(base, np.zeros((3, 4, 4, 3), np.uint8))
    run_script("super_res_sample.py", "--model_path", tmp_path / "sr" / "model000001.pt",
               "--base_samples", base, "--num_samples", "3", "--timestep_respacing", "2",
               "--log_dir", tmp_path / "up", timeout=90)
    assert _load(tmp_path / "up" / "samples_3x8x8x3.npz")["arr_0"].shape == (3, 8, 8, 3)


# ---------------------------------------------------------------------------------------------
# the library part


def test_batches_cover_every_index_once_and_deal_equal_counts_to_ranks():
    for n, bs, world in [(5, 2, 1), (5, 1, 2), (7, 3, 3), (2, 4, 2)]:
        per_rank = [sampling.shard_batches(n, bs, r, world) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1
        flat = np.concatenate([b for rank in per_rank for b in rank])
        assert sorted(flat.tolist()) == list(range(n))
        assert max(len(b) for rank in per_rank for b in rank) <= bs


def test_per_sample_noise_does_not_depend_on_the_batch_it_is_drawn_in():
    seeds = [sampling.sample_seed(3, i) for i in range(4)]
    x = th.zeros(4, 3, 2, 2)
    whole = sampling.PerSampleRandn(seeds)(x)
    parts = th.cat([sampling.PerSampleRandn(seeds[:1])(x[:1]),
                    sampling.PerSampleRandn(seeds[1:])(x[1:])])
    assert th.equal(whole, parts)
    assert not th.equal(whole[0], whole[1])
    assert sampling.sample_seed(3, 0) != sampling.sample_seed(4, 0)


def test_reconcile_prefers_the_file_and_rejects_contradicting_explicit_flags():
    defaults = {"num_channels": 128, "class_cond": False, "timestep_respacing": ""}
    file_flags = {"num_channels": 32, "class_cond": True, "timestep_respacing": ""}
    flags = sampling.reconcile_flags(file_flags, {"timestep_respacing": "ddim5",
                                                  "class_cond": "True"}, defaults)
    assert flags == {"num_channels": 32, "class_cond": True, "timestep_respacing": "ddim5"}
    with pytest.raises(sampling.FlagConflictError, match="--num_channels 64 .*num_channels=32"):
        sampling.reconcile_flags(file_flags, {"num_channels": 64}, defaults)
    assert sampling.reconcile_flags(None, {"num_channels": 64}, defaults)["num_channels"] == 64


def test_explicit_args_sees_only_typed_flags_even_when_equal_to_the_default():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--num_channels", type=int, default=128)
    p.add_argument("--use_ddim", type=lambda v: v == "True", default=False)
    assert sampling.explicit_args(p, ["--num_channels", "128"]) == {"num_channels": 128}
    assert sampling.explicit_args(p, []) == {}
