"""What a background save costs the run, three figures taken separately in one run (issue 45
item 4), on the compute-light model of ``--size`` (sizes.LIGHT: the checkpoint's bytes on 8x8
images, one thread, one rank):

- ``bg_pause_over_host_memcpy`` (goal <= 1.2): the blocking pause of TrainLoop.save() with
  --async_save True (the first save, which starts the writer and allocates the arena, not
  counted; it follows two steps, so that the arena holds the optimizer's state as at a run's
  first save; nor the second, reported apart as ``bg_second_save_pause_over_host_memcpy``: the
  first with buffers, before any plan is kept) over ``host_memcpy_s``, one copy of the step's
  bytes between preallocated host buffers on one thread, measured in the same run, with the
  garbage collector's seconds inside each pause (``gc_in_pauses_s``) and the same ratio
  against the copy on as many threads as the pause copies with
  (``pause_over_memcpy_on_copy_threads``: host_copy.copy_threads);
- ``bg_step_p50_during_write_over_alone`` and ``bg_step_p99_during_write_over_alone`` (goal
  <= 1.10 for p99): the steps timed one by one while the background write runs (a step wholly
  inside the write) over the same steps without one, taken in alternation, round by round
  (with a few dozen steps, p99 is about the slowest: ``steps_during`` says how many);
- ``bg_write_over_sync_save`` (goal <= 1.3): the background write's duration (from the save's
  start until its files and manifest are fsync'd, the log's "saved step N ... in X s") over a
  synchronous save (--async_save False) of the same step's bytes, the two in alternating
  order, round by round (median of the per-round ratios), with the raw fsync'd write of the
  same bytes (``raw_write_fsync_s``) beside them;
- ``bg_pauses_every_3_steps`` (goal: no growth): the pauses of ``--chain`` saves made every
  3 steps, in order, with each save's background write time (does a save wait for the one
  before it?);
- ``bg_pause_cpu_over_host_memcpy_cpu`` and ``bg_write_cpu_over_sync_save_cpu``: the same two
  ratios in CPU seconds (the saving thread's for the pause and the memcpy; the writer process's
  for the write against the trainer process's for the synchronous save), which a machine loaded
  by other work changes far less than the wall seconds;
- ``bg_writer_profile``: where the background time goes: the writer process's nice levels
  seen while steps ran beside its write (``--writer_nice``: writer_process.WRITER_NICE) and
  CPU affinity against the trainer's, its CPU time (user, system) during one write over the
  write's wall time, the trainer's CPU over the same span, and the machine's load.

``--figures pause,after`` (issue 53; what benchmarks/gpu_check.sh runs) takes instead, on the
device the run has (CUDA when there is one) and the model of ``--model`` (a config of
benchmarks/train.py: ``dit-xl2`` is DiT-XL/2's whole training state, weights, EMA and Adam
moments, ~10.8 GB; ``--amp bf16`` its steps under bfloat16 autocast), after two steps and
``--warm_saves`` saves (2: the first starts the writer and allocates the arena, the second is a
run's second, before any plan of its host copy is kept):

- ``save_pause_over_pinned_copy`` (goal <= 1.2): the pause of one --async_save True save
  (TrainLoop.save(): the NaN/Inf check of every tensor, the RNG gather, the device-to-host copy
  into the writer's page-locked arena) over a device-to-host copy of the same tensors into one
  preallocated pinned buffer (``pinned_copy_s``, median of 3; on a CPU a host copy into one
  preallocated buffer, ``pinned``: false), measured in the same run; with the GB/s of both;
- ``save_steps_after_over_without`` (goal <= 1.03): the 10 steps right after that save (its
  background write beside them) over 10 without a save (before it, and after its write ended:
  their mean), each step timed until the device finished it;
- ``save_background_write_s``: that save's write, from the save's start until its files and
  manifest are fsync'd, on ``--dir``'s file system;
- ``save_refuses_non_finite``: one weight set to inf in the EMA, the next save refuses (raises
  NonFiniteError, nothing written): the check in the pause above is the real one.

``--first_runs N`` takes instead a run's first saves, each run a fresh process of
scripts/train.py on a cold page cache: benchmarks/first_save.py (its docstring), which it runs
with the other arguments.

One JSON line per figure with the command. Usage:

    python benchmarks/bg_save.py [--size 30M] [--dir DIR] [--repeat 3] [--chain 5] [--writer_nice N]
    python benchmarks/bg_save.py --figures pause,after --model dit-xl2 --amp bf16 --batch 32
    python benchmarks/bg_save.py --first_runs 3 [--wall_pairs 3]   # benchmarks/first_save.py
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checkpoint as cb  # noqa: E402  (benchmarks/checkpoint.py: build_loop, timed_save, ...)


def cpu_times(pid):
    """(user, system) CPU seconds of process ``pid``, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class GcTimer:
    """Seconds the garbage collector ran (gc.callbacks) since ``take()`` was last called: the
    part of a pause that is Python's collector, not the save (a full collection triggered by
    the save's allocations lands in whichever pause it falls)."""

    def __init__(self):
        import gc

        self.total, self._t0 = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self._t0 = None

    def take(self):
        took, self.total = self.total, 0.0
        return took


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def write_s(loop):
    """Wait for the background save; its seconds from its start until on disk."""
    return loop.checkpointer.wait_for_save()[1]


def pause_parts(loop, step):
    """Where one async save's pause goes: cProfile's cumulative seconds of its parts (the
    weights check, building the step's files, the RNG gather, pickling, the host copy)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    pause = cb.timed_save(loop, step, async_save=True)
    prof.disable()
    write_s(loop)
    parts = {"_refuse_non_finite_weights": "weights_check", "step_files": "step_files",
             "get_rng_state": "rng_state", "dump": "pickle", "_foreach_copy_": "host_copy",
             "pack": "pack", "_start": "writer_start",
             "_copy_and_check": "host_copy_and_weights_check"}
    out = {}
    for (_, _, name), row in pstats.Stats(prof).stats.items():
        if name in parts or name.endswith("._foreach_copy_>") or "foreach_copy" in name:
            key = parts.get(name, "host_copy")
            out[key] = round(out.get(key, 0) + row[3], 4)
    return pause, out


def crc_threads_pairs(loop, d, step, repeat):
    """run_dir.write_step of the same host copy with the CRC on the writing thread before each
    write (crc_threads=1, what the writer process passes) and on the CRC threads while the
    write runs (None: the synchronous save's), alternating; seconds of each."""
    from improved_diffusion.ckpt import rng, run_dir
    from improved_diffusion.ckpt.async_save import to_host

    files = to_host(loop.checkpointer.step_files(step, [rng.get_rng_state()]))
    rows = {1: [], None: []}
    for r in range(repeat):
        for threads in ((1, None) if r % 2 else (None, 1)):
            t0 = time.perf_counter()
            run_dir.write_step(d, step, files, crc_threads=threads)
            rows[threads].append(time.perf_counter() - t0)
            cb.drop_step(d, step)
    return rows[1], rows[None]


SPY_PARTS = {"crc32": "crc", "ChecksumWriter.write": "write_syscalls", "_fsync_dir": "fsync",
             "sync_file_range": "writeback", "persistent_id": "torch_pickling",
             "_Unpickler": "hand_off_unpickle", "Connection._recv": "idle_waiting_for_work"}


def spy_writer(loop, d, step, writes):
    """py-spy (``pip install py-spy``) samples the writer process's main thread (idle frames
    too) over ``writes`` background writes: seconds of each part per write, by the innermost
    frame named in SPY_PARTS (the rest: 'other', torch's zip writer and Python)."""
    import collections
    import subprocess

    out = os.path.join(d, "spy.txt")
    rate = 200
    spy = subprocess.Popen(["py-spy", "record", "-p", str(loop.checkpointer._process.pid),
                            "--idle", "-r", str(rate), "-f", "raw", "-o", out, "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    walls = []
    for _ in range(writes):
        step += 1
        cb.timed_save(loop, step, async_save=True)
        walls.append(write_s(loop))
        cb.drop_step(d, step)
    spy.send_signal(2)
    spy.wait()
    parts = collections.Counter()
    with open(out) as f:
        for line in f:
            stack, n = line.rstrip().rsplit(" ", 1)
            if "_watch_parent" in stack:
                continue
            frames = stack.split(";")
            part = next((p for fr in reversed(frames) for k, p in SPY_PARTS.items() if k in fr),
                        "other")
            parts[part] += int(n)
    os.unlink(out)
    return step, walls, {k: round(v / rate / writes, 4) for k, v in parts.items()}


def state_tensors(loop):
    """Every tensor of the loop's training state as a save holds it: the model's parameters
    and buffers, the EMAs, the optimizer's state."""
    import torch as th

    out = list(loop.model.parameters()) + list(loop.model.buffers())
    out += [p for ema in loop.ema_params for p in ema]
    out += [v for st in loop.opt.state.values() for v in st.values() if isinstance(v, th.Tensor)]
    return out


def pinned_copy_s(tensors, repeat=3):
    """(seconds, pinned) of one copy of ``tensors``' bytes into one preallocated host buffer
    (page-locked when they live on CUDA: the device-to-host copy at its best; a plain host copy
    on a CPU), the device synchronised around it; median of ``repeat``."""
    import torch as th

    on_cuda = any(t.device.type == "cuda" for t in tensors)
    flat = [t.detach().reshape(-1).view(th.uint8) for t in tensors]
    host = th.empty(sum(f.numel() for f in flat), dtype=th.uint8, pin_memory=on_cuda)
    host.fill_(0)  # the pages in place before the clock starts
    devices = {t.device for t in tensors}
    times = []
    for _ in range(repeat):
        for d in devices:
            cb.sync(d)
        t0 = time.perf_counter()
        offset = 0
        for f in flat:
            host[offset:offset + f.numel()].copy_(f, non_blocking=on_cuda)
            offset += f.numel()
        for d in devices:
            cb.sync(d)
        times.append(time.perf_counter() - t0)
    del host
    return statistics.median(times), on_cuda


def build_model_loop(config, d, batch, amp, save_writer="auto"):
    """A TrainLoop (checkpoints into ``d``, async saves) on benchmarks/train.py's ``config`` at
    ``batch``, on this process's device; returns (loop, one fixed batch)."""
    import torch as th

    import train as tb  # benchmarks/train.py: its configs and synthetic data

    from improved_diffusion import dist_util, train_util

    flags, batch = tb._flags(config, batch)
    train_util.seed_rngs(0)
    model, diffusion = tb.build_on(dist_util.dev(), flags)
    data = tb._Data(batch, flags["image_size"], 0, channels=flags["in_channels"],
                    num_classes=flags["num_classes"] if flags.get("class_cond") else None)
    loop = train_util.TrainLoop(
        model=model, diffusion=diffusion, data=data, batch_size=batch, microbatch=-1,
        lr=1e-4, ema_rate="0.9999", log_interval=10 ** 9, save_interval=0,
        resume_checkpoint="", log_dir=d, model_flags=flags, keep_checkpoints=2,
        use_fp16=amp == "fp16", save_writer=save_writer)
    if amp == "bf16":  # no flag asks for bf16 on CUDA: the loop's autocast dtype, no scaler
        loop.amp_dtype, loop.grad_scaler = th.bfloat16, None
    return loop, next(data)


def fs_type(path):
    """The file system type of ``path`` (/proc/mounts' longest matching mount point)."""
    path, best = os.path.realpath(path), ("", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) > len(best[0]):
                    best = (mount, kind)
    except OSError:
        pass
    return best[1]


def pause_after_figures(args, cmd):
    """``--figures pause,after`` (the module docstring)."""
    import torch as th

    from improved_diffusion import logger
    from improved_diffusion.ckpt.checkpointer import NonFiniteError

    d = tempfile.mkdtemp(dir=args.dir, prefix="bg_save_")
    logger.configure(dir=d, format_strs=["log"])
    loop, batch = build_model_loop(args.model, d, args.batch, args.amp, args.save_writer)
    params = sum(q.numel() for q in loop.model.parameters())
    for _ in range(2):  # the optimizer's state exists at a run's first save
        cb.step_seconds(loop, batch)
    step = 100
    for _ in range(args.warm_saves):  # the writer's start and the arena; a run's second save
        step += 1
        cb.timed_save(loop, step, async_save=True)
        write_s(loop)
        cb.drop_step(d, step)
    nbytes = sum(t.nbytes for t in state_tensors(loop))
    device = loop.device
    common = dict(model=args.model, params=params, batch=batch[0].shape[0], amp=args.amp,
                  device=device.type, state_bytes=nbytes,
                  device_name=th.cuda.get_device_name(device) if device.type == "cuda"
                  else "cpu", writer=loop.checkpointer.save_writer_chosen,
                  dir_fs=fs_type(d))
    before = [cb.step_seconds(loop, batch) for _ in range(args.steps_after)]
    step += 1
    pause = cb.timed_save(loop, step, async_save=True)
    after = [cb.step_seconds(loop, batch) for _ in range(args.steps_after)]
    in_flight = loop.checkpointer.save_in_flight  # the write still ran beside the last step
    copy, pinned = pinned_copy_s(state_tensors(loop))
    cb.emit("save_pause_over_pinned_copy", pause / copy, "ratio", cmd, **common, goal="<= 1.2",
            pause_s=round(pause, 4), pinned_copy_s=round(copy, 4), pinned=pinned,
            pause_gb_per_s=round(nbytes / pause / 1e9, 2),
            pinned_copy_gb_per_s=round(nbytes / copy / 1e9, 2),
            nan_check_in_pause=True)
    wrote = write_s(loop)
    step_bytes = sum(os.path.getsize(os.path.join(d, n)) for n in cb.step_files(d, step))
    cb.drop_step(d, step)
    later = [cb.step_seconds(loop, batch) for _ in range(args.steps_after)]
    without = (sum(before) + sum(later)) / 2
    cb.emit("save_steps_after_over_without", sum(after) / without, "ratio", cmd, **common,
            goal="<= 1.03", steps=args.steps_after,
            steps_after_s=[round(x, 4) for x in after],
            steps_before_s=[round(x, 4) for x in before],
            steps_after_write_s=[round(x, 4) for x in later],
            write_still_running_after_last_step=in_flight)
    cb.emit("save_background_write_s", wrote, "s", cmd, **common, step_bytes=step_bytes,
            write_gb_per_s=round(step_bytes / wrote / 1e9, 3) if wrote else None)
    ema = loop.ema_params[0][0]
    kept = ema.view(-1)[0].item()
    ema.view(-1)[0] = float("inf")
    step += 1
    try:
        cb.timed_save(loop, step, async_save=True)
        refused = False
        write_s(loop)
    except NonFiniteError:
        refused = True
    ema.view(-1)[0] = kept
    written = cb.step_files(d, step)
    cb.emit("save_refuses_non_finite", float(refused and not written), "bool", cmd, **common,
            refused=refused, files_written=written)
    loop.close()
    return 0 if refused and not written else 1


def main():
    if "--first_runs" in sys.argv[1:]:  # a run's first saves: benchmarks/first_save.py
        import first_save

        return first_save.main(sys.argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="30M")
    p.add_argument("--figures", default="all",
                   help="all (the figures above), or pause,after (the device's figures)")
    p.add_argument("--model", default="dit-xl2",
                   help="--figures pause,after: a config of benchmarks/train.py")
    p.add_argument("--batch", type=int, default=None,
                   help="--figures pause,after: the batch (default: the config's)")
    p.add_argument("--amp", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="--figures pause,after: the steps' precision")
    p.add_argument("--steps_after", type=int, default=10)
    p.add_argument("--warm_saves", type=int, default=2,
                   help="--figures pause,after: saves before the measured one (the first starts "
                        "the writer and allocates the arena; 1 on a slow disk)")
    p.add_argument("--save_writer", default="auto",
                   help="--figures pause,after: the loop's --save_writer (process: the writer "
                        "process even for a small state, as a large one gets)")
    p.add_argument("--dir", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chain", type=int, default=5)
    p.add_argument("--spy", type=int, default=0, help="py-spy the writer over this many writes")
    p.add_argument("--writer_nice", type=int, default=None,
                   help="writer_process.WRITER_NICE for this run (0: the trainer's priority)")
    args = p.parse_args()
    cmd = "python benchmarks/bg_save.py " + " ".join(sys.argv[1:])
    if args.figures != "all":
        if set(args.figures.split(",")) != {"pause", "after"}:
            p.error("--figures: all, or pause,after")
        return pause_after_figures(args, cmd)
    import torch as th

    from improved_diffusion import logger

    from improved_diffusion.ckpt import writer_process

    if args.writer_nice is not None:  # (before the writer starts: it reads it then)
        writer_process.WRITER_NICE = args.writer_nice
    th.set_num_threads(1)
    d = tempfile.mkdtemp(dir=args.dir, prefix="bg_save_")
    logger.configure(dir=d, format_strs=["log"])
    loop, batch = cb.build_loop(args.size, d, light=True, keep_checkpoints=2)
    params = sum(q.numel() for q in loop.model.parameters())
    step = 100
    for _ in range(2):  # the optimizer's state exists at a run's first save: the arena holds it
        cb.step_seconds(loop, batch)
    cb.timed_save(loop, step, async_save=True)  # the first: the writer's start, the arena
    write_s(loop)
    cb.drop_step(d, step)
    cb.step_seconds(loop, batch)
    step += 1
    second = cb.timed_save(loop, step, async_save=True)  # no plan kept yet: reported apart
    write_s(loop)
    cb.drop_step(d, step)
    writer = loop.checkpointer.save_writer_chosen
    proc = getattr(loop.checkpointer, "_process", None)
    wpid = getattr(proc, "pid", None) if writer == "process" else None
    buf = cb.random_bytes()
    pauses, alone, during, ratios, writes, syncs, raws = [], [], [], [], [], [], []
    prof, nice_seen, pause_cpus, cpu_ratios, cpu_pairs = [], set(), [], [], []
    gc_s, pause_gcs = GcTimer(), []
    for r in range(args.repeat):
        alone += [cb.step_seconds(loop, batch) for _ in range(10)]
        step += 1
        t0 = time.perf_counter()
        c0, w0 = os.times(), (cpu_times(wpid) if wpid else (0, 0))
        t_cpu = time.thread_time()
        gc_s.take()
        pauses.append(cb.timed_save(loop, step, async_save=True))
        pause_cpus.append(time.thread_time() - t_cpu)
        pause_gcs.append(gc_s.take())
        while loop.checkpointer.save_in_flight:
            if wpid:
                nice_seen.add(os.getpriority(os.PRIO_PROCESS, wpid))
            took = cb.step_seconds(loop, batch)
            if loop.checkpointer.save_in_flight:
                during.append(took)
        wall = time.perf_counter() - t0
        c1, w1 = os.times(), (cpu_times(wpid) if wpid else (0, 0))
        loop.step = step
        write_s(loop)
        prof.append((wall, w1[0] - w0[0], w1[1] - w0[1], c1.user - c0.user,
                     c1.system - c0.system))
        sizes = [os.path.getsize(os.path.join(d, n)) for n in cb.step_files(d, step)]
        nbytes = sum(sizes)
        cb.drop_step(d, step)
        # the background write without steps beside it, and the synchronous save, in turn
        pair = {}
        for which in (("bg", "sync") if r % 2 else ("sync", "bg")):
            step += 1
            if which == "bg":
                w0 = sum(cpu_times(wpid)) if wpid else 0
                cb.timed_save(loop, step, async_save=True)
                pair["bg"] = write_s(loop)
                pair["bg_cpu"] = sum(cpu_times(wpid)) - w0 if wpid else None
            else:
                c0 = time.process_time()
                pair["sync"] = cb.timed_save(loop, step, async_save=False)
                pair["sync_cpu"] = time.process_time() - c0
            cb.drop_step(d, step)
        writes.append(pair["bg"])
        syncs.append(pair["sync"])
        ratios.append(pair["bg"] / pair["sync"])
        if pair["bg_cpu"] is not None:
            cpu_ratios.append(pair["bg_cpu"] / pair["sync_cpu"])
            cpu_pairs.append((pair["bg_cpu"], pair["sync_cpu"]))
        raws.append(cb.raw_write(d, sizes, buf))
    memcpy = cb.memcpy_s(nbytes)
    copy_threads = getattr(proc, "copy_threads", 1) if writer == "process" else 1
    memcpy_threads = cb.memcpy_s(nbytes, threads=copy_threads)
    memcpy_cpu = cb.memcpy_s(nbytes, clock=time.thread_time)
    load = os.getloadavg()
    common = dict(size=args.size, params=params, step_bytes=nbytes, writer=writer,
                  writer_nice_above_trainer=getattr(writer_process, "WRITER_NICE", 0),
                  model="light (8x8 images)", threads=1, repeats=args.repeat,
                  loadavg=[round(x, 2) for x in load])
    pause = statistics.median(pauses)
    cb.emit("bg_pause_over_host_memcpy", pause / memcpy, "ratio", cmd, **common,
            goal="<= 1.2", pause_s=round(pause, 4), host_memcpy_s=round(memcpy, 4),
            pauses_s=[round(x, 4) for x in pauses],
            gc_in_pauses_s=[round(x, 4) for x in pause_gcs], copy_threads=copy_threads,
            host_memcpy_on_copy_threads_s=round(memcpy_threads, 4),
            pause_over_memcpy_on_copy_threads=round(pause / memcpy_threads, 3))
    cb.emit("bg_second_save_pause_over_host_memcpy", second / memcpy, "ratio", cmd, **common,
            pause_s=round(second, 4), host_memcpy_s=round(memcpy, 4),
            note="a run's second save: no plan kept from the save before, nothing copied "
                 "ahead (host_copy.HostCopy.ahead)")
    cb.emit("bg_pause_cpu_over_host_memcpy_cpu", statistics.median(pause_cpus) / memcpy_cpu,
            "ratio", cmd, **common, pause_cpu_s=[round(x, 4) for x in pause_cpus],
            host_memcpy_cpu_s=round(memcpy_cpu, 4),
            note="CPU seconds of the saving thread (time.thread_time): a loaded machine's waits "
                 "for a core left out")
    if cpu_ratios:
        cb.emit("bg_write_cpu_over_sync_save_cpu", statistics.median(cpu_ratios), "ratio", cmd,
                **common, ratios=[round(x, 3) for x in cpu_ratios],
                bg_writer_cpu_s=[round(b, 4) for b, _ in cpu_pairs],
                sync_save_cpu_s=[round(s_, 4) for _, s_ in cpu_pairs],
                note="the writer process's CPU seconds (user+system, all threads) for the "
                     "write alone over the trainer process's for the synchronous save")
    a50, a99 = statistics.median(alone), pct(alone, 99)
    if during:
        d50, d99 = statistics.median(during), pct(during, 99)
        cb.emit("bg_step_p50_during_write_over_alone", d50 / a50, "ratio", cmd, **common,
                step_s_alone=round(a50, 4), step_s_during=round(d50, 4),
                steps_during=len(during), steps_alone=len(alone))
        cb.emit("bg_step_p99_during_write_over_alone", d99 / a99, "ratio", cmd, **common,
                goal="<= 1.10", step_p99_s_alone=round(a99, 4), step_p99_s_during=round(d99, 4),
                steps_during=len(during), steps_alone=len(alone))
    cb.emit("bg_write_over_sync_save", statistics.median(ratios), "ratio", cmd, **common,
            goal="<= 1.3", ratios=[round(x, 3) for x in ratios],
            bg_write_s=[round(x, 4) for x in writes], sync_save_s=[round(x, 4) for x in syncs],
            raw_write_fsync_s=[round(x, 4) for x in raws])
    wall, wu, ws, tu, ts = (statistics.median(x) for x in zip(*prof))
    cb.emit("bg_writer_profile", (wu + ws) / wall, "cpu/wall", cmd, **common,
            write_with_steps_s=round(wall, 4), writer_user_s=round(wu, 4),
            writer_sys_s=round(ws, 4), trainer_user_s=round(tu, 4), trainer_sys_s=round(ts, 4),
            writer_nice_during_steps=sorted(nice_seen),
            trainer_nice=os.getpriority(os.PRIO_PROCESS, 0),
            writer_affinity=sorted(os.sched_getaffinity(wpid)) if wpid else None,
            trainer_affinity=sorted(os.sched_getaffinity(0)), cpus=os.cpu_count())
    step += 1
    pause, parts = pause_parts(loop, step)
    cb.drop_step(d, step)
    cb.emit("bg_pause_parts", pause, "s", cmd, **common, host_memcpy_s=round(memcpy, 4),
            note="cProfile (adds overhead) cumulative seconds", **parts)
    step += 1
    one, par = crc_threads_pairs(loop, d, step, args.repeat)
    cb.emit("bg_crc_before_write_over_beside", statistics.median(one) / statistics.median(par),
            "ratio", cmd, **common, crc_threads_1_s=[round(x, 4) for x in one],
            crc_threads_pool_s=[round(x, 4) for x in par],
            note="run_dir.write_step of one host copy in this process, alternating")
    if args.spy:
        step, walls, parts = spy_writer(loop, d, step, args.spy)
        busy = sum(v for k, v in parts.items() if k != "idle_waiting_for_work")
        cb.emit("bg_writer_spy_s_per_write", busy, "s", cmd, **common,
                bg_write_s=[round(x, 4) for x in walls], sampled_s_per_write=parts,
                note="py-spy --idle, the writer's main thread")
    # saves every 3 steps, as a run makes them
    # (each pause split into the wait for the previous save's write and the save's own pause)
    chain_pauses, chain_waits, chain_writes, chain_gcs = [], [], [], []
    for _ in range(args.chain):
        for _ in range(3):
            cb.step_seconds(loop, batch)
        step += 3
        t0 = time.perf_counter()
        done = loop.checkpointer.wait_for_save()
        chain_waits.append(time.perf_counter() - t0)
        if done:
            chain_writes.append(done[1])
        gc_s.take()
        chain_pauses.append(cb.timed_save(loop, step, async_save=True))
        chain_gcs.append(gc_s.take())
        loop.step = step
    chain_writes.append(write_s(loop))
    cb.emit("bg_pauses_every_3_steps", chain_pauses[-1] / chain_pauses[0], "ratio", cmd,
            **common, goal="no growth (last over first ~1)",
            pauses_s=[round(x, 4) for x in chain_pauses],
            waits_for_previous_s=[round(x, 4) for x in chain_waits],
            gc_in_pauses_s=[round(x, 4) for x in chain_gcs],
            writes_s=[round(x, 4) for x in chain_writes], step_s=round(a50, 4),
            disk_sustains=max(chain_writes) <= 3 * a50)
    loop.close()


if __name__ == "__main__":
    sys.exit(main())
