"""run_dir.py: cheap discovery, verification of the candidate only, the resume plan, honest reads.

Faults here are real bytes on disk (garbled manifests, flipped bytes, symlink loops) or a read
that raises the errno a failing disk or store raises (EIO), injected where the bytes are read.
"""
import errno
import hashlib
import os
import runpy
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch as th
from PIL import Image

from conftest import MPIEXEC, REPO, child_env, hang_s, run_script
from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion.ckpt import file_writer as W
from improved_diffusion.ckpt import run_dir as R
from improved_diffusion.infra import storage


def _sd(seed=0):
    g = th.Generator().manual_seed(seed)
    return OrderedDict([("a.weight", th.randn(64, 64, generator=g))])


def _save_steps(d, steps, rates=("0.9999",)):
    os.makedirs(d, exist_ok=True)
    for s in steps:
        files = {C.model_filename(s): C.model_payload(s, _sd(s), {}),
                 C.opt_filename(s): C.opt_payload(s, {"format": "named-v1", "state": {},
                                                      "param_groups": []}, {"step": s})}
        for r in rates:
            files[C.ema_filename(r, s)] = C.ema_payload(s, r, _sd(s + 100), {})
        R.save_step(d, s, files)


def _snapshot(d):
    """{relative path: sha256} of every file under d (what a failed start must leave alone)."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_symlink():
            out[str(p.relative_to(d))] = "symlink -> " + os.readlink(p)
    return out


def _images(d, n=4):
    d.mkdir()
    for i in range(n):
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(d / f"{i}.png")
    return d


def _flip_a_byte(path):
    data = bytearray(Path(path).read_bytes())
    data[-200] ^= 0xFF
    Path(path).write_bytes(bytes(data))


@pytest.fixture
def hashed(monkeypatch):
    """The paths whose checksums were read (file_digest calls)."""
    seen = []
    real = W.file_digest

    def counting(path, *algorithm):
        seen.append(os.path.basename(path))
        return real(path, *algorithm)

    monkeypatch.setattr(W, "file_digest", counting)
    return seen


# ------------------------------------------------------------------------------ start-up cost


def test_auto_resume_reads_the_checksums_of_the_chosen_step_only(tmp_path, hashed):
    _save_steps(tmp_path, range(1, 31))
    hashed.clear()  # (the writer hashes what it writes)
    plan = R.plan_resume(tmp_path, "")
    assert (plan.source, plan.step) == ("auto", 30)
    assert sorted(hashed) == sorted(["model000030.pt", "ema_0.9999_000030.pt", "opt000030.pt"])


def test_the_prune_after_a_save_reads_no_step_its_process_wrote_and_keeps_a_good_step_only(
        tmp_path, hashed):
    """Prune keeps the newest resumable steps, checked as a resume checks them (issue 43, item
    9), at no read of a step this process wrote (its checksums were computed as it was
    written); a step changed since is read, and a flipped byte makes it no kept step."""
    _save_steps(tmp_path, [1, 2, 3])
    hashed.clear()
    deleted = R.prune(tmp_path, 2)
    assert sorted(os.path.basename(p) for p in deleted) == [
        "ema_0.9999_000001.pt", "manifest000001.json", "model000001.pt", "opt000001.pt"]
    assert hashed == []
    _flip_a_byte(tmp_path / "model000003.pt")
    R.prune(tmp_path, 1)
    assert "model000003.pt" in hashed and "model000002.pt" not in hashed
    assert [s.step for s in R.list_steps(tmp_path)] == [3, 2]  # the damaged one stays too
    assert R.plan_resume(tmp_path, "").step == 2


def test_a_damaged_newest_step_is_skipped_one_step_at_a_time(tmp_path, hashed):
    _save_steps(tmp_path, [1, 2, 3, 4])
    _flip_a_byte(tmp_path / "model000004.pt")  # same size: only the checksum can tell
    hashed.clear()
    plan = R.plan_resume(tmp_path, "")
    assert plan.step == 3 and len(plan.warnings) == 1
    assert "step 4" in plan.warnings[0] and "crc32" in plan.warnings[0]
    assert not any("00000" + s in n for n in hashed for s in "12")  # older steps never read
    assert plan.newer_than(3) == [4]


def test_damage_in_an_old_step_costs_nothing_at_start_up(tmp_path, hashed):
    _save_steps(tmp_path, [1, 2])
    _flip_a_byte(tmp_path / "opt000001.pt")
    hashed.clear()
    assert R.plan_resume(tmp_path, "").step == 2
    assert "opt000001.pt" not in hashed


# ------------------------------------------------------------------- never fresh over history


def test_a_log_dir_whose_steps_all_fail_to_verify_refuses_to_start_and_changes_nothing(tmp_path):
    _save_steps(tmp_path, [5, 10])
    for s in (5, 10):
        (tmp_path / f"manifest{s:06d}.json").write_text("{not json")
    before = _snapshot(tmp_path)
    with pytest.raises(R.NoUsableStepError, match=r"holds 2 saved step\(s\) but none can be "
                                                   r"resumed \(step 10: manifest .*garbled"):
        R.plan_resume(tmp_path, "")
    assert _snapshot(tmp_path) == before


def test_only_interrupted_saves_in_a_new_log_dir_start_fresh_and_are_set_aside(tmp_path):
    _save_steps(tmp_path, [2])
    os.unlink(tmp_path / "manifest000002.json")  # the very first save was killed
    plan = R.plan_resume(tmp_path, "")
    assert plan.model is None and "only interrupted saves" in plan.message
    moved, _ = R.tidy_for_resume(plan, 0)
    assert sorted(moved) == ["ema_0.9999_000002.pt", "model000002.pt", "opt000002.pt"]
    assert R.list_steps(tmp_path) == []


def test_train_py_refuses_a_log_dir_whose_manifests_are_all_garbled(tmp_path, capsys):
    train_main = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")["main"]
    _save_steps(tmp_path / "run", [5])
    (tmp_path / "run" / "manifest000005.json").write_text("garbage")
    before = _snapshot(tmp_path / "run")
    code = train_main(["--data_dir", str(_images(tmp_path / "images")), "--log_dir", str(tmp_path / "run"),
                       "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
                       "--attention_resolutions", "", "--max_steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "none can be resumed" in err[0], err
    assert "ckpt.py verify" in err[0] and "--resume_checkpoint" in err[0]
    after = _snapshot(tmp_path / "run")
    assert {k: after[k] for k in before} == before and not [k for k in after if "step" in k]


# ---------------------------------------------------------------------- reads that fail


def _failing_reads(monkeypatch, name, exc):
    """Make every open of a file called ``name`` raise ``exc`` (as a failing disk or NFS does)."""
    real = storage.open

    def open_file(path, *args, **kwargs):
        if os.path.basename(str(path)) == name:
            raise exc
        return real(path, *args, **kwargs)

    monkeypatch.setattr(storage, "open", open_file)


def test_a_manifest_read_error_is_an_error_not_a_skipped_step(tmp_path, monkeypatch):
    _save_steps(tmp_path, [1, 2])
    _failing_reads(monkeypatch, "manifest000002.json", OSError(errno.EIO, "Input/output error"))
    before = _snapshot(tmp_path)
    with pytest.raises(C.CheckpointReadError, match="manifest000002.json"):
        R.plan_resume(tmp_path, "")
    assert _snapshot(tmp_path) == before


def test_a_stat_that_fails_with_an_io_error_is_not_a_missing_file(tmp_path):
    _save_steps(tmp_path, [1])
    os.unlink(tmp_path / "opt000001.pt")
    os.symlink("opt000001.pt", tmp_path / "opt000001.pt")  # ELOOP on every stat and read
    with pytest.raises(C.CheckpointReadError, match="opt000001.pt: cannot read"):
        R.list_steps(tmp_path)


def test_a_checksum_read_error_stops_the_plan_instead_of_skipping_the_step(tmp_path,
                                                                           monkeypatch):
    _save_steps(tmp_path, [1, 2])

    def broken_digest(path, *algorithm):
        raise C.CheckpointReadError(f"{path}: cannot read (OSError: [Errno 5] I/O error)")

    monkeypatch.setattr(W, "file_digest", broken_digest)
    with pytest.raises(C.CheckpointReadError, match="Errno 5"):
        R.plan_resume(tmp_path, "")


def test_remote_reads_are_retried_a_bounded_number_of_times(monkeypatch):
    pauses, calls = [], []
    monkeypatch.setattr(C.time, "sleep", pauses.append)

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EIO, "transient")
        return b"ok"

    assert C.with_retry(flaky, "gs://bucket/run/opt000001.pt", retry_on=(OSError,)) == b"ok"
    assert len(calls) == 3 and pauses == [0.5, 1.0]

    calls.clear()
    with pytest.raises(OSError, match="transient"):
        C.with_retry(lambda: flaky() if False else (_ for _ in ()).throw(OSError("transient")),
                     "gs://b/x", retry_on=(OSError,))
    with pytest.raises(FileNotFoundError):  # never retried: it will not appear by waiting
        C.with_retry(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), "gs://b/x",
                     retry_on=(OSError,))
    local = []
    with pytest.raises(OSError):
        C.with_retry(lambda: local.append(1) or (_ for _ in ()).throw(OSError("eio")), "/x",
                     retry_on=(OSError,))
    assert local == [1]  # a local path is tried once


# --------------------------------------------------------------------------- explicit sources


def test_a_run_directory_as_resume_checkpoint_resumes_its_newest_complete_step(tmp_path):
    _save_steps(tmp_path / "old", [3, 6])
    plan = R.plan_resume(tmp_path / "new", tmp_path / "old")
    assert (plan.source, plan.step, plan.in_log_dir) == ("auto", 6, False)
    assert plan.model == str(tmp_path / "old" / "model000006.pt")
    assert plan.files_of(6)["opt"] == str(tmp_path / "old" / "opt000006.pt")


def test_an_empty_directory_as_resume_checkpoint_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(C.CheckpointError, match="no checkpoint files in this directory"):
        R.plan_resume(tmp_path / "run", tmp_path / "empty")


def test_an_explicit_file_plans_its_neighbours_from_one_listing(tmp_path, monkeypatch):
    _save_steps(tmp_path, [4, 8], rates=("0.9999", "0.99"))
    listed = []
    real = R.listdir
    monkeypatch.setattr(R, "listdir", lambda d: listed.append(str(d)) or real(d))
    plan = R.plan_resume(tmp_path, tmp_path / "model000004.pt")
    assert listed == [str(tmp_path)] and plan.in_log_dir and plan.source == "explicit"
    assert plan.files_of(4)["ema"] == {"0.99": str(tmp_path / "ema_0.99_000004.pt"),
                                        "0.9999": str(tmp_path / "ema_0.9999_000004.pt")}
    with pytest.raises(C.CheckpointError, match="already holds a complete checkpoint at step 8"):
        R.refuse_overwrite(plan, 4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_opt_file_that_cannot_be_read_stops_the_resume_instead_of_a_fresh_optimizer(
        tmp_path, ranks):
    """The optimizer slot falls back only on content; an I/O error must not cost exact resume,
    and nothing is moved because of it (not even a newer interrupted save). The fault is a real
    OSError(EIO) from every read of opt000002.pt on every rank once the resume plan has verified
    the step (tests/fault_train.py): it hits the optimizer's load, not the plan's checksums."""
    run = tmp_path / "run"
    flags = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
             "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule",
             "cosine", "--batch_size", "2"]
    images = _images(tmp_path / "images")
    run_script("train.py", *flags, "--data_dir", images, "--log_dir", run, "--max_steps", "2",
               timeout=120)
    shutil.copy(run / "model000002.pt", run / "model000003.pt")  # an interrupted save of step 3
    before = _snapshot(run)
    launcher = [] if ranks == 1 else [MPIEXEC, "-n", str(ranks)]
    proc = subprocess.run(
        [*launcher, sys.executable, REPO / "tests" / "fault_train.py", *flags,
         "--data_dir", str(images), "--log_dir", str(run), "--max_steps", "4"],
        cwd=REPO, env=child_env({"FAULT_EIO_READ": "opt000002.pt"}), capture_output=True,
        text=True, timeout=hang_s(180))
    out = proc.stdout + proc.stderr
    assert "auto-resume: newest complete step in" in out, out  # the plan chose step 2 ...
    assert "fault_train: EIO reading opt000002.pt" in out, out  # ... then its load failed
    assert proc.returncode == 1, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out
    assert "opt000002.pt: cannot read" in errors[0] and "Errno 5" in errors[0], out
    assert "fresh optimizer" not in out and "Traceback" not in out, out
    after = _snapshot(run)
    assert {k: v for k, v in after.items() if k not in ("log.txt", "progress.csv")} == \
        {k: v for k, v in before.items() if k not in ("log.txt", "progress.csv")}


def test_a_run_directory_from_elsewhere_never_sets_aside_newer_complete_steps_of_log_dir(
        tmp_path, capsys):
    train_main = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")["main"]
    images = _images(tmp_path / "images")
    flags = ["--data_dir", str(images), "--image_size", "8", "--num_channels", "32",
             "--num_res_blocks", "1", "--attention_resolutions", "", "--diffusion_steps", "20",
             "--noise_schedule", "cosine", "--batch_size", "2", "--save_interval", "2"]
    assert train_main([*flags, "--log_dir", str(tmp_path / "a"), "--max_steps", "4"]) == 0
    assert train_main([*flags, "--log_dir", str(tmp_path / "b"), "--max_steps", "2"]) == 0
    before = _snapshot(tmp_path / "a")
    capsys.readouterr()
    code = train_main([*flags, "--log_dir", str(tmp_path / "a"), "--max_steps", "6",
                       "--resume_checkpoint", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 1 and "already holds a complete checkpoint at step 4" in err, err
    after = _snapshot(tmp_path / "a")
    assert {k: v for k, v in after.items() if "step" not in k and k.endswith((".pt", ".json"))} \
        == {k: v for k, v in before.items() if k.endswith((".pt", ".json"))}
    assert not (tmp_path / "a" / "incomplete").exists()


def test_prune_deletes_set_aside_interrupted_saves_once_older_than_the_kept_steps(tmp_path):
    _save_steps(tmp_path, [2])
    os.unlink(tmp_path / "manifest000002.json")  # killed mid-save: set aside at the next start
    R.tidy_for_resume(R.plan_resume(tmp_path, ""), 0)
    assert (tmp_path / "incomplete" / "step000002" / "model000002.pt").exists()
    _save_steps(tmp_path, [1, 3, 4])
    R.prune(tmp_path, keep=2)  # keeps 3 and 4: the set-aside step 2 is older
    assert not (tmp_path / "incomplete" / "step000002").exists()
    assert [s.step for s in R.list_steps(tmp_path)] == [4, 3]
    _save_steps(tmp_path / "b", [5])
    os.unlink(tmp_path / "b" / "manifest000005.json")
    _save_steps(tmp_path / "b", [4])
    R.tidy_for_resume(R.plan_resume(tmp_path / "b", ""), 4)  # step 5 set aside, newer than 4
    R.prune(tmp_path / "b", keep=1)
    assert (tmp_path / "b" / "incomplete" / "step000005" / "model000005.pt").exists()


def test_a_live_source_run_says_its_newest_step_is_being_saved_and_a_pruned_file_gone(tmp_path):
    """Issue 29, item 13: resuming from another run that a live job holds: its step without a
    manifest is most likely the save that job is writing (before: "interrupted"), and a file the
    job pruned between the plan and the load says the source is live and changing (before: "no
    such file; check the path")."""
    from improved_diffusion.ckpt import run_lock
    from improved_diffusion.ckpt.checkpointer import Resume

    src = tmp_path / "live"
    _save_steps(src, [2, 4])
    os.unlink(src / "manifest000004.json")  # step 4: being written by the live job
    holder = run_lock.LogDirLock(src, 0).acquire(log=lambda s: None)
    try:
        plan = R.plan_resume(tmp_path / "new", str(src))
        assert plan.step == 2 and plan.source_live and f"pid {os.getpid()}" in plan.source_live
        assert any("most likely the save the job that holds the run" in w
                   for w in plan.warnings), plan.warnings
        assert not any("interrupted" in w for w in plan.warnings), plan.warnings
        os.unlink(src / "model000002.pt")  # the live job pruned it after the plan
        with pytest.raises(C.CheckpointReadError, match=r"model000002.pt: gone since the resume "
                                                        r"chose it: .* is a live run"):
            Resume(ckpt=None, plan=plan)._load(plan.model)
    finally:
        holder.release()
    assert run_lock.live_holder(src) is None  # released: not live


def test_the_settings_of_a_step_whose_manifest_records_none_come_from_its_trainer_state(
        tmp_path):
    """Issue 43, item 11: a manifest without ``run_flags`` (an older release's): the settings
    are those the trainer state of the step's opt file records (that release's ``flags``: every
    setting, --max_steps included; --batch_size, --seed and --ema_rate from their entries)."""
    trainer = {"step": 5, "batch_size": 4, "seed": 3, "ema_rates": ["0.99", "0.999"],
               "flags": {"lr": 2e-3, "max_steps": 6}}
    opt = {"format": "named-v1", "state": {}, "param_groups": []}
    R.save_step(tmp_path, 5, {C.model_filename(5): C.model_payload(5, _sd(5), {}),
                              C.opt_filename(5): C.opt_payload(5, opt, trainer)})
    got = R.step_settings(tmp_path / "model000005.pt")
    assert got == {"lr": 2e-3, "max_steps": 6, "batch_size": 4, "seed": 3,
                   "ema_rate": "0.99,0.999"} and got.source == "trainer"
    R.save_step(tmp_path, 6, {C.model_filename(6): C.model_payload(6, _sd(6), {}),
                              C.opt_filename(6): C.opt_payload(6, opt, trainer)},
                settings={"lr": 1e-3})
    got = R.step_settings(tmp_path / "model000006.pt")
    assert got == {"lr": 1e-3} and got.source == "manifest"
