"""Start scripts/train.py (through tests/fault_train.py) as a two-node torchrun job or under
mpiexec, ``kill -9`` part of it, and time how long the rest takes to end.

"Two hosts" on one machine: two ``torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d``
launchers, each in its own session; killing "node 1" kills its launcher and its worker (torchrun
starts workers in sessions of their own, so the whole tree is killed, not one process group).
Used by tests/test_dist_faults.py and benchmarks/dead_rank.py.
"""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
TORCHRUN = str(BIN / "torchrun")
DRIVER = REPO / "tests" / "fault_train.py"

# The hang detectors' factor (tests/conftest.py's docstring says the rule); here so that the
# helpers benchmarks import without pytest (stores.py, multihost.py) scale their waits too.
TIMEOUT_FACTOR = float(os.environ.get("TEST_TIMEOUT_FACTOR", "5"))


def hang_s(seconds):
    """A hang detector's bound: ``seconds`` (what a quiet machine needs) x TIMEOUT_FACTOR."""
    return seconds * TIMEOUT_FACTOR

# The tiny model of tests/test_train.py.
TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1",
]


def random_images(folder, n=8, size=8):
    """Write `n` random RGB PNGs of `size` px into a new `folder` (tiny training data); returns it."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
            folder / f"img_{i:03d}.png")
    return folder


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k in ("OPENAI_LOGDIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def start(cmd, out_path, env=None):
    """Popen ``cmd`` in a session of its own, stdout+stderr to ``out_path``."""
    out = open(out_path, "w")
    return subprocess.Popen([str(c) for c in cmd], cwd=str(REPO), env=child_env(env),
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def two_node_torchrun(train_args, work, dist_timeout=20, env=None):
    """Start node 0 then node 1 of a two-node torchrun job; returns (node0, node1) Popens."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--node_rank", str(node),
               # node 0 hosts the rendezvous store, as the endpoint's host would
               "--rdzv_conf", f"is_host={int(node == 0)}",
               "--max_restarts", "0", DRIVER, *train_args, "--dist_timeout", str(dist_timeout)]
        nodes.append(start(cmd, Path(work) / f"node{node}.out", env))
    return tuple(nodes)


def mpiexec(n, train_args, work, dist_timeout=20, env=None):
    cmd = [MPIEXEC, "-n", str(n), PY, DRIVER, *train_args, "--dist_timeout", str(dist_timeout)]
    return start(cmd, Path(work) / "mpiexec.out", env)


def process_tree(pid):
    """``pid`` and all its descendants (from /proc)."""
    children = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill9(pids):
    signal_all(pids, signal.SIGKILL)


def alive(pid):
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def all_gone(pids, within_s):
    """True once none of ``pids`` runs, polled for at most ``within_s`` seconds (a rank that
    the launcher just killed can take a moment to leave the process table)."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def rank_pids(pid_dir, n):
    return {r: int((Path(pid_dir) / f"rank{r}.pid").read_text()) for r in range(n)}


def wait_until(predicate, timeout, procs=(), what="condition"):
    """Poll ``predicate`` until true; raise if ``timeout`` passes or one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a process exited ({p.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def complete_steps(log_dir):
    """Steps with a manifest in ``log_dir``, ascending."""
    return sorted(int(p.stem[len("manifest"):]) for p in Path(log_dir).glob("manifest*.json"))


def step_problems(log_dir, step):
    """Check step ``step`` against its manifest (sizes and checksums, computed here); [] if intact."""
    doc = json.loads((Path(log_dir) / f"manifest{step:06d}.json").read_text())
    problems = []
    for name, meta in doc["files"].items():
        path = Path(log_dir) / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        if not matches_manifest(path.read_bytes(), meta):
            problems.append(f"{name}: does not match the manifest")
    return problems


def matches_manifest(data, entry):
    """Whether a file's bytes ``data`` have the size and checksum its manifest ``entry`` lists
    (crc32, or sha256 in a version-1 manifest), computed here from the bytes alone."""
    if len(data) != entry["size"]:
        return False
    if "crc32" in entry:
        return f"{zlib.crc32(data):08x}" == entry["crc32"]
    return hashlib.sha256(data).hexdigest() == entry["sha256"]


def wait_exit(proc, timeout):
    """Seconds until ``proc`` exits (at most ``timeout``; then kills its tree and raises)."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill9(process_tree(proc.pid))
        raise TimeoutError(f"still running {timeout} s later")
    return time.monotonic() - t0


def torchrun_one_node(train_args, rdzv="standalone", nproc=2, max_restarts=0, script=DRIVER,
                      launcher_flags=()):
    """The command of a one-node ``torchrun`` job of ``nproc`` workers running ``script`` (the
    fault driver of train.py), with rendezvous ``rdzv``: "standalone" (``--standalone``), "c10d"
    (``--rdzv_backend c10d`` at a free local port) or "static" (``--master_addr/--master_port``);
    ``launcher_flags``: more of torchrun's own flags."""
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--max_restarts", str(max_restarts), "--monitor_interval", "0.1", *launcher_flags]
    if rdzv == "standalone":
        cmd += ["--standalone"]
    elif rdzv == "c10d":
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    elif rdzv == "static":
        cmd += ["--rdzv_backend", "static", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]
    else:
        raise ValueError(f"unknown rendezvous {rdzv!r}")
    return cmd + [script, *train_args]


def kill_workers_repeatedly(proc, log_dir, pid_dir, kills, nproc=2, timeout=120, on_kill=None):
    """
    While ``proc`` (a torchrun job with ``--max_restarts >= kills``, its workers writing their pid
    files into ``pid_dir``) runs: ``kills`` times, wait until the workers of a new attempt have
    formed their process group and saved a step of their own, then ``kill -9`` one of them (rank
    1, rank 0, rank 1, ...). Returns the list of (attempt, killed rank, newest complete step
    when killed); raises (TimeoutError, RuntimeError) when an attempt makes no progress within
    ``timeout`` seconds or the job ends first. ``on_kill(record)`` is called after each kill.
    """
    done, old = [], set()
    for attempt in range(kills):
        def formed():
            try:
                pids = rank_pids(pid_dir, nproc)
            except (OSError, ValueError):
                return False
            return not old.intersection(pids.values()) and all(alive(p) for p in pids.values())
        wait_until(formed, timeout, (proc,), f"attempt {attempt}'s process group")
        pids = rank_pids(pid_dir, nproc)
        start = (complete_steps(log_dir) or [0])[-1]
        wait_until(lambda: (complete_steps(log_dir) or [0])[-1] > start, timeout, (proc,),
                   f"a step saved by attempt {attempt}")
        rank = (attempt + 1) % nproc
        kill9([pids[rank]])
        old |= set(pids.values())
        record = (attempt, rank, complete_steps(log_dir)[-1])
        done.append(record)
        if on_kill:
            on_kill(record)
    return done
