"""The resume conformance run (issue 44): one training run interrupted again and again, resumed on
another rank count and launcher each time, must equal a straight run bit for bit at every step
it stopped at. Anyone can repeat it (``make conformance``); it is not part of ``make test``
(tests/test_same_run.py keeps a 2-hop chain there).

    python benchmarks/conformance.py [--seed 0] [--quick] [--steps 19] [--microbatch 1]
    python benchmarks/conformance.py --chain 1,1 --launchers python --deterministic --json
        (one process per segment: one GPU, --deterministic True; what benchmarks/gpu_check.sh
        runs; --json: one JSON line, figure conformance_bitwise, after the table)

What it runs (scripts/train.py, the tiny class-conditional UNet of tests/test_same_run.py: label
dropout, dropout, the loss-aware schedule sampler, two EMAs; --num_workers 1; a generated image
folder with class-named files; ``--global_batch_size 12 --microbatch 1``, so K = 12 virtual
shards and 1, 2, 3, 4, 6 ranks all work; ``--save_interval 1``: every step's files exist):

1. a straight run of --steps steps (19; 7 with --quick) on 1 rank (plain python);
2. the chain, one segment after another in one log dir, on 2 -> 3 -> 1 -> 4 -> 6 ranks (--quick:
   2 -> 3), launched by mpiexec and torchrun in turn (a segment types the run flags only while
   the log dir has no complete step; the others resume flagless: G, m and the run flags come
   from the checkpoint). Every segment but
   the last is interrupted once its run has a complete step ``k`` (1 or 2) past where it began,
   by one of: SIGTERM to one rank (a random one), SIGTERM to every process of the job (launcher,
   ranks, loader workers: as SLURM does), or ``kill -9`` of every process after a random delay
   of up to a second (it may land in a step or in a save). Which, where and the delays are drawn
   from --seed (the full chain has each kind at least once); when a step is done is the
   machine's. After a SIGTERM the job must save the step it reached and exit 75 (mpiexec; under
   torchrun each worker exits 75, torchrun itself 1); after kill -9 the next segment resumes
   from the last complete step (a manifest whose files match it). The last segment runs to
   --steps.

The table, one row per segment:

    seg  ranks  launcher  interruption  exit  resumed at  ended at  equal  first difference

``resumed at``: the step the segment said it resumed at ("-": it started fresh); ``ended at``: the
newest complete step when it exited; ``equal``: whether the log dir's files at that step equal
the straight run's at the same step, compared as tests/test_same_run.py's ``same_run`` does
(model and EMA files byte for byte, Adam moments, the schedule sampler's history, the
fixed-point exponents, the data position; progress.csv's loss, grad norm, lr and sample columns
of every step up to it; the trainer state's rank count and RNGs differ by design); ``first
difference``: the first thing that differs (a tensor's path in the file), or a failed check of
the segment (its exit, its resume step, its last step's manifest, no step within --timeout
seconds: a hang, the job then killed). Exit 0 only when every row
says yes. The work dir (runs and each job's output) is kept with --keep or when a row says no.
"""
import argparse
import csv
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import cluster_sim as cs  # noqa: E402  (tests/: the process helpers the tests use)
from conftest import MPIEXEC, PY, resumed_step, write_class_folder  # noqa: E402
from test_same_run import RUN, same_run  # noqa: E402  (the same run, the same comparison)

TRAIN = REPO / "scripts" / "train.py"
PREEMPTED = 75
KINDS = ("SIGTERM to one rank", "SIGTERM to every process", "kill -9")
CHAIN = (2, 3, 1, 4, 6)
QUICK_CHAIN = (2, 3)
LAUNCHERS = ("mpiexec", "torchrun")  # in turn; "python": a 1-rank segment, no launcher
COLUMNS = ("seg", "ranks", "launcher", "interruption", "exit", "resumed at", "ended at", "equal",
           "first difference")


def run_flags(microbatch):
    """tests/test_same_run.py's RUN with --microbatch ``microbatch`` and a save every step."""
    flags = list(RUN)
    for name, value in (("--microbatch", microbatch), ("--save_interval", 1)):
        flags[flags.index(name) + 1] = str(value)
    return flags


def min_steps(ranks_chain):
    """The run's steps for a chain: each interrupted segment takes up to 4 (1-2 past its start,
    then the SIGTERM is acted on a step or two later), and the last segment trains 3 at least."""
    return 4 * (len(ranks_chain) - 1) + 3


def plan(seed, ranks_chain, launchers=LAUNCHERS):
    """[(ranks, launcher, interruption or None, steps past the start, kill delay s, rank to
    signal)] of each segment, from ``seed``; the last segment is not interrupted."""
    rng = random.Random(seed)
    n = len(ranks_chain) - 1
    if n >= len(KINDS):  # each kind at least once
        kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(n - len(KINDS))]
        rng.shuffle(kinds)
    else:
        kinds = [rng.choice(KINDS) for _ in range(n)]
    out = []
    for i, ranks in enumerate(ranks_chain):
        kind = kinds[i] if i < n else None
        out.append((ranks, launchers[i % len(launchers)], kind, rng.randint(1, 2),
                    rng.uniform(0, 1), rng.randrange(ranks)))
    return out


def launch(ranks, launcher, args):
    if launcher == "python":
        return [PY, TRAIN, *args]
    if launcher == "mpiexec":
        return [MPIEXEC, "-n", str(ranks), PY, TRAIN, *args]
    return cs.torchrun_one_node(args, "standalone", nproc=ranks, script=TRAIN)


def rank_pids(root):
    """{rank: pid} of the ranks of the job started as ``root`` (PMI_RANK under mpiexec, RANK under
    torchrun), their loader workers (forks with the same environment) left out."""
    env_rank, parent = {}, {}
    for pid in cs.process_tree(root)[1:]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        rank = env.get(b"PMI_RANK", env.get(b"RANK"))
        if rank is not None and TRAIN.name.encode() in cmdline:
            env_rank[pid] = int(rank)
    return {r: p for p, r in env_rank.items() if parent.get(p) not in env_rank}


def newest(log_dir):
    return (cs.complete_steps(log_dir) or [0])[-1]


def run_segment(i, seg, work, log_dir, data, flags, steps, timeout):
    """Run one segment: (its row, a dict of COLUMNS' values up to "ended at"; the problems
    found with it, such as an exit that is not a preemption after a SIGTERM; its output)."""
    ranks, launcher, kind, past, delay, victim = seg
    start = newest(log_dir)
    # the run flags while there is no step to resume (a first segment, or one after a segment
    # that saved nothing), else none: they come from the checkpoint
    args = ["--data_dir", data, "--log_dir", log_dir, "--num_workers", "1", "--save_interval",
            "1", "--max_steps", str(steps), *(flags if start == 0 else [])]
    out_path = work / f"segment{i + 1}.out"
    proc = cs.start(launch(ranks, launcher, args), out_path)
    problems, done = [], kind
    try:
        try:
            cs.wait_until(lambda: newest(log_dir) >= start + past, timeout, (proc,),
                          f"step {start + past}")
        except RuntimeError:  # it ended first (finished, or failed: its exit says)
            done = f"none ({kind}: ended first)" if kind else None
        except TimeoutError:
            problems.append(f"no step {start + past} within {timeout} s (a hang?)")
            done = f"none (no step {start + past} in {timeout} s)"
        if done == kind and kind is not None:
            if kind == "SIGTERM to one rank":
                pids = {0: proc.pid} if launcher == "python" else rank_pids(proc.pid)
                if victim not in pids:
                    problems.append(f"rank {victim} not found among {sorted(pids)}")
                else:
                    os.kill(pids[victim], signal.SIGTERM)
                done = f"SIGTERM to rank {victim} after step {start + past}"
            elif kind == "SIGTERM to every process":
                cs.signal_all(cs.process_tree(proc.pid), signal.SIGTERM)
                done = f"SIGTERM to all after step {start + past}"
            else:
                time.sleep(delay)
                cs.kill9(cs.process_tree(proc.pid))
                done = f"kill -9 {delay:.2f} s after step {start + past}"
        try:
            cs.wait_exit(proc, timeout)
        except TimeoutError:
            problems.append(f"still running {timeout} s later (a hang?): killed")
    finally:
        if proc.poll() is None:
            cs.kill9(cs.process_tree(proc.pid))
            proc.wait()
    rc = proc.returncode
    out = out_path.read_text()
    if kind in ("SIGTERM to one rank", "SIGTERM to every process") and done.startswith("SIGTERM"):
        workers = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
        ok = (rc == PREEMPTED if launcher in ("mpiexec", "python")
              else rc in (1, -15) and (not workers or set(workers) == {PREEMPTED}))
        if not ok or "preempted" not in out:
            problems.append(f"exit {rc} (workers {workers}) after a SIGTERM, not a preemption")
    elif kind is None or done.startswith("none"):
        if rc != 0 and not problems:
            problems.append(f"exit {rc}")
    end = newest(log_dir)
    if end and cs.step_problems(log_dir, end):
        problems.append(f"step {end}: {cs.step_problems(log_dir, end)[0]}")
    resumed = resumed_step(out) if start else None
    if start and resumed != start:
        problems.append(f"resumed at {resumed}, not at the last complete step {start}")
    if end <= start:  # nothing of this rank count was checked
        problems.append(f"trained no step ({start} -> {end}): raise --steps")
    return dict(zip(COLUMNS, (i + 1, ranks, launcher, done or "none", rc,
                              "-" if resumed is None else resumed, end))), problems, out


def compare_at(straight, chain, step, work):
    """tests/test_same_run.py's same_run of the two log dirs at ``step``, with progress.csv's rows
    up to ``step`` (the chain has not run the later ones yet; a killed segment's rows past its
    last save are logged again by the next, and the later row counts)."""
    views = []
    for name, src in (("straight", straight), ("chain", chain)):
        view = work / f"at{step:06d}" / name
        if view.exists():
            shutil.rmtree(view)
        view.mkdir(parents=True)
        for f in Path(src).glob(f"*{step:06d}.pt"):
            (view / f.name).symlink_to(f.resolve())
        with open(Path(src) / "progress.csv", newline="") as f:
            reader = csv.DictReader(f)
            rows = [r for r in reader if r.get("step") and int(r["step"]) <= step]
            fields = reader.fieldnames
        with open(view / "progress.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)
        views.append(view)
    try:
        return same_run(*views, step)
    except (OSError, KeyError, RuntimeError) as e:
        return [f"{type(e).__name__}: {e}"]


def format_table(rows):
    """The rows (dicts of COLUMNS) as a fixed-width text table, a header line first."""
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa
    return "\n".join([line(COLUMNS), line(["-" * w for w in widths])] + [line(r) for r in cells])


def parse_table(text):
    """The rows of a table format_table printed (a list of {column: text}), for scripts that
    read its output: the header gives each column's start."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["seg", "ranks"])
    starts = [lines[head].index(c) for c in COLUMNS]
    rows = []
    for ln in lines[head + 2:]:
        if not ln.split()[0].isdigit():
            break
        rows.append({c: ln[s:(starts[j + 1] if j + 1 < len(starts) else None)].strip()
                     for j, (c, s) in enumerate(zip(COLUMNS, starts))})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="draws the interruptions and their steps")
    ap.add_argument("--quick", action="store_true",
                    help="2 segments (2 -> 3 ranks) instead of 5 (2 -> 3 -> 1 -> 4 -> 6)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps of the run (default: {min_steps(CHAIN)}; {min_steps(QUICK_CHAIN)} "
                         f"with --quick, the fewest it takes)")
    ap.add_argument("--microbatch", type=int, default=1,
                    help="samples per virtual shard (the global batch is 12): 1 lets 4 ranks in")
    ap.add_argument("--work", default=None,
                    help="work dir (default: a new temporary one; runs left there are replaced)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a job may take (hangs)")
    ap.add_argument("--chain", default=None,
                    help="the segments' rank counts, comma-separated (default 2,3,1,4,6; "
                         "--quick: 2,3)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help="the segments' launchers in turn, of mpiexec, torchrun, python (python: "
                         "1-rank segments only)")
    ap.add_argument("--deterministic", action="store_true",
                    help="every job with --deterministic True (the straight run too)")
    ap.add_argument("--json", action="store_true",
                    help="also one JSON line (figure conformance_bitwise) at the end")
    args = ap.parse_args()
    # a SIGTERM (a timeout around this script) ends it through its finally blocks, which kill
    # the running job: it runs in a session of its own, which the signal does not reach
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chain = QUICK_CHAIN if args.quick else CHAIN
    if args.chain:
        try:
            chain = tuple(int(r) for r in args.chain.split(","))
        except ValueError:
            chain = ()
        if len(chain) < 2 or min(chain) < 1:
            ap.error(f"--chain {args.chain}: at least two rank counts >= 1, e.g. 1,1")
    launchers = tuple(args.launchers.split(","))
    if set(launchers) - {"mpiexec", "torchrun", "python"}:
        ap.error(f"--launchers {args.launchers}: of mpiexec, torchrun, python")
    if any(launchers[i % len(launchers)] == "python" and r != 1 for i, r in enumerate(chain)):
        ap.error("--launchers python: only for 1-rank segments (--chain 1,1)")
    steps = args.steps or min_steps(chain)
    K = 12 // args.microbatch
    if 12 % args.microbatch or any(K % r for r in chain):
        ap.error(f"--microbatch {args.microbatch}: 12/m shards must split over "
                 f"{', '.join(map(str, chain))} ranks (take 1)")
    segments = plan(args.seed, chain, launchers)
    if steps < min_steps(chain):
        ap.error(f"--steps {steps}: too few for {len(chain)} segments (at least "
                 f"{min_steps(chain)})")
    work = Path(args.work or tempfile.mkdtemp(prefix="conformance"))
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / "straight", work / "chain", *work.glob("at[0-9]*")]:  # a --work used before
        shutil.rmtree(old, ignore_errors=True)
    data = write_class_folder(work / "data", per_class=5)
    flags = run_flags(args.microbatch) + (["--deterministic", "True"] if args.deterministic
                                          else [])
    print(f"conformance: seed {args.seed}, {steps} steps, global batch 12, microbatch "
          f"{args.microbatch}, ranks {' -> '.join(map(str, chain))}; work dir {work}", flush=True)
    t0 = time.monotonic()
    straight = work / "straight"
    with open(work / "straight.out", "w") as out:
        proc = subprocess.run([PY, str(TRAIN), "--data_dir", str(data), "--log_dir",
                               str(straight), "--num_workers", "1", *flags, "--max_steps",
                               str(steps)], cwd=REPO, env=cs.child_env(), stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=args.timeout)
    if proc.returncode or newest(straight) != steps:
        sys.exit(f"the straight run failed (exit {proc.returncode}): see {work / 'straight.out'}")
    print(f"straight run on 1 rank: {steps} steps ({time.monotonic() - t0:.0f} s)", flush=True)
    log_dir = work / "chain"
    rows, failures = [], []
    for i, seg in enumerate(segments):
        row, problems, _ = run_segment(i, seg, work, log_dir, data, flags, steps, args.timeout)
        diffs = compare_at(straight, log_dir, row["ended at"], work) if row["ended at"] else \
            ["no complete step"]
        row["equal"] = "yes" if not (diffs or problems) else "no"
        row["first difference"] = (problems + diffs)[0] if problems or diffs else "-"
        rows.append(row)
        if problems or diffs:
            failures.append((i + 1, problems + diffs))
        print(f"segment {i + 1}: {row['ranks']} rank(s) by {row['launcher']}, {row['interruption']}"
              f", exit {row['exit']}, steps {row['resumed at']} -> {row['ended at']}: "
              f"{row['equal']} ({time.monotonic() - t0:.0f} s)", flush=True)
    if rows[-1]["ended at"] != steps:
        failures.append((len(rows), [f"the chain ended at step {rows[-1]['ended at']}, not {steps}"]))
    print()
    print(format_table(rows))
    for seg, diffs in failures:
        print(f"\nsegment {seg}:\n  " + "\n  ".join(diffs[:20]))
    ok = not failures
    print(f"\n{sum(r['equal'] == 'yes' for r in rows)}/{len(rows)} segments equal to the straight "
          f"run ({time.monotonic() - t0:.0f} s){'' if ok else '; work dir kept: ' + str(work)}")
    if args.json:
        import json

        import torch as th

        cuda = th.cuda.is_available()
        print(json.dumps({
            "figure": "conformance_bitwise", "value": ok, "steps": steps,
            "chain": list(chain), "launchers": list(launchers),
            "deterministic": args.deterministic, "global_batch_size": 12,
            "microbatch": args.microbatch, "device": "cuda" if cuda else "cpu",
            "device_name": th.cuda.get_device_name(0) if cuda else "cpu",
            "segments": [{k: r[k] for k in COLUMNS} for r in rows],
            "differences": [d for _, ds in failures for d in ds][:20],
            "command": "python benchmarks/conformance.py " + " ".join(sys.argv[1:])}),
            flush=True)
    if ok and not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
