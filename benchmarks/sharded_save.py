"""
The blocking time of a sharded save, side by side on the same state in one run (JSON lines on
rank 0): DCP's own dcp.save and dcp.async_save (process- and thread-based), and ours
(sharded.start_save in each mode: the same plus the temp folder, the names' checks, and in
collect() the CRC-32s and the manifest). "blocking_s": until the call returns (training could go
on); "total_s": until the step is complete (ours: collect() returned, manifest written).

    mpiexec -n 2 python benchmarks/sharded_save.py --width 1024 --repeats 3 --dir /tmp/bench
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.distributed as dist  # noqa: E402

import sharded_driver as drv  # noqa: E402
from improved_diffusion import dist_util  # noqa: E402
from improved_diffusion.ckpt import sharded  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/sharded_bench")
    args = p.parse_args()
    dist_util.setup_dist(timeout=600)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    rank = dist_util.get_rank()
    model, opt, emas = drv.build(args.width, seed=0)
    drv.train_step(model, opt, emas, 1)
    files = drv.files_of(model, opt, emas, 1)
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 5  # model, 2 EMAs, 2 moments
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()
    thread_group = dist.new_group(backend="gloo")
    counter = [0]

    def fresh():
        counter[0] += 1
        return os.path.join(args.dir, f"run{counter[0]}")

    def dcp_sync():
        d = fresh()
        t = time.perf_counter()
        dcp.save(files, storage_writer=FileSystemWriter(d, sync_files=True))
        return time.perf_counter() - t, time.perf_counter() - t

    def dcp_async(kind, group=None):
        def run():
            d = fresh()
            t = time.perf_counter()
            fut = dcp.async_save(files, storage_writer=FileSystemWriter(d, sync_files=True),
                                 async_checkpointer_type=kind, process_group=group)
            blocking = time.perf_counter() - t
            fut.result()
            dist.barrier()
            return blocking, time.perf_counter() - t
        return run

    def ours(mode):
        def run():
            d = fresh()
            if rank == 0:
                os.makedirs(d)
            dist.barrier()
            t = time.perf_counter()
            pending = sharded.start_save(d, 1, files, {"bench": True}, mode=mode)
            blocking = time.perf_counter() - t
            pending.collect()
            return blocking, time.perf_counter() - t
        return run

    cases = [("dcp.save", dcp_sync), ("ours sync", ours("sync")),
             ("dcp.async_save process", dcp_async(AsyncCheckpointerType.PROCESS)),
             ("ours process", ours("process")),
             ("dcp.async_save thread (own gloo group)",
              dcp_async(AsyncCheckpointerType.THREAD, thread_group)),
             ("ours thread", ours("thread"))]
    results = {}
    for name, fn in cases:
        fn()  # warm-up (the process-based writer is spawned on its first save)
        times = [fn() for _ in range(args.repeats)]
        results[name] = times
        if rank == 0:
            print(json.dumps({"case": name, "world": dist.get_world_size(), "bytes": nbytes,
                              "blocking_s": round(statistics.median(t[0] for t in times), 4),
                              "total_s": round(statistics.median(t[1] for t in times), 4),
                              "repeats": args.repeats}), flush=True)
    if rank == 0:
        med = {k: statistics.median(t[0] for t in v) for k, v in results.items()}
        for ours_name, theirs in (("ours sync", "dcp.save"),
                                  ("ours process", "dcp.async_save process"),
                                  ("ours thread", "dcp.async_save thread (own gloo group)")):
            print(json.dumps({"ratio": f"{ours_name} / {theirs}",
                              "blocking": round(med[ours_name] / med[theirs], 3)}), flush=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main()
