"""Shared test helpers: paths, and subprocess runners that can never hang CI.

Every helper here runs a child under a timeout; a hang becomes a failed test with the child's
output attached, never a blocked CI run.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
PY = sys.executable
_BIN = Path(sys.executable).parent
MPIEXEC = str(_BIN / "mpiexec") if (_BIN / "mpiexec").exists() else "mpiexec"


def child_env(extra=None):
    """Environment for child processes: the repo importable, one thread per rank, no stray logdir."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(_BIN) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OPENAI_LOGDIR", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def _run(cmd, timeout, env=None, check=True, cwd=None):
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=str(cwd or REPO),
            env=child_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"timed out after {timeout}s (a hang?): {' '.join(map(str, cmd))}\n{out[-4000:]}")
    if check and proc.returncode != 0:
        pytest.fail(
            f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stdout[-6000:]}"
        )
    return proc


def run_script(script, *args, timeout=120, env=None, check=True):
    """Run `python scripts/<script> args...` in one process; returns CompletedProcess (text)."""
    return _run([PY, REPO / "scripts" / script, *args], timeout, env=env, check=check)


def run_mpi(n, script, *args, timeout=180, env=None, check=True):
    """Run `mpiexec -n N python scripts/<script> args...` under a timeout."""
    return _run([MPIEXEC, "-n", str(n), PY, REPO / "scripts" / script, *args], timeout, env=env,
                check=check)


def run_module_mpi(n, code, timeout=120, env=None, check=True):
    """Run `mpiexec -n N python -c CODE` (for direct tests of collectives)."""
    return _run([MPIEXEC, "-n", str(n), PY, "-c", code], timeout, env=env, check=check)


@pytest.fixture
def fixtures_dir():
    return FIXTURES


def job_pids(root):
    """`root` and all its descendants (from /proc): mpiexec, its proxies and the ranks, which
    hydra starts in sessions of their own (a killpg of the launcher would leave them running)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def signal_all(pids, sig):
    """Send ``sig`` to each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def write_images(d, n=14, size=8, seed=14):
    """A folder of ``n`` random ``size``x``size`` RGB PNGs named img_000.png..., returned."""
    import numpy as np
    from PIL import Image

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)).save(
            d / f"img_{i:03d}.png")
    return d
