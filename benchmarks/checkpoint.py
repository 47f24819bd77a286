"""Checkpoint cost: the training pause per save, the whole save, what saves cost a run, the load
(issues 11, 20).

For UNets of about 10M, 60M and 250M parameters (benchmarks/sizes.py; model + one EMA + AdamW
state, as the trainer saves them), measured side by side in the same run, on the same disk
(--dir):

- ``save_sync_bandwidth_over_raw_write`` (goal >= 0.70): the bytes of a step over the time of
  TrainLoop.save() with --async_save False (``save_sync_s``: the weights check, the RNG gather,
  serialising, checksums, writing, fsyncs; ``save_sync_torch_crc_s``: the same save with every
  file written by torch.save itself, its CRCs torch's, on the saving thread: what torch_zip
  saves), against ``raw_write_fsync_s``, the reference:
  writing the same number of bytes, in as many files, from memory with plain write() + fsync
  (+ the directory's fsync), in the same directory. ``raw_write_writeback_s``: the same raw write
  asking the kernel to start writeback every 32 MiB, as the checkpoint writer does (what the
  disk itself allows);
- ``save_every_10_steps_extra_wall_over_raw_write`` (goal <= 0.10): what saves cost a whole run:
  the real TrainLoop.run_loop of ``--run_steps`` steps (default 40, async saves, the default)
  saving every 10 steps, against the same run saving only at its end, on the compute-light model
  of the same size (sizes.LIGHT: the same parameters and bytes on 8x8 images, one thread, batch
  1, --keep_checkpoints 2); the extra wall time per extra save, over the raw write of the same
  bytes, with the pause of each save (``pause_s``), the rest of the extra time
  (``extra_beyond_pause_s``: the steps slowed by the writer beside them) and the time its
  background write took;
- ``save_every_10_steps_extra_wall_over_host_memcpy`` (goal <= 2, issue 31): the same extra
  wall time per save over ``host_memcpy_s``, a copy of the step's bytes between preallocated
  host buffers measured in the same run (the floor of a save that copies its bytes once), with
  ``steps_slower_during_write`` (goal <= 0.05): the extra time beyond the pause over the
  background write's duration, i.e. how much slower the steps beside the writer ran. With
  ``--ranks 1,2`` the run figures are taken on one rank and then on two (mpiexec -n 2, gloo,
  rank 0 writes; a run's time is its slowest rank's); with ``--writers process,thread`` each
  run figure is taken with the writer process and then with the in-process writer thread (its
  fallback where there is no memfd_create), side by side (``writer`` in each line);
- ``writer_process_start_s`` (figure ``start``, no size): what a job pays once for the writer
  process (--save_writer process): the wall time of its first write of a tiny step (one 4 KiB
  tensor) less that of a later one, and ``child_cpu_s``, the CPU the writer process used in all
  (a fresh interpreter importing torch), beside ``thread_write_s``, the same tiny step written
  by run_dir.write_step in this process (what --save_writer thread pays per save);
  writer_process.PROCESS_MIN_BYTES weighs the two;
- ``steps_slower_beside_raw`` (figure ``beside``): the light model's steps (one thread)
  while another process writes a step's bytes from memory (raw_write with writeback, no
  serialising, no CRC) against the same steps alone: what the machine itself takes from the
  steps beside any writer, the reference of ``steps_slower_during_write``; ``_crc``,
  ``_memcpy``, ``_spin``: the same beside 3 s of zlib's CRC-32, of memcpys, of a busy loop
  (which part of a writer's work slows the steps); ``steps_slower_beside_write`` (goal <= 0.05,
  issue 31): the steps timed one by one while a real background save (each of ``--writers``)
  is written, against the same steps alone: the goal measured directly, without the save's
  other costs that ``steps_slower_during_write`` folds in;
- ``save_async_pause_s``: how long TrainLoop.save() holds training with --async_save True (the
  weights check, the RNG gather, the host copy into reused buffers; ``save_async_first_pause_s``:
  the first save, which allocates the buffers), beside ``host_memcpy_s``: a plain copy of the
  step's bytes between preallocated host buffers (the bound of the pause on a CPU); ``save_async_total_s``: until its files and
  manifest are on disk (fsync'd); ``step_s_during_async_save`` vs ``step_s``: one training step
  while the writer runs, and alone;
- ``load_2ranks_s``: checkpoint.load_file_collective of the step's opt file (its largest) on 2 ranks
  (mpiexec -n 2), every rank timed from a barrier to the end; ``load_broadcast_2ranks_s``: the same
  through the fallback (rank 0 reads, broadcasts the bytes); ``load_1rank_s``: load_file in one
  process (the CRC-checking reader alone); ``torch_load_s``: the reference, one
  plain torch.load(weights_only=True) of the same file in one process (warm page cache for all);
  each in a fresh process, with its peak RSS over what the process held before the load
  (VmHWM - VmRSS before; ``peak_rss_over_file``: that peak in units of the file's size).

One JSON line per figure, each with the command that reproduces it. Usage:

    python benchmarks/checkpoint.py [--sizes 10M,60M,250M] [--dir DIR] [--repeat 2]
                                    [--figures save,run,load,start,beside] [--run_steps 40]
                                    [--ranks 1,2] [--writers process,thread,auto] [--threads 1]

250M needs ~12 GB of free memory and ~15 GB of disk (a step is 4.4 GB): leave it out with
--sizes 10M,60M.
"""
import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from sizes import model_flags  # noqa: E402


def vm(field):
    """This process's /proc/self/status field in bytes (VmHWM: peak RSS; VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def emit(figure, value, unit, cmd, **extra):
    print(json.dumps({"figure": figure, "value": round(value, 4), "unit": unit, **extra,
                      "command": cmd}), flush=True)


# ------------------------------------------------------------------------------------ saving


def build_loop(size, log_dir, light=False, **kwargs):
    import torch as th

    from improved_diffusion import train_util
    from improved_diffusion.script_util import create_model_and_diffusion

    flags = model_flags(size, light)
    train_util.seed_rngs(0)
    model, diffusion = create_model_and_diffusion(**flags)
    n = flags["image_size"]
    batch = (th.randn(1, 3, n, n), {})
    loop = train_util.TrainLoop(
        model=model, diffusion=diffusion, data=iter(lambda: batch, None), batch_size=1,
        microbatch=-1, lr=1e-4, ema_rate="0.9999", log_interval=10 ** 9,
        save_interval=0, resume_checkpoint="", log_dir=log_dir, model_flags=flags, **kwargs)
    return loop, batch


def raw_write(d, sizes, buf, writeback=False):
    """Write len(sizes) new files of these sizes from ``buf`` with fsync, then fsync ``d``
    (``writeback``: starting the kernel's writeback every 32 MiB, as file_writer.write_file)."""
    from improved_diffusion.ckpt import file_writer

    start_writeback = file_writer.sync_file_range() if writeback else None
    t0 = time.perf_counter()
    for i, n in enumerate(sizes):
        with open(os.path.join(d, f"raw{i}.bin"), "wb") as f:
            view = memoryview(buf)
            left = started = 0
            while left < n:
                k = min(n - left, len(buf))
                f.write(view[:k])
                left += k
                if start_writeback is not None and left - started >= 32 << 20:
                    f.flush()
                    start_writeback(f.fileno(), started, left - started, 2)
                    started = left
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    took = time.perf_counter() - t0
    for i in range(len(sizes)):
        os.unlink(os.path.join(d, f"raw{i}.bin"))
    return took


def random_bytes():
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()


def memcpy_s(nbytes, clock=time.perf_counter, threads=1):
    """Seconds to copy ``nbytes`` between two preallocated host buffers (torch's copy_, in 256 MiB
    pieces): what the host copy of an async save cannot beat on a CPU (median of 3).
    ``clock``: time.thread_time for this thread's CPU seconds (which a loaded machine's waits
    for a core do not count). ``threads`` > 1: that many threads copy each piece, in turns of
    4 MiB slices (what a save's host_copy threads could do at best; wall seconds)."""
    import threading

    import torch as th

    piece = min(nbytes, 256 << 20)
    src = th.randint(0, 256, (piece,), dtype=th.uint8)
    dst = th.empty_like(src)
    dst.copy_(src)  # the pages of both buffers in place before the clock starts

    def part(k):
        for left in range(nbytes, 0, -piece):
            n = min(left, piece)
            for a in range(k * (4 << 20), n, threads * (4 << 20)):
                b = min(a + (4 << 20), n)
                dst[a:b].copy_(src[a:b])

    times = []
    for _ in range(3):
        t0 = clock()
        if threads == 1:
            for left in range(nbytes, 0, -piece):
                dst[:min(left, piece)].copy_(src[:min(left, piece)])
        else:
            ts = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        times.append(clock() - t0)
    return statistics.median(times)


def sync(device):
    """Wait for ``device``'s queued work (CUDA; nothing on a CPU): around every timer."""
    import torch as th

    if getattr(device, "type", device) == "cuda":
        th.cuda.synchronize(device)


def timed_save(loop, step, async_save):
    """Seconds TrainLoop.save() held the caller for a save of ``step`` (the device's queued
    work done first, so a step's kernels are not counted in the pause)."""
    loop.step = step
    loop.checkpointer.config = dataclasses.replace(loop.checkpointer.config,
                                                 async_save=async_save)
    sync(loop.device)
    t0 = time.perf_counter()
    loop.save()
    return time.perf_counter() - t0


def step_seconds(loop, batch):
    """Seconds of one loop.run_step(*batch), until the device finished it."""
    sync(loop.device)
    t0 = time.perf_counter()
    loop.run_step(*batch)
    sync(loop.device)
    return time.perf_counter() - t0


def timed_save_torch_crc(loop, step):
    """timed_save(async_save=False) with every file written by torch.save itself, its CRCs
    computed by torch on the saving thread (the reference of torch_zip)."""
    from improved_diffusion.ckpt import torch_zip

    learned = torch_zip.learned["fast"]
    torch_zip.learned["fast"] = False
    try:
        return timed_save(loop, step, async_save=False)
    finally:
        torch_zip.learned["fast"] = learned


def step_files(d, step):
    return [n for n in os.listdir(d) if n.endswith(f"{step:06d}.pt")]


def drop_step(d, step):
    for n in os.listdir(d):
        if f"{step:06d}." in n:
            os.unlink(os.path.join(d, n))


def bench_save(size, d, repeat, cmd, keep_path):
    """The save figures of one size (in this process); leaves the last step's opt file at
    ``keep_path`` for the load figures."""
    import torch as th

    from improved_diffusion import logger

    logger.configure(dir=d, format_strs=["log"])
    loop, batch = build_loop(size, d)
    params = sum(p.numel() for p in loop.model.parameters())
    loop.run_step(*batch)  # Adam moments exist, as in any saved run
    step_alone = []
    for _ in range(2):
        t0 = time.perf_counter()
        loop.run_step(*batch)
        step_alone.append(time.perf_counter() - t0)
    buf = random_bytes()
    rows = {k: [] for k in ("pause", "total", "sync", "sync_torch_crc", "raw", "raw_writeback",
                            "step_during", "first_pause")}
    step = 100
    for r in range(repeat + 1):  # the first async save allocates its buffers: not counted
        step += 1
        pause = timed_save(loop, step, async_save=True)
        t1 = time.perf_counter()
        loop.run_step(*batch)  # a training step while the writer runs
        during = time.perf_counter() - t1
        loop.step = step  # run_step counted one
        _, total, _, _ = loop.checkpointer.wait_for_save()  # from the save's start: on disk
        sizes = [os.path.getsize(os.path.join(d, n)) for n in step_files(d, step)]
        drop_step(d, step)
        rows["first_pause" if r == 0 else "pause"].append(pause)
        # the two synchronous saves, each first every other round (the second finds the disk
        # still busy with the first's writeback); the last round keeps torch_zip's step
        for which in (("torch", "ours") if r % 2 else ("ours", "torch")):
            step += 1
            if which == "ours":
                sync, kept = timed_save(loop, step, async_save=False), step
            else:
                sync_torch_crc = timed_save_torch_crc(loop, step)
            if r < repeat or which == "torch":
                drop_step(d, step)
        if r:
            rows["sync_torch_crc"].append(sync_torch_crc)
            rows["total"].append(total)
            rows["step_during"].append(during)
            rows["sync"].append(sync)
            rows["raw"].append(raw_write(d, sizes, buf))
            rows["raw_writeback"].append(raw_write(d, sizes, buf, writeback=True))
    for n in step_files(d, kept):
        if n.startswith("opt") and keep_path:
            shutil.move(os.path.join(d, n), keep_path)
    drop_step(d, kept)
    nbytes = sum(sizes)
    med = {k: statistics.median(v) for k, v in rows.items()}
    # the writer --save_writer auto chose for this size here (the async figures are its)
    writer = loop.checkpointer.save_writer_chosen
    common = dict(size=size, params=params, step_bytes=nbytes, repeats=repeat, writer=writer)
    raw = med["raw"]
    memcpy = memcpy_s(nbytes)
    emit("save_async_pause_s", med["pause"], "s", cmd, **common,
         over_raw_write=round(med["pause"] / raw, 4), host_memcpy_s=round(memcpy, 4),
         over_host_memcpy=round(med["pause"] / memcpy, 4))
    emit("save_async_first_pause_s", med["first_pause"], "s", cmd, **common,
         over_raw_write=round(med["first_pause"] / raw, 4))
    emit("save_async_total_s", med["total"], "s", cmd, **common,
         over_raw_write=round(med["total"] / raw, 4))
    emit("save_sync_s", med["sync"], "s", cmd, **common,
         bandwidth_over_raw_write=round(raw / med["sync"], 4),
         over_torch_crc=round(med["sync"] / med["sync_torch_crc"], 4))
    emit("save_sync_torch_crc_s", med["sync_torch_crc"], "s", cmd, **common,
         bandwidth_over_raw_write=round(raw / med["sync_torch_crc"], 4))
    emit("raw_write_fsync_s", raw, "s", cmd, **common, mb_per_s=round(nbytes / raw / 1e6, 1))
    emit("raw_write_writeback_s", med["raw_writeback"], "s", cmd, **common,
         mb_per_s=round(nbytes / med["raw_writeback"] / 1e6, 1))
    emit("save_sync_bandwidth_over_raw_write", raw / med["sync"], "ratio", cmd, **common,
         goal=">= 0.70", save_sync_s=round(med["sync"], 4), raw_write_fsync_s=round(raw, 4),
         over_raw_write_writeback=round(med["raw_writeback"] / med["sync"], 4))
    emit("step_s", statistics.median(step_alone), "s", cmd, **common)
    emit("step_s_during_async_save", med["step_during"], "s", cmd, **common,
         over_step=round(med["step_during"] / statistics.median(step_alone), 4))
    th.cuda.empty_cache() if th.cuda.is_available() else None


def timed_run(loop, steps, save_interval):
    """Seconds of loop.run_loop() for ``steps`` more steps, saving every ``save_interval`` (0:
    only at the end, which run_loop does in any case), until the last save is on disk; then the
    step's files are removed. The run starts at a multiple of 10 (the step counter moves on):
    with ``steps`` a multiple of 10 too, its last step is an interval save and the final save is
    that one, as in a run whose --max_steps is a multiple of --save_interval (otherwise the final
    save, one step after an interval save, would wait for that one's background write). Returns
    (seconds, saves)."""
    from improved_diffusion import dist_util

    loop.step = first = -(-loop.step // 10) * 10
    loop.config = dataclasses.replace(loop.config, max_steps=first + steps)
    loop.save_interval = save_interval
    dist_util.barrier()
    t0 = time.perf_counter()
    loop.run_loop()
    took = time.perf_counter() - t0
    log_dir = loop.config.checkpoint.log_dir
    if dist_util.get_rank() == 0:
        for step in {int(n[5:11]) for n in os.listdir(log_dir) if n.startswith("model")}:
            drop_step(log_dir, step)
    dist_util.barrier()
    last = first + steps
    every = [s for s in range(first + 1, last + 1) if save_interval and s % save_interval == 0]
    return took, len(every) + (0 if every and every[-1] == last else 1)  # + run_loop's final save


def bench_run(size, d, repeat, steps, cmd, writer="process", threads=1):
    """What saves cost a whole run (in this process, one of the ranks under mpiexec): run_loop
    saving every 10 steps against saving once, alternating, on the compute-light model of
    ``size``; rank 0 prints the figures, with the references (a raw write, a memcpy of the
    step's bytes) measured in the same run. ``writer``: --save_writer, "process" (the writer
    process), "thread" (the host copy and the write in this process: the reference of issue 31)
    or "auto" (the rule train.py uses by default). ``threads``: torch's threads per rank (1:
    the writer has a core of its own on one rank of a 2-core machine; 2: none is left)."""
    import torch as th

    from improved_diffusion import dist_util, logger

    th.set_num_threads(threads)
    dist_util.setup_dist()
    rank, ranks = dist_util.get_rank(), dist_util.get_world_size()
    logger.configure(dir=d if rank == 0 else os.path.join(d, f"rank{rank}"),
                     format_strs=["log"] if rank == 0 else [])
    loop, batch = build_loop(size, d, light=True, keep_checkpoints=2,  # prunes as runs do
                             save_writer=writer)
    params = sum(p.numel() for p in loop.model.parameters())
    timed_run(loop, 1, 0)  # warm: Adam moments, the writer's host buffers
    buf = random_bytes() if rank == 0 else None
    runs = {10: [], 0: []}
    raws, saves = [], {}
    for _ in range(repeat):
        for interval in (10, 0):
            took, saves[interval] = timed_run(loop, steps, interval)
            runs[interval].append(took)
        loop.step += 1
        loop.save(wait=True)  # one step's files, for the size of the raw write
        if rank == 0:
            sizes = [os.path.getsize(os.path.join(d, n)) for n in step_files(d, loop.step)]
            drop_step(d, loop.step)
            raws.append(raw_write(d, sizes, buf))
        dist_util.barrier()
    step_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        loop.run_step(*batch)
        step_s.append(time.perf_counter() - t0)
    # every rank's runs: the slowest rank's time is the run's
    runs = {k: [max(r) for r in zip(*dist_util.all_gather_object(v))] for k, v in runs.items()}
    chosen = loop.checkpointer.save_writer_chosen  # what --save_writer chose (rank 0)
    loop.close()
    if rank != 0:
        return
    every, once, raw = (statistics.median(runs[10]), statistics.median(runs[0]),
                        statistics.median(raws))
    memcpy = memcpy_s(sum(sizes))
    # the loop's own line per save: "saved step N to D in T s (training paused P s)"
    with open(os.path.join(d, "log.txt")) as f:
        logged = [tuple(map(float, m.groups())) for m in re.finditer(
            r"saved step \d+ to .* in ([\d.]+) s \(training paused ([\d.]+) s\)", f.read())]
    extra = (every - once) / (saves[10] - saves[0])
    pause = statistics.median(p for _, p in logged)
    background = statistics.median(t for t, _ in logged)
    emit("save_every_10_steps_extra_wall_over_raw_write", extra / raw, "ratio", cmd, size=size,
         params=params, ranks=ranks, step_bytes=sum(sizes), goal="<= 0.10 (issue 20)",
         model="light (8x8 images)",
         steps=steps, saves=[saves[10], saves[0]], extra_s_per_save=round(extra, 4),
         run_s_saving_every_10=round(every, 3), run_s_saving_once=round(once, 3),
         step_s=round(statistics.median(step_s), 4), raw_write_fsync_s=round(raw, 4),
         pause_s=round(pause, 4), pause_over_raw_write=round(pause / raw, 4),
         extra_beyond_pause_s=round(extra - pause, 4), background_write_s=round(background, 4),
         async_save=loop.checkpointer.config.async_save, writer=writer,
         writer_chosen=chosen, threads=threads, repeats=repeat)
    emit("save_every_10_steps_extra_wall_over_host_memcpy", extra / memcpy, "ratio", cmd,
         size=size, params=params, ranks=ranks, step_bytes=sum(sizes), goal="<= 2 (issue 31)",
         model="light (8x8 images)", extra_s_per_save=round(extra, 4),
         host_memcpy_s=round(memcpy, 4), pause_s=round(pause, 4),
         pause_over_host_memcpy=round(pause / memcpy, 4),
         extra_beyond_pause_s=round(extra - pause, 4), background_write_s=round(background, 4),
         # the steps beside the background write: how much slower they ran (the extra time
         # beyond the pause over the write's duration, which the steps overlap)
         steps_slower_during_write=round(max(extra - pause, 0.0) / background, 4),
         steps_slower_goal="<= 0.05", writer=writer, writer_chosen=chosen, threads=threads,
         repeats=repeat)


BESIDE_LOADS = ("raw", "crc", "memcpy", "spin")
LOAD_S = 3.0


def raw_writer_child(d, sizes, load):
    """The child of bench_beside: ready once its buffer exists, then, per "go" line, one load:
    "raw" a raw write (with writeback, as the checkpoint writer) of files of ``sizes`` into
    ``d``; for LOAD_S seconds: "crc" zlib's CRC-32 over a 64 MiB buffer again and again,
    "memcpy" copies of it into another, "spin" a Python loop (one core, no memory traffic)."""
    import zlib

    import numpy as np

    buf = random_bytes()
    src, dst = np.frombuffer(buf, dtype=np.uint8), np.empty(len(buf), dtype=np.uint8)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        if load == "raw":
            raw_write(d, sizes, buf, writeback=True)
        while load != "raw" and time.perf_counter() - t0 < LOAD_S:
            if load == "crc":
                zlib.crc32(buf)
            elif load == "memcpy":
                np.copyto(dst, src)
        print(f"done {time.perf_counter() - t0}", flush=True)


def bench_beside(size, d, repeat, cmd, load="raw"):
    """How much slower the steps run beside another process's ``load`` (raw_writer_child):
    a plain write of a step's bytes (no serialising, no CRC: the machine's share of issue 31's
    5% goal), or for LOAD_S seconds the CRC, a memcpy, a busy loop; on the compute-light model of
    ``size``, one thread, in this process."""
    import select

    import torch as th

    from improved_diffusion import logger

    th.set_num_threads(1)
    logger.configure(dir=d, format_strs=["log"])
    loop, batch = build_loop(size, d, light=True)
    params = sum(p.numel() for p in loop.model.parameters())
    sizes = [4 * params, 4 * params, 8 * params]  # model, EMA, opt (Adam's two moments)
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--_rawwrite", ",".join(map(str, sizes)),
         "--dir", d, "--mode", load], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    for _ in range(3):
        loop.run_step(*batch)
    alone, during, writes = [], [], []
    for _ in range(repeat):
        alone += [step_seconds(loop, batch) for _ in range(20)]
        child.stdin.write("go\n")
        child.stdin.flush()
        while True:
            took = step_seconds(loop, batch)
            if select.select([child.stdout], [], [], 0)[0]:
                writes.append(float(child.stdout.readline().split()[1]))
                break
            during.append(took)
    child.stdin.close()
    child.wait(timeout=60)
    slower = statistics.median(during) / statistics.median(alone) - 1
    emit(f"steps_slower_beside_{load}", slower, "ratio", cmd, size=size, params=params,
         step_bytes=sum(sizes), model="light (8x8 images)", threads=1, load=load,
         step_s_alone=round(statistics.median(alone), 4),
         step_s_during=round(statistics.median(during), 4), steps_during=len(during),
         load_s=round(statistics.median(writes), 4), repeats=repeat,
         goal_of_the_writer="<= 0.05 (issue 31)")


def bench_beside_writer(size, d, repeat, cmd, writer):
    """How much slower the steps run while a background save of ``writer`` (--save_writer) is
    written, against the same steps alone, timed one by one (no other cost of a save is in
    it: the pause, the wait, the pruning), on the compute-light model of ``size``, one
    thread, in this process: issue 31's 5% goal, measured directly."""
    import torch as th

    from improved_diffusion import logger

    th.set_num_threads(1)
    logger.configure(dir=d, format_strs=["log"])
    loop, batch = build_loop(size, d, light=True, save_writer=writer, keep_checkpoints=2)
    params = sum(p.numel() for p in loop.model.parameters())
    step = 100
    timed_save(loop, step, async_save=True)  # the first: buffers, the writer process's start
    loop.checkpointer.wait_for_save()
    alone, during, writes = [], [], []
    for _ in range(repeat):
        alone += [step_seconds(loop, batch) for _ in range(10)]
        step += 1
        t_write = time.perf_counter()
        timed_save(loop, step, async_save=True)
        while loop.checkpointer.save_in_flight:
            took = step_seconds(loop, batch)
            if loop.checkpointer.save_in_flight:  # a step wholly beside the write
                during.append(took)
        writes.append(time.perf_counter() - t_write)
        loop.checkpointer.wait_for_save()
        loop.step = step
    chosen = loop.checkpointer.save_writer_chosen
    loop.close()
    slower = statistics.median(during) / statistics.median(alone) - 1 if during else None
    emit("steps_slower_beside_write", slower if slower is not None else float("nan"), "ratio",
         cmd, size=size, params=params, model="light (8x8 images)", threads=1, writer=writer,
         writer_chosen=chosen, step_s_alone=round(statistics.median(alone), 4),
         step_s_during=round(statistics.median(during), 4) if during else None,
         steps_during=len(during), write_s=round(statistics.median(writes), 4),
         goal="<= 0.05 (issue 31)", repeats=repeat)


def bench_start(d, repeat, cmd):
    """The writer process's cost per job (see the module docstring), in this process."""
    import resource

    import torch as th

    from improved_diffusion.ckpt import run_dir, writer_process

    files = {"model000001.pt": {"w": th.arange(1024.0)}}
    firsts, laters, cpus, threads = [], [], [], []
    for r in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        w = writer_process.WriterProcess()
        times = []
        for step in (1, 2, 3):
            sub = os.path.join(d, f"p{r}_{step}")
            os.makedirs(sub)
            t0 = time.perf_counter()
            w.write(sub, 1, w.pack(files))
            times.append(time.perf_counter() - t0)
        w.close()  # waits for the child: its CPU is in RUSAGE_CHILDREN
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        firsts.append(times[0])
        laters.append(statistics.median(times[1:]))
        sub = os.path.join(d, f"t{r}")
        os.makedirs(sub)
        t0 = time.perf_counter()
        run_dir.write_step(sub, 1, files)
        threads.append(time.perf_counter() - t0)
    later = statistics.median(laters)
    emit("writer_process_start_s", statistics.median(firsts) - later, "s", cmd,
         first_write_s=round(statistics.median(firsts), 4), later_write_s=round(later, 4),
         child_cpu_s=round(statistics.median(cpus), 4),
         thread_write_s=round(statistics.median(threads), 4), step_bytes=4096,
         process_min_bytes=writer_process.PROCESS_MIN_BYTES, repeats=repeat)


# ------------------------------------------------------------------------------------ loading


def load_once(path, mode):
    """One load in this fresh process: prints {"seconds", "peak_over_before"} (rank 0 prints the
    slowest rank's time and the largest peak)."""
    import torch as th

    from improved_diffusion import dist_util
    from improved_diffusion.ckpt import checkpoint

    dist_util.setup_dist()
    with open(path, "rb") as f:  # warm page cache, as for the reference
        while f.read(64 << 20):
            pass
    before = vm("VmRSS")
    dist_util.barrier()
    t0 = time.perf_counter()
    if mode == "torch":
        th.load(path, weights_only=True, map_location="cpu")
    elif mode == "collective":
        checkpoint.load_file_collective(path)
    elif mode == "broadcast":
        checkpoint.load_file_broadcast(path)
    elif mode == "single":
        checkpoint.load_file(path)
    took = time.perf_counter() - t0
    peak = vm("VmHWM") - before
    got = dist_util.all_gather_object((took, peak))
    if dist_util.get_rank() == 0:
        print(json.dumps({"seconds": max(g[0] for g in got), "peaks": [g[1] for g in got]}))
    dist_util.cleanup()


def run_load(path, mode, ranks):
    py = [sys.executable, os.path.abspath(__file__), "--_load", path, "--mode", mode]
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        py = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks)] + py
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(py, check=True, stdout=subprocess.PIPE, text=True, env=env,
                         timeout=1200).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_load(size, path, repeat, cmd):
    nbytes = os.path.getsize(path)
    res = {}
    for _ in range(repeat):  # interleaved, side by side
        for mode, ranks in (("torch", 1), ("collective", 2), ("broadcast", 2), ("single", 1)):
            res.setdefault(mode, []).append(run_load(path, mode, ranks))
    ref = statistics.median(r["seconds"] for r in res["torch"])
    for mode, figure in (("torch", "torch_load_s"), ("collective", "load_2ranks_s"),
                         ("broadcast", "load_broadcast_2ranks_s"), ("single", "load_1rank_s")):
        secs = statistics.median(r["seconds"] for r in res[mode])
        peaks = [max(r["peaks"][i] for r in res[mode]) for i in range(len(res[mode][0]["peaks"]))]
        emit(figure, secs, "s", cmd, size=size, file="opt", file_bytes=nbytes,
             over_torch_load=round(secs / ref, 4), peak_rss_bytes_per_rank=peaks,
             peak_rss_over_file=[round(p / nbytes, 3) for p in peaks], repeats=repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,60M,250M")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--figures", default="save,run,load",
                    help="which: save (pause, sync save), run (saving every 10 steps), load, start "
                         "(the writer process's cost per job), beside (steps beside a raw write "
                         "from another process)")
    ap.add_argument("--ranks", default="1",
                    help="run figure: on these numbers of ranks, one after the other (1,2: "
                         "also under mpiexec -n 2)")
    ap.add_argument("--writers", default="process",
                    help="run figure: with these background writers, one after the other "
                         "(process,thread: the writer process beside the in-process thread)")
    ap.add_argument("--writer", default="process", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1,
                    help="run figure: torch's threads per rank (default 1)")
    ap.add_argument("--run_steps", type=int, default=40,
                    help="steps of each run (run figure; a multiple of 10, >= 20)")
    ap.add_argument("--_save", help=argparse.SUPPRESS)
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_load", help=argparse.SUPPRESS)
    ap.add_argument("--_rawwrite", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--keep", help=argparse.SUPPRESS)
    ap.add_argument("--cmd", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_steps < 20 or args.run_steps % 10:
        ap.error(f"--run_steps must be a multiple of 10, at least 20 (got {args.run_steps})")
    if args._load:
        return load_once(args._load, args.mode)
    if args._rawwrite:
        return raw_writer_child(args.dir, [int(n) for n in args._rawwrite.split(",")],
                                args.mode)
    if args._save:
        return bench_save(args._save, args.dir, args.repeat, args.cmd, args.keep)
    if args._run:
        return bench_run(args._run, args.dir, args.repeat, args.run_steps, args.cmd, args.writer,
                         args.threads)
    cmd = "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:])
    figures = set(args.figures.split(","))
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt")

    def child(*flags, ranks=1):
        py = [sys.executable, os.path.abspath(__file__), *flags, "--repeat", str(args.repeat),
              "--cmd", cmd]
        if ranks > 1:
            mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
            py = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks)] + py
        subprocess.run(py, check=True, timeout=3600)

    try:
        if "start" in figures:
            os.makedirs(os.path.join(root, "start"))
            bench_start(os.path.join(root, "start"), max(args.repeat, 3), cmd)
        for size in args.sizes.split(","):
            d = os.path.join(root, size)
            keep = os.path.join(root, f"opt_{size}.pt") if "load" in figures else ""
            if figures & {"save", "load"}:
                os.makedirs(d)
                child("--_save", size, "--dir", d, "--keep", keep)
                shutil.rmtree(d)
            if "load" in figures:
                bench_load(size, keep, args.repeat, cmd)
                os.unlink(keep)
            if "beside" in figures:
                os.makedirs(d)
                for load in BESIDE_LOADS:
                    bench_beside(size, d, args.repeat, cmd, load)
                for writer in args.writers.split(","):
                    os.makedirs(os.path.join(d, writer))
                    bench_beside_writer(size, os.path.join(d, writer), args.repeat, cmd, writer)
                shutil.rmtree(d)
            if "run" in figures:
                for ranks in map(int, args.ranks.split(",")):
                    for writer in args.writers.split(","):
                        os.makedirs(d)
                        child("--_run", size, "--dir", d, "--run_steps", str(args.run_steps),
                              "--writer", writer, "--threads", str(args.threads), ranks=ranks)
                        shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
