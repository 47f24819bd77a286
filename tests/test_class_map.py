"""A resume's class labels against the class names its checkpoint stores (issue 37, item 3).

Trained on apple/banana/cherry, a resume on apple/cherry went on with cherry as label 1 and
rewrote the stored names, exit 0. A resume whose classes differ (removed, added, renamed,
relabelled) now stops with one line naming the differences, before anything of the log dir
changes, unless --class_map says how to map them: keep (the checkpoint's labels, by name) or
data (the folder's). The same for classifier_train.py, whose files now store their class names
and whose validation folder is labelled by the training folder's names.
"""
import json
import shutil

import numpy as np
import pytest
import torch as th
from PIL import Image

from conftest import MPIEXEC, PY, REPO, _run, run_mpi, run_script, write_class_folder
from improved_diffusion.image_datasets import (DataError, load_data, relabel,
                                               resumed_class_names)

TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
        "--noise_schedule", "cosine", "--class_cond", "True", "--batch_size", "2",
        "--save_interval", "1000", "--num_workers", "0"]
CLASSIFIER = ["--image_size", "8", "--classifier_width", "32", "--classifier_depth", "1",
              "--classifier_attention_resolutions", "4", "--diffusion_steps", "20",
              "--noise_schedule", "cosine", "--batch_size", "2", "--iterations", "3",
              "--num_workers", "0"]


def class_folders(d, classes, per_class=2):
    """One folder per class of 8x8 images (img0.png ...), returned."""
    rng = np.random.default_rng(0)
    for c in classes:
        (d / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                d / c / f"img{i}.png")
    return d


def on_disk(run):
    """{name: (size, mtime_ns)} of a log dir's files but its logs (a failed job appends its
    error there), recursively."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in run.rglob("*") if p.is_file() and p.name not in ("log.txt", "progress.csv")}


def errors(proc):
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]


def stored_names(path):
    return th.load(path, weights_only=True, map_location="cpu").get("class_names")


@pytest.mark.timeout(500)
def test_a_resume_without_a_class_is_refused_on_2_ranks_and_class_map_keep_trains_it_by_name(
        tmp_path):
    """Trained on apple/banana/cherry, resumed on apple/cherry: refused on 2 ranks, nothing
    moved; with --class_map keep (issue 43, item 22) every batch of every rank gives cherry's
    images label 2 (the checkpoint's), never the folder's own 1 (tests/label_record_train.py
    records each sample's folder and label), and the files keep the checkpoint's names."""
    data, run = class_folders(tmp_path / "data", ("apple", "banana", "cherry")), tmp_path / "run"
    run_script("train.py", *TINY, "--data_dir", data, "--log_dir", run, "--max_steps", 1)
    shutil.rmtree(data / "banana")
    before = on_disk(run)
    proc = run_mpi(2, "train.py", *TINY, "--data_dir", data, "--log_dir", run, "--max_steps", 2,
                   check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert errors(proc) == [
        f"error: --data_dir {data}: its classes differ from those {run}/model000001.pt was "
        "trained on (0=apple 1=banana 2=cherry): not in --data_dir: banana; labels changed: "
        "cherry 2->1; pass --class_map keep to keep the checkpoint's labels by name, or "
        "--class_map data to take the folder's (0=apple 1=cherry)"], proc.stdout[-3000:]
    assert on_disk(run) == before  # nothing moved, nothing written

    record = tmp_path / "labels.jsonl"
    out = _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "label_record_train.py", *TINY,
                "--data_dir", data, "--log_dir", run, "--max_steps", 4, "--class_map", "keep"],
               300, env={"RECORD_LABELS": str(record)}).stdout
    assert ("resume: --class_map keep: labels by name, as the checkpoint's: 0=apple 1=banana "
            "2=cherry; not in --data_dir, not trained: banana (not the folder's own labels: "
            "its later resumes take --class_map keep too)") in out, out[-3000:]
    for name in ("model000004.pt", "ema_0.9999_000004.pt"):
        assert stored_names(run / name) == ["apple", "banana", "cherry"], name
    rows = [json.loads(ln) for ln in record.read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in rows) == [
        (rank, step) for rank in (0, 1) for step in (2, 3, 4)], rows
    seen = {(c, y) for r in rows for c, y in zip(r["classes"], r["labels"])}
    assert seen == {("apple", 0), ("cherry", 2)}, seen


@pytest.mark.timeout(300)
def test_classifier_train_stores_its_class_names_and_refuses_a_resume_whose_classes_changed(
        tmp_path):
    data = write_class_folder(tmp_path / "data", per_class=2)  # cat, dog, owl
    run = tmp_path / "run"
    run_script("classifier_train.py", *CLASSIFIER, "--data_dir", data, "--log_dir", run,
               "--max_steps", 1)
    assert stored_names(run / "model000001.pt") == ["cat", "dog", "owl"]
    renamed = write_class_folder(tmp_path / "renamed", classes=("cat", "emu", "owl"),
                                 per_class=2)
    before = on_disk(run)
    proc = run_script("classifier_train.py", *CLASSIFIER, "--data_dir", renamed, "--log_dir",
                      run, "--max_steps", 2, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert errors(proc) == [
        f"error: --data_dir {renamed}: its classes differ from those {run}/model000001.pt was "
        "trained on (0=cat 1=dog 2=owl): not in --data_dir: dog; new: emu; pass --class_map "
        "keep to keep the checkpoint's labels by name, or --class_map data to take the "
        "folder's (0=cat 1=emu 2=owl)"], proc.stdout[-3000:]
    assert on_disk(run) == before
    fewer = write_class_folder(tmp_path / "fewer", classes=("cat", "owl"), per_class=2)
    out = run_script("classifier_train.py", *CLASSIFIER, "--data_dir", fewer, "--log_dir", run,
                     "--max_steps", 2, "--class_map", "keep").stdout
    assert ("resume: --class_map keep: labels by name, as the checkpoint's: 0=cat 1=dog 2=owl; "
            "not in --data_dir, not trained: dog (not the folder's own labels: its later "
            "resumes take --class_map keep too)") in out, out[-3000:]
    assert stored_names(run / "model000002.pt") == ["cat", "dog", "owl"]
    # a validation folder is labelled by the training folder's names: a class it lacks is refused
    val = write_class_folder(tmp_path / "val", classes=("cat", "yak"))
    proc = run_script("classifier_train.py", *CLASSIFIER, "--data_dir", data, "--val_data_dir",
                      val, "--log_dir", tmp_path / "run2", "--max_steps", 1, check=False)
    assert proc.returncode == 1 and errors(proc) == [
        f"error: --val_data_dir {val}: classes the training data (--data_dir {data}) lacks: "
        "yak; give a validation folder of the training classes"], proc.stdout[-3000:]


# ------------------------------------------------------------------------------ the rules


def test_each_difference_is_named_and_each_class_map_gives_its_label_order():
    saved = ["apple", "banana", "cherry"]
    where = dict(data_dir="D", source="F")
    assert resumed_class_names(saved, saved, **where) == (saved, "")
    assert resumed_class_names(None, ["a", "b"], **where) == (["a", "b"], "")  # older files
    cases = {  # folder's classes -> the differences named
        ("apple", "cherry"): "not in --data_dir: banana; labels changed: cherry 2->1",
        ("apple", "banana", "blueberry", "cherry"): "new: blueberry; labels changed: cherry 2->3",
        ("apple", "berry", "cherry"): "not in --data_dir: banana; new: berry",
    }
    for names, diffs in cases.items():
        with pytest.raises(DataError, match=f"trained on \\(0=apple 1=banana 2=cherry\\): "
                                            f"{diffs}; pass --class_map keep"):
            resumed_class_names(saved, list(names), **where)
    with pytest.raises(DataError, match="trained on \\(0=b 1=a\\): labels changed: a 1->0, "
                                        "b 0->1; pass"):  # reordered
        resumed_class_names(["b", "a"], ["a", "b"], **where)
    # keep: the checkpoint's labels by name, new classes after them (room needed)
    assert resumed_class_names(saved, ["apple", "blueberry", "cherry"], "keep", num_classes=4,
                               **where) == (saved + ["blueberry"], (
        "--class_map keep: labels by name, as the checkpoint's: 0=apple 1=banana 2=cherry "
        "3=blueberry; not in --data_dir, not trained: banana (not the folder's own labels: its "
        "later resumes take --class_map keep too)"))
    assert resumed_class_names(saved, saved + ["date"], "keep", num_classes=4, **where) == (
        saved + ["date"], "--class_map keep: labels by name, as the checkpoint's: 0=apple "
        "1=banana 2=cherry 3=date")  # the folder's own labels: a later resume needs no flag
    with pytest.raises(DataError, match="need 4 labels, but the model has --num_classes 3; "
                                        "pass --num_classes 4 --allow_model_change True"):
        resumed_class_names(saved, ["apple", "blueberry"], "keep", num_classes=3, **where)
    with pytest.raises(DataError, match="stores no class names to keep"):
        resumed_class_names(None, ["a"], "keep", **where)
    assert resumed_class_names(saved, ["apple", "cherry"], "data", **where)[0] == [
        "apple", "cherry"]


def test_relabel_gives_the_batches_the_labels_of_the_names(tmp_path):
    data = class_folders(tmp_path / "d", ("apple", "cherry"))
    loader = load_data(data_dir=str(data), batch_size=4, image_size=8, class_cond=True,
                       deterministic=True, rank=0, world_size=1)
    assert next(loader)[1]["y"].tolist() == [0, 0, 1, 1]
    relabel(loader, ["apple", "banana", "cherry"])
    assert loader.class_names == ["apple", "banana", "cherry"]
    assert next(loader)[1]["y"].tolist() == [0, 0, 2, 2]  # cherry keeps its label 2
