"""A save that meets a full disk, a read-only or a vanished log dir (issue 9, item 9).

The faults are real: a small tmpfs shrunk under a running 2-rank job, a read-only bind mount laid
over its log dir, the log dir removed with shutil.rmtree. Each job is frozen (SIGSTOP to its process
group) right after it saved step N, the fault is injected, and the job continues into its save of
step 2N. Every rank must exit 1 with the same one line naming the log dir and the cause; on disk
step N must stay complete (our own manifest + checksum reading) with nothing of step 2N and no temp
file; after the repair (the full disk, in make test), auto-resume continues from N. Unit tests check the errno -> message mapping
in-process (also for remote-like paths) and that other errors keep their type.
"""
import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (MPIEXEC, PY, REPO, child_env, hang_s, process_tree, resumed_step, signal_all,
                      write_images)

from cluster_sim import matches_manifest
from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion.ckpt import file_writer as W
from improved_diffusion.ckpt import run_dir as R
from improved_diffusion.infra import storage

TRAIN = REPO / "scripts" / "train.py"
TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--seed", "0",
]
N = 3  # the save interval: step N fits, step 2N meets the fault
STEP_FILE_RE = re.compile(r"^(?:model|opt|manifest)(\d{6,})\.(?:pt|json)$|^ema_.+_(\d{6,})\.pt$")
TEMP_RE = re.compile(r"\.tmp")


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), seed=14)


def _sh(*cmd):
    return subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=hang_s(30))


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory):
    """Skip (with the reason) where tmpfs mounts are not permitted (not root, no CAP_SYS_ADMIN)."""
    probe = tmp_path_factory.mktemp("mount_probe")
    res = _sh("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {res.stdout.strip()}")
    _sh("umount", probe)


@pytest.fixture
def mounts():
    """mounts(*mount args, target) mounts; everything mounted is unmounted at the end, newest first."""
    done = []

    def mount(*args):
        res = _sh("mount", *args)
        assert res.returncode == 0, f"mount {' '.join(map(str, args))}: {res.stdout}"
        done.append(str(args[-1]))

    mount.unmount = lambda target: (_sh("umount", target), done.remove(str(target)))
    yield mount
    for target in reversed(done):
        if _sh("umount", target).returncode != 0:
            _sh("umount", "-l", target)


def step_of(name):
    m = STEP_FILE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def names_in(d):
    try:
        return sorted(os.listdir(d))
    except FileNotFoundError:
        return []


def step_problem(log_dir, step):
    """None when `step` is complete by our own reading: the manifest lists model, EMA and opt
    files, each present with the listed size and checksum, each loading with weights_only."""
    try:
        files = json.loads((Path(log_dir) / f"manifest{step:06d}.json").read_text())["files"]
    except FileNotFoundError:
        return "no manifest"
    want = {f"model{step:06d}.pt", f"opt{step:06d}.pt", f"ema_0.9999_{step:06d}.pt"}
    if set(files) != want:
        return f"manifest lists {sorted(files)}"
    for name, info in files.items():
        data = (Path(log_dir) / name).read_bytes()
        if not matches_manifest(data, info):
            return f"{name} differs from its manifest"
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if obj.get("step") != step:
            return f"{name} holds step {obj.get('step')}"
    return None


def train_cmd(images, log_dir, max_steps, extra=()):
    return [MPIEXEC, "-n", "2", PY, TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
            "--save_interval", N, "--max_steps", max_steps, *extra]


def resume(images, log_dir, max_steps):
    """Auto-resume on one rank (cheaper to start; a resume works on any world size)."""
    cmd = train_cmd(images, log_dir, max_steps)[3:]  # without "mpiexec -n 2"
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO,
                          env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=hang_s(180), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@contextlib.contextmanager
def frozen(proc):
    """The whole job (launcher, proxies, ranks) stopped while the body runs."""
    pids = process_tree(proc.pid)
    assert len(pids) >= 3, f"expected mpiexec and its 2 ranks, found {pids}"
    signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_all(pids, signal.SIGCONT)


def run_into_fault(tmp_path, images, log_dir, inject, extra=()):
    """Start a 2-rank job (``extra``: more flags), freeze it once step N is saved, inject(), let
    it run into its save of step 2N. Returns the job's output (it must have exited by itself)."""
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log_f:
        proc = subprocess.Popen([str(c) for c in train_cmd(images, log_dir, 3 * N, extra)],
                                cwd=REPO,
                                env=child_env(), stdout=log_f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + hang_s(120)
        while not (Path(log_dir) / f"manifest{N:06d}.json").exists() or any(
                TEMP_RE.search(n) for n in names_in(log_dir)):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < end, "step N was never saved:\n" + log_path.read_text()
            time.sleep(0.01)
        with frozen(proc):
            begun = [n for n in names_in(log_dir) if step_of(n.split(".tmp")[0]) == 2 * N]
            assert not begun, f"the save of step {2 * N} had begun before the fault: {begun}"
            inject()
        proc.wait(timeout=hang_s(120))
    finally:
        if proc.poll() is None:
            signal_all(process_tree(proc.pid), signal.SIGKILL)
            proc.wait()
    return proc.returncode, log_path.read_text()


def assert_one_line_on_every_rank(rc, out, log_dir, phrase):
    """Exit 1 on every rank and one error line for the job (each rank raised the same error; a
    line that several ranks would print alike is printed once)."""
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 1, f"exit {rc}:\n{out[-4000:]}"
    assert len(errors) == 1, out[-4000:]
    assert phrase in errors[0] and str(log_dir) in errors[0] and f"step {2 * N}" in errors[0], (
        errors[0])
    assert "Traceback" not in out and "aborting" not in out, out[-4000:]


def assert_step_n_kept_and_nothing_of_2n(log_dir):
    names = names_in(log_dir)
    assert step_problem(log_dir, N) is None, (step_problem(log_dir, N), names)
    assert not [n for n in names if TEMP_RE.search(n)], names
    assert not [n for n in names if step_of(n) == 2 * N], names


# --------------------------------------------------------------------- real faults, 2 ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fsdp", [
    False,
    # --fsdp True --async_save False: the save streams, one file gathered and written at a
    # time; the disk fits the model and EMA files and half the opt file, so the write fails
    # mid-stream and every rank must leave the gathers together (make soak)
    pytest.param(True, marks=pytest.mark.slow)])
def test_a_disk_that_fills_up_before_a_save_ends_every_rank_with_one_line_and_step_n_resumes(
        tmp_path, images, can_mount, mounts, fsdp):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=64m", "tmpfs", disk)
    log_dir = disk / "run"

    def fill_up():  # shrink the file system to what it holds now plus half a checkpoint file
        st = os.statvfs(disk)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        sizes = {n.split("0")[0]: (log_dir / n).stat().st_size for n in names_in(log_dir)
                 if n.endswith(".pt")}
        room = (sizes["model"] + sizes["ema_"] + sizes["opt"] // 2 if fsdp
                else min(sizes.values()) // 2)
        res = _sh("mount", "-o", f"remount,size={(used + room) // 1024}k", disk)
        assert res.returncode == 0, res.stdout

    rc, out = run_into_fault(tmp_path, images, log_dir, fill_up,
                             ["--fsdp", "True", "--async_save", "False"] if fsdp else ())
    assert_one_line_on_every_rank(rc, out, log_dir, "no space left on device")
    assert_step_n_kept_and_nothing_of_2n(log_dir)

    assert _sh("mount", "-o", "remount,size=64m", disk).returncode == 0  # make room
    out = resume(images, log_dir, 2 * N)
    assert resumed_step(out) == N, out[-3000:]
    assert step_problem(log_dir, 2 * N) is None


@pytest.mark.timeout(300)
def test_a_log_dir_turned_read_only_before_a_save_ends_every_rank_with_one_line(
        tmp_path, images, can_mount, mounts):
    # `mount -o remount,ro` of the tmpfs itself fails (EBUSY) while the job holds log.txt and
    # progress.csv open for writing; a read-only bind mount laid over the log dir is what the
    # job's next open() meets instead: the same files, on a read-only mount.
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=64m", "tmpfs", disk)
    log_dir = disk / "run"

    def read_only():
        mounts("--bind", log_dir, log_dir)
        mounts("-o", "remount,bind,ro", log_dir)
        with pytest.raises(OSError, match="Read-only"):
            (log_dir / "probe").write_text("x")

    rc, out = run_into_fault(tmp_path, images, log_dir, read_only)
    assert_one_line_on_every_rank(rc, out, log_dir, "read-only file system")
    mounts.unmount(log_dir)  # writable again
    assert_step_n_kept_and_nothing_of_2n(log_dir)  # (the resume from it: the full disk's test)


@pytest.mark.timeout(300)
def test_a_log_dir_removed_while_the_job_runs_ends_every_rank_with_one_line_and_is_not_recreated(
        tmp_path, images):
    log_dir = tmp_path / "run"
    rc, out = run_into_fault(tmp_path, images, log_dir, lambda: shutil.rmtree(log_dir))
    assert_one_line_on_every_rank(rc, out, log_dir, "the log dir no longer exists")
    error = next(ln for ln in out.splitlines() if ln.startswith("error:"))
    assert "nothing of it is intact" in error and "step is intact" not in error, error
    assert not log_dir.exists(), names_in(log_dir)  # an empty log dir would hide the loss


# ------------------------------------------------------------------------- in-process mapping


def _files(step):
    sd = {"w": torch.arange(4.0)}
    return {C.model_filename(step): C.model_payload(step, sd, {}),
            C.ema_filename("0.9999", step): C.ema_payload(step, "0.9999", sd, {}),
            C.opt_filename(step): C.opt_payload(step, {"state": {}, "param_groups": []}, {})}


FAULTS = [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded"),
          (errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")]


@pytest.mark.parametrize("code,phrase", FAULTS, ids=[errno.errorcode[c] for c, _ in FAULTS])
def test_a_remote_write_failing_with_an_os_error_is_one_line_naming_the_log_dir(
        monkeypatch, code, phrase):
    class FailingUpload:  # storage.open_write's stream, failing as a store's write can
        def __init__(self, path, exclusive=False):
            pass

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def discard(self):
            pass

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(storage, "exists", lambda path: False)
    monkeypatch.setattr(storage, "open_write", FailingUpload)
    monkeypatch.setattr(storage, "remove", gone)
    with pytest.raises(C.CheckpointError, match=re.escape(phrase)) as info:
        R.save_step("gs://bucket/run", 7, _files(7))
    msg = str(info.value)
    assert msg.startswith("gs://bucket/run: ") and "step 7" in msg and "\n" not in msg, msg
    assert "free there" not in msg  # no statvfs for a remote path


def test_a_local_write_failing_with_enospc_at_fsync_leaves_no_file_of_the_step(
        tmp_path, monkeypatch):
    R.save_step(tmp_path, 1, _files(1))
    real_fsync = os.fsync

    def fsync(fd):  # the second file of step 2 (the EMA; the model is in place) meets a full disk
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("ema_0.9999_000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(C.os, "fsync", fsync)
    with pytest.raises(C.CheckpointError, match=r"no space left on device while saving step 2 "
                                                r"\(ema_0\.9999_000002\.pt\) \(only .* free"):
        R.save_step(tmp_path, 2, _files(2))
    assert [n for n in names_in(tmp_path) if "000002" in n or ".tmp" in n] == []
    assert R.latest_complete_step(tmp_path, warn=None).step == 1


def test_atomic_write_names_the_directory_of_a_full_disk(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.os, "fsync", full)
    with pytest.raises(C.CheckpointError, match=f"^{re.escape(str(tmp_path))}: no space left"):
        W.atomic_write(tmp_path / "model000001.pt", {"x": 1})
    assert names_in(tmp_path) == []


@pytest.mark.parametrize("free,mapped", [(4096, True), (10 << 30, False)],
                         ids=["disk-nearly-full", "disk-has-room"])
def test_torchs_wrapped_write_failure_counts_as_a_full_disk_only_when_statvfs_says_so(
        tmp_path, monkeypatch, free, mapped):
    def save(obj, f, *args):
        f.write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    class Stat:
        f_bavail, f_frsize = free // 4096, 4096

    monkeypatch.setattr(W.torch_zip, "save", save)  # what writes a .pt file's bytes
    monkeypatch.setattr(C.os, "statvfs", lambda d: Stat)
    want = (C.CheckpointError, "no space left on device") if mapped else (
        RuntimeError, "unexpected pos")
    with pytest.raises(want[0], match=want[1]):
        R.save_step(tmp_path, 3, _files(3))
    assert names_in(tmp_path) == []


def test_a_bug_during_a_save_keeps_its_type_and_leaves_no_file_of_the_step(tmp_path, monkeypatch):
    real_save = W.torch_zip.save

    def save(obj, f, *args):
        if obj.get("kind") == "opt":
            raise TypeError("a bug in a payload")
        return real_save(obj, f, *args)

    monkeypatch.setattr(W.torch_zip, "save", save)
    with pytest.raises(TypeError, match="a bug in a payload"):
        R.save_step(tmp_path, 4, _files(4))
    assert names_in(tmp_path) == []


def test_save_step_into_a_log_dir_that_vanished_says_so_and_does_not_recreate_it(tmp_path):
    gone = tmp_path / "run"
    with pytest.raises(C.CheckpointError, match=f"^{re.escape(str(gone))}: the log dir no longer "
                                                f"exists .* not recreated"):
        R.save_step(gone, 5, _files(5))
    assert not gone.exists()


def test_a_real_write_into_a_full_tmpfs_names_the_disk_full(tmp_path, can_mount, mounts):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=256k", "tmpfs", disk)
    big = {"w": torch.zeros(200_000)}  # 800 kB
    with pytest.raises(C.CheckpointError, match="no space left on device"):
        W.atomic_write(disk / "model000001.pt", big)
    assert names_in(disk) == []


# ---------------------------------------------------------------- a log dir that cannot be written


def _a_run(log_dir):
    """A log dir as a run leaves it (its bytes only matter: nothing may change them)."""
    log_dir.mkdir(parents=True)
    for name in ("model000002.pt", "ema_0.9999_000002.pt", "opt000002.pt", "manifest000002.json",
                 "log.txt", "progress.csv"):
        (log_dir / name).write_bytes(f"{name} of the run".encode())
    return log_dir


def _tree(d):
    """{path: bytes} of everything under ``d`` (None when it does not exist)."""
    d = Path(d)
    return {str(p): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} \
        if d.exists() else None


READ_ONLY_MOUNT = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,existing", [
    # make soak: read-only mount of an existing run (its reason: the new log dir's; the advice
    # for an existing run: no-permission-existing-run's)
    pytest.param("read-only mount", True, marks=pytest.mark.slow), ("read-only mount", False),
    ("no permission", True), ("under a file", False),
], ids=["read-only-mount-existing-run", "read-only-mount-new-log-dir",
        "no-permission-existing-run", "path-under-a-file"])
def test_a_log_dir_that_cannot_be_written_is_one_line_naming_it_and_nothing_is_touched(
        tmp_path, images, how, existing):
    if os.geteuid() != 0:
        pytest.skip("needs root: a private mount namespace, or dropping root's capabilities")
    parent = tmp_path / "runs"
    parent.mkdir()
    log_dir = _a_run(parent / "run") if existing else parent / "new"
    wrap = []
    if how == "read-only mount":
        mounted = log_dir if existing else parent
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT,
                "sh", mounted]
    elif how == "no permission":
        # The log dir belongs to another uid. The job runs as root without the capabilities
        # that bypass permissions, so it is checked as any other uid would be (a true non-root
        # uid cannot run this venv's interpreter, which lives under /root).
        os.chown(log_dir, 65534, 65534)
        wrap = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    else:
        (parent / "notes.txt").write_text("a file")
        log_dir = parent / "notes.txt" / "run"
    before = _tree(parent)
    cmd = [*wrap, *train_cmd(images, log_dir, 2)]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=hang_s(90), stdin=subprocess.DEVNULL)
    out = proc.stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{out[-4000:]}"
    assert len(errors) == 1 and f"log dir {log_dir} cannot be written (" in errors[0], out[-4000:]
    reason = {"read-only mount": "read-only file system", "no permission": "permission denied",
              "under a file": "under the file"}[how]
    assert reason in errors[0], errors[0]
    if existing:
        assert f"--resume_checkpoint {log_dir} --log_dir NEW" in errors[0], errors[0]
    assert "Traceback" not in out and "training on" not in out, out[-4000:]
    assert _tree(parent) == before


def test_the_disk_full_line_gives_the_free_space_when_the_write_failed(tmp_path, can_mount,
                                                                       mounts):
    """Issue 29, item 13: a step's first file fits (120 kB), its second (800 kB) fills the
    256 kB disk: the line reports the few KiB free when the write failed, not the space freed
    once the partial files were removed (before: "only 250 KiB free" for a write that failed for
    want of space)."""
    import re

    from improved_diffusion.ckpt import run_dir

    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=256k", "tmpfs", disk)
    files = {"model000001.pt": {"w": torch.zeros(30_000)}, "opt000001.pt": {"w": torch.zeros(200_000)}}
    with pytest.raises(C.CheckpointError) as e:
        run_dir.write_step(str(disk), 1, files)
    msg = str(e.value)
    m = re.search(r"only ([\d.]+) (bytes|KiB) free there when it failed", msg)
    assert m and "opt000001.pt" in msg, msg
    assert float(m.group(1)) * (1024 if m.group(2) == "KiB" else 1) < 64 * 1024, msg
    assert names_in(disk) == []
