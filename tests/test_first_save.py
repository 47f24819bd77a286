"""A run's first save as cheap as its later ones (issue 56 item 10): the writer process, its arena
and the arena's pages, and the copy's plan are readied while the first steps train
(improved_diffusion/ckpt/first_save.py), without changing what the run trains or writes.

Through scripts/train.py (tests/first_save_train.py records what the first save found): the
writer process the first save hands its step to is the one started at the Checkpointer's
construction (the same pid: not started, nor started again, by the save), the arena already
holds the step, its pages are resident in the trainer, and the first save's copy
neither grows the arena nor faults its pages in; the step's files are byte for byte those of the
same run saving synchronously. Nothing here is timed.
"""
import json
import subprocess

import pytest

from conftest import PY, REPO, child_env, hang_s, write_images

FIRST_SAVE_TRAIN = REPO / "tests" / "first_save_train.py"
FLAGS = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
         "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
         "--batch_size", "2", "--seed", "0", "--log_interval", "100", "--ema_rate", "0.9999",
         "--save_interval", "3", "--max_steps", "3", "--save_writer", "process"]
PAGE = 4096


def train(tmp_path, name, *extra, record=None):
    images = tmp_path / "images"
    if not images.exists():
        write_images(images, seed=5)
    log_dir = tmp_path / name
    env = child_env({"FIRST_SAVE_RECORD": str(record)} if record else {})
    done = subprocess.run([str(c) for c in (PY, FIRST_SAVE_TRAIN, *FLAGS, "--data_dir", images,
                                           "--log_dir", log_dir, *extra)],
                          cwd=REPO, env=env, timeout=hang_s(240), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
    return log_dir, done.stdout


@pytest.mark.timeout(600)
def test_the_first_save_finds_its_arena_laid_out_and_resident_and_copies_without_page_faults(
        tmp_path):
    record = tmp_path / "first_save.json"
    log_dir, out = train(tmp_path, "async", record=record)
    seen = json.loads(record.read_text())
    # the writer process started at the Checkpointer's construction, the one the first save uses
    assert seen["pid_at_construction"] is not None, seen
    assert seen["pid_at_first_pack"] == seen["pid_at_construction"], seen
    pages = seen["copied"] // PAGE
    assert pages > 1000, seen  # a step large enough for its page faults to show
    # before the first save began: a buffer for every storage of the step, in pages resident here
    assert seen["laid_out"] >= seen["copied"], seen
    assert seen["arena_size"] >= seen["copied"] and seen["mapped"] == seen["arena_size"], seen
    assert seen["rss"] >= 0.99 * seen["arena_size"], seen
    # the first save's copy: no new arena, no page faults of its own (one a page without)
    assert seen["grows"] == 0, seen
    assert seen["minor_faults"] < pages / 10, seen
    assert "saved step 3" in out and "not readied" not in out, out[-3000:]
    # what the run trained and wrote: the synchronous save's bytes
    sync_dir, _ = train(tmp_path, "sync", "--async_save", "False")
    for name in ("model000003.pt", "ema_0.9999_000003.pt", "opt000003.pt"):
        assert (log_dir / name).read_bytes() == (sync_dir / name).read_bytes(), name
