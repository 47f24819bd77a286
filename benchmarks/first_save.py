"""A run's first saves against its later ones, each run a fresh process (issue 56 item 10).

Every run is scripts/train.py itself (its TrainLoop and Checkpointer, built as train.py builds
them, async saves, the writer --save_writer chooses) in a process of its own, one rank, one
torch thread, on the UNet of ``--size`` at 8x8 (43M: the issue's, benchmarks/fsdp_memory.py's
~43M-parameter UNet; or a key of sizes.LIGHT), batch 2, random 8x8 images. Before each run of
``--first_runs``, the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``) when
this process may (root; ``cold`` in each line says whether it was). Each such run trains
``--steps`` (12) steps saving every 3 and records, for each save, the pause (the wall time of
Checkpointer.save() on the training thread; ``waited_s``: the part of it that waited for the
previous save's write; ``minor_faults``: the process's page faults inside it, getrusage), the
log's "saved step N ... in X s" at full precision (``write_s``), and after its last save three
synchronous saves (--async_save False) of the same state (``sync_save_s``), and one host memcpy of
the step's bytes (benchmarks/checkpoint.py's memcpy_s); the writer process's main thread is
sampled every 5 ms from the Checkpointer's construction (``writer_timeline``: its wchan at each
change; unix_stream_read_generic: started, waiting for work), beside ``first_save_at_s``.
Figures (median over the runs):

- ``first_save_pause_over_third`` (goal <= 1.2): a run's first save's pause over its third's,
  each less its wait for the previous save's write (reported), with the second's
  (``second_save_pause_over_third``) and every pause in memcpys;
- ``first_save_write_over_sync_save`` (goal <= 1.3): the first save's "saved ... in X s" over the
  median of the same run's synchronous saves (and over its third save's write), with the writer
  process's state when the first save came (``writer_at_first_save``: its main thread's wchan
  and its CPU seconds so far: still starting, or waiting for work);
- ``extra_wall_per_save_over_memcpy`` (goal <= 2): the whole job's wall (the process, from its
  start to its exit) of ``--wall_steps`` (45) steps saving every 3 (15 saves) over the same job
  saving once (its final save), in ``--wall_pairs`` pairs in alternating order, warm page cache;
  the extra wall per extra save in memcpys of the step, with where it goes: the saves' pauses,
  the steps (slowed beside the writes), the rest of the loop, and outside the loop (start-up,
  exit).

One JSON line per figure with its goal and the command. Usage:

    OMP_NUM_THREADS=1 python benchmarks/first_save.py [--size 43M] [--first_runs 3]
        [--wall_pairs 3] [--dir DIR] [--figures first,wall]

(also ``python benchmarks/bg_save.py --first_runs N ...``, which runs this.)
"""
import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

# benchmarks/fsdp_memory.py's model: the 43M-parameter UNet at 8x8
FLAGS_43M = ["--image_size", "8", "--num_channels", "128", "--channel_mult", "1,2,2,2",
             "--num_res_blocks", "2", "--attention_resolutions", "4,2,1"]


def size_flags(size):
    """train.py's model flags of ``size``: 43M, or a key of sizes.LIGHT (its learned sigma)."""
    if size == "43M":
        return FLAGS_43M
    from sizes import LIGHT

    if size not in LIGHT:
        raise SystemExit(f"--size: 43M or one of {', '.join(LIGHT)} (got {size!r})")
    flags = dict(LIGHT[size], learn_sigma=True)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def drop_caches():
    """Drop the page cache (root only); returns whether it was dropped, or why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        return f"not dropped: {e}"


def writer_state(pid):
    """The writer process's main thread as seen from here: (state, wchan, CPU seconds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return {"state": fields[0], "wchan": wchan,
            "cpu_s": round((int(fields[11]) + int(fields[12])) / tick, 2)}


# ------------------------------------------------------------------------------- the child

T0 = [0.0]  # perf_counter at the end of the Checkpointer's construction (watch: its start)


def watch(pid, timeline, every=0.005, until=30.0):
    """Sample the writer process's main thread's wchan every ``every`` s for ``until`` s after
    the Checkpointer's construction, appending (seconds since, wchan) at each change: when it
    has started, it waits for work in unix_stream_read_generic."""
    T0[0] = t0 = time.perf_counter()
    last = None
    while time.perf_counter() - t0 < until:
        seen = writer_state(pid)
        if seen is None:
            return
        if seen["wchan"] != last:
            last = seen["wchan"]
            timeline.append((round(time.perf_counter() - t0, 3), last, seen["cpu_s"]))
        time.sleep(every)



def child(record, argv, sync_saves):
    """Run scripts/train.py with ``argv`` in this process, recording every save (see the module
    docstring) into the JSON file ``record``; ``sync_saves`` synchronous saves after the run."""
    from improved_diffusion import train_util
    from improved_diffusion.ckpt import checkpointer as ck

    rec = {"saves": [], "logged": {}, "steps": [], "waits": [], "sync_save_s": []}
    save, log_saved, collect = (ck.Checkpointer.save, ck.Checkpointer._log_saved,
                                ck.Checkpointer._collect_save)
    run_step, run_loop = train_util.TrainLoop.run_step, train_util.TrainLoop.run_loop

    init = ck.Checkpointer.__init__

    def watched_init(self, *a, **kw):
        init(self, *a, **kw)
        proc = getattr(self, "_warm_writer", None)
        if sync_saves and "writer_timeline" not in rec and getattr(proc, "pid", None):
            rec["writer_timeline"] = []  # (s since the construction, wchan) at each change
            threading.Thread(target=watch, args=(proc.pid, rec["writer_timeline"]),
                             daemon=True).start()

    def timed_save(self, step, wait=False):
        proc = self._process if self._process is not None else getattr(self, "_warm_writer", None)
        seen = writer_state(proc.pid) if getattr(proc, "pid", None) else None
        rec["waits"].clear()
        rec.setdefault("first_save_at_s", time.perf_counter() - T0[0])
        mods = set(sys.modules)
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        try:
            return save(self, step, wait)
        finally:
            rec["saves"].append(dict(
                step=int(step), s=time.perf_counter() - t0, wait=wait,
                waited_s=sum(rec["waits"]), async_save=self.config.async_save, writer=seen,
                minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                imported=sorted(set(sys.modules) - mods)))

    def timed_collect(self, block):
        t0 = time.perf_counter()
        try:
            return collect(self, block)
        finally:
            if block:
                rec["waits"].append(time.perf_counter() - t0)

    def logged(self, step, took, paused, prune_lines):
        rec["logged"].setdefault(int(step), []).append(took)
        return log_saved(self, step, took, paused, prune_lines)

    def timed_step(self, batch, cond):
        t0 = time.perf_counter()
        run_step(self, batch, cond)
        rec["steps"].append(time.perf_counter() - t0)

    def timed_loop(self):
        t0 = time.perf_counter()
        code = run_loop(self)
        rec["loop_s"] = time.perf_counter() - t0
        c = self.checkpointer
        rec["writer"] = c.save_writer_chosen
        rec["step_bytes"] = getattr(c._process, "nbytes", None)
        c.config = dataclasses.replace(c.config, async_save=False)
        for i in range(sync_saves):
            c.save(self.step + 1 + i)
            rec["sync_save_s"].append(rec["logged"][self.step + 1 + i][-1])
        if sync_saves:
            import checkpoint as cb  # benchmarks/checkpoint.py

            rec["memcpy_s"] = cb.memcpy_s(rec["step_bytes"] or 1)
        return code

    ck.Checkpointer.__init__ = watched_init
    ck.Checkpointer.save, ck.Checkpointer._log_saved = timed_save, logged
    ck.Checkpointer._collect_save = timed_collect
    train_util.TrainLoop.run_step, train_util.TrainLoop.run_loop = timed_step, timed_loop
    script = os.path.join(REPO, "scripts", "train.py")
    sys.argv = [script] + argv
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rec["exit"] = e.code
    rec["logged"] = {str(k): v for k, v in rec["logged"].items()}
    with open(record, "w") as f:
        json.dump(rec, f)


# ------------------------------------------------------------------------------- the parent


def one_run(d, name, train_flags, sync_saves, cold):
    """A fresh process of scripts/train.py (``child``) in log dir ``d/name``; returns (its
    record, the process's wall seconds, the page cache's state)."""
    log_dir, record = os.path.join(d, name), os.path.join(d, name + ".json")
    dropped = drop_caches() if cold else False
    cmd = [sys.executable, os.path.abspath(__file__), "--child", record,
           "--sync_saves", str(sync_saves), "--", *train_flags, "--log_dir", log_dir]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}")
    with open(record) as f:
        rec = json.load(f)
    subprocess.run(["rm", "-rf", log_dir, record])
    return rec, wall, dropped


def first_figures(args, d, base, cmd, common):
    runs = []
    for i in range(args.first_runs):
        rec, wall, cold = one_run(d, f"first{i}", base + ["--save_interval", "3",
                                  "--max_steps", str(args.steps)], 3, args.cold)
        asyncs = [s for s in rec["saves"] if s["async_save"] and not s["wait"]]
        runs.append(dict(rec=rec, asyncs=asyncs, cold=cold, wall=wall))
    r3 = lambda x: round(x, 4)  # noqa: E731
    own = lambda s: s["s"] - s["waited_s"]  # noqa: E731  (less the wait for the save before)
    first = [own(r["asyncs"][0]) / own(r["asyncs"][2]) for r in runs]
    second = [own(r["asyncs"][1]) / own(r["asyncs"][2]) for r in runs]
    per_run = [dict(cold=r["cold"], pauses_s=[r3(s["s"]) for s in r["asyncs"]],
                    pauses_in_memcpys=[round(s["s"] / r["rec"]["memcpy_s"], 2)
                                       for s in r["asyncs"]],
                    waited_s=[r3(s["waited_s"]) for s in r["asyncs"]],
                    minor_faults=[s["minor_faults"] for s in r["asyncs"]],
                    imported_in_first_save=r["asyncs"][0]["imported"],
                    write_s=[r3(r["rec"]["logged"][str(s["step"])][0]) for s in r["asyncs"]],
                    sync_save_s=[r3(x) for x in r["rec"]["sync_save_s"]],
                    memcpy_s=r3(r["rec"]["memcpy_s"]), step_s=r3(statistics.median(
                        r["rec"]["steps"])), writer_at_first_save=r["asyncs"][0]["writer"],
                    first_save_at_s=r3(r["rec"].get("first_save_at_s", 0)),
                    writer_timeline=r["rec"].get("writer_timeline", [])[:40],
                    job_wall_s=round(r["wall"], 2)) for r in runs]
    writer = runs[0]["rec"].get("writer")
    extra = dict(common, steps=args.steps, writer=writer, step_bytes=runs[0]["rec"]["step_bytes"],
                 runs=per_run)
    cold = [r["cold"] for r in runs]
    emit("first_save_pause_over_third", statistics.median(first), "ratio", cmd, goal="<= 1.2",
         ratios=[round(x, 3) for x in first], cold_cache=cold, **extra)
    emit("second_save_pause_over_third", statistics.median(second), "ratio", cmd,
         ratios=[round(x, 3) for x in second], cold_cache=cold, **common)
    writes = [r["rec"]["logged"][str(r["asyncs"][0]["step"])][0]
              / statistics.median(r["rec"]["sync_save_s"]) for r in runs]
    later = [r["rec"]["logged"][str(r["asyncs"][0]["step"])][0]
             / r["rec"]["logged"][str(r["asyncs"][2]["step"])][0] for r in runs]
    emit("first_save_write_over_sync_save", statistics.median(writes), "ratio", cmd,
         goal="<= 1.3", ratios=[round(x, 3) for x in writes], cold_cache=cold,
         first_write_over_third_write=[round(x, 3) for x in later],
         note="the log's 'saved step N in X s' of the run's first save over the median of the "
              "same run's synchronous saves of the same state (per_run: "
              "first_save_pause_over_third)",
         **common)


def wall_figures(args, d, base, cmd, common):
    walls, recs = {3: [], 0: []}, {3: [], 0: []}
    for p in range(args.wall_pairs):
        for interval in ((3, 0) if p % 2 == 0 else (0, 3)):
            rec, wall, _ = one_run(d, f"wall{p}_{interval}", base + [
                "--save_interval", str(interval), "--max_steps", str(args.wall_steps)], 0, False)
            walls[interval].append(wall)
            recs[interval].append(rec)
    saves = {k: len(recs[k][0]["logged"]) for k in recs}  # the steps saved
    n = saves[3] - saves[0]
    med = statistics.median

    def part(f):
        return (med(f(r) for r in recs[3]) - med(f(r) for r in recs[0])) / n

    extra = (med(walls[3]) - med(walls[0])) / n
    _, _, memcpy = memcpy_of(args, d, base)
    pauses = part(lambda r: sum(s["s"] for s in r["saves"]))
    waits = part(lambda r: sum(s["waited_s"] for s in r["saves"]))
    steps = part(lambda r: sum(r["steps"]))
    loop = part(lambda r: r["loop_s"])
    emit("extra_wall_per_save_over_memcpy", extra / memcpy, "ratio", cmd, goal="<= 2",
         extra_s_per_save=round(extra, 4), host_memcpy_s=round(memcpy, 4),
         steps=args.wall_steps, saves=[saves[3], saves[0]], pairs=args.wall_pairs,
         job_wall_s_every_3=[round(x, 3) for x in walls[3]],
         job_wall_s_once=[round(x, 3) for x in walls[0]],
         per_save_s=dict(pauses=round(pauses, 4), of_which_waits_for_previous=round(waits, 4),
                         steps=round(steps, 4), rest_of_loop=round(loop - pauses - steps, 4),
                         outside_loop=round(extra - loop, 4)),
         pauses_s_every_3=[round(s["s"], 4) for s in recs[3][0]["saves"]],
         write_s_every_3=[round(v[0], 4) for v in recs[3][0]["logged"].values()],
         step_s=round(med(recs[0][0]["steps"]), 4), cold_cache=False, **common)


_MEMCPY = {}


def memcpy_of(args, d, base):
    """(step bytes, writer, one host memcpy of them), from one short warm run (kept)."""
    if not _MEMCPY:
        rec, _, _ = one_run(d, "memcpy", base + ["--save_interval", "3", "--max_steps", "3"],
                            1, False)
        _MEMCPY["v"] = (rec["step_bytes"], rec["writer"], rec["memcpy_s"])
    return _MEMCPY["v"]


def emit(figure, value, unit, cmd, **extra):
    print(json.dumps({"figure": figure, "value": round(value, 4), "unit": unit, **extra,
                      "command": cmd}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="43M", help="43M (the issue's UNet) or a sizes.LIGHT key")
    p.add_argument("--first_runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="steps of a --first_runs run")
    p.add_argument("--wall_pairs", type=int, default=3)
    p.add_argument("--wall_steps", type=int, default=45)
    p.add_argument("--figures", default="first,wall")
    p.add_argument("--cold", type=int, default=1, help="drop the page cache before each first "
                   "run (1, where allowed) or not (0)")
    p.add_argument("--dir", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sync_saves", type=int, default=0, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    rest = []
    if "--" in argv:
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, rest, args.sync_saves)
    cmd = "OMP_NUM_THREADS=1 python benchmarks/first_save.py " + " ".join(argv)
    d = tempfile.mkdtemp(dir=args.dir, prefix="first_save_")
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import write_images  # tests/conftest.py

    images = write_images(os.path.join(d, "images"), n=16, seed=5)
    base = [*size_flags(args.size), "--data_dir", str(images), "--batch_size", "2",
            "--diffusion_steps", "20", "--log_interval", "1000", "--seed", "0"]
    common = dict(size=args.size, threads=os.environ.get("OMP_NUM_THREADS"),
                  cpus=os.cpu_count(), loadavg=[round(x, 2) for x in os.getloadavg()])
    figures = set(args.figures.split(","))
    if "first" in figures:
        first_figures(args, d, base, cmd, common)
    if "wall" in figures:
        wall_figures(args, d, base, cmd, common)
    subprocess.run(["rm", "-rf", d])
    return 0


if __name__ == "__main__":
    sys.exit(main())
