"""The sharded layout of a step (ckpt/sharded.py): DCP checkpoints under real `mpiexec -n 2/3`
with FSDP2 on gloo/CPU (tests/sharded_driver.py), resharded loads, the manifest's checks, kills,
a full disk, the doctor, consolidate.

One saved run (the module fixture ``saved``: steps 1 and 2 in DCP's process-based async save,
the driver training on while the writer processes write) is read by most tests: its loads
check the state of the save's start bitwise; the synchronous save is the kill -9 and full disk
tests' (and test_fsdp.py's, through train.py, bitwise). The doctor runs as scripts/ckpt.py once
per command that matters here (verify, consolidate), and in this process (its ``main``) where a
test only reads what it says.
"""
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from conftest import MPIEXEC, PY, REPO, _run, ckpt_in_process, run_script, run_script_here
from improved_diffusion.ckpt import run_dir, sharded

DRIVER = REPO / "tests" / "sharded_driver.py"


def driver(n, *args, check=True, timeout=240):
    return _run([MPIEXEC, "-n", str(n), PY, DRIVER, *args], timeout, check=check)



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 saved by 2 ranks in DCP's process-based async save (the driver trains on
    while the writer processes write: the step must hold the state of its start), and the
    references: ref{step}.pt (that state), full/."""
    root = tmp_path_factory.mktemp("sharded")
    (root / "log").mkdir()
    driver(2, "save", "--log_dir", root / "log", "--steps", "1,2", "--ref", root, "--mode",
           "process", timeout=400)
    return root


def copy_run(saved, tmp_path):
    shutil.copytree(saved / "log", tmp_path / "log")
    return tmp_path / "log"


def test_the_layout_on_disk(saved):
    names = sorted(os.listdir(saved / "log"))
    assert names == ["manifest000001.json", "manifest000002.json", "step000001.dcp",
                     "step000002.dcp"]
    st = run_dir.list_steps(saved / "log", verify_checksums=True)[0]
    assert (st.step, st.complete, st.verified, st.layout) == (2, True, True, "sharded")
    assert sorted(st.manifest["files"]) == ["step000002.dcp/.metadata",
                                            "step000002.dcp/__0_0.distcp",
                                            "step000002.dcp/__1_0.distcp"]
    assert st.manifest["holds"] == ["model000002.pt", "ema_0.9999_000002.pt",
                                    "ema_0.999_000002.pt", "opt000002.pt"]
    assert st.manifest["ranks"] == 2 and st.manifest["run_flags"] == {"lr": 0.01}
    shapes = sharded.state_dict_shapes(st.sharded_path, "model000002.pt")
    assert shapes["0.weight"] == torch.Size([12, 6]) and shapes["count"] == torch.Size([3])


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_saved_on_2_ranks_loads_on_n_bitwise(saved, n):  # make soak: 2 (test_fsdp.py's resumes)
    out = driver(n, "load", "--log_dir", saved / "log", "--step", "2", "--ref", saved)
    assert f"LOAD OK world {n}" in out.stdout


def test_plan_resume_chooses_the_newest_sharded_step(saved):
    plan = run_dir.plan_resume(saved / "log", "")
    assert (plan.step, plan.layout, plan.warnings) == (2, "sharded", [])
    assert plan.model == str(saved / "log" / "step000002.dcp")
    assert plan.files_of(2)["sharded"] == plan.model


def test_sample_py_on_a_step_of_two_emas_asks_which_in_one_line(saved, tmp_path, capsys):
    """sample.py given a sharded step that holds two EMAs: one line naming them and the path
    and the path of one, and of the model's weights; nothing read, nothing written."""
    step = saved / "log" / "step000002.dcp"
    for extra in ([], ["--weights", "ema"]):
        code, text = run_script_here("sample.py", "--model_path", step, *extra, "--log_dir",
                                     tmp_path / "s", capsys=capsys)
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1, text[-3000:]
        assert errors[0] == (f"error: --model_path {step}: holds 2 EMAs (ema_0.9999_000002.pt, "
                             f"ema_0.999_000002.pt); name the one to load, e.g. "
                             f"{step}/ema_0.9999_000002.pt, or the model's, "
                             f"{step}/model000002.pt"), errors
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("*.npz"))


def _flip(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_found_before_any_weight_is_loaded(saved, tmp_path):
    log = copy_run(saved, tmp_path)
    _flip(log / "step000002.dcp" / "__1_0.distcp")
    proc = run_script("ckpt.py", "verify", log, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "step        2  NOT resumable" in proc.stdout
    assert "__1_0.distcp does not match its crc32" in proc.stdout
    plan = run_dir.plan_resume(log, "")
    assert plan.step == 1 and plan.model.endswith("step000001.dcp")
    assert len(plan.warnings) == 1 and "skipping step 2" in plan.warnings[0]
    assert "__1_0.distcp" in plan.warnings[0]


def test_a_truncated_shard_or_an_extra_file_makes_the_step_incomplete(saved, tmp_path):
    log = copy_run(saved, tmp_path)
    shard = log / "step000002.dcp" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 10)
    rc, text = ckpt_in_process("verify", log)
    assert rc == 1 and "truncated" in text, text
    plan = run_dir.plan_resume(log, "")
    assert plan.step == 1 and len(plan.warnings) == 1
    (log / "step000001.dcp" / "__7_0.distcp").write_bytes(b"x")
    with pytest.raises(run_dir.NoUsableStepError):
        run_dir.plan_resume(log, "")


def test_kill_9_of_a_rank_mid_save_leaves_the_previous_step(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    proc = driver(2, "save", "--log_dir", log, "--steps", "1,2", "--die_rank", "1",
                  "--die_step", "2", check=False)
    assert proc.returncode != 0
    names = os.listdir(log)
    assert "manifest000002.json" not in names and "step000001.dcp" in names
    plan = run_dir.plan_resume(log, "")
    assert plan.step == 1 and plan.layout == "sharded"
    run_dir.tidy_for_resume(plan, 1)  # the temp folder removed
    assert sorted(os.listdir(log)) == ["manifest000001.json", "step000001.dcp"]
    assert run_dir.list_steps(log, verify_checksums=True)[0].complete


def test_an_interrupted_folder_is_quarantined_and_pruning_removes_folders(saved, tmp_path):
    log = copy_run(saved, tmp_path)
    (log / "manifest000002.json").unlink()  # killed between the rename and the manifest
    plan = run_dir.plan_resume(log, "")
    assert plan.step == 1 and "no manifest" in plan.warnings[0]
    moved, _ = run_dir.tidy_for_resume(plan, 1)
    assert moved == ["step000002.dcp"]
    assert (log / "incomplete" / "step000002" / "step000002.dcp" / ".metadata").exists()
    log2 = copy_run(saved, tmp_path / "b")
    rc, text = ckpt_in_process("prune", log2, "--keep", "1")
    assert rc == 0 and sorted(os.listdir(log2)) == ["manifest000002.json",
                                                   "step000002.dcp"], text


def test_inspect_and_consolidate(saved, tmp_path):
    rc, text = ckpt_in_process("inspect", saved / "log" / "step000002.dcp")
    assert rc == 0 and "layout sharded (DCP), written by 2 rank(s)" in text, text
    assert "holds opt000002.pt" in text
    out = tmp_path / "full"
    run_script("ckpt.py", "consolidate", saved / "log", "--step", "2", "--out", out)
    import sharded_driver
    for name in ["model000002.pt", "ema_0.9999_000002.pt", "ema_0.999_000002.pt",
                 "opt000002.pt"]:
        got = torch.load(out / name, weights_only=True)
        want = torch.load(saved / "full" / name, weights_only=True)
        assert sharded_driver.same(want, got, name) is None
    st = run_dir.list_steps(out, verify_checksums=True)[0]
    assert st.complete and st.layout == "full"
    assert st.manifest["run_flags"] == {"lr": 0.01}


def damage_structure_record(log):
    """Overwrite step 2's structure record (the saved nesting, read first by a load) in its
    shard file with bytes of the same length that are not a pickle; returns that file."""
    step_dir = log / "step000002.dcp"
    meta = sharded.read_metadata(step_dir)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == sharded.STRUCTURE_KEY)
    path = step_dir / info.relative_path
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * info.length)
    return path


def test_a_structure_record_unreadable_on_one_rank_fails_every_rank_with_one_line(saved,
                                                                                   tmp_path):
    """Rank 1 reads another copy of the step (another host's disk) whose structure record is
    damaged; rank 0's copy is whole. Both ranks end with rank 1's one line: none goes on into
    the load's collectives (where rank 0 met another error than rank 1's before the ranks
    agreed first), none is left waiting (the driver's timeout)."""
    bad = copy_run(saved, tmp_path / "bad")
    shard = damage_structure_record(bad)
    for ranks in ([], ["--rank_log_dir", "1", bad]):
        log = bad if not ranks else saved / "log"
        proc = driver(2, "load", "--log_dir", log, "--step", "2", "--ref", saved, *ranks,
                      check=False, timeout=120)
        # each rank's line (two ranks writing at once can share a line of the job's output)
        lines = sorted("LOAD FAILED" + part.split("\n")[0]
                       for part in proc.stdout.split("LOAD FAILED")[1:])
        assert proc.returncode == 3 and len(lines) == 2, proc.stdout[-3000:]
        assert all(f"{shard.parent}/{shard.name}: its structure record cannot be read" in ln
                   for ln in lines), lines
        assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1], lines


def test_a_full_disk_is_one_line_and_keeps_older_steps(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = driver(2, "save", "--log_dir", mnt, "--steps", "1,2", "--width", "96",
                      "--leave_free", "20000", check=False)
        lines = [ln for ln in proc.stdout.splitlines() if "SAVE FAILED" in ln]
        assert proc.returncode != 0 and lines, proc.stdout[-3000:]
        assert "no space left on device while saving step 2" in lines[0]
        assert "last complete step is intact" in lines[0]
        os.unlink(mnt / "filler")
        names = sorted(n for n in os.listdir(mnt))
        assert names == ["manifest000001.json", "step000001.dcp"], names
        assert run_dir.list_steps(mnt, verify_checksums=True)[0].complete
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
