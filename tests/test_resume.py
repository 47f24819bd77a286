"""Resume that is exact, elastic and crash-safe (issue 4), tested through scripts/train.py.

Every test drives the real CLI in subprocesses (one rank, or `mpiexec -n N`; a run that only
sets up a log dir: train.py's main() in the test's process) on tiny models and a folder of 8x8
PNGs, and checks the files on disk with its own reader (manifest + sizes + checksums +
`torch.load(weights_only=True)`), not only with improved_diffusion.ckpt.checkpoint.
"""
import csv
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cluster_sim import matches_manifest
from conftest import (MPIEXEC, PY, REPO, _run, child_env, deep_diff, hang_s, rank_pids,
                      resumed_step, run_mpi, run_script, train_here)

SLOW_SAVE_TRAIN = REPO / "tests" / "slow_save_train.py"
AMP_TRAIN = REPO / "tests" / "amp_train.py"
TRAIN = REPO / "scripts" / "train.py"

TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--seed", "0",
]
TWO_EMAS = "0.9999,0.99"
# Everything that can break an exact resume at once: resampler history, dropout RNG, gradient
# accumulation, autocast with a GradScaler whose scale moves every 2 good steps (and backs off,
# skipping the step, on overflow), and two EMA rates. Which autocast --use_fp16 gives on a CPU
# depends on its bfloat16 units; the tests force each branch (train(..., cpu_bf16=)).
HARD = ["--schedule_sampler", "loss-second-moment", "--dropout", "0.1", "--microbatch", "1",
        "--use_fp16", "True", "--fp16_scale_growth", "0.5", "--ema_rate", TWO_EMAS]

STEP_FILE_RE = re.compile(r"^(?:model|opt|manifest)(\d{6,})\.(?:pt|json)$|^ema_.+_(\d{6,})\.pt$")
TEMP_FILE_RE = re.compile(r"\.tmp")
# progress.csv columns that measure time, not training.
TIME_COLUMN_RE = re.compile(r"time|sec|elapsed|wall|throughput|per_s", re.I)


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """images(n) -> a folder of n random 8x8 RGB PNGs (made once per module and n)."""
    made = {}

    def make(n):
        if n not in made:
            d = tmp_path_factory.mktemp(f"images{n}")
            rng = np.random.default_rng(n)
            for i in range(n):
                arr = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
                Image.fromarray(arr).save(d / f"img_{i:03d}.png")
            made[n] = d
        return made[n]

    return make


def train_args(data_dir, log_dir, *extra):
    return [*TINY, "--data_dir", str(data_dir), "--log_dir", str(log_dir), *map(str, extra)]


def train(ranks, data_dir, log_dir, *extra, timeout=150, check=True, cpu_bf16=None):
    """Run train.py on `ranks` ranks; returns the CompletedProcess (stdout+stderr as text).

    ``cpu_bf16``: None (this CPU decides what --use_fp16 is), False (float16 autocast with a
    GradScaler) or True (bfloat16 autocast, no scaler), forced by tests/amp_train.py."""
    args = train_args(data_dir, log_dir, *extra)
    if cpu_bf16 is not None:
        launcher = [] if ranks == 1 else [MPIEXEC, "-n", str(ranks)]
        return _run([*launcher, PY, AMP_TRAIN, *args], timeout, check=check,
                    env={"CPU_BF16": str(int(cpu_bf16))})
    if ranks == 1:
        return run_script("train.py", *args, timeout=timeout, check=check)
    return run_mpi(ranks, "train.py", *args, timeout=timeout, check=check)


def load_pt(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def step_of(name):
    m = STEP_FILE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def step_names(step, rates):
    names = {f"model{step:06d}.pt", f"opt{step:06d}.pt"}
    names |= {f"ema_{r}_{step:06d}.pt" for r in rates.split(",")}
    return names


def check_step(log_dir, step, rates, deep=False):
    """None when step `step` in log_dir is complete (our own reading of the format), else why not.

    Complete: manifest{step}.json parses, lists the model, every EMA and the opt file, and each
    listed file exists with the listed size. deep=True also checks the checksum and that every file
    loads with weights_only=True and is tagged with its kind and this step.
    """
    log_dir = Path(log_dir)
    manifest = log_dir / f"manifest{step:06d}.json"
    try:
        doc = json.loads(manifest.read_text())
        files = doc["files"]
    except FileNotFoundError:
        return "no manifest"
    except (ValueError, KeyError, TypeError) as e:
        return f"manifest unreadable ({e})"
    if not step_names(step, rates) <= set(files):
        return f"manifest lists {sorted(files)}, expected {sorted(step_names(step, rates))}"
    for name, info in files.items():
        p = log_dir / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return f"{name} missing"
        if size != info["size"]:
            return f"{name}: {size} bytes, manifest says {info['size']}"
        if deep:
            if not matches_manifest(p.read_bytes(), info):
                return f"{name}: checksum differs from the manifest"
            try:
                obj = load_pt(p)
            except Exception as e:  # noqa: BLE001 - any load failure is the finding
                return f"{name}: does not load ({type(e).__name__}: {e})"
            if obj.get("step") != step or obj.get("kind") not in ("model", "ema", "opt"):
                return f"{name}: tagged kind={obj.get('kind')!r} step={obj.get('step')!r}"
    return None


def complete_steps(log_dir, rates="0.9999", deep=False):
    """Sorted steps of log_dir (top level) that check_step calls complete."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        return []
    steps = {step_of(n) for n in os.listdir(log_dir)} - {None}
    return sorted(s for s in steps if check_step(log_dir, s, rates, deep=deep) is None)


def progress_rows(log_dir):
    """{step: row} from progress.csv (the last row logged for each step)."""
    with open(Path(log_dir) / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by_step = {}
    for row in rows:
        if row.get("step") not in (None, ""):
            by_step[int(float(row["step"]))] = row
    return by_step


def top_level_names(log_dir):
    try:
        return {e.name for e in os.scandir(log_dir) if e.is_file()}
    except FileNotFoundError:
        return set()


def read_sample_indices(log_dir):
    """{step: {rank: [dataset indices]}} from sample_indices/rank{r}.csv ("step,idx,idx,...")."""
    by_step = {}
    for f in sorted((Path(log_dir) / "sample_indices").glob("rank*.csv")):
        rank = int(re.search(r"rank(\d+)", f.name).group(1))
        for line in f.read_text().splitlines():
            if not line.strip() or not line[0].isdigit():
                continue
            step, *idx = (int(x) for x in line.split(","))
            assert rank not in by_step.setdefault(step, {}), f"{f.name} logs step {step} twice"
            by_step[step][rank] = idx
    return by_step


def stopped_after(run, step, d):
    """A copy ``d`` of the log dir ``run`` without its steps after ``step`` (files and
    progress.csv rows): as a job that ended after its save of ``step`` leaves it."""
    shutil.copytree(run, d)
    for name in top_level_names(d):
        if (step_of(name) or 0) > step:
            (d / name).unlink()
    with open(d / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(d / "progress.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if r.get("step") and int(float(r["step"])) <= step)
    return d


# ------------------------------------------------------------------------------- bitwise


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "ranks,config,cpu_bf16",
    # make soak: the one-rank variants (2 ranks below keep lsm, dropout, microbatches, the fp16
    # scaler and 2 EMAs; loader workers resume bitwise in test_own_model_edges.py, 2 ranks; bf16
    # autocast has no state of its own to resume (no scaler): its runs in test_nan_policy.py)
    [pytest.param(1, "workers", None, marks=pytest.mark.slow),
     pytest.param(1, "hard", False, marks=pytest.mark.slow),
     (2, "hard", False), pytest.param(1, "hard", True, marks=pytest.mark.slow)],
    ids=["1rank-plain-2workers", "1rank-lsm-dropout-micro-fp16scaler-2ema",
         "2ranks-lsm-dropout-micro-fp16scaler-2ema", "1rank-lsm-dropout-micro-bf16-2ema"],
)
def test_a_run_resumed_at_step_5_ends_bitwise_identical_to_a_straight_run_to_10(
        tmp_path, images, ranks, config, cpu_bf16):
    data = images(14)  # 14 images: the epoch boundary falls inside both halves of the run
    # "workers": default flags, data loaded by 2 worker processes (whose start must not touch
    # the training RNG streams). "hard" with float16 + GradScaler (whose state must be restored)
    # or bfloat16 autocast without a scaler, whichever this CPU would choose.
    cfg = HARD if config == "hard" else ["--num_workers", "2"]
    rates = TWO_EMAS if config == "hard" else "0.9999"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    train(ranks, data, straight, *cfg, "--max_steps", 10, "--save_interval", 5,
          cpu_bf16=cpu_bf16)
    stopped_after(straight, 5, resumed)  # as a job preempted after its save of step 5 leaves it
    # One rank: the default (auto-resume from the log dir); two ranks: upstream's explicit path.
    how = [] if ranks == 1 else ["--resume_checkpoint", resumed / "model000005.pt"]
    out = train(ranks, data, resumed, *cfg, "--max_steps", 10, "--save_interval", 5, *how,
                cpu_bf16=cpu_bf16).stdout
    assert resumed_step(out) == 5, out[-3000:]

    for d in (straight, resumed):
        assert check_step(d, 10, rates, deep=True) is None, f"{d}: {check_step(d, 10, rates)}"
    diffs = []
    for name in sorted(step_names(10, rates)):
        pair = load_pt(straight / name), load_pt(resumed / name)
        diffs += [f"{name}{p}" for p in deep_diff(*pair)]
    assert not diffs, "step-10 files differ (straight vs resumed):\n" + "\n".join(diffs[:40])
    scaler = [load_pt(d / f"opt{s:06d}.pt")["trainer"]["grad_scaler"]
              for d, s in ((resumed, 5), (straight, 10))]
    if cpu_bf16 is False:  # the branch asked for, with a scale that moved after step 5
        assert "bfloat16 autocast" not in out and None not in scaler, out[-3000:]
        assert scaler[0]["scale"] != scaler[1]["scale"], scaler
    elif cpu_bf16:
        assert "--use_fp16: bfloat16 autocast" in out and scaler == [None, None], out[-3000:]

    a, b = progress_rows(straight), progress_rows(resumed)
    assert sorted(a) == list(range(1, 11)), f"straight run logged steps {sorted(a)}"
    assert set(range(6, 11)) <= set(b), f"resumed run logged steps {sorted(b)}"
    cols = [c for c in a[10] if c in b[10] and not TIME_COLUMN_RE.search(c)]
    assert "loss" in cols, cols
    bad = [(s, c, a[s][c], b[s][c]) for s in range(6, 11) for c in cols if a[s][c] != b[s][c]]
    assert not bad, "progress.csv differs (step, column, straight, resumed):\n" + "\n".join(
        map(str, bad[:30]))


# ------------------------------------------------------------------------------- elastic

ELASTIC_IMAGES = 20  # an epoch of 20 samples spans the world-size change at sample 12


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory, images):
    """A log dir after 3 steps on 2 ranks x batch 2 (global batch 4: samples 0..11 consumed)."""
    d = tmp_path_factory.mktemp("elastic") / "run"
    train(2, images(ELASTIC_IMAGES), d, "--max_steps", 3, "--save_interval", 1000,
          "--ema_rate", TWO_EMAS, "--log_sample_indices", "True")
    return d


@pytest.mark.timeout(200)
# make soak: 2 -> 1 (2 -> 3 here, the uneven split; examples/own_model.py and torchrun restarts
# resume on fewer ranks in make test)
@pytest.mark.parametrize("new_world,max_steps", [pytest.param(1, 8, marks=pytest.mark.slow), (3, 6)],
                         ids=["2to1", "2to3"])
def test_a_run_saved_on_2_ranks_resumes_on_another_world_size_without_repeating_samples(
        tmp_path, images, saved_on_two_ranks, new_world, max_steps):
    run = tmp_path / "run"
    shutil.copytree(saved_on_two_ranks, run)
    data = images(ELASTIC_IMAGES)
    out = train(new_world, data, run, "--max_steps", max_steps, "--save_interval", 1000,
                "--ema_rate", TWO_EMAS, "--log_sample_indices", "True").stdout
    assert resumed_step(out) == 3, out[-3000:]

    # The log says what changed: the global batch size 4 -> 2 * new_world.
    new_gb = 2 * new_world
    lines = [ln for ln in out.splitlines() if re.search(r"(?i)global[ _]batch", ln)
             and {4, new_gb} <= {int(x) for x in re.findall(r"\d+", ln)}]
    assert lines, f"no log line names the global batch change 4 -> {new_gb}:\n{out[-3000:]}"
    # The optimizer state was loaded, not replaced by a fresh one.
    assert not re.search(r"(?i)fresh optimi[sz]er", out), out[-3000:]

    assert check_step(run, max_steps, TWO_EMAS, deep=True) is None
    trainer = load_pt(run / f"opt{max_steps:06d}.pt")["trainer"]
    assert trainer["world_size"] == new_world and trainer["global_batch"] == new_gb

    by_step = read_sample_indices(run)
    assert sorted(by_step) == list(range(1, max_steps + 1)), sorted(by_step)
    seq, worlds = [], []
    for step in sorted(by_step):
        ranks = sorted(by_step[step])
        assert ranks == list(range(len(ranks))), f"step {step}: ranks {ranks} logged"
        worlds.append(len(ranks))
        for r in ranks:
            assert len(by_step[step][r]) == 2, f"step {step} rank {r}: {by_step[step][r]}"
            seq += by_step[step][r]
    assert worlds == [2] * 3 + [new_world] * (max_steps - 3), worlds
    n = ELASTIC_IMAGES
    for e in range(0, len(seq), n):
        epoch = seq[e:e + n]
        dup = sorted({i for i in epoch if epoch.count(i) > 1})
        assert not dup, f"epoch {e // n}: indices {dup} seen twice; sequence {seq}"
        if len(epoch) == n:
            assert sorted(epoch) == list(range(n)), f"epoch {e // n} skips samples: {epoch}"
    # The order is the pure function of (seed, epoch, global index) that the data module exposes.
    from improved_diffusion.image_datasets import global_indices

    want = [int(i) for i in global_indices(0, len(seq), n, 0, True)]
    assert seq == want, f"sample order\n got  {seq}\n want {want}"


# ------------------------------------------------------------------------ damaged files


@pytest.fixture(scope="module")
def three_saved_steps(tmp_path_factory, images):
    d = tmp_path_factory.mktemp("damaged") / "run"
    train_here(*train_args(images(14), d, "--max_steps", 3, "--save_interval", 1))
    return d


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damage", [  # make soak: garbage (test_checkpoint reads it: one line)
    "truncated", pytest.param("garbage_of_the_same_size", marks=pytest.mark.slow)])
def test_auto_resume_skips_a_step_with_a_damaged_file_and_says_so_in_one_line(
        tmp_path, images, three_saved_steps, damage):
    run = tmp_path / "run"
    shutil.copytree(three_saved_steps, run)
    victim = run / "opt000003.pt"
    size = victim.stat().st_size
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: size // 2])
    else:
        victim.write_bytes(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
    out = train(1, images(14), run, "--max_steps", 4, "--save_interval", 1).stdout
    assert resumed_step(out) == 2, out[-3000:]
    said = [ln for ln in out.splitlines()
            if re.search(r"(?i)skip", ln) and re.search(r"\bstep 3\b|opt000003", ln)]
    assert said, f"no line says that step 3 was skipped:\n{out[-3000:]}"
    assert check_step(run, 4, "0.9999", deep=True) is None


# ------------------------------------------------------------------------------- kill -9

KILL_TRIALS = 4  # each mode at least once; make soak's test_soak runs 200 such cycles
KILL_MAX_STEPS = 100000  # kill trials never finish by themselves; the last run trains 3 more steps

def _poll(pred, proc, timeout, interval=0.002):
    """Wait until pred() is true (True), the process exits (False), or timeout (pytest.fail)."""
    end = time.monotonic() + hang_s(timeout)
    while time.monotonic() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(interval)
    pytest.fail(f"waited {hang_s(timeout)}s for the trainer to reach the kill point")


def _new_save_started(log_dir, baseline):
    """A file that was not in `baseline` (a temp file, or a file of a new step) is in log_dir."""
    def pred():
        return any(TEMP_FILE_RE.search(n) or step_of(n) is not None
                   for n in top_level_names(log_dir) - baseline)
    return pred


def _final_file_without_manifest(log_dir, baseline):
    """A new model/ema/opt file is in place but its step's manifest is not."""
    def pred():
        names = top_level_names(log_dir)
        for name in names - baseline:
            s = step_of(name)
            if (s is not None and not name.startswith("manifest")
                    and f"manifest{s:06d}.json" not in names):
                return True
        return False
    return pred


def _crash_state(log_dir, rates, baseline):
    """What a kill left behind: new temp files, and new files of steps that are not complete."""
    names = top_level_names(log_dir) - baseline
    temps = sorted(n for n in names if TEMP_FILE_RE.search(n))
    done = set(complete_steps(log_dir, rates))
    partial = sorted(n for n in names if step_of(n) is not None and step_of(n) not in done)
    return temps, partial


# make soak, beside test_soak.py's 200 cycles; in make test: a kill -9 inside a save
# (test_keep_checkpoints_1_and_a_kill_9...), of one rank (test_dist_faults), of the writer process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_at_random_moments_always_resumes_from_a_complete_step(tmp_path, images):
    from improved_diffusion.ckpt import run_dir

    rng = random.Random(20261130)
    log_dir = tmp_path / "run"
    cmd = [PY, SLOW_SAVE_TRAIN, *train_args(images(14), log_dir, "--save_interval", 1,
                                            "--ema_rate", TWO_EMAS)]
    env = child_env({"SLOW_SAVE_S": "0.02"})
    kills, mid_save, history = 0, 0, []
    for trial in range(KILL_TRIALS + 1):
        final = trial == KILL_TRIALS
        steps = complete_steps(log_dir, TWO_EMAS, deep=True)
        expected = steps[-1] if steps else None
        if expected is not None:  # the library agrees with our reading of the directory
            st = run_dir.latest_complete_step(str(log_dir), warn=None)
            assert st is not None and st.step == expected, (trial, expected, st)
        log_path = tmp_path / f"trial{trial:02d}.log"
        with open(log_path, "w") as log_f:
            target = (expected or 0) + 3 if final else KILL_MAX_STEPS
            proc = subprocess.Popen([str(c) for c in cmd + ["--max_steps", target]], cwd=REPO,
                                    env=env, stdout=log_f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        mode = "to the end" if final else ("random", "in a save", "between files")[trial % 3]
        baseline = set()
        try:
            if not final:
                # Let the run save one complete step of its own (so every trial resumes from a
                # newer step), then kill it at a random moment, or once its next save has begun.
                def saved_one():
                    return (complete_steps(log_dir, TWO_EMAS) or [0])[-1] > (expected or 0)
                hit = _poll(saved_one, proc, timeout=90, interval=0.005)
                baseline = top_level_names(log_dir)
                if mode == "random":  # anywhere: startup, a step, a save, a prune
                    deadline = time.monotonic() + rng.uniform(0.0, 1.5)
                    while time.monotonic() < deadline and proc.poll() is None:
                        time.sleep(0.005)
                else:
                    hit = hit and _poll(_new_save_started(log_dir, baseline), proc, timeout=60)
                if hit and mode == "between files":
                    _poll(_final_file_without_manifest(log_dir, baseline), proc, timeout=30)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=hang_s(120))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = log_path.read_text()
        temps, partial = _crash_state(log_dir, TWO_EMAS, baseline)
        history.append(f"trial {trial} ({mode}): resumed from {expected}, rc {rc}, "
                       f"complete now {complete_steps(log_dir, TWO_EMAS)[-2:]}, "
                       f"temp {temps}, partial {partial}")
        assert rc in (0, -signal.SIGKILL), f"trial {trial} exited {rc} by itself:\n{out[-4000:]}"
        if rc == -signal.SIGKILL:
            kills += 1
            mid_save += bool(temps or partial)
        if expected is not None:
            assert resumed_step(out) == expected, (
                f"trial {trial}: newest complete step was {expected}; the run said:\n{out[-3000:]}"
                "\n" + "\n".join(history))
    print("\n".join(history))
    assert rc == 0, out[-3000:]
    assert check_step(log_dir, target, TWO_EMAS, deep=True) is None, "\n".join(history)
    assert kills >= KILL_TRIALS, "\n".join(history)
    stale = sorted(n for n in top_level_names(log_dir) if TEMP_FILE_RE.search(n))
    assert not stale, f"temp files of killed saves left in the log dir: {stale}"
    assert mid_save >= max(1, KILL_TRIALS // 3), (
        "too few kills landed inside a save:\n" + "\n".join(history))


# ------------------------------------------------------------------------------- SIGTERM


@pytest.mark.timeout(150)
# make soak: SIGUSR1 on one rank (SIGUSR1 reaches the same handler in test_preemption's import
# and checkpoint-load tests; SIGTERM to one of 2 ranks here)
@pytest.mark.parametrize("ranks,sig", [(2, signal.SIGTERM),
                                       pytest.param(1, signal.SIGUSR1, marks=pytest.mark.slow)],
                         ids=["sigterm-to-rank1-of-2", "sigusr1-single-rank"])
def test_a_preemption_signal_to_one_rank_saves_a_complete_checkpoint_and_exits_75(
        tmp_path, images, ranks, sig):
    log_dir = tmp_path / "run"
    launcher = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launcher, PY, TRAIN, *train_args(images(14), log_dir, "--max_steps", 100000,
                                             "--save_interval", 100000)]
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log_f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(), stdout=log_f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        def training():
            try:
                return len(progress_rows(log_dir)) >= 3
            except (FileNotFoundError, ValueError, KeyError):
                return False
        assert _poll(training, proc, timeout=90, interval=0.05), log_path.read_text()[-3000:]
        if ranks > 1:
            pids = rank_pids(str(log_dir))
            assert sorted(pids) == list(range(ranks)), pids
            os.kill(pids[ranks - 1], sig)  # not the writer: rank 0 must learn of it from rank 1
        else:
            os.kill(proc.pid, sig)
        rc = proc.wait(timeout=hang_s(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text()
    assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    steps = complete_steps(log_dir, deep=True)
    assert len(steps) == 1, f"complete steps {steps}; files {sorted(top_level_names(log_dir))}"
    s = steps[0]
    logged = progress_rows(log_dir)
    assert max(logged) == s, f"saved step {s}, but progress.csv logged steps up to {max(logged)}"
    assert load_pt(log_dir / f"opt{s:06d}.pt")["trainer"]["step"] == s


# ------------------------------------------------------------------------ keep_checkpoints


@pytest.mark.timeout(150)
def test_keep_checkpoints_2_never_leaves_fewer_than_one_complete_step_on_disk(tmp_path, images):
    log_dir = tmp_path / "run"
    cmd = [PY, SLOW_SAVE_TRAIN, *train_args(images(14), log_dir, "--max_steps", 12,
                                            "--save_interval", 1, "--keep_checkpoints", 2)]
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env({"SLOW_SAVE_S": "0.01"}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)
    reader.start()
    seen_complete, snapshots, violations = False, 0, []
    try:
        end = time.monotonic() + hang_s(120)
        while proc.poll() is None and time.monotonic() < end:
            before = top_level_names(log_dir)
            done = complete_steps(log_dir)
            after = top_level_names(log_dir)
            if before != after:  # the directory changed while we looked: not a snapshot
                continue
            snapshots += 1
            if done:
                seen_complete = True
            elif seen_complete:
                violations.append(sorted(after))
            time.sleep(0.001)
        rc = proc.wait(timeout=hang_s(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=hang_s(10))
    out = "".join(output)
    assert rc == 0, out[-3000:]
    assert not violations, f"no complete step on disk at some moment: {violations[:3]}"
    assert seen_complete and snapshots >= 20, (seen_complete, snapshots)
    assert complete_steps(log_dir, deep=True) == [11, 12]
    leftover = sorted(n for n in top_level_names(log_dir) if step_of(n) not in (None, 11, 12))
    assert not leftover, f"files of pruned steps remain: {leftover}"


@pytest.mark.timeout(150)
def test_keep_checkpoints_1_and_a_kill_9_inside_the_next_save_leave_the_kept_step_resumable(
        tmp_path, images):
    """With one step kept, the save of the next step must not remove it before the new step is
    complete: the job is killed (kill -9) while the new step's last data file is being written
    (slowly: tests/slow_save_train.py), its other two in place, and the kept step must still
    verify and resume.
    (test_save_order checks the order of every removal against the manifests, sync and async.)"""
    log_dir = tmp_path / "run"
    cmd = [PY, SLOW_SAVE_TRAIN, *train_args(images(14), log_dir, "--max_steps", KILL_MAX_STEPS,
                                            "--save_interval", 1, "--keep_checkpoints", 1)]
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log_f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO,
                                env=child_env({"SLOW_SAVE_S": "0.15"}), stdout=log_f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def writing_the_last_file_of_step_3():  # 2 of its 3 files in place, no manifest yet
            names = top_level_names(log_dir)
            return ("manifest000003.json" not in names
                    and len(names & step_names(3, "0.9999")) == 2)
        hit = _poll(writing_the_last_file_of_step_3, proc, timeout=90)
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=hang_s(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert hit and rc == -signal.SIGKILL, f"exit {rc}:\n{out[-3000:]}"
    assert complete_steps(log_dir, deep=True) == [2], sorted(top_level_names(log_dir))
    assert "pruned" in out, out[-3000:]  # step 1 went once step 2 was complete

    out = train(1, images(14), log_dir, "--max_steps", 3, "--save_interval", 1,
                "--keep_checkpoints", 1).stdout
    assert resumed_step(out) == 2, out[-3000:]
    assert complete_steps(log_dir, deep=True) == [3], sorted(top_level_names(log_dir))


# ----------------------------------------------------------------------- never overwrite


@pytest.mark.timeout(150)
def test_a_new_run_in_a_log_dir_with_checkpoints_resumes_and_never_overwrites_a_file(
        tmp_path, images, three_saved_steps):
    data, log_dir = images(14), tmp_path / "run"
    shutil.copytree(three_saved_steps, log_dir)  # a run of 3 steps saved at each

    def ckpt_digests():
        return {n: sha256(log_dir / n) for n in top_level_names(log_dir) if step_of(n) is not None}

    first, rows_before = ckpt_digests(), progress_rows(log_dir)
    out = train(1, data, log_dir, "--max_steps", 5, "--save_interval", 1).stdout
    assert resumed_step(out) == 3, out[-3000:]
    second = ckpt_digests()
    changed = sorted(n for n in first if second.get(n) != first[n])
    assert not changed, f"the resumed run rewrote or removed {changed}"
    assert complete_steps(log_dir, deep=True) == [1, 2, 3, 4, 5]
    rows_after = progress_rows(log_dir)  # appended to (the header may grow), never truncated
    lost = [(step, col) for step, row in rows_before.items() for col, v in row.items()
            if rows_after.get(step, {}).get(col) != v]
    assert not lost, f"progress.csv lost or changed the first run's values {lost[:10]}"

    # Asking for an older step in the same dir must not overwrite the newer steps' files either.
    proc = train(1, data, log_dir, "--max_steps", 5, "--save_interval", 1,
                 "--resume_checkpoint", log_dir / "model000002.pt", check=False)
    changed = sorted(n for n, d in ckpt_digests().items() if second.get(n) != d)
    changed += sorted(set(second) - set(ckpt_digests()))
    assert not changed, f"resuming from step 2 rewrote or removed {changed}:\n{proc.stdout[-3000:]}"
    if proc.returncode != 0:
        assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
        assert proc.stdout.strip().splitlines()[-1].startswith("error:"), proc.stdout[-3000:]


# ---------------------------------------------------------------------- what a resume says


@pytest.mark.timeout(150)
def test_a_resume_with_a_changed_lr_and_an_image_fewer_says_each_once_for_the_job(
        tmp_path, images):
    data = Path(shutil.copytree(images(14), tmp_path / "data"))
    log_dir = tmp_path / "run"
    train_here(*train_args(data, log_dir, "--max_steps", 2, "--lr", "1e-4", "--weight_decay",
                           "0.0"))  # saved by one process, here
    (data / "img_013.png").unlink()  # a file left the data folder
    out = train(2, data, log_dir, "--max_steps", 3, "--lr", "2e-4", "--weight_decay", "0.01",
                "--resume_checkpoint", log_dir / "model000002.pt").stdout
    assert resumed_step(out) == 2, out[-3000:]
    lines = out.splitlines()
    flags = [ln for ln in lines if ln.startswith("resume: --")]
    assert flags == ["resume: --lr 0.0001 -> 0.0002", "resume: --weight_decay 0.0 -> 0.01",
                     "resume: --max_steps 2 -> 3"], (
        out[-3000:])  # one line each, and none for the flags that did not change
    warning = ("warning: the data position was saved for 14 samples but the dataset now has "
               "13; the sample order continues but is not the saved run's")
    assert lines.count(warning) == 1 and "UserWarning" not in out, out[-3000:]
    assert (log_dir / "log.txt").read_text().count("resume: --lr 0.0001 -> 0.0002") == 1


# ------------------------------------------------------------ flags from the checkpoint


# make soak: test_resume_flags.py's flagless 2-rank resume takes every flag from the checkpoint
# and ends bitwise; its noise-clash test keeps the "(the file's: ...)" refusal
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_resume_without_retyped_flags_takes_the_checkpoints_and_ends_bitwise(tmp_path, images):
    """Issue 29, item 8: a resume with only --data_dir, --log_dir (and how long to run) takes
    every model and diffusion flag from the checkpoint, says which in one line, and ends bitwise
    like a straight run (before: it failed naming one of five missing flags, or, with one
    forgotten, silently trained on another noise process); a model flag typed with another value
    is an error naming both values (exit 1), nothing written."""
    data = images(14)
    flags = [*TINY, "--dropout", "0.1", "--learn_sigma", "True"]
    straight, half = tmp_path / "straight", tmp_path / "half"
    run_script("train.py", *flags, "--data_dir", data, "--log_dir", straight, "--max_steps", 4)
    run_script("train.py", *flags, "--data_dir", data, "--log_dir", half, "--max_steps", 2)
    out = run_script("train.py", "--data_dir", data, "--log_dir", half, "--max_steps", 4,
                     "--batch_size", 2, "--log_interval", 1).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("resume: from the checkpoint")]
    assert len(lines) == 1 and "--diffusion_steps 20" in lines[0], out[-3000:]
    assert "--learn_sigma True" in lines[0] and "--dropout 0.1" in lines[0], lines
    assert resumed_step(out) == 2
    for name in ("model000004.pt", "ema_0.9999_000004.pt", "opt000004.pt"):
        diffs = deep_diff(load_pt(straight / name), load_pt(half / name))
        assert not diffs, f"{name}: {diffs[:10]}"

    before = sorted(os.listdir(half))
    proc = run_script("train.py", "--data_dir", data, "--log_dir", half, "--max_steps", 6,
                      "--batch_size", 2, "--diffusion_steps", 100, check=False)
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-3000:]
    assert "--diffusion_steps 100 (the file's: 20)" in errors[0]
    assert "--allow_model_change True" in errors[0]
    assert sorted(os.listdir(half)) == before
