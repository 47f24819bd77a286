"""Shared test helpers: paths, and subprocess runners that can never hang CI.

Every helper here runs a child under a timeout; a hang becomes a failed test with the child's
output attached, never a blocked CI run.

Timeouts are hang detectors, never speed assertions. The rule, in one place: a timeout written
in a test (``@pytest.mark.timeout(N)``, pytest.ini's ``timeout``, the ``timeout=`` of
run_script/run_mpi/run_module_mpi/_run, a direct subprocess call's or a wait loop's
``hang_s(N)``) is the most that test or wait needs on a quiet machine, and what is applied is
``TIMEOUT_FACTOR`` (5, or the environment's ``TEST_TIMEOUT_FACTOR``) times that: the suite stays
green on a machine 5x slower than quiet (other jobs beside it) and a real hang still ends the
test. pytest_collection_modifyitems below scales every test's pytest-timeout (its marker, or
the ini/command-line default); the helpers scale their ``timeout=``; direct calls wrap their
number in ``hang_s``. Not scaled, because they are not hang detectors: the product's own
timeouts a test passes as flags (``--dist_timeout``, a store's retry window), and a bound a
test asserts (a job ends within a few times ``--dist_timeout`` rather than at the 600 s
default), which is set far below what it tells apart.
"""
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cluster_sim

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
PY = sys.executable
_BIN = Path(sys.executable).parent
MPIEXEC = str(_BIN / "mpiexec") if (_BIN / "mpiexec").exists() else "mpiexec"


# Defined in cluster_sim, which benchmarks import without pytest.
TIMEOUT_FACTOR, hang_s = cluster_sim.TIMEOUT_FACTOR, cluster_sim.hang_s


def pytest_collection_modifyitems(config, items):
    """Every test's pytest-timeout (its closest ``timeout`` marker, else the ini or command-line
    default) x TIMEOUT_FACTOR: see the module docstring."""
    import pytest_timeout

    default = pytest_timeout.get_env_settings(config).timeout
    for item in items:
        marker = item.get_closest_marker("timeout")
        kwargs = dict(marker.kwargs) if marker else {}
        args = list(marker.args) if marker else []
        base = kwargs.pop("timeout", None) if "timeout" in kwargs else (
            args.pop(0) if args else default)
        if base:  # 0 or None: no timeout, left so
            item.add_marker(pytest.mark.timeout(hang_s(float(base)), *args, **kwargs),
                            append=False)


def child_env(extra=None):
    """Environment for child processes: the repo importable, one thread per rank, no stray logdir,
    MLflow at its own defaults (no MLFLOW_* variable of the machine's: a test that needs one
    passes it in ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
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


@contextlib.contextmanager
def launched(cmd, log_path, env=None, cwd=None):
    """``cmd`` (a launcher and its ranks) started in a session of its own, its output into
    ``log_path``; yields the Popen. On leaving, a job still running is killed whole (kill -9 of
    its process group) and waited for, whatever the test asserted."""
    with open(log_path, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd or REPO),
                                env=env or child_env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(cmd, timeout, env=None, check=True, cwd=None):
    """Run ``cmd`` (stdout+stderr as text) under ``hang_s(timeout)``; fail the test with the
    child's output on a timeout or (``check``) a non-zero exit."""
    timeout = hang_s(timeout)
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


def run_script(script, *args, timeout=120, env=None, check=True, cwd=None):
    """Run `python scripts/<script> args...` in one process (in ``cwd``, default the repo);
    returns CompletedProcess (text)."""
    return _run([PY, REPO / "scripts" / script, *args], timeout, env=env, check=check, cwd=cwd)


def run_script_here(script, *args, capsys):
    """scripts/<script>'s entry point (``run(argv)``, train.py's ``main(argv)``: its errors one
    ``error:`` line and an exit code) in this process, one rank: for a usage error, no process
    launch. Returns (exit code, what it printed: stdout, then stderr)."""
    from test_cli import load_script

    capsys.readouterr()
    module = load_script(script)
    code = getattr(module, "run", module.main)([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


def run_mpi(n, script, *args, timeout=180, env=None, check=True, cwd=None):
    """Run `mpiexec -n N python scripts/<script> args...` under a timeout (in ``cwd``, default
    the repo)."""
    return _run([MPIEXEC, "-n", str(n), PY, REPO / "scripts" / script, *args], timeout, env=env,
                check=check, cwd=cwd)


def ckpt_in_process(*args):
    """scripts/ckpt.py's ``main`` (the doctor) in this process, no launch: (exit status, what it
    wrote). For a check that reads a step; a test of the doctor itself runs the script."""
    import io

    from improved_diffusion.apps import ckpt_tool
    buf = io.StringIO()
    return ckpt_tool.main([str(a) for a in args], out=buf, err=buf), buf.getvalue()


def run_module_mpi(n, code, timeout=120, env=None, check=True):
    """Run `mpiexec -n N python -c CODE` (for direct tests of collectives)."""
    return _run([MPIEXEC, "-n", str(n), PY, "-c", code], timeout, env=env, check=check)


@pytest.fixture
def fixtures_dir():
    return FIXTURES


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's in-process math (``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``): as upstream's references were made, and far
    cheaper than several threads on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def restore_logger():
    """The logger of before the test, back after it, for every test: a test that configures a
    logger onto pytest's captured stdout would otherwise leave it to the next test, whose first
    log line then writes to a closed file (seen in CI: test_sample_grids after a logger test)."""
    from improved_diffusion import logger

    prev = logger.Logger.CURRENT
    yield
    if logger.Logger.CURRENT is not prev and logger.Logger.CURRENT is not None:
        logger.Logger.CURRENT.close()
    logger.Logger.CURRENT = prev


def train_here(*argv, script="train.py"):
    """scripts/<script>'s main() in this process, for a set-up run whose files tests read: no
    interpreter start-up (a job's ~2.5 s of importing torch); fails the test unless it exits 0.
    The logger it configured is closed after it, as restore_logger does after a test. Not for a
    run compared bit for bit with a job's (this process's torch threads are not a job's)."""
    import runpy

    from improved_diffusion import logger

    prev = logger.Logger.CURRENT
    try:
        main = runpy.run_path(str(REPO / "scripts" / script), run_name="train_module")["main"]
        code = main([str(a) for a in argv])
    finally:
        if logger.Logger.CURRENT is not prev and logger.Logger.CURRENT is not None:
            logger.Logger.CURRENT.close()
        logger.Logger.CURRENT = prev
    assert code == 0, f"{script} {' '.join(map(str, argv))}: exit {code}"


# The process-tree helpers live in cluster_sim (benchmarks use them without pytest).
process_tree, signal_all = cluster_sim.process_tree, cluster_sim.signal_all


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


def write_digits_and_ref(d, n_ref=40):
    """The real 8x8 digits as a training folder ``d/data``, and the last ``n_ref`` of them as an
    RGB reference batch ``d/ref.npz`` (for --eval_ref_batch): (data folder, ref path)."""
    sys.path.insert(0, str(REPO / "datasets"))
    import digits

    d = Path(d)
    digits.write_digits_folder(str(d / "data"), size=8, log=lambda *a: None)
    x, _ = digits.load_real_digits()
    np.savez(d / "ref.npz", arr_0=np.stack([np.asarray(digits.digit_to_image(v, size=8)
                                                       .convert("RGB")) for v in x[-n_ref:]]))
    return d / "data", d / "ref.npz"


def write_class_folder(d, classes=("cat", "dog", "owl"), per_class=4, size=8):
    """An image folder whose file names carry class names (cat_0.png ...), returned."""
    from PIL import Image

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for c in classes:
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                d / f"{c}_{i}.png")
    return d


# Keys of checkpoint dicts that may differ between two runs without the state differing.
VOLATILE_KEYS = {"time", "timestamp", "created", "hostname", "host", "pid", "wall_time"}


def job_pids(marker, script=b"train.py"):
    """{pid: rank} of every process of an MPI job whose command line holds ``marker`` (say its
    log dir) and ``script``: the ranks and their loader workers (forks of them, with their
    command line and environment). Via /proc; {} when none is running."""
    pids = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if str(marker).encode() in cmdline and script in cmdline:
            for kv in environ:
                if kv.startswith(b"PMI_RANK="):
                    pids[int(entry)] = int(kv.split(b"=", 1)[1])
    return pids


def rank_pids(marker, script=b"train.py"):
    """{rank: pid} of the ranks alone of such a job (job_pids): a loader worker, a fork of its
    rank, has that rank's PMI_RANK too, and its parent is in the job."""
    job = job_pids(marker, script)
    ranks = {}
    for pid, rank in job.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent not in job:
            ranks[rank] = pid
    return ranks


def resumed_step(output):
    """The step a run said it resumed at ("resumed at step N ..."), or None."""
    found = re.findall(r"(?i)resum\w*[^\n]*?\bstep\s+(\d+)", output)
    return int(found[-1]) if found else None


def deep_diff(a, b, path="", out=None):
    """Paths where nested dicts/lists/tensors a and b differ (tensors: torch.equal, dtype too)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in VOLATILE_KEYS:
                continue
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'second' if k not in a else 'first'}")
            else:
                deep_diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            deep_diff(x, y, f"{path}[{i}]", out)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            extra = ""
            if a.shape == b.shape and a.dtype == b.dtype and a.is_floating_point():
                extra = f" max|diff|={(a.double() - b.double()).abs().max().item():.3g}"
            out.append(f"{path}: tensors differ ({a.dtype}{list(a.shape)} vs "
                       f"{b.dtype}{list(b.shape)}){extra}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not np.array_equal(a, b):
            out.append(f"{path}: arrays differ")
    elif type(a) is not type(b) or a != b:
        out.append(f"{path}: {a!r} != {b!r}")
    return out


# ---------------------------------------------------------------------------------------------
# float32 tolerances

FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


def float32_atol(magnitude, terms=1, layers=1, margin=4):
    """An absolute tolerance for two float32 evaluations of the same math that differ only in
    rounding: the order of their sums (a batch of 6 against one of 3, another CPU's kernels -
    oneDNN picks other blockings on CPUs with AVX-512 or bfloat16 units - or the machine that
    made a reference). A sum of ``terms`` products of size ``magnitude`` is off by about
    sqrt(terms) ulps of it (the roundings add as a random walk), and ``layers`` such sums in a
    row add theirs: ``margin * sqrt(terms * layers) * eps32 * magnitude``. Derived from the
    computation, not tuned on one CPU: a tolerance one CPU meets with little room fails on
    another (issue 29: 1.37e-6 against 1e-6)."""
    return margin * math.sqrt(terms * layers) * FLOAT32_EPS * float(magnitude)


def forward_atol(module, *outputs, margin=4):
    """`float32_atol` for outputs of ``module``'s forward: ``terms`` its widest fan-in (a
    conv's in_channels x kernel, a linear layer's in_features), ``layers`` its count of conv
    and linear layers, ``magnitude`` the largest |value| among ``outputs``."""
    weights = [m.weight for m in module.modules()
               if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                                 torch.nn.Linear))]
    terms = max(w[0].numel() for w in weights)
    magnitude = max(float(o.abs().max()) for o in outputs)
    return float32_atol(magnitude, terms, len(weights), margin)
