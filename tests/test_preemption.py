"""A job is preemptible from its first line to its last (issue 19, point 1): improved_diffusion/
preemption.py, through the real launchers.

Each test starts scripts/train.py (or tests/fault_train.py, which only adds faults asked for
through the environment) under ``mpiexec -n 2`` or ``torchrun --nproc_per_node 2``, sends
SIGTERM or SIGUSR1 at one moment of the job's start-up (the imports, the rendezvous with a rank
that does not come, the wait for a predecessor's lock, the loading of a checkpoint) to the
launcher or to one rank, and checks what a job script sees (the exit code: 75 from mpiexec, 75
for every worker in torchrun's summary), the one line printed once, no traceback, and the log dir
left as it was. Once the loop runs, signals that keep coming during the preemption save and after
it do not cut the save short.
"""
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import cluster_sim as cs
from conftest import (MPIEXEC, PY, REPO, child_env, hang_s, train_here, write_class_folder,
                      write_images)

from improved_diffusion.infra.preemption import BEFORE_TRAINING

TRAIN = REPO / "scripts" / "train.py"
DRIVER = REPO / "tests" / "fault_train.py"
SLOW_SAVE_TRAIN = REPO / "tests" / "slow_save_train.py"
TINY = [*cs.TINY, "--seed", "0"]
# A log dir's files that a job start-up may append to (the text logs); all others must be
# byte for byte as they were.
TEXT_LOGS = {"log.txt", "progress.csv"}

# A predecessor still running: takes the lock of argv[1], prints HELD, sleeps until killed.
HOLDER = r"""
import sys, time
from improved_diffusion.ckpt import run_lock
lock = run_lock.LogDirLock(sys.argv[1], 0).acquire()
print("HELD", flush=True)
time.sleep(600)
"""


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


class Job:
    """A launcher started in a session of its own, its output in a file; killed at the end."""

    def __init__(self, cmd, out_path, env=None):
        self.out_path = Path(out_path)
        with open(self.out_path, "w") as f:
            self.proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(env),
                                         stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def out(self):
        return self.out_path.read_text()

    def wait_for(self, predicate, what, timeout=90):
        cs.wait_until(predicate, hang_s(timeout), (self.proc,), what)

    def wait_for_text(self, pattern, timeout=90):
        self.wait_for(lambda: re.search(pattern, self.out), f"{pattern!r} in the output", timeout)

    def rank_pids(self):
        """{rank: pid} of this job's ranks (PMI_RANK under mpiexec, RANK under torchrun)."""
        found = {}
        for pid in cs.process_tree(self.proc.pid)[1:]:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            rank = env.get(b"PMI_RANK", env.get(b"RANK"))
            if rank is not None and b"python" in cmd.split(b"\0")[0] and b".py" in cmd:
                found[int(rank)] = pid
        return found

    def wait_for_importing_ranks(self, n=2):
        """{rank: pid} once ``n`` ranks run and each is importing torch (its libraries are
        mapped; the import goes on for a second or more after that)."""
        def ready():
            pids = self.rank_pids()
            return len(pids) == n and all(importing_torch(p) for p in pids.values())
        self.wait_for(ready, f"{n} ranks importing torch")
        return self.rank_pids()

    def end(self, timeout=hang_s(90)):
        """The launcher's exit code, within ``timeout`` seconds (else the test fails)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s after the signal:\n{self.out[-3000:]}")
        finally:
            self.kill()

    def kill(self):
        cs.kill9(cs.process_tree(self.proc.pid))
        self.proc.wait()


def importing_torch(pid):
    """Whether process ``pid`` has begun to import torch (libtorch is mapped)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# docs/CLUSTERS.md's torchrun flags for SLURM's --signal=USR1@...: torchrun forwards SIGUSR1
SLURM_TORCHRUN = ("--signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")


def launch(launcher, script, args, launcher_flags=()):
    if launcher == "mpiexec":
        return [MPIEXEC, "-n", "2", PY, script, *args]
    return cs.torchrun_one_node(args, "standalone", script=script, launcher_flags=launcher_flags)


def snapshot(d):
    """{relative path: sha256} of every file under ``d`` but the text logs."""
    d = Path(d)
    if not d.exists():
        return None
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in TEXT_LOGS}


def worker_exit_codes(out):
    """The exit codes torchrun's failure summary lists for its workers."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]


# Where our code lives (a traceback through these is ours; the venv may be inside REPO too).
OUR_CODE = tuple(str(REPO / d) + os.sep for d in
                 ("improved_diffusion", "scripts", "tests", "examples", "benchmarks"))


def assert_preempted_before_training(job, rc, launcher, to_launcher=False):
    """Exit 75 (mpiexec) or every worker 75 (torchrun, which exits 1 itself; signalled itself
    it lists no worker, only its own traceback), the one line printed once, no traceback of
    ours, no training."""
    out = job.out
    if launcher == "mpiexec":
        assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    elif to_launcher:
        assert rc == 1 and "death signal, shutting down workers" in out, (
            f"exit {rc}:\n{out[-3000:]}")
    else:
        codes = worker_exit_codes(out)
        assert rc == 1 and codes and set(codes) == {75}, (
            f"exit {rc}, workers {codes}:\n{out[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.strip() == BEFORE_TRAINING]
    assert len(lines) == 1, f"{len(lines)} times {BEFORE_TRAINING!r}:\n{out[-3000:]}"
    ours = [f for f in re.findall(r'File "([^"]+)"', out)
            if f.startswith(OUR_CODE)]  # torchrun itself may live in REPO/.venv
    assert not ours and "error:" not in out, out[-3000:]  # torchrun's own traceback aside
    assert not re.search(r"^step \d+", out, re.M), out[-3000:]


# ------------------------------------------------------------------------------- lock wait


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher,target,sig", [
    ("mpiexec", "launcher", signal.SIGTERM),
    # make soak: SIGUSR1 (SIGUSR1 reaches the same handler in the import and load tests below)
    pytest.param("mpiexec", 1, signal.SIGUSR1, marks=pytest.mark.slow),
    # make soak: torchrun (a signal to a waiting rank: the classifier's lock-wait test below;
    # torchrun's ranks preempted before training: the import, rendezvous and load tests)
    pytest.param("torchrun", 1, signal.SIGTERM, marks=pytest.mark.slow),
    pytest.param("torchrun", "launcher", signal.SIGUSR1,  # as SLURM's --signal=USR1@180 does
                 marks=pytest.mark.slow),
], ids=["mpiexec-sigterm-to-mpiexec", "mpiexec-sigusr1-to-rank1", "torchrun-sigterm-to-rank1",
        "torchrun-sigusr1-to-torchrun"])
def test_a_requeued_job_waiting_for_its_predecessors_lock_exits_75_when_preempted(
        tmp_path, images, launcher, target, sig):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / "model000002.pt").write_bytes(b"the predecessor's step")
    holder = Job([PY, "-c", HOLDER, log_dir], tmp_path / "holder.out")
    try:
        holder.wait_for_text("HELD")
        before = snapshot(log_dir)
        # the watcher out of the way (300 s): the wait's own check must end the job
        job = Job(launch(launcher, DRIVER, [*TINY, "--data_dir", images, "--log_dir", log_dir,
                                            "--lock_wait", 120], SLURM_TORCHRUN),
                  tmp_path / "job.out", env={"FAULT_HARD_EXIT_S": "300"})
        job.wait_for_text(f"log dir {re.escape(str(log_dir))} is in use by pid {holder.proc.pid}")
        os.kill(job.proc.pid if target == "launcher" else job.rank_pids()[target], sig)
        rc = job.end()
        assert_preempted_before_training(job, rc, launcher, to_launcher=target == "launcher")
        assert snapshot(log_dir) == before
    finally:
        holder.kill()


@pytest.mark.timeout(150)
def test_the_classifier_trainer_waiting_for_a_lock_exits_75_when_preempted(tmp_path):
    """classifier_train.py is preemptible before training too (its first lines install
    preemption.py): SIGTERM to a rank while it waits for the lock ends the job with 75."""
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / "model000002.pt").write_bytes(b"the predecessor's step")
    data = write_class_folder(tmp_path / "classes", per_class=2)
    holder = Job([PY, "-c", HOLDER, log_dir], tmp_path / "holder.out")
    try:
        holder.wait_for_text("HELD")
        before = snapshot(log_dir)
        job = Job([MPIEXEC, "-n", "2", PY, REPO / "scripts" / "classifier_train.py",
                   "--image_size", "8", "--classifier_width", "32", "--classifier_depth", "1",
                   "--classifier_attention_resolutions", "4", "--diffusion_steps", "20",
                   "--batch_size", "2", "--data_dir", data, "--log_dir", log_dir,
                   "--lock_wait", 120], tmp_path / "job.out")
        job.wait_for_text(f"log dir {re.escape(str(log_dir))} is in use by pid {holder.proc.pid}")
        os.kill(job.rank_pids()[1], signal.SIGTERM)
        rc = job.end()
        assert_preempted_before_training(job, rc, "mpiexec")
        assert snapshot(log_dir) == before
    finally:
        holder.kill()


# --------------------------------------------------------------------- imports, rendezvous


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher,target,sig", [
    ("mpiexec", "launcher", signal.SIGTERM),
    ("torchrun", 1, signal.SIGUSR1),
], ids=["mpiexec-sigterm-to-mpiexec", "torchrun-sigusr1-to-rank1"])
def test_a_signal_while_the_ranks_import_ends_the_job_with_75_and_no_log_dir(
        tmp_path, images, launcher, target, sig):
    log_dir = tmp_path / "run"
    job = Job(launch(launcher, TRAIN, [*TINY, "--data_dir", images, "--log_dir", log_dir]),
              tmp_path / "job.out")
    pids = job.wait_for_importing_ranks()
    os.kill(job.proc.pid if target == "launcher" else pids[target], sig)
    rc = job.end()
    assert_preempted_before_training(job, rc, launcher)
    assert not log_dir.exists()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_rank_stuck_in_the_rendezvous_when_preempted_is_ended_with_75(
        tmp_path, images, launcher):
    # Rank 1 comes 60 s late: rank 0 waits inside the rendezvous (an MPI allgather, or the
    # store), where no Python code runs. Its watcher ends it (after 1 s here, 10 s by default).
    log_dir = tmp_path / "run"
    job = Job(launch(launcher, DRIVER, [*TINY, "--data_dir", images, "--log_dir", log_dir]),
              tmp_path / "job.out",
              env={"FAULT_LATE_RANK": "1", "FAULT_LATE_S": "60", "FAULT_HARD_EXIT_S": "1"})
    job.wait_for_text("FAULT: rank 0 enters the rendezvous")
    time.sleep(1.0)  # inside it by now
    os.kill(job.rank_pids()[0], signal.SIGTERM)
    rc = job.end(timeout=30)  # not the 60 s of the late rank
    out = job.out
    if launcher == "mpiexec":
        assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    else:  # the agent stops rank 1 with SIGTERM, which ends it the same way
        codes = worker_exit_codes(out)
        assert rc == 1 and codes and set(codes) == {75}, f"workers {codes}:\n{out[-3000:]}"
    assert BEFORE_TRAINING in out and "error:" not in out, out[-3000:]
    assert not log_dir.exists()


# --------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, images):
    """A log dir holding step 2 of a 1-rank run."""
    d = tmp_path_factory.mktemp("saved") / "run"
    train_here(*TINY, "--data_dir", images, "--log_dir", d, "--max_steps", "2")
    return d


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher,target,sig,slow", [
    ("mpiexec", 1, signal.SIGUSR1, {"FAULT_SLOW_LOAD_S": "0.7"}),
    # rank 1 waits for rank 0's slow read inside a collective: its watcher ends it after 1 s;
    # torchrun then stops rank 0 with SIGTERM, still reading: its watcher ends it with 75 too
    ("torchrun", 1, signal.SIGTERM, {"FAULT_SLOW_LOAD_S": "4", "FAULT_SLOW_LOAD_RANK": "0",
                                     "FAULT_HARD_EXIT_S": "1"}),
], ids=["mpiexec-sigusr1-to-rank1", "torchrun-rank1-stuck-in-a-collective"])
def test_a_signal_while_the_checkpoint_loads_ends_the_job_with_75_and_changes_nothing(
        tmp_path, images, saved_run, launcher, target, sig, slow):
    log_dir = tmp_path / "run"
    shutil.copytree(saved_run, log_dir)
    before = snapshot(log_dir)
    job = Job(launch(launcher, DRIVER, [*TINY, "--data_dir", images, "--log_dir", log_dir,
                                        "--max_steps", 4]),
              tmp_path / "job.out", env=slow)
    job.wait_for_text("FAULT: loading model000002.pt")
    os.kill(job.rank_pids()[target], sig)
    rc = job.end()
    assert_preempted_before_training(job, rc, launcher)
    assert snapshot(log_dir) == before  # the lock's file removed, after a hard exit too
    if "FAULT_HARD_EXIT_S" not in slow:  # a rank ended by its watcher writes no log file
        assert "preempted before training started" in (log_dir / "log.txt").read_text()


# ------------------------------------------------------------------------- the loop's save


@pytest.mark.timeout(150)
def test_signals_that_keep_coming_during_the_preemption_save_and_after_it_do_not_cut_it_short(
        tmp_path, images):
    log_dir = tmp_path / "run"
    job = Job([MPIEXEC, "-n", "2", PY, SLOW_SAVE_TRAIN, *TINY, "--data_dir", images,
               "--log_dir", log_dir, "--max_steps", 100000, "--save_interval", 100000],
              tmp_path / "job.out", env={"SLOW_SAVE_S": "0.3"})  # ~2 s to write a step
    job.wait_for_text(r"(?m)^step 3\b")
    pids = job.rank_pids()
    os.kill(pids[1], signal.SIGTERM)
    sent = 1
    while job.proc.poll() is None:  # the preemption save, then close, cleanup, exit: all of it
        time.sleep(0.05)
        cs.signal_all(pids.values(), signal.SIGTERM)
        sent += 1
    rc = job.end()
    out = job.out
    assert rc == 75, f"exit {rc} after {sent} signals:\n{out[-3000:]}"
    saved = int(re.search(r"preempted \(SIGTERM on some rank\): saved step (\d+)", out).group(1))
    assert cs.complete_steps(log_dir) == [saved] and cs.step_problems(log_dir, saved) == []
    assert sent > 20, sent  # the signals did cover the save


# ------------------------------------------------------------------ with loader workers


def loader_workers(job):
    """The pids of the job's DataLoader worker processes: forked children of a rank, with the
    rank's own command line."""
    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None

    def parent(pid):
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    return [pid for pid in cs.process_tree(job.proc.pid)
            if cmdline(pid) and b".py" in cmdline(pid) and cmdline(parent(pid)) == cmdline(pid)]


CLASSIFIER_TINY = ["--image_size", "8", "--classifier_width", "32", "--classifier_depth", "1",
                   "--classifier_attention_resolutions", "4", "--diffusion_steps", "20",
                   "--batch_size", "2", "--log_interval", "1"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script,launcher,target", [
    # make soak: SIGTERM to mpiexec alone ("every process" below signals mpiexec too, with the
    # ranks and the workers; SIGTERM to mpiexec before training: the lock-wait and import tests)
    pytest.param("train.py", "mpiexec", "launcher", marks=pytest.mark.slow),
    # make soak: torchrun's launcher (SIGTERM to mpiexec and to every process keep the loader
    # workers' preemption; torchrun's forwarding of SIGTERM: the requeued, importing and
    # rendezvous tests here, and test_restarts)
    pytest.param("train.py", "torchrun", "launcher", marks=pytest.mark.slow),
    ("train.py", "mpiexec", "every process"),
    pytest.param("classifier_train.py", "torchrun", "every process",
                 marks=pytest.mark.slow),  # make soak: the same loader as train.py's
], ids=["train-sigterm-to-mpiexec", "train-sigterm-to-torchrun",
        "train-sigterm-to-every-process", "classifier-sigterm-to-every-process"])
def test_sigterm_with_loader_workers_saves_the_step_it_reached_and_exits_75(
        tmp_path, images, script, launcher, target):
    """--num_workers 2 (the GPU default starts 1-8): SIGTERM as a cluster sends it, to the
    launcher or to every process of the job (SLURM), workers included, once the loop runs. The
    workers ignore it (the main process owns it), so the ranks save the step they reached
    (the last interval save is step 0: none) and exit 75; before, a worker died of it and the
    job ended with exit 1, "DataLoader worker (pid ...) is killed by signal", nothing saved."""
    log_dir = tmp_path / "run"
    if script == "train.py":
        args = [*TINY, "--data_dir", images]
    else:
        args = [*CLASSIFIER_TINY, "--data_dir", write_class_folder(tmp_path / "classes")]
    job = Job(launch(launcher, REPO / "scripts" / script,
                     [*args, "--log_dir", log_dir, "--num_workers", 2, "--max_steps", 100000,
                      "--save_interval", 100000]), tmp_path / "job.out")
    job.wait_for_text(r"(?m)^step 3\b")
    workers = loader_workers(job)
    assert len(workers) == 4, f"expected 2 ranks x 2 loader workers, found {workers}"
    if target == "launcher":
        os.kill(job.proc.pid, signal.SIGTERM)
    else:
        cs.signal_all(cs.process_tree(job.proc.pid), signal.SIGTERM)
    rc = job.end()
    out = job.out
    assert "killed by signal" not in out and "error:" not in out, out[-3000:]
    if launcher == "mpiexec":
        assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    elif target == "launcher":  # torchrun exits 1 itself; its workers each exit 75
        assert rc == 1 and "death signal, shutting down workers" in out, f"exit {rc}:\n{out}"
    else:
        codes = worker_exit_codes(out)
        assert rc in (1, -15) and (not codes or set(codes) == {75}), f"exit {rc}:\n{out}"
    saved = int(re.search(r"preempted \(SIGTERM on some rank\): saved step (\d+)", out).group(1))
    assert saved >= 3, out[-3000:]
    assert cs.complete_steps(log_dir) == [saved] and cs.step_problems(log_dir, saved) == []
