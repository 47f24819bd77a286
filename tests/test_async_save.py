"""Asynchronous checkpointing and the cheaper collective load (issue 11, checkpoint half).

A save copies the state to host memory and a background thread writes it: the files must be the
bytes a synchronous save writes, even though training changed the weights while they were written;
a write that fails (a real full tmpfs) must stop every rank at a later step with one line, leaving
the previous step complete and nothing of the failed one; a kill -9 while the thread writes leaves
the previous step to resume from. The collective load reads a local file on every rank with the
CRC checks shared between ranks: a flipped byte in any record is still an error on every rank.
"""
import io
import json
import os
import re
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import (MPIEXEC, PY, REPO, child_env, hang_s, resumed_step, run_module_mpi,
                      write_images)
from test_disk_faults import can_mount, mounts, step_problem  # noqa: F401 (fixtures)

from improved_diffusion import logger, train_util
from improved_diffusion.ckpt import async_save
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

TRAIN = REPO / "scripts" / "train.py"
SLOW_SAVE_TRAIN = REPO / "tests" / "slow_save_train.py"
TINY_FLAGS = dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="",
                  diffusion_steps=20, noise_schedule="cosine")
TINY = [a for k, v in TINY_FLAGS.items() for a in (f"--{k}", str(v))] + [
    "--batch_size", "2", "--seed", "0"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), seed=11)


def tiny_loop(log_dir, async_save, ema_rate="0.9999,0.99", **kw):
    """A TrainLoop of the tiny model in this process, on fixed random batches."""
    flags = model_and_diffusion_defaults()
    flags.update(TINY_FLAGS)
    train_util.seed_rngs(0)
    model, diffusion = create_model_and_diffusion(**flags)
    gen = torch.Generator().manual_seed(1)
    batches = iter(lambda: (torch.randn(2, 3, 8, 8, generator=gen), {}), None)
    return train_util.TrainLoop(
        model=model, diffusion=diffusion, data=batches, batch_size=2, microbatch=-1, lr=1e-3,
        ema_rate=ema_rate, log_interval=100, save_interval=2, resume_checkpoint="",
        log_dir=str(log_dir), model_flags=flags, async_save=async_save, **kw)


def step_names(d, step):
    return sorted(n for n in os.listdir(d) if f"{step:06d}." in n)


# ------------------------------------------------------------------------------ in process


def test_save_in_flight_is_true_while_the_background_write_runs_and_false_once_it_ended(
        tmp_path, monkeypatch):
    from improved_diffusion.ckpt import torch_zip

    logger.configure(dir=str(tmp_path), format_strs=["log"])
    real_save = torch_zip.save

    def slow_save(*args):  # every file of the step written 0.3 s late
        time.sleep(0.3)
        return real_save(*args)

    monkeypatch.setattr(torch_zip, "save", slow_save)
    loop = tiny_loop(tmp_path, async_save=True, max_steps=1, save_writer="thread")
    try:
        assert not loop.checkpointer.save_in_flight
        loop.step = 1
        loop.save()
        assert loop.checkpointer.save_in_flight and not (tmp_path / "manifest000001.json").exists()
        end = time.monotonic() + hang_s(30)
        while loop.checkpointer.save_in_flight:  # false once the write ended, not yet collected
            assert time.monotonic() < end, "save_in_flight stayed true after the write"
            time.sleep(0.01)
        assert (tmp_path / "manifest000001.json").exists()
        loop.checkpointer.wait_for_save()
        assert not loop.checkpointer.save_in_flight
        assert (tmp_path / "manifest000001.json").exists()
    finally:
        loop.close()


def test_an_async_save_writes_the_bytes_a_synchronous_save_writes(tmp_path):
    """Step 2 is written while step 3 trains (the final save, 3, is waited for): the
    files equal a synchronous run's byte for byte, so nothing of a later step leaked in."""
    logger.configure(dir=str(tmp_path), format_strs=["log"])
    for mode in (True, False):
        d = tmp_path / f"async_{mode}"
        d.mkdir()
        loop = tiny_loop(d, async_save=mode, max_steps=3)
        assert loop.run_loop() == 0
        assert not loop.checkpointer._writer.busy
    a, s = tmp_path / "async_True", tmp_path / "async_False"
    assert sorted(os.listdir(a)) == sorted(os.listdir(s))
    for step in (2, 3):
        names = step_names(a, step)
        assert len(names) == 5, names  # model, 2 EMAs, opt, manifest
        for name in names:
            if name.startswith("manifest"):
                ma, ms = (json.loads((d / name).read_text()) for d in (a, s))
                assert ma["files"] == ms["files"]  # sizes and sha256 (computed while writing)
            else:
                assert (a / name).read_bytes() == (s / name).read_bytes(), name
    log = (tmp_path / "log.txt").read_text()
    assert re.search(r"saved step 2 to .*async_True in [\d.]+ s \(training paused [\d.]+ s\)",
                     log), log
    assert re.search(r"saved step 2 to .*async_False in [\d.]+ s\n", log), log


def test_a_host_snapshot_keeps_sharing_reuses_its_buffers_and_is_independent_of_training():
    w = torch.arange(12.0)
    payload = {"a": w, "again": w, "view": w[2:5], "t": (w, [1, "x"]), "other": torch.ones(3)}
    snap = async_save.HostSnapshot()
    first = snap.copy(payload)
    assert first["again"] is first["a"]  # the same tensor stays one object (pickle memo)
    assert first["view"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()
    assert first["view"].storage_offset() == 2 and first["t"][1] == [1, "x"]
    ptr = first["a"].untyped_storage().data_ptr()
    assert ptr != w.untyped_storage().data_ptr()
    w.add_(100)  # training goes on
    assert torch.equal(first["a"], torch.arange(12.0))
    second = snap.copy(payload)
    assert second["a"].untyped_storage().data_ptr() == ptr  # the buffer was reused
    assert torch.equal(second["view"], w[2:5]) and snap.nbytes == 12 * 4 + 3 * 4
    same = async_save.to_host(payload)["a"].untyped_storage().data_ptr()
    assert same == w.untyped_storage().data_ptr()  # a synchronous save copies no CPU tensor


def test_a_failed_background_write_is_raised_at_a_later_step_and_every_save_waits(tmp_path):
    """The writer's error reaches the loop through the per-step flags, not only at a save."""
    logger.configure(dir=str(tmp_path), format_strs=["log"])
    loop = tiny_loop(tmp_path, async_save=True, max_steps=8)
    boom = RuntimeError("disk on fire")

    def failing(*args):
        raise boom

    loop.checkpointer._write_in_background = failing
    with pytest.raises(RuntimeError, match="disk on fire"):
        loop.run_loop()
    assert loop.step in (2, 3)  # at the start of step 3 or 4: before the next save (4)
    assert os.listdir(tmp_path) == ["log.txt"]


# ------------------------------------------------------------------------------ real faults


def step_bytes(tmp_path):
    """The bytes of one step of the tiny model (model, EMA, opt, manifest) on 2 ranks."""
    d = tmp_path / "measure"
    d.mkdir()
    logger.configure(dir=str(d), format_strs=["log"])
    loop = tiny_loop(d, async_save=False, ema_rate="0.9999")
    loop.run_step(*next(loop.data))  # Adam moments exist
    loop.save()
    return sum((d / n).stat().st_size for n in step_names(d, 1))


@pytest.mark.timeout(300)
def test_a_disk_full_under_a_background_write_stops_every_rank_with_one_line_and_keeps_step_2(
        tmp_path, images, can_mount, mounts):  # noqa: F811
    """A tmpfs with room for 1.5 steps: step 2 fits, step 4's background write meets ENOSPC.
    Both ranks exit 1 with one line naming the disk and step 4; step 2 stays complete (own
    reading: manifest, sizes, sha256, weights_only loads), nothing of step 4 or later and no temp
    file is left; after making room, a resume starts from step 2."""
    room = int(step_bytes(tmp_path) * 1.5) + (256 << 10)
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", f"size={room // 1024}k", "tmpfs", disk)
    log_dir = disk / "run"
    cmd = [MPIEXEC, "-n", "2", PY, TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
           "--save_interval", "2", "--max_steps", "8", "--log_interval", "100"]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=child_env(), timeout=hang_s(240),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1, out[-4000:]
    assert len(errors) == 1 and "no space left on device" in errors[0], out[-4000:]
    assert "step 4" in errors[0] and str(log_dir) in errors[0], errors[0]
    assert "Traceback" not in out and "aborting" not in out, out[-4000:]
    assert "saved step 2 to" in out and "training paused" in out, out[-4000:]
    names = sorted(os.listdir(log_dir))
    assert step_problem(log_dir, 2) is None, (step_problem(log_dir, 2), names)
    assert not [n for n in names if ".tmp" in n], names
    assert not [n for n in names if re.search(r"00000[4-8]\.", n)], names

    assert subprocess.run(["mount", "-o", "remount,size=64m", str(disk)]).returncode == 0
    res = subprocess.run([str(c) for c in cmd[3:] + ["--max_steps", "4"]], cwd=REPO,
                         env=child_env(), timeout=hang_s(180), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    assert res.returncode == 0, res.stdout[-4000:]
    assert resumed_step(res.stdout) == 2, res.stdout[-3000:]
    assert step_problem(log_dir, 4) is None


@pytest.mark.slow  # test_resume's kill -9 test covers kills inside (background) saves by default
@pytest.mark.timeout(200)
def test_a_kill_9_while_the_writer_thread_writes_resumes_from_the_previous_step(
        tmp_path, images):
    """Slow writes (tests/slow_save_train.py) keep step 4's background write open long enough to
    kill the process inside it: step 4 has files but no manifest; the resume takes step 2 and
    moves step 4's leftovers aside."""
    log_dir = tmp_path / "run"
    cmd = [PY, SLOW_SAVE_TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
           "--save_interval", "2", "--log_interval", "100", "--ema_rate", "0.9999"]
    proc = subprocess.Popen([str(c) for c in cmd + ["--max_steps", "50"]], cwd=REPO,
                            env=child_env({"SLOW_SAVE_S": "0.5"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + hang_s(150)
        while not any(n.startswith(("model000004", "ema_0.9999_000004"))
                      for n in (os.listdir(log_dir) if log_dir.exists() else ())):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < end, "step 4's save never began"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=hang_s(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names = sorted(os.listdir(log_dir))
    assert "manifest000004.json" not in names and step_problem(log_dir, 2) is None, names
    res = subprocess.run([str(c) for c in cmd + ["--max_steps", "3"]], cwd=REPO,
                         env=child_env({"SLOW_SAVE_S": "0"}), timeout=hang_s(120),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert res.returncode == 0, res.stdout[-4000:]
    assert resumed_step(res.stdout) == 2, res.stdout[-3000:]
    assert step_problem(log_dir, 3) is None
    assert not [n for n in os.listdir(log_dir) if "000004" in n]


# ------------------------------------------------------------------------------ loading


def test_two_ranks_share_the_crc_checks_and_a_flipped_byte_in_any_record_fails_on_both(
        tmp_path):
    """Each rank reads the file itself and checks every other record: a damaged record with an
    even index (rank 0's share) and one with an odd index (rank 1's) both fail on both ranks with
    the same line; an intact file gives both ranks the same tensors."""
    buf = io.BytesIO()
    torch.save({"a": torch.arange(300.0), "b": torch.arange(500.0) * 2}, buf)
    good = buf.getvalue()
    (tmp_path / "good.pt").write_bytes(good)
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        infos = z.infolist()
    for k in (0, 1):  # a tensor record checked by rank k
        info = next(i for i in infos if i.filename.endswith(("data/0", "data/1"))
                    and infos.index(i) % 2 == k)
        h = info.header_offset
        start = h + 30 + int.from_bytes(good[h + 26:h + 28], "little") + \
            int.from_bytes(good[h + 28:h + 30], "little")
        bad = bytearray(good)
        bad[start + 5] ^= 0x10
        (tmp_path / f"bad{k}.pt").write_bytes(bytes(bad))
    code = f"""
import json, sys, torch
from improved_diffusion import dist_util
from improved_diffusion.ckpt import checkpoint as C
dist_util.setup_dist()
r = dist_util.get_rank()
out = {{}}
ck = C.load_file_collective({str(tmp_path / "good.pt")!r})
out["sum"] = float(ck.raw["a"].sum() + ck.raw["b"].sum())
for k in (0, 1):
    try:
        C.load_file_collective({str(tmp_path)!r} + f"/bad{{k}}.pt")
    except C.CheckpointError as e:
        out[f"bad{{k}}"] = str(e)
sys.stdout.write(f"RESULT {{r}} {{json.dumps(out)}}\\n")  # one write: the ranks share stdout
sys.stdout.flush()
dist_util.cleanup()
"""
    proc = run_module_mpi(2, code, timeout=120)
    res = {int(m.group(1)): json.loads(m.group(2))
           for m in re.finditer(r"^RESULT (\d) (.*)$", proc.stdout, re.M)}
    assert sorted(res) == [0, 1], proc.stdout[-3000:]
    want = float(torch.arange(300.0).sum() + (torch.arange(500.0) * 2).sum())
    for r in (0, 1):
        assert res[r]["sum"] == want
        for k in (0, 1):
            assert "CRC mismatch" in res[r][f"bad{k}"] and f"bad{k}.pt" in res[r][f"bad{k}"]
            assert res[r][f"bad{k}"] == res[0][f"bad{k}"]
