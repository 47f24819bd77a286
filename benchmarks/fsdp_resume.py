"""Resume time under --fsdp True, the sharded layout against the full one; one JSON line each.

    python benchmarks/fsdp_resume.py [--ranks 2] [--num_channels 128] [--repeats 2]

scripts/train.py under `mpiexec -n N --fsdp True`, the ~41M-parameter UNet of
benchmarks/fsdp_memory.py, one step saved in each layout (--save_layout full / sharded, the same
training), then the same command resumed with nothing left to train (--max_steps 1), in one run,
alternating. ``job_s``: the whole resume command's wall time (start-up, the plan, the checksums
of the chosen step, the load, and the exit; nothing is trained or saved), per repeat and median;
``step_bytes``: the step's files.
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

from conftest import MPIEXEC, PY, child_env, write_images  # noqa: E402
from fsdp_memory import model_flags  # noqa: E402  (benchmarks/, this script's folder)

COMMAND = "python benchmarks/fsdp_resume.py"


def train(ranks, args):
    cmd = [MPIEXEC, "-n", str(ranks), PY, REPO / "scripts" / "train.py", *args]
    began = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], env=child_env(), cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                         + proc.stdout[-3000:])
    return time.perf_counter() - began


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--num_channels", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_images(work / "img", n=16)
        runs = {}
        for layout in ("full", "sharded"):
            runs[layout] = work / layout
            train(a.ranks, ["--data_dir", data, "--log_dir", runs[layout],
                            *model_flags(a.num_channels), "--batch_size", "2", "--max_steps",
                            "1", "--fsdp", "True", "--save_layout", layout, "--num_workers",
                            "0"])
        times = {layout: [] for layout in runs}
        for _ in range(a.repeats):
            for layout, run in runs.items():
                job = train(a.ranks, ["--data_dir", data, "--log_dir", run, "--num_workers",
                                      "0"])
                times[layout].append(job)
        for layout, jobs in times.items():
            print(json.dumps({"figure": "fsdp_resume_job_s", "layout": layout,
                              "ranks": a.ranks, "job_s": [round(t, 2) for t in jobs],
                              "job_s_median": round(sorted(jobs)[len(jobs) // 2], 2),
                              "step_bytes": sum(f.stat().st_size for f in runs[layout].rglob("*")
                                                if f.is_file() and "000001" in str(f)),
                              "command": COMMAND}), flush=True)


if __name__ == "__main__":
    main()
