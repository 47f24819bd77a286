"""Ranks started with different flags or data stop at start-up with one line (issue 9, item 5).

Each test starts two ranks with real `mpiexec` in MPMD form (`-n 1 train.py A : -n 1 train.py B`),
so that the ranks really get different command lines, and checks what both ranks print and that
nothing was written to the log dir.
"""
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import MPIEXEC, PY, REPO, _run

TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--max_steps", "2",
]
TRAIN = REPO / "scripts" / "train.py"


def images(folder, n, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
            folder / f"img_{i:03d}.png")
    return folder


def two_ranks(rank0_args, rank1_args, timeout=60):
    """mpiexec with a different train.py command line per rank; returns the CompletedProcess."""
    cmd = [MPIEXEC, "-n", "1", PY, TRAIN, *rank0_args, ":", "-n", "1", PY, TRAIN, *rank1_args]
    return _run(cmd, timeout=timeout, check=False)


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


def checkpoint_files(log_dir):
    return sorted(p.name for p in log_dir.glob("*.pt")) if log_dir.exists() else []


@pytest.mark.timeout(90)
def test_ranks_with_different_model_flags_both_fail_with_one_line_naming_the_flag(tmp_path):
    data, log = images(tmp_path / "data", 4), tmp_path / "log"
    common = [*TINY, "--data_dir", data, "--log_dir", log]
    proc = two_ranks(common, [*common, "--num_channels", "64"])
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout  # the same line on each rank, printed once for the job
    assert "--num_channels differs between ranks (32 on rank 0; 64 on rank 1)" in errors[0]
    assert "Traceback" not in proc.stdout and "aborting" not in proc.stdout
    assert checkpoint_files(log) == []


@pytest.mark.slow  # make soak: the same check as the model flags' test, for training flags
@pytest.mark.timeout(90)
def test_ranks_with_different_lr_fail_and_every_differing_flag_is_named(tmp_path):
    data, log = images(tmp_path / "data", 4), tmp_path / "log"
    common = [*TINY, "--data_dir", data, "--log_dir", log]
    proc = two_ranks(common, [*common, "--lr", "0.1", "--weight_decay", "0.01"])
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout
    assert "--lr differs between ranks (0.0001 on rank 0; 0.1 on rank 1)" in errors[0]
    assert "--weight_decay differs between ranks (0.0 on rank 0; 0.01 on rank 1)" in errors[0]
    assert "num_channels" not in errors[0]
    assert checkpoint_files(log) == []


@pytest.mark.timeout(90)
def test_ranks_whose_data_folders_differ_in_content_fail_naming_sizes_and_hashes(tmp_path):
    a = images(tmp_path / "a", 4)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "img_003.png").write_bytes((a / "img_000.png").read_bytes() + b"\0")  # one size differs
    log = tmp_path / "log"
    proc = two_ranks([*TINY, "--data_dir", a, "--log_dir", log],
                     [*TINY, "--data_dir", b, "--log_dir", log])
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 1, proc.stdout
    assert "the dataset differs between ranks (4 files, sha256 " in errors[0]
    assert "on rank 0; 4 files, sha256 " in errors[0] and "on rank 1)" in errors[0]
    assert "--data_dir" in errors[0] and "data_dir differs" not in errors[0]
    assert checkpoint_files(log) == []


@pytest.mark.timeout(90)
def test_ranks_reading_identical_copies_of_the_data_from_different_paths_train(tmp_path):
    a = images(tmp_path / "a", 4)
    b = tmp_path / "node1" / "copy"
    shutil.copytree(a, b)
    log = tmp_path / "log"
    proc = two_ranks([*TINY, "--data_dir", a, "--log_dir", log],
                     [*TINY, "--data_dir", b, "--log_dir", log])
    assert proc.returncode == 0, proc.stdout
    assert "agree on all 2 rank(s)" in proc.stdout
    assert (log / "manifest000002.json").exists()


def test_the_dataset_fingerprint_follows_relative_names_and_sizes_not_the_mount_point(tmp_path):
    from improved_diffusion.image_datasets import load_data

    def fingerprint(folder):
        return load_data(data_dir=str(folder), batch_size=1, image_size=8).fingerprint()

    a = images(tmp_path / "a", 3)
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert fingerprint(a) == fingerprint(b) and fingerprint(a)["num_files"] == 3
    (b / "img_002.png").write_bytes(b"x" * (b / "img_002.png").stat().st_size)  # same size
    assert fingerprint(a) == fingerprint(b)  # image bytes are never read
    (b / "img_002.png").rename(b / "img_009.png")
    assert fingerprint(a)["sha256"] != fingerprint(b)["sha256"]
