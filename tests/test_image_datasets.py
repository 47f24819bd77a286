"""The image-folder dataset and its resumable, rank-sharded sample order."""
import os
import warnings

import numpy as np
import pytest
import torch as th
from PIL import Image

from improved_diffusion.image_datasets import (
    DataError,
    ImageDataset,
    ResumableLoader,
    global_indices,
    list_image_files,
    load_data,
    sample_order,
)


class IndexDataset:
    """Returns its own index as the image, so a batch tells which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((1, 2, 2), float(i), dtype=np.float32), {"y": np.int64(i % 3)}


def make_folder(path, labels=("cat", "dog"), per_class=3, size=12, mode="RGB"):
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for label in labels:
        for i in range(per_class):
            shape = (size, size + 4, 3) if mode == "RGB" else (size, size + 4)
            arr = rng.integers(0, 256, size=shape, dtype=np.uint8)
            Image.fromarray(arr, mode=mode).save(path / f"{label}_{i:03d}.png")
    return path


def test_sample_order_is_a_pure_function_of_seed_and_epoch():
    a = sample_order(3, 5, 100)
    assert np.array_equal(a, sample_order(3, 5, 100))
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, sample_order(3, 6, 100))
    assert not np.array_equal(a, sample_order(4, 5, 100))
    assert np.array_equal(sample_order(3, 5, 10, shuffle=False), np.arange(10))


def test_global_indices_span_epochs_and_match_the_per_epoch_orders():
    n = 7
    got = global_indices(5, 12, n, seed=1)
    expected = np.concatenate([sample_order(1, e, n) for e in range(3)])[5:17]
    assert np.array_equal(got, expected)
    # The same positions requested in pieces give the same indices.
    pieces = np.concatenate([global_indices(p, 3, n, seed=1) for p in range(5, 17, 3)])
    assert np.array_equal(pieces, expected)
    assert np.array_equal(global_indices(3, 6, n, seed=1, shuffle=False), [3, 4, 5, 6, 0, 1])


def test_two_ranks_cover_each_global_batch_disjointly():
    ds = IndexDataset(20)
    loaders = [ResumableLoader(ds, 3, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        (b0, c0), (b1, c1) = next(loaders[0]), next(loaders[1])
        got = np.concatenate([loaders[0].last_indices, loaders[1].last_indices])
        start = loaders[0].position - 6
        assert np.array_equal(got, global_indices(start, 6, 20, seed=7))
        assert len(set(got.tolist())) == 6
        assert b0[:, 0, 0, 0].long().tolist() == loaders[0].last_indices.tolist()
        assert c1["y"].dtype == th.int64 and c1["y"].tolist() == [i % 3 for i in got[3:]]
    assert loaders[0].position == loaders[1].position == 18
    assert loaders[0].global_batch == 6


def run_world(ds, world_size, batch_size, steps, state, seen):
    """Take `steps` steps on `world_size` loaders resumed from `state`; return the new state."""
    loaders = [
        ResumableLoader(ds, batch_size, seed=11, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
    for _ in range(steps):
        for ld in loaders:
            next(ld)
            seen.extend(ld.last_indices.tolist())
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)
    return states[0]


def test_resume_on_two_then_one_then_three_ranks_sees_each_index_once_per_epoch():
    n = 60
    ds = IndexDataset(n)
    seen = []
    state = run_world(ds, 2, 4, 3, None, seen)  # 24 samples
    assert state["position"] == 24
    state = run_world(ds, 1, 5, 3, state, seen)  # 15 samples -> 39
    state = run_world(ds, 3, 3, 3, state, seen)  # 27 samples -> 66: into epoch 1
    assert state["position"] == 66
    assert sorted(seen[:n]) == list(range(n))
    # The run continues exactly where a single rank would have been.
    assert seen == global_indices(0, 66, n, seed=11).tolist()


def test_state_dict_is_plain_and_warns_when_the_dataset_size_changed():
    ld = ResumableLoader(IndexDataset(10), 2, seed=5)
    next(ld)
    sd = ld.state_dict()
    assert sd == {"position": 2, "seed": 5, "num_samples": 10, "shuffle": True}
    other = ResumableLoader(IndexDataset(12), 2, seed=5)
    with pytest.warns(UserWarning, match="saved for 10 samples"):
        other.load_state_dict(sd)
    assert other.position == 2
    same = ResumableLoader(IndexDataset(10), 2, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(sd)
    next(same)
    next(ld)
    assert np.array_equal(same.last_indices, ld.last_indices)


def test_workers_give_the_same_batches_as_loading_in_process(tmp_path):
    ds = ImageDataset(8, list_image_files(make_folder(tmp_path / "d")), classes=[0, 1] * 3)
    plain = ResumableLoader(ds, 2, seed=3, rank=1, world_size=2)
    workers = ResumableLoader(ds, 2, seed=3, rank=1, world_size=2, num_workers=2)
    for step in range(4):
        if step == 2:  # resuming mid-stream restarts the workers at the new position
            workers.load_state_dict(plain.state_dict())
        (a, ca), (b, cb) = next(plain), next(workers)
        assert th.equal(a, b) and th.equal(ca["y"], cb["y"])
        assert np.array_equal(plain.last_indices, workers.last_indices)


def test_load_data_reads_a_tiny_folder_with_classes_from_file_names(tmp_path):
    folder = make_folder(tmp_path / "imgs", labels=("b", "a", "c"), per_class=2)
    (folder / "sub").mkdir()
    Image.fromarray(np.zeros((10, 10), np.uint8), mode="L").save(folder / "sub" / "a_gray.png")
    (folder / "notes.txt").write_text("not an image")
    data = load_data(data_dir=str(folder), batch_size=7, image_size=8, class_cond=True,
                     deterministic=True, rank=0, world_size=1)
    batch, cond = next(data)
    assert batch.shape == (7, 3, 8, 8) and batch.dtype == th.float32
    assert batch.min() >= -1 and batch.max() <= 1
    files = list_image_files(str(folder))
    assert len(files) == 7 and files == sorted(files)
    # class = the part of the name before "_", sorted: a -> 0, b -> 1, c -> 2
    expected = [{"a": 0, "b": 1, "c": 2}[f.split("/")[-1].split("_")[0]] for f in files]
    assert cond["y"].dtype == th.int64 and cond["y"].tolist() == expected
    gray = batch[files.index(str(folder / "sub" / "a_gray.png"))]
    assert th.all(gray == -1)


def test_unconditional_batches_have_empty_cond(tmp_path):
    folder = make_folder(tmp_path / "imgs", per_class=2, mode="L")
    batch, cond = next(load_data(data_dir=str(folder), batch_size=2, image_size=4))
    assert batch.shape == (2, 3, 4, 4) and cond == {}


def test_preprocessing_center_crops_the_resized_image(tmp_path):
    arr = np.zeros((16, 32, 3), np.uint8)
    arr[:, 8:24] = 255  # the central 16 columns are white
    Image.fromarray(arr).save(tmp_path / "x_0.png")
    x, cond = ImageDataset(8, [str(tmp_path / "x_0.png")])[0]
    assert x.shape == (3, 8, 8) and x.dtype == np.float32 and cond == {}
    assert np.allclose(x, 1.0)


def test_missing_or_empty_data_dir_is_a_clear_error_naming_the_flag(tmp_path):
    with pytest.raises(DataError, match="--data_dir .*does not exist"):
        load_data(data_dir=str(tmp_path / "nope"), batch_size=1, image_size=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="--data_dir .*holds no images"):
        load_data(data_dir=str(tmp_path / "empty"), batch_size=1, image_size=8)
    with pytest.raises(DataError, match="--data_dir"):
        load_data(data_dir="", batch_size=1, image_size=8)


# ---------------------------------------------------------------------------------------------
# class labels (issue 29): one folder per class, or the file-name prefix; refused when every
# file would be its own class; the names travel in the checkpoint to sampling


@pytest.mark.timeout(200)
def test_train_py_reads_one_folder_per_class_logs_the_rule_and_sampling_names_the_labels(
        tmp_path):
    from PIL import Image

    from conftest import run_script
    from improved_diffusion.ckpt import checkpoint

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for cls in ("dog", "cat"):  # files without "_": the prefix rule made each its own class
        (data / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                data / cls / f"img{i}.png")
    tiny = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
            "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
            "--noise_schedule", "cosine", "--class_cond", "True", "--batch_size", "2",
            "--save_interval", "1000",
            "--num_workers", "0"]
    out = run_script("train.py", *tiny, "--data_dir", data, "--log_dir", tmp_path / "run",
                     "--max_steps", "1").stdout
    assert ("class labels from one folder per class (DIR/CLASS/...): 2 classes: 0=cat 1=dog"
            in out), out
    for name in ("model000001.pt", "ema_0.9999_000001.pt"):  # beside the flags, not in them
        f = checkpoint.load_file(str(tmp_path / "run" / name))
        assert f.raw["class_names"] == ["cat", "dog"], name
        assert f.flags["num_classes"] == 2 and "class_names" not in f.flags
    out = run_script("sample.py", "--model_path", tmp_path / "run" / "model000001.pt",
                     "--num_samples", "3", "--classes", "1,0", "--log_dir", tmp_path / "s",
                     "--progress", "False").stdout
    assert "labels: 0=cat x1, 1=dog x2" in out, out
    # a flat folder of files without "_": each its own class, refused in one line
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (flat / name).write_bytes((data / "cat" / "img0.png").read_bytes())
    proc = run_script("train.py", *tiny, "--data_dir", flat, "--log_dir", tmp_path / "run2",
                      "--max_steps", "1", check=False)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1] == (
        f"error: --data_dir {flat}: --class_cond True finds 3 classes for 3 files by the "
        "file-name prefix before the first '_', one class per file; put each class in its own "
        "folder (DIR/cat/*.png) or name the files CLASS_anything.png")
    assert not list((tmp_path / "run2").glob("*.pt"))


@pytest.mark.timeout(200)
def test_train_py_refuses_a_stray_file_beside_the_class_folders_and_a_symlink_loop_in_one_line(
        tmp_path):
    """Issue 37, item 4: one IMG_0001.jpg beside cat/ and dog/ switched the whole tree to the
    prefix rule (`1 classes: 0=IMG`, exit 0); a symbolic link back up the tree was a traceback
    (OSError: too many levels of symbolic links)."""
    from conftest import run_script

    tiny = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
            "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
            "--noise_schedule", "cosine", "--class_cond", "True", "--batch_size", "2",
            "--num_workers", "0", "--max_steps", "1"]
    data = tmp_path / "data"
    for cls in ("cat", "dog"):
        make_folder(data / cls, labels=("IMG",), per_class=2, size=8)
    make_folder(data, labels=("IMG",), per_class=1, size=8)  # data/IMG_000.png: a stray
    proc = run_script("train.py", *tiny, "--data_dir", data, "--log_dir", tmp_path / "r1",
                      check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        f"error: --data_dir {data}: --class_cond True: 1 file(s) lie beside its class folders "
        "(cat, dog), in no class folder: IMG_000.png; move them into their class's folder or "
        "out of --data_dir"), proc.stdout[-3000:]
    (data / "IMG_000.png").unlink()
    (data / "dog" / "back").symlink_to("..")
    proc = run_script("train.py", *tiny, "--data_dir", data, "--log_dir", tmp_path / "r2",
                      check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        f"error: {data}/dog/back: a symbolic link back to {os.path.realpath(data)}, a folder "
        "above it (a loop); remove the link or point it outside the data folder"), (
            proc.stdout[-3000:])
    assert "Traceback" not in proc.stdout
    assert not list(tmp_path.glob("r*/*.pt"))


def test_files_beside_class_folders_are_refused_unless_every_prefix_agrees_with_the_folders(
        tmp_path):
    from improved_diffusion.image_datasets import class_labels

    d = str(tmp_path)
    with pytest.raises(DataError, match=r"2 file\(s\) lie beside its class folders \(cat, dog\), "
                                        r"in no class folder: a.png, b.png; move"):
        class_labels(d, [f"{d}/a.png", f"{d}/b.png", f"{d}/cat/1.png", f"{d}/dog/2.png"])
    # every file has a prefix and the folders' files agree with it: the prefix rule reads all
    paths = [f"{d}/cat/cat_{i}.png" for i in (1, 2)] + [f"{d}/dog/dog_1.png", f"{d}/owl_1.png",
                                                        f"{d}/owl_2.png"]
    assert class_labels(d, paths) == ("prefix", ["cat", "dog", "owl"], [0, 0, 1, 2, 2])
    # one subfolder beside flat files: no folder-per-class tree, upstream's prefix rule
    assert class_labels(d, [f"{d}/cat_1.png", f"{d}/cat_2.png", f"{d}/more/dog_1.png",
                            f"{d}/more/dog_2.png"]) == ("prefix", ["cat", "dog"], [0, 0, 1, 1])
    # a broken file link is one line naming it (its stat was a traceback in the fingerprint)
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(DataError, match="gone.png: a symbolic link to nothing"):
        list_image_files(d)


# Promises of issue 29 that no test guarded (issue 37, items 24 and 25)

def test_class_labels_follow_sorted_order_of_the_names_uppercase_first(tmp_path):
    """Item 24: class indices follow sorted() (code points, torchvision's ImageFolder order):
    Zebra/ before ant/, and the batches carry those labels."""
    from improved_diffusion.image_datasets import class_labels

    d = str(tmp_path)
    paths = [f"{d}/ant/1.png", f"{d}/ant/2.png", f"{d}/Zebra/1.png", f"{d}/Zebra/2.png"]
    assert class_labels(d, sorted(paths)) == ("folders", ["Zebra", "ant"], [0, 0, 1, 1])
    assert class_labels(d, [f"{d}/ant_1.png", f"{d}/Zebra_1.png", f"{d}/ant_2.png"])[1:] == (
        ["Zebra", "ant"], [1, 0, 1])
    for cls in ("ant", "Zebra"):
        make_folder(tmp_path / "data" / cls, labels=("x",), per_class=2, size=8)
    loader = load_data(data_dir=str(tmp_path / "data"), batch_size=4, image_size=8,
                       class_cond=True, deterministic=True, rank=0, world_size=1)
    assert loader.class_names == ["Zebra", "ant"]
    files = list_image_files(str(tmp_path / "data"))
    assert next(loader)[1]["y"].tolist() == [0 if "/Zebra/" in f else 1 for f in files]


def test_subfolders_and_prefixes_that_name_different_classes_are_refused(tmp_path):
    """Item 25: DIR/train/cat_1.png and DIR/test/dog_2.png could mean classes train/test or
    cat/dog: refused, naming both readings (through load_data, as train.py reads a folder)."""
    for split, labels in (("train", ("cat", "dog")), ("test", ("cat", "dog"))):
        make_folder(tmp_path / "data" / split, labels=labels, per_class=1, size=8)
    with pytest.raises(DataError, match=r"its subfolders \(test, train\) and its file-name "
                                        r"prefixes \(cat, dog\) name different classes"):
        load_data(data_dir=str(tmp_path / "data"), batch_size=2, image_size=8, class_cond=True)


@pytest.mark.timeout(200)
def test_a_damaged_image_read_by_a_loader_worker_is_the_same_one_line_as_without_workers(
        tmp_path):
    """Issue 56, item 4: with --num_workers 2 (the default starts workers on a GPU host) a
    truncated image was torch's re-raise, the worker's whole traceback on one `error:` line, and
    then the job never ended (multiprocessing's exit joins the workers, which ignore SIGTERM)."""
    import subprocess

    from conftest import PY, REPO, child_env, hang_s

    data = make_folder(tmp_path / "data", per_class=2, size=8)
    damaged = data / "cat_001.png"
    damaged.write_bytes(damaged.read_bytes()[:60])  # cut inside the image data
    tiny = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
            "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
            "--noise_schedule", "cosine", "--batch_size", "4", "--max_steps", "2",
            "--data_dir", str(data)]
    ends = {}
    for workers in ("0", "2"):
        proc = subprocess.run(
            [PY, str(REPO / "scripts" / "train.py"), *tiny, "--num_workers", workers,
             "--log_dir", str(tmp_path / f"run{workers}")], cwd=REPO, env=child_env(),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=hang_s(60))
        ends[workers] = proc.returncode, proc.stderr
    code, line = ends["0"]
    assert code == 1 and line == (f"error: cannot read image {damaged}: image file is truncated; "
                                  "remove or replace the file\n"), ends
    assert ends["2"] == ends["0"], ends["2"][1][-3000:]
    assert not list(tmp_path.glob("run*/*.pt"))
