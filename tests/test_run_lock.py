"""One job per log dir (issue 9, item 3): improved_diffusion/ckpt/run_lock.py and train.py
--lock_wait.

Contention is always between real processes: lock holders started with `python -c`, held locks
killed with SIGKILL, and real `train.py` jobs (one rank or `mpiexec -n 2`) on a log dir that a
running job holds. The remote flavour (a heartbeat lock object) runs on a local directory posing
as a blob store, through the same `BlobStore` calls that serve gs:// and az:// paths.
"""
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MPIEXEC, PY, REPO, child_env, hang_s, write_images

from improved_diffusion.ckpt.run_lock import BlobStore, LogDirLock, LogDirLockedError

TRAIN = REPO / "scripts" / "train.py"
TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--seed", "0",
]

# A lock holder: takes the lock of argv[1] ("local" or "remote" flavour, wait_s, heartbeat_s),
# prints HELD, holds it until the file argv[5] exists, releases it, prints RELEASED, and lives on
# for LINGER_S seconds (so that only release(), not its exit, can have freed the lock).
# FORK_CHILD=1: after taking the lock, fork a child that sleeps (a data loader worker, say), and
# print HELD once the child is running (a kill before that could find the child mid-fork, still
# holding its copy of the lock's descriptor for a moment: a race of the test, not of the lock).
HOLDER = r"""
import os, sys, time
from improved_diffusion.ckpt import run_lock
log_dir, flavour, wait_s, heartbeat_s, release_file = sys.argv[1:6]
store = run_lock.BlobStore() if flavour == "remote" else None
lock = run_lock.LogDirLock(log_dir, float(wait_s), float(heartbeat_s), store=store)
try:
    lock.acquire(log=lambda m: print("WAITING " + m, flush=True))
except run_lock.LogDirLockedError as e:
    print("ERROR " + str(e), flush=True)
    sys.exit(e.exit_code)
if os.environ.get("FORK_CHILD"):
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:  # its at-fork handlers (run_lock's: close the lock's copy) have run
        os.write(ready_w, b"1")
        time.sleep(120)
        os._exit(0)
    os.read(ready_r, 1)  # HELD only once the child is past them: a kill then finds it settled
print("HELD", os.getpid(), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(release_file) and time.monotonic() < deadline:
    time.sleep(0.02)
lock.release()
print("RELEASED", flush=True)
time.sleep(float(os.environ.get("LINGER_S", "0")))
"""


# ---------------------------------------------------------------------------------- helpers


class Procs:
    """Children started by a test, each writing stdout+stderr to its own file; all killed at the
    end (by process group: a forked grandchild goes too)."""

    def __init__(self, tmp_path):
        self.tmp_path, self.started = tmp_path, []

    def start(self, cmd, name, env=None):
        log_path = self.tmp_path / f"{name}.log"
        with open(log_path, "w") as f:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(env),
                                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def holder(self, log_dir, name, flavour="local", wait_s=0, heartbeat_s=30, env=None):
        release = self.tmp_path / f"{name}.release"
        proc = self.start([PY, "-c", HOLDER, log_dir, flavour, wait_s, heartbeat_s, release],
                          name, env)
        proc.release_file = release
        return proc

    def kill_all(self):
        for proc in self.started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def output(proc):
    return proc.log_path.read_text()


def wait_for(pred, proc, timeout=60, what="it"):
    """Poll pred() until true; fails (with proc's output) on timeout or if proc ended first."""
    end = time.monotonic() + hang_s(timeout)
    while time.monotonic() < end:
        if pred():
            return
        if proc.poll() is not None and not pred():
            pytest.fail(f"exit {proc.returncode} before {what}:\n{output(proc)[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{output(proc)[-3000:]}")


def wait_for_text(proc, pattern, timeout=60):
    wait_for(lambda: re.search(pattern, output(proc)), proc, timeout, repr(pattern))
    return re.search(pattern, output(proc))


def held_pid(proc, timeout=60):
    return int(wait_for_text(proc, r"HELD (\d+)", timeout).group(1))


def lock_record(log_dir):
    return json.loads((Path(log_dir) / "lock.json").read_text())


def snapshot(log_dir):
    """{relative path: (size, sha256)} of every file under log_dir, and every directory (None)."""
    out = {}
    for root, dirs, files in os.walk(log_dir):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), log_dir)] = None
        for name in files:
            p = Path(root) / name
            data = p.read_bytes()
            out[str(p.relative_to(log_dir))] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------- two processes, one lock


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flavour", ["local", "remote"])
def test_a_second_process_waits_for_a_held_lock_names_the_holder_and_takes_it_once_released(
        tmp_path, procs, flavour):
    log_dir = tmp_path / "run"
    first = procs.holder(log_dir, "first", flavour, heartbeat_s=0.5, env={"LINGER_S": "60"})
    first_pid = held_pid(first)
    second = procs.holder(log_dir, "second", flavour, wait_s=60, heartbeat_s=0.5)
    said = wait_for_text(second, r"WAITING log dir (.*) is in use by pid (\d+) on host (\S+),")
    assert said.group(1) == str(log_dir)
    assert (int(said.group(2)), said.group(3)) == (first_pid, socket.gethostname())
    time.sleep(1.5)  # three heartbeats: still held, still waiting
    assert "HELD" not in output(second), output(second)

    first.release_file.touch()
    wait_for_text(first, "RELEASED")
    second_pid = held_pid(second)  # while the first process lives on: release() freed it
    assert first.poll() is None
    assert output(second).count("WAITING") == 1, output(second)
    if flavour == "remote":
        assert lock_record(log_dir)["pid"] == second_pid
    else:
        assert json.loads((log_dir / ".lock").read_text())["pid"] == second_pid


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flavour", ["local", "remote"])
def test_a_second_process_with_a_short_wait_fails_with_one_line_naming_the_holder_and_log_dir(
        tmp_path, procs, flavour):
    log_dir = tmp_path / "run"
    # heartbeat 0.5 s: the remote lock stays fresh though held longer than its stale bound (2 s)
    first = procs.holder(log_dir, "first", flavour, heartbeat_s=0.5)
    first_pid = held_pid(first)
    before = snapshot(log_dir) if flavour == "local" else None
    second = procs.holder(log_dir, "second", flavour, wait_s=3, heartbeat_s=0.5)
    assert second.wait(timeout=hang_s(60)) == 1, output(second)
    errors = [line for line in output(second).splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, output(second)
    assert f"log dir {log_dir} is in use by pid {first_pid} on host {socket.gethostname()}" \
        in errors[0]
    assert "another --log_dir" in errors[0] and "stop it" in errors[0]
    assert first.poll() is None and "HELD" not in output(second)
    if flavour == "local":
        assert snapshot(log_dir) == before
    else:
        assert lock_record(log_dir)["pid"] == first_pid


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forked_child", [False, True], ids=["alone", "with-a-forked-child-alive"])
def test_a_holder_killed_with_kill_9_never_blocks_the_next_job(tmp_path, procs, forked_child):
    log_dir = tmp_path / "run"
    first = procs.holder(log_dir, "first", env={"FORK_CHILD": "1"} if forked_child else None)
    os.kill(held_pid(first), signal.SIGKILL)
    assert first.wait(timeout=hang_s(30)) == -signal.SIGKILL

    lock = LogDirLock(log_dir, wait_s=0)
    lock.acquire(log=pytest.fail)  # at once: no wait, nothing to say
    try:
        assert lock.held
        assert json.loads((log_dir / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.timeout(60)
def test_a_lock_file_removed_by_its_releasing_holder_as_the_next_job_opens_it_guards_nothing(
        tmp_path, monkeypatch):
    log_dir = tmp_path / "run"
    first = LogDirLock(log_dir, wait_s=0).acquire()
    real_flock = fcntl.flock

    def holder_lets_go_first(fd, op):  # between the next job's open() and its flock()
        if first.held:
            first.release()  # removes .lock, then drops the flock
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_lets_go_first)
    second = LogDirLock(log_dir, wait_s=30).acquire(log=lambda m: None)
    monkeypatch.undo()
    try:
        assert json.loads((log_dir / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(LogDirLockedError, match=f"is in use by pid {os.getpid()} "):
            LogDirLock(log_dir, wait_s=0).acquire()  # the lock on the file that is there holds
    finally:
        second.release()


# ---------------------------------------------------------------------- the remote flavour


@pytest.mark.timeout(60)
def test_a_remote_lock_refreshes_its_heartbeat_while_held_and_is_removed_on_release(tmp_path):
    log_dir = tmp_path / "run"
    lock = LogDirLock(log_dir, wait_s=0, heartbeat_s=0.2, store=BlobStore()).acquire()
    try:
        first = lock_record(log_dir)
        assert (first["pid"], first["host"]) == (os.getpid(), socket.gethostname())
        end = time.monotonic() + hang_s(1.0)  # beats every 0.2 s: five of them, unloaded
        while (later := lock_record(log_dir))["heartbeat"] <= first["heartbeat"]:
            assert time.monotonic() < end, "the lock's heartbeat was not refreshed"
            time.sleep(0.1)
        assert later["token"] == first["token"] and later["since"] == first["since"]
    finally:
        lock.release()
    assert not (log_dir / "lock.json").exists() and lock.lost is None


@pytest.mark.timeout(60)
def test_a_remote_lock_with_a_stale_heartbeat_is_taken_over_at_once(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    dead = {"host": "node-gone", "pid": 4242, "job_id": "77", "since": time.time() - 7200,
            "token": "0" * 32, "heartbeat": time.time() - 3600}
    (log_dir / "lock.json").write_text(json.dumps(dead))
    said = []
    lock = LogDirLock(log_dir, wait_s=0, heartbeat_s=30, store=BlobStore(), settle_s=0.1)
    lock.acquire(log=said.append)
    try:
        assert lock_record(log_dir)["pid"] == os.getpid()
        assert len(said) == 1 and "taking over the stale lock" in said[0], said
        assert "pid 4242 on host node-gone (job 77)" in said[0]
    finally:
        lock.release()


@pytest.mark.timeout(90)
def test_a_remote_lock_of_a_killed_holder_is_taken_over_once_stale_not_before(tmp_path, procs):
    log_dir = tmp_path / "run"
    first = procs.holder(log_dir, "first", "remote", heartbeat_s=0.25)
    os.kill(held_pid(first), signal.SIGKILL)
    first.wait(timeout=hang_s(30))
    assert (log_dir / "lock.json").exists()  # nobody removed it: the holder died

    waiter = LogDirLock(log_dir, wait_s=0, heartbeat_s=0.25, stale_s=30, store=BlobStore())
    with pytest.raises(LogDirLockedError, match=r"in use by pid \d+ on host .*last heartbeat"):
        waiter.acquire(log=lambda m: None)
    said = []
    waiter = LogDirLock(log_dir, wait_s=60, heartbeat_s=0.25, stale_s=2, store=BlobStore())
    waiter.acquire(log=said.append)
    try:
        assert lock_record(log_dir)["pid"] == os.getpid()
        assert "taking over the stale lock" in said[-1], said
    finally:
        waiter.release()


@pytest.mark.timeout(60)
def test_a_remote_holder_whose_lock_object_was_overwritten_knows_it_lost_the_lock(tmp_path):
    log_dir = tmp_path / "run"
    lock = LogDirLock(log_dir, wait_s=0, heartbeat_s=0.1, store=BlobStore()).acquire()
    try:
        other = dict(lock_record(log_dir), pid=999999, host="elsewhere", token="f" * 32,
                     heartbeat=time.time() + 3600)
        (log_dir / "lock.json").write_text(json.dumps(other))
        end = time.monotonic() + hang_s(30)
        while lock.lost is None and time.monotonic() < end:
            time.sleep(0.05)
        assert lock.lost and "pid 999999 on host elsewhere" in lock.lost
    finally:
        lock.release()
    assert lock_record(log_dir)["token"] == "f" * 32  # release leaves the new owner's lock


# -------------------------------------------------------------------------------- train.py


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), seed=0)


def train_cmd(images, log_dir, *extra, ranks=1):
    launcher = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    return [*launcher, PY, TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
            "--max_steps", 100000, "--save_interval", 5, *extra]


def stop_group(pgid, timeout=30):
    """SIGSTOP every process of the group ``pgid`` (a job started in its own session: the trainer
    and its checkpoint writer process), and wait until each is stopped."""
    os.killpg(pgid, signal.SIGSTOP)
    deadline = time.monotonic() + hang_s(timeout)
    while time.monotonic() < deadline:
        states = []
        for d in Path("/proc").iterdir():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:
                states.append(fields[0])
        if states and all(st in "Tt" for st in states):
            return
        time.sleep(0.05)
    raise AssertionError(f"the processes of group {pgid} did not all stop")


def saved(log_dir, step):
    return (Path(log_dir) / f"manifest{step:06d}.json").exists()


@pytest.mark.timeout(360)
def test_a_second_train_job_on_a_held_log_dir_exits_1_and_a_requeued_one_waits_then_resumes(
        tmp_path, procs, images):
    """One first job serves both: a second job with a short --lock_wait (2 ranks) exits 1
    naming the holder and touches nothing, the first job goes on; then a requeued job waits for
    it to finish (preempted) and resumes from its last step. (A second process of 1 rank:
    test_a_second_process_with_a_short_wait_fails_with_one_line_naming_the_holder_and_log_dir.)"""
    log_dir = tmp_path / "run"
    first = procs.start(train_cmd(images, log_dir), "first")
    wait_for(lambda: saved(log_dir, 5), first, 120, "the first job's step 5")
    stop_group(first.pid)  # it writes nothing while the second job runs (nor its writer process)
    try:
        before = snapshot(log_dir)
        holder = f"is in use by pid {first.pid} on host {socket.gethostname()}"
        # 2 ranks: the one line printed once, not once a rank
        second = procs.start(train_cmd(images, log_dir, "--lock_wait", 2, ranks=2), "second-2")
        assert second.wait(timeout=hang_s(120)) == 1, output(second)
        out = output(second)
        assert len(error_lines(out)) == 1, out  # the same on every rank: printed once
        for line in error_lines(out):
            assert f"error: log dir {log_dir} {holder}" in line, out
        assert out.count("waiting up to 2 s") == 1, out  # said once, by rank 0
        assert "Traceback" not in out, out
        assert snapshot(log_dir) == before, "the second job (2 ranks) touched the dir"
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    wait_for(lambda: saved(log_dir, 10), first, 120, "the first job's step 10")  # it goes on

    requeued = procs.start(train_cmd(images, log_dir, "--lock_wait", 120), "requeued")
    wait_for_text(requeued, rf"log dir {re.escape(str(log_dir))} is in use by pid {first.pid} ",
                  120)
    assert "training on" not in output(requeued)  # it waits before anything else
    os.kill(first.pid, signal.SIGTERM)  # preempted: it saves its current step, then exits 75
    assert first.wait(timeout=hang_s(60)) == 75, output(first)
    last = int(re.search(r"preempted .*saved step (\d+)", output(first)).group(1))
    resumed = wait_for_text(requeued, r"(?i)resum\w*[^\n]*?\bstep\s+(\d+)", 120)
    assert int(resumed.group(1)) == last, output(requeued)[-3000:]
    nxt = (last // 5 + 1) * 5
    wait_for(lambda: saved(log_dir, nxt), requeued, 120, f"the requeued job's step {nxt}")
    os.kill(requeued.pid, signal.SIGTERM)
    assert requeued.wait(timeout=hang_s(60)) == 75, output(requeued)
    assert not (log_dir / "incomplete").exists()  # nothing of the first job was set aside
    for out in (output(first), output(requeued)):
        assert not error_lines(out) and "Traceback" not in out, out


@pytest.mark.timeout(120)
def test_train_main_releases_the_lock_when_its_job_ends_well_or_badly(tmp_path, images, capsys):
    import runpy

    main = runpy.run_path(str(TRAIN), run_name="train_module")["main"]
    log_dir = tmp_path / "run"
    flags = [*TINY, "--log_dir", log_dir, "--max_steps", "1", "--lock_wait", "0"]
    assert main([str(a) for a in [*flags, "--data_dir", images]]) == 0
    # a job that fails after taking the lock (no images there) releases it too
    assert main([str(a) for a in [*flags, "--data_dir", tmp_path / "none"]]) == 1
    err = capsys.readouterr().err
    assert "--data_dir" in err and "in use" not in err, err
    with LogDirLock(log_dir, wait_s=0) as lock:  # free at once, in this very process
        assert lock.held
