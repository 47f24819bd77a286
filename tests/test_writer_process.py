"""The writer process (issue 31): the background write out of the training process.

A writer that is killed mid-write ends the job with one line naming the step, never a hang, and
the resume takes the previous step; a SIGTERM to every process of the job while the writer
writes lets the write finish and the job exit 75 with its last step complete; the writer does
not outlive a trainer that was kill -9'd, keeps the log dir's lock held while it lives and puts
nothing in place after the trainer died (issue 37), nor after its job let the lock go; a log dir
removed mid-write is said to be gone with all its steps; loader workers (--num_workers 2) neither
inherit its connection nor break it; nothing is left in /dev/shm. Slow writes of step 4
(tests/slow_save_train.py, whose patch of torch.save also runs in the writer process) keep a
write open long enough.
"""
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from conftest import PY, REPO, child_env, hang_s, resumed_step, run_script_here, write_images
from test_disk_faults import step_problem

from improved_diffusion.ckpt import run_lock, writer_process

SLOW_SAVE_TRAIN = REPO / "tests" / "slow_save_train.py"
TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
        "--batch_size", "2", "--seed", "0", "--log_interval", "100", "--ema_rate", "0.9999",
        "--save_interval", "2", "--save_writer", "process"]  # the process, whatever the size
BOUND_S = hang_s(120)  # how long a test waits for something that should happen (a hang fails)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), seed=12)


def shm_names():
    """/dev/shm's entries, less MPICH's (other mpiexec jobs on the machine make and remove them)."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("mpich_shm")}


@pytest.fixture
def shm_unchanged():
    """Nothing new left in /dev/shm by the test. Another test's job (make test runs two at a
    time) may hold an entry for a moment: a new one must be gone within a few seconds."""
    before = shm_names()
    yield
    end = time.monotonic() + hang_s(10)
    while not shm_names() <= before and time.monotonic() < end:
        time.sleep(0.1)
    assert shm_names() <= before, sorted(shm_names() - before)


def writer_pids(parent):
    """Pids of the writer processes whose parent is ``parent``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"improved_diffusion.ckpt.writer_process" in cmdline:
            found.append(int(name))
    return found


def state(pid):
    """The process's state letter (R, S, D, T, Z, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid):
    return state(pid) not in (None, "Z", "X")


def start_slow(log_dir, images, max_steps, *extra, session=False):
    cmd = [PY, SLOW_SAVE_TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
           "--max_steps", str(max_steps), *extra]
    # step 4's writes only: step 2 (the step a test needs complete before) is saved at once
    env = child_env({"SLOW_SAVE_S": "0.5", "SLOW_SAVE_STEP": "4"})
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=session)


def wait_for_write_of(proc, log_dir, step):
    """Until the first file of ``step`` appears (its background write began); the writer's pid."""
    end = time.monotonic() + BOUND_S
    while not any(f"{step:06d}" in n and not n.startswith("manifest")
                  for n in (os.listdir(log_dir) if log_dir.exists() else ())):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < end, f"step {step}'s save never began"
        time.sleep(0.01)
    pids = writer_pids(proc.pid)
    assert len(pids) == 1, pids
    return pids[0]


def finish(proc):
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


def resume(log_dir, images, max_steps):
    cmd = [PY, SLOW_SAVE_TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir,
           "--max_steps", str(max_steps)]
    return subprocess.run([str(c) for c in cmd], cwd=REPO, env=child_env({"SLOW_SAVE_S": "0"}),
                          timeout=BOUND_S, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


@pytest.mark.timeout(400)
def test_a_writer_killed_mid_write_ends_the_job_with_one_line_and_the_resume_takes_step_2(
        tmp_path, images, shm_unchanged):
    log_dir = tmp_path / "run"
    proc = start_slow(log_dir, images, 50)
    writer = wait_for_write_of(proc, log_dir, 4)
    os.kill(writer, signal.SIGKILL)
    out = finish(proc)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1, out[-4000:]
    assert len(errors) == 1, out[-4000:]
    assert "writer process" in errors[0] and "step 4" in errors[0], errors[0]
    assert "killed by signal 9" in errors[0] and "no manifest" in errors[0], errors[0]
    assert "Traceback" not in out, out[-4000:]
    names = sorted(os.listdir(log_dir))
    assert "manifest000004.json" not in names and step_problem(log_dir, 2) is None, names
    res = resume(log_dir, images, 3)
    assert res.returncode == 0, res.stdout[-4000:]
    assert resumed_step(res.stdout) == 2, res.stdout[-3000:]
    assert step_problem(log_dir, 3) is None


@pytest.mark.timeout(400)
def test_sigterm_to_every_process_while_the_writer_writes_exits_75_once_complete_on_disk(
        tmp_path, images, shm_unchanged):
    """As a cluster does: SIGTERM to the job's whole process group (trainer, writer, two loader
    workers) while step 4 is written. The writer ignores it and finishes step 4; the trainer
    saves the step it stops at and exits 75 only once that step is complete on disk."""
    log_dir = tmp_path / "run"
    proc = start_slow(log_dir, images, 50, "--num_workers", "2", session=True)
    writer = wait_for_write_of(proc, log_dir, 4)
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 75, out[-4000:]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    saved = [int(s) for s in __import__("re").findall(r"preempted .*: saved step (\d+)", out)]
    assert len(saved) == 1 and saved[0] >= 4, out[-4000:]
    assert step_problem(log_dir, 4) is None
    assert step_problem(log_dir, saved[0]) is None
    assert not [n for n in os.listdir(log_dir) if ".tmp" in n]
    end = time.monotonic() + BOUND_S
    while alive(writer):  # it ends with the job (the trainer closed its connection)
        assert time.monotonic() < end, "the writer process outlived the job"
        time.sleep(0.05)


@pytest.mark.timeout(400)
def test_a_trainer_kill_9d_mid_write_leaves_no_writer_and_puts_nothing_in_place_after_it(
        tmp_path, images, shm_unchanged):
    """kill -9 of the trainer while its writer writes step 4, the writer frozen (SIGSTOP) across
    the kill: a writer that does not get the CPU (or the GIL) in time to see its trainer go. The
    log dir's lock is never free while the writer lives (no other job can take the log dir under
    it), the writer ends (the kernel's kill, or its own checks once it runs again), and nothing
    is put in place in the log dir after the trainer died."""
    log_dir = tmp_path / "run"
    proc = start_slow(log_dir, images, 50)
    writer = wait_for_write_of(proc, log_dir, 4)
    os.kill(writer, signal.SIGSTOP)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=BOUND_S)  # the trainer is dead and reaped (the writer shares its stdout)
        at_death = set(os.listdir(log_dir))
        lock_free = run_lock.live_holder(log_dir) is None
        # still stopped now, so stopped (holding all its descriptors) when the lock was looked at
        frozen = state(writer) in ("T", "t")
        assert not (lock_free and frozen), "the log dir's lock is free while its writer lives"
    finally:
        if alive(writer):
            os.kill(writer, signal.SIGCONT)
        finish(proc)
    end = time.monotonic() + BOUND_S
    while alive(writer):
        assert time.monotonic() < end, "the writer process outlived its trainer"
        time.sleep(0.05)
    late = sorted(n for n in set(os.listdir(log_dir)) - at_death if ".tmp" not in n)
    assert not late, f"put in place after the trainer died: {late}"
    assert "manifest000004.json" not in at_death
    assert run_lock.live_holder(log_dir) is None  # the writer's copy of the lock went with it


@pytest.mark.timeout(400)
def test_a_log_dir_removed_mid_write_says_nothing_of_it_is_intact_and_is_not_recreated(
        tmp_path, images):
    """The log dir removed (for real: rm -r) while the writer writes step 4: one line saying
    that the log dir is gone and nothing of it is intact (not "the last complete step is
    intact": step 2 went with it), exit 1, and the log dir is not recreated."""
    log_dir = tmp_path / "run"
    proc = start_slow(log_dir, images, 50)
    wait_for_write_of(proc, log_dir, 4)
    end = time.monotonic() + BOUND_S
    while log_dir.exists():  # the writer may add a temp file while rmtree empties the directory
        shutil.rmtree(log_dir, ignore_errors=True)
        assert time.monotonic() < end, "the log dir could not be removed"
    out = finish(proc)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, out[-4000:]
    assert "the log dir no longer exists" in errors[0] and "step 4" in errors[0], errors[0]
    assert "nothing of it is intact" in errors[0] and "step is intact" not in errors[0], errors[0]
    assert "Traceback" not in out, out[-4000:]
    assert not log_dir.exists()  # an empty log dir would hide the loss


def test_a_writer_whose_job_no_longer_holds_the_log_dirs_lock_puts_nothing_in_place(tmp_path):
    """The writer holds a copy of the job's lock and checks, before each file is put in place,
    that the log dir's lock file is still the one its job locked: after the job let the lock go
    and another job took it, the next write puts no file of its step in place, and the
    trainer's error says why in one line."""
    from improved_diffusion.ckpt.checkpoint import CheckpointError

    log_dir = tmp_path / "run"
    lock = run_lock.LogDirLock(log_dir, wait_s=0).acquire()
    w = writer_process.WriterProcess()
    other = None
    try:
        files = {f"model{s:06d}.pt": {"w": torch.arange(6.0)} for s in (1, 2)}
        w.write(log_dir, 1, w.pack({"model000001.pt": files["model000001.pt"]}))
        assert (log_dir / "manifest000001.json").exists()
        lock.release()
        other = run_lock.LogDirLock(log_dir, wait_s=0).acquire()  # the next job's lock
        with pytest.raises(CheckpointError, match="lock file is no longer the one") as e:
            w.write(log_dir, 2, w.pack({"model000002.pt": files["model000002.pt"]}))
        assert "\n" not in str(e.value) and "step 2" in str(e.value), str(e.value)
        assert not [n for n in os.listdir(log_dir) if "000002" in n and ".tmp" not in n]
    finally:
        w.close()
        lock.release()
        if other is not None:
            other.release()


def test_a_forked_process_closes_its_copies_of_the_writers_connection_and_arena(tmp_path):
    """A DataLoader worker forked after the writer started holds neither its socket nor the
    arena's descriptor, and the trainer's writer still works after the fork."""
    from improved_diffusion.ckpt import run_dir

    w = writer_process.WriterProcess()
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        files = {"model000001.pt": {"w": torch.arange(6.0)}}
        w.write(tmp_path / "a", 1, w.pack(files))
        fds = (w._conn.fileno(), w.arena.fd)
        pid = os.fork()
        if pid == 0:  # the worker: both numbers closed, nothing of the writer kept
            code = 0
            for fd in fds:
                try:
                    os.fstat(fd)
                    code = 1
                except OSError:
                    pass
            os._exit(code if w._conn is None and w.arena.fd is None else 2)
        assert os.waitpid(pid, 0)[1] == 0
        w.write(tmp_path / "b", 1, w.pack(files))
        assert [st.step for st in run_dir.list_steps(str(tmp_path / "b"), verify_checksums=True)
                if st.complete] == [1]
        assert (tmp_path / "a" / "model000001.pt").read_bytes() == \
            (tmp_path / "b" / "model000001.pt").read_bytes()
    finally:
        child = w.pid
        w.close()
    assert child is not None and not alive(child)


def test_the_thread_writes_the_bytes_the_writer_process_writes(tmp_path):
    """--save_writer thread (the host copy in process, written from its thread) writes the same
    files as --save_writer process."""
    from test_async_save import step_names, tiny_loop

    from improved_diffusion import logger

    logger.configure(dir=str(tmp_path), format_strs=["log"])
    for name in ("process", "thread"):
        (tmp_path / name).mkdir()
        loop = tiny_loop(tmp_path / name, async_save=True, max_steps=3, save_writer=name)
        assert loop.run_loop() == 0
        assert isinstance(loop.checkpointer._process, writer_process.WriterProcess) == \
            (name == "process")
        loop.close()
    for step in (2, 3):
        for n in step_names(tmp_path / "process", step):
            if not n.startswith("manifest"):
                assert (tmp_path / "process" / n).read_bytes() == \
                    (tmp_path / "thread" / n).read_bytes(), n


@pytest.mark.parametrize("writer,platform_has,min_bytes,threads,process", [
    ("auto", True, writer_process.PROCESS_MIN_BYTES, 1, False),  # a tiny step: the thread
    ("auto", True, 1, 1, True),  # a large step, a core left for the writer: the process
    ("auto", True, 1, 4, False),  # a large step, every core runs a training thread: the thread
    ("process", True, writer_process.PROCESS_MIN_BYTES, 4, True),
    ("process", False, 1, 1, False),  # no memfd_create (not Linux): the thread, whatever is asked
    ("auto", False, 1, 1, False),
])
def test_save_writer_chooses_the_writer_at_the_first_async_save(
        tmp_path, monkeypatch, writer, platform_has, min_bytes, threads, process):
    """On a host of 4 cores (as this process sees it), one rank with ``threads`` torch threads."""
    from test_async_save import tiny_loop

    from improved_diffusion import dist_util, logger

    logger.configure(dir=str(tmp_path), format_strs=["log"])
    monkeypatch.setattr(writer_process, "available", lambda: platform_has)
    monkeypatch.setattr(writer_process, "PROCESS_MIN_BYTES", min_bytes)
    monkeypatch.setattr(dist_util, "usable_cores", lambda: 4)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    loop = tiny_loop(tmp_path, async_save=True, max_steps=2, ema_rate="0.9999",
                     save_writer=writer)
    try:
        assert loop.run_loop() == 0
        assert isinstance(loop.checkpointer._process, writer_process.WriterProcess) == process
    finally:
        loop.close()
        torch.set_num_threads(before)
    assert (tmp_path / "manifest000002.json").exists()


@pytest.mark.parametrize("on_cpu,threads,local_ranks,affinity,host_cpus,free", [
    (True, 1, 1, 2, 2, True),  # this machine, OMP_NUM_THREADS=1: the second core is the writer's
    (True, 2, 1, 2, 2, False),  # torch's default threads fill both cores
    (True, 1, 2, 2, 2, False),  # two ranks of one thread each
    (True, 4, 4, 16, 16, False),  # 4 ranks x 4 threads on 16 cores
    (True, 3, 4, 16, 16, True),
    (True, 5, 4, 6, 48, True),  # srun --cpus-per-task=6: its own 6 cores, 5 threads on them
    (True, 6, 4, 6, 48, False),
    (False, 16, 8, 96, 96, True),  # a GPU node: the ranks' threads mostly wait on the GPUs
])
def test_a_core_is_free_for_the_writer_unless_the_ranks_threads_fill_them(
        on_cpu, threads, local_ranks, affinity, host_cpus, free):
    assert writer_process.core_free(on_cpu, threads, local_ranks, affinity, host_cpus) is free
    assert writer_process.use_process("auto", 1 << 30, free_core=free) is (
        free and writer_process.available())


def test_a_bad_save_writer_is_a_one_line_usage_error_before_anything_is_written(tmp_path,
                                                                                capsys):
    code, out = run_script_here("train.py", *TINY, "--data_dir", tmp_path, "--log_dir",
                                tmp_path / "run", "--save_writer", "disk", capsys=capsys)
    assert code == 2, out[-3000:]
    assert out.strip().splitlines()[-1] == \
        "error: --save_writer must be one of auto, process, thread (got 'disk')", out
    assert not (tmp_path / "run").exists()


def test_a_write_that_fails_in_the_writer_is_its_one_line_error_here_and_the_writer_lives_on(
        tmp_path):
    from improved_diffusion.ckpt.checkpoint import CheckpointError

    w = writer_process.WriterProcess()
    try:
        files = {"model000001.pt": {"w": torch.arange(6.0)}}
        with pytest.raises(CheckpointError, match="no longer exists") as e:
            w.write(tmp_path / "gone", 1, w.pack(files))
        assert "\n" not in str(e.value) and "step 1" in str(e.value)
        pid = w.pid
        (tmp_path / "here").mkdir()
        w.write(tmp_path / "here", 1, w.pack(files))  # the same writer process writes on
        assert w.pid == pid and (tmp_path / "here" / "manifest000001.json").exists()
    finally:
        w.close()


def test_the_writer_process_checks_the_weights_on_its_host_copy_and_still_refuses_a_nan(
        tmp_path, monkeypatch):
    """The weights check of a save by the writer process is made on the host copy as it is
    copied (WriterProcess.pack), not by a pass over the live weights before it (issue 45 item
    4: off the pause): no parameter reaches count_non_finite; a NaN in the model is still
    refused with the line the separate check gave, nothing of the step is written, and the
    next finite save writes as before."""
    from test_async_save import tiny_loop

    from improved_diffusion import logger
    from improved_diffusion.ckpt import checkpointer

    logger.configure(dir=str(tmp_path), format_strs=["log"])
    counted, real = [], checkpointer.count_non_finite

    def spy(tensors):
        tensors = list(tensors)
        counted.extend(t.untyped_storage().data_ptr() for t in tensors)
        return real(tensors)

    monkeypatch.setattr(checkpointer, "count_non_finite", spy)
    loop = tiny_loop(tmp_path, async_save=True, max_steps=2, save_writer="process",
                     phema_stds="")
    try:
        assert loop.run_loop() == 0
        params = {p.untyped_storage().data_ptr() for p in loop.model.parameters()}
        assert (tmp_path / "manifest000002.json").exists() and not params & set(counted)
        p = next(iter(loop.model.parameters()))
        kept = p.detach().clone()
        with torch.no_grad():
            p.view(-1)[3] = float("nan")
        loop.step = 3
        with pytest.raises(checkpointer.NonFiniteError) as e:
            loop.save(wait=True)
        assert str(e.value) == ("step 3: not saved: the weights hold non-finite values (model: "
                                "1 tensor(s)); the last saved step is 2; resume from a saved "
                                "step with a lower --lr")
        assert not [n for n in os.listdir(tmp_path) if "000003" in n]
        with torch.no_grad():
            p.copy_(kept)
        loop.save(wait=True)
        assert (tmp_path / "manifest000003.json").exists()
        assert not params & set(counted)
    finally:
        loop.close()


def test_the_writer_writes_nicer_than_the_trainer_until_the_trainer_waits_for_it(
        tmp_path, monkeypatch):
    """Each write starts with every thread of the writer process at WRITER_NICE above the
    trainer's nice level (the steps beside it keep their core); hurry(), what the checkpointer
    calls once it waits for the write, sets them back to the trainer's level. A trainer that
    could not set them back (no privilege to lower a nice value) leaves the writer at its own
    level."""
    def nices(pid):
        return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    nicer = min(19, mine + writer_process.WRITER_NICE)
    assert writer_process.WRITER_NICE > 0
    for privileged in (True, False):
        if privileged and not writer_process.may_renice(mine):
            continue  # this machine cannot show it
        monkeypatch.setattr(writer_process, "may_renice", lambda nice: privileged)
        log_dir = tmp_path / str(privileged)
        log_dir.mkdir()
        w = writer_process.WriterProcess()
        try:
            big = torch.randn(1 << 20)  # 4 MiB: a CRC thread too
            w.write(log_dir, 1, w.pack({"model000001.pt": {"w": big}}))
            assert nices(w.pid) == ({nicer} if privileged else {mine})
            w.hurry()
            assert nices(w.pid) == {mine}
            w.write(log_dir, 2, w.pack({"model000002.pt": {"w": big}}))
            assert nices(w.pid) == ({nicer} if privileged else {mine})  # each write: nicer
        finally:
            w.close()
