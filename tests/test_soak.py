"""Soak: many save/resume cycles of a tiny model with random kills (issue 9). Marked slow: the
default suite skips it; `make soak` runs it. SOAK_CYCLES (default 200) sets the number of cycles.

test_cycles: SOAK_CYCLES jobs of scripts/train.py, alternating between two log dirs:
  - "elastic": each job on 1, 2 or 3 ranks (random);
  - "fixed": each job on 2 ranks, so that its final state can be compared bit for bit with one
    uninterrupted 2-rank run to the same step (an elastic run follows another trajectory).
Each job, with --keep_checkpoints 2, either runs to a nearby --max_steps, or is killed with
SIGKILL at a random moment (the whole job, or one rank: a dead node), or gets a SIGTERM on one rank
at a random moment of training (a preemption: save, exit 75). After every job we check, with our
own reading of the files: it resumed from the newest complete step; that step never goes back; the
steps on disk stay within --keep_checkpoints (plus one interrupted save); a job that ended by itself
left no temp file and only complete steps.

test_a_long_lived_process...: one process per rank (mpiexec -n 2) builds, runs and closes a
TrainLoop SOAK_CYCLES times (save, resume, prune, some preemptions), reporting its open file
descriptors and RSS; neither may grow with the number of cycles.
"""
import io
import json
import os
import random
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cluster_sim import matches_manifest
from conftest import (MPIEXEC, PY, REPO, child_env, deep_diff, hang_s, process_tree, resumed_step,
                      run_module_mpi, signal_all, write_images)

pytestmark = pytest.mark.slow

CYCLES = int(os.environ.get("SOAK_CYCLES", "200"))
KEEP = 2
SAVE_INTERVAL = 3
TRAIN = REPO / "scripts" / "train.py"
TINY = [
    "--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--seed", "0",
]
STEP_FILE_RE = re.compile(r"^(?:model|opt|manifest)(\d{6,})\.(?:pt|json)$|^ema_.+_(\d{6,})\.pt$")
TEMP_RE = re.compile(r"\.tmp")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), seed=14)


# ------------------------------------------------------------------ our reading of a log dir


def step_of(name):
    m = STEP_FILE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def top_names(d):
    try:
        return {e.name for e in os.scandir(d) if e.is_file()}
    except FileNotFoundError:
        return set()


def complete(log_dir, step, deep=False):
    """Step `step` has a manifest listing model, EMA and opt, each present with its size (and
    checksum + a weights_only load of the right step when deep)."""
    try:
        files = json.loads((Path(log_dir) / f"manifest{step:06d}.json").read_text())["files"]
    except (FileNotFoundError, ValueError, KeyError):
        return False
    if set(files) != {f"model{step:06d}.pt", f"opt{step:06d}.pt", f"ema_0.9999_{step:06d}.pt"}:
        return False
    for name, info in files.items():
        p = Path(log_dir) / name
        if not p.exists() or p.stat().st_size != info["size"]:
            return False
        if deep:
            data = p.read_bytes()
            if not matches_manifest(data, info):
                return False
            if torch.load(io.BytesIO(data), weights_only=True)["step"] != step:
                return False
    return True


def steps_on_disk(log_dir):
    return sorted({step_of(n) for n in top_names(log_dir)} - {None})


def newest_complete(log_dir):
    for s in reversed(steps_on_disk(log_dir)):
        if complete(log_dir, s):
            return s
    return None


def quarantined(log_dir):
    """(number of step folders, bytes) under log_dir/incomplete (interrupted saves moved away)."""
    root = Path(log_dir) / "incomplete"
    if not root.is_dir():
        return 0, 0
    return (sum(1 for _ in root.iterdir()),
            sum(p.stat().st_size for p in root.rglob("*") if p.is_file()))


# ------------------------------------------------------------------------------- one job



def rank_pids(root):
    """The pids of the ranks (processes running train.py) of the job started as `root`."""
    out = []
    for pid in process_tree(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"train.py" in cmdline and not cmdline.startswith(str(MPIEXEC).encode()):
            out.append(pid)
    return out


def leftovers(marker):
    """Processes still running train.py on the log dir `marker` (a job's ranks that outlived it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if b"train.py" in cmdline and marker.encode() in cmdline and state != "Z":
                pids.append(int(entry))
    return pids


def progress_lines(log_dir):
    try:
        return (Path(log_dir) / "progress.csv").read_text().splitlines()
    except FileNotFoundError:
        return []


def progress_rows_up_to(log_dir, step):
    """progress.csv's rows (lists of cells) of steps up to ``step``."""
    rows = progress_lines(log_dir)
    if not rows:
        return []
    i = rows[0].split(",").index("step")
    out = []
    for r in rows[1:]:
        try:
            if float(r.split(",")[i]) <= step:
                out.append(r)
        except (IndexError, ValueError):  # a row cut short by a kill
            pass
    return out


def trained_past(log_dir, step, lines_before):
    """This job (progress.csv grew beyond `lines_before` lines) logged a step > `step`: it is
    training, past its resume point (with its preemption handlers installed)."""
    rows = progress_lines(log_dir)
    if len(rows) <= max(lines_before, 1):
        return False
    header = rows[0].split(",")
    try:
        return float(rows[-1].split(",")[header.index("step")]) > step
    except (IndexError, ValueError):
        return False


def wait_until(pred, proc, timeout=120):
    end = time.monotonic() + hang_s(timeout)
    while not pred() and proc.poll() is None:
        assert time.monotonic() < end, f"waited {hang_s(timeout)} s for the job to start training"
        time.sleep(0.01)


def run_job(images, log_dir, ranks, max_steps, action, rng, log_path):
    """Start train.py on `ranks` ranks; `action`: "finish" | "kill9" | "sigterm". Returns
    (exit code, output)."""
    cmd = [PY, TRAIN, *TINY, "--data_dir", images, "--log_dir", log_dir, "--save_interval",
           SAVE_INTERVAL, "--keep_checkpoints", KEEP, "--max_steps", max_steps]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", ranks, *cmd]
    start_step = newest_complete(log_dir) or 0
    # the rows up to the resumed step: the job drops those of later steps (a killed job's)
    lines_before = 1 + sum(1 for r in progress_rows_up_to(log_dir, start_step))
    with open(log_path, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        if action == "kill9":  # anywhere: start-up, resume, a step, a save, a prune
            if rng.random() < 0.7:  # mostly once training, so that the run moves on
                wait_until(lambda: trained_past(log_dir, start_step, lines_before), proc)
            deadline = time.monotonic() + rng.uniform(0.0, 3.0)
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
            if proc.poll() is None:
                pids = rank_pids(proc.pid)
                if ranks > 1 and pids and rng.random() < 0.5:
                    # one rank dies (a lost node); the launcher must end the rest
                    os.kill(rng.choice(pids), signal.SIGKILL)
                else:  # the whole job dies at once
                    signal_all(process_tree(proc.pid), signal.SIGKILL)
        elif action == "sigterm":  # a preemption while training, to one rank
            wait_until(lambda: trained_past(log_dir, start_step, lines_before), proc)
            time.sleep(rng.uniform(0.0, 1.0))
            if proc.poll() is None:
                os.kill(rng.choice(rank_pids(proc.pid) or [proc.pid]), signal.SIGTERM)
        proc.wait(timeout=hang_s(180))
    finally:
        if proc.poll() is None:
            signal_all(process_tree(proc.pid), signal.SIGKILL)
            proc.wait()
    # Nothing of the job may outlive it (a rank left running would write into the log dir).
    left = []
    for _ in range(50):
        left = leftovers(str(log_dir))
        if not left:
            break
        time.sleep(0.1)
    signal_all(left, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their job (rc {proc.returncode})"
    return proc.returncode, Path(log_path).read_text()


# --------------------------------------------------------------------------------- tests


@pytest.mark.timeout(max(600, CYCLES * 40))
def test_cycles_of_random_kills_and_preemptions_keep_disk_bounded_and_end_like_a_straight_run(
        tmp_path, images):
    rng = random.Random(int(os.environ.get("SOAK_SEED", "9")))
    dirs = {"elastic": tmp_path / "elastic", "fixed": tmp_path / "fixed"}
    history, counts, worst = [], {}, {"steps": 0, "quarantined": (0, 0)}
    t0 = time.monotonic()
    for cycle in range(CYCLES + 2):  # + a last job to the end in each log dir
        which = "elastic" if cycle % 2 == 0 else "fixed"
        log_dir = dirs[which]
        last = cycle >= CYCLES
        ranks = 2 if which == "fixed" else rng.choice([1, 2, 3])
        before = newest_complete(log_dir)
        action = "finish" if last else rng.choice(["finish", "kill9", "kill9", "sigterm"])
        base = before or 0
        max_steps = (base + rng.randint(1, 2 * SAVE_INTERVAL) if action == "finish"
                     else base + 50 * SAVE_INTERVAL)
        rc, out = run_job(images, log_dir, ranks, max_steps, action, rng,
                          tmp_path / f"job{cycle:04d}.log")
        after = newest_complete(log_dir)
        on_disk = steps_on_disk(log_dir)
        q = quarantined(log_dir)
        counts[(action, rc)] = counts.get((action, rc), 0) + 1
        worst["steps"] = max(worst["steps"], len(on_disk))
        worst["quarantined"] = max(worst["quarantined"], q)
        history.append(f"{cycle} {which} n={ranks} {action} max={max_steps}: rc {rc}, newest "
                       f"{before} -> {after}, on disk {on_disk}, quarantined {q}")
        where = f"\n{out[-3000:]}\n" + "\n".join(history[-10:])

        ended_by_itself = action == "finish" or (action == "sigterm" and rc in (0, 75))
        if action == "finish":
            assert rc == 0, where
            assert after == max_steps and complete(log_dir, after, deep=True), where
        if action == "sigterm":
            assert rc == 75, where
        if before is not None and ended_by_itself:
            assert resumed_step(out) == before, where
        assert (after or 0) >= (before or 0), "the newest complete step went back" + where
        assert len(on_disk) <= KEEP + 1, "more steps on disk than --keep_checkpoints 2 + 1" + where
        if ended_by_itself:
            names = top_names(log_dir)
            assert not [n for n in names if TEMP_RE.search(n)], where
            assert len(on_disk) <= KEEP and all(complete(log_dir, s) for s in on_disk), where

    # The fixed-world log dir ends bit for bit where one uninterrupted 2-rank run ends.
    final = newest_complete(dirs["fixed"])
    straight = tmp_path / "straight"
    rc, out = run_job(images, straight, 2, final, "finish", rng, tmp_path / "straight.log")
    assert rc == 0, out[-3000:]
    diffs = []
    for name in (f"model{final:06d}.pt", f"ema_0.9999_{final:06d}.pt", f"opt{final:06d}.pt"):
        a = torch.load(straight / name, weights_only=True)
        b = torch.load(dirs["fixed"] / name, weights_only=True)
        diffs += [f"{name}{p}" for p in deep_diff(a, b)]
    took = time.monotonic() - t0
    summary = (f"{CYCLES} cycles in {took:.0f} s ({took / max(CYCLES, 1):.1f} s/cycle); "
               f"outcomes {sorted(counts.items())}; final steps "
               f"{ {k: newest_complete(d) for k, d in dirs.items()} }; most steps on disk "
               f"{worst['steps']}; most quarantined (dirs, bytes) {worst['quarantined']}")
    print(summary)
    assert not diffs, "final state differs from the straight run:\n" + "\n".join(diffs[:30])
    kills = sum(n for (a, _), n in counts.items() if a == "kill9")
    assert CYCLES < 8 or kills >= 1, summary
    # Interrupted saves moved to incomplete/ must not pile up: at most one step's worth.
    for d in dirs.values():
        assert quarantined(d)[0] <= 1, f"{d}: {quarantined(d)} quarantined\n{summary}"


FD_RSS_CODE = textwrap.dedent("""
    import dataclasses, json, os, runpy, signal, sys
    train = runpy.run_path({train!r})
    from improved_diffusion import train_job  # (train.py put the repo on sys.path)
    cycles, argv = {cycles}, {argv!r}

    def fds():
        return len(os.listdir("/proc/self/fd"))

    def rss_kb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    def report(tag, cycle):
        rank = int(os.environ.get("PMI_RANK", "0"))
        sys.stdout.write(json.dumps({{"tag": tag, "rank": rank, "cycle": cycle, "fds": fds(),
                                     "rss_kb": rss_kb()}}) + "\\n")
        sys.stdout.flush()

    codes = []
    for cycle in range(cycles):
        args = train["create_argparser"]().parse_args(argv)
        train_job.check_train_args(args)
        lock = train_job.start_job(args)
        loop = train_job.make_loop(args, train["build"](args))
        loop.config = dataclasses.replace(loop.config, max_steps=loop.resume_step + 2)
        if cycle % 3 == 2 and loop.rank == 1:  # a preemption signal on one rank, mid-run
            run_step = loop.run_step

            def preempted_step(*a, **k):
                run_step(*a, **k)
                signal.raise_signal(signal.SIGTERM)
            loop.run_step = preempted_step
        try:
            codes.append(train_job.run_and_close(loop))
        finally:
            lock.release()
        del loop
        if cycle == {warmup} - 1:
            report("warm", cycle)
    report("end", cycles - 1)
    sys.stdout.write(json.dumps({{"codes": codes}}) + "\\n")
""")


@pytest.mark.timeout(max(600, CYCLES * 10))
def test_a_long_lived_process_keeps_file_descriptors_and_memory_bounded_over_cycles(
        tmp_path, images):
    warmup = min(5, max(1, CYCLES // 4))
    argv = [*TINY, "--data_dir", str(images), "--log_dir", str(tmp_path / "run"),
            "--save_interval", "1", "--keep_checkpoints", str(KEEP)]
    code = FD_RSS_CODE.format(train=str(TRAIN), cycles=max(CYCLES, warmup + 2), argv=argv,
                              warmup=warmup)
    out = run_module_mpi(2, code, timeout=max(600, CYCLES * 10) - 30).stdout
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    by = {(r["tag"], r["rank"]): r for r in rows if "tag" in r}
    codes = [r["codes"] for r in rows if "codes" in r]
    assert len(codes) == 2 and all(75 in c and set(c) <= {0, 75} for c in codes), out[-3000:]
    summary = []
    for rank in (0, 1):
        warm, end = by[("warm", rank)], by[("end", rank)]
        summary.append(f"rank {rank}: fds {warm['fds']} -> {end['fds']} "
                       f"(cycles {warm['cycle']} -> {end['cycle']}), rss "
                       f"{warm['rss_kb'] // 1024} -> {end['rss_kb'] // 1024} MiB")
    print("; ".join(summary))
    for rank in (0, 1):
        warm, end = by[("warm", rank)], by[("end", rank)]
        assert end["fds"] <= warm["fds"] + 2, summary
        assert end["rss_kb"] - warm["rss_kb"] <= 96 * 1024, summary
    assert len(list((tmp_path / "run").glob("manifest*.json"))) <= KEEP
