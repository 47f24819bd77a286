"""Peak memory per rank, FSDP (--fsdp True) against DDP on the same model; one JSON line each.

    python benchmarks/fsdp_memory.py [--ranks 2,3] [--steps 3] [--num_channels 128]
                                     [--mmap_threshold 0,131072] [--async_save False]

scripts/train.py under `mpiexec -n N`, the UNet of ~43M parameters at 8x8 (--num_channels 128
--channel_mult 1,2,2,2 --num_res_blocks 2 --attention_resolutions 4,2,1, AdamW, one EMA), batch 2
per rank, on the CPU, DDP and FSDP side by side in one run. While the job runs, every rank's
resident memory (/proc/PID/status VmRSS) is read every 20 ms:

* ``train_peak_rss_mb``: the largest VmRSS of each rank before the first save began (the model
  built, sharded, and trained: what the state costs while training); ``..._max`` over the ranks;
* ``peak_rss_mb``: each rank's VmHWM at its end (the saves included: the full layout gathers the
  whole state on rank 0 to write today's files);
* ``ratio_to_ddp``: FSDP's figure over DDP's at the same rank count (the issue's goal: <= 0.65
  at 2 ranks for the training peak).

A process's resident memory includes torch's own (~300-400 MB here), which no sharding divides.
``mmap_threshold``: glibc's MALLOC_MMAP_THRESHOLD_ for both jobs (0: glibc's default, which
keeps freed blocks of up to 32 MB in the heap, so resident memory stays at its high-water mark
of transient buffers, such as FSDP's gathered blocks; 131072: each block of 128 KiB or more is
its own mapping, returned when freed, so resident memory follows what is live).
``async_save``: both jobs' --async_save (False by default: the full layout's synchronous save
streams file by file under FSDP; True: both jobs hand a host copy of the step to the background
writer; FSDP's rank 0 gathers each whole tensor straight into that copy, so it holds the copy
and no other whole state, as DDP's rank 0 does).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import MPIEXEC, PY, child_env, rank_pids, write_images  # noqa: E402

COMMAND = "python benchmarks/fsdp_memory.py"


def model_flags(channels):
    return ["--image_size", "8", "--num_channels", str(channels), "--channel_mult", "1,2,2,2",
            "--num_res_blocks", "2", "--attention_resolutions", "4,2,1", "--diffusion_steps",
            "20"]


def status_kb(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def measure(work, data, ranks, sharded, steps, channels, mmap_threshold, async_save):
    log_dir = work / f"{'fsdp' if sharded else 'ddp'}{ranks}_{mmap_threshold}"
    out_path = work / f"{log_dir.name}.out"
    cmd = [MPIEXEC, "-n", str(ranks), PY, REPO / "scripts" / "train.py", "--data_dir", data,
           "--log_dir", log_dir, *model_flags(channels), "--batch_size", "2", "--max_steps",
           str(steps), "--save_interval", "0", "--fsdp", str(sharded), "--num_workers", "0",
           "--async_save", str(async_save)]
    train_peak, hwm = {}, {}
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else None
    with open(out_path, "w") as out:
        job = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                               env=child_env(env), cwd=REPO)
        saving = False
        while job.poll() is None:
            pids = rank_pids(log_dir)
            saving = saving or "saved step" in out_path.read_text() or "step " + str(steps) in \
                out_path.read_text()
            for rank, pid in pids.items():
                rss, peak = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")
                if peak is not None:
                    hwm[rank] = max(hwm.get(rank, 0), peak)
                if rss is not None and not saving:
                    train_peak[rank] = max(train_peak.get(rank, 0), rss)
            time.sleep(0.02)
    if job.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {job.returncode}:\n"
                         + out_path.read_text()[-3000:])
    mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
    return ({r: mb(v) for r, v in sorted(train_peak.items())},
            {r: mb(v) for r, v in sorted(hwm.items())})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num_channels", type=int, default=128)
    p.add_argument("--mmap_threshold", default="0,131072")
    p.add_argument("--async_save", choices=("False", "True"), default="False")
    a = p.parse_args()
    import torch
    from improved_diffusion.script_util import create_model, model_and_diffusion_defaults
    flags = model_and_diffusion_defaults()
    flags.update(image_size=8, num_channels=a.num_channels, channel_mult="1,2,2,2",
                 num_res_blocks=2, attention_resolutions="4,2,1")
    keys = create_model.__code__.co_varnames[:create_model.__code__.co_argcount]
    params = sum(t.numel() for t in create_model(**{k: flags[k] for k in keys if k in flags})
                 .parameters())
    del torch
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_images(work / "img", n=16)
        for ranks, mmap in [(r, m) for r in map(int, a.ranks.split(","))
                            for m in map(int, a.mmap_threshold.split(","))]:
            figures = {}
            for sharded in (False, True):
                figures[sharded] = measure(work, data, ranks, sharded, a.steps, a.num_channels,
                                           mmap, a.async_save)
            for sharded in (False, True):
                train, hwm = figures[sharded]
                line = {"figure": "peak_rss_per_rank", "mode": "fsdp" if sharded else "ddp",
                        "ranks": ranks, "params_m": round(params / 1e6, 1),
                        "mmap_threshold": mmap, "async_save": a.async_save == "True",
                        "train_peak_rss_mb": train,
                        "train_peak_rss_mb_max": max(train.values()),
                        "peak_rss_mb": hwm, "peak_rss_mb_max": max(hwm.values()),
                        "command": COMMAND}
                if sharded:
                    ddp_train, ddp_hwm = figures[False]
                    line["ratio_to_ddp"] = round(max(train.values()) / max(ddp_train.values()), 3)
                    line["ratio_to_ddp_with_saves"] = round(
                        max(hwm.values()) / max(ddp_hwm.values()), 3)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
