"""Resume time under --fsdp True, the sharded layout against the full one; one JSON line each.

    python benchmarks/fsdp_resume.py [--ranks 2] [--num_channels 128] [--repeats 2]
    python benchmarks/fsdp_resume.py --ranks 1 --more_steps 1   (one process, no launcher: on
                                     CUDA a one-rank NCCL group, infra/fsdp.ensure_process_group)

scripts/train.py under `mpiexec -n N --fsdp True`, the ~41M-parameter UNet of
benchmarks/fsdp_memory.py, one step saved in each layout (--save_layout full / sharded, the same
training), then the same command resumed with nothing left to train (--max_steps 1), in one run,
alternating. ``job_s``: the whole resume command's wall time (start-up, the plan, the checksums
of the chosen step, the load, and the exit; nothing is trained or saved), per repeat and median;
``step_bytes``: the step's files. ``--more_steps N``: each resume trains N more steps and saves
them in the same layout (a save after a resume too). Every resume must say "resumed at step S"
in its log dir's log.txt (S the step it resumed from), or the script fails naming the layout.
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
    launcher = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launcher, PY, REPO / "scripts" / "train.py", *args]
    began = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], env=child_env(), cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                         + proc.stdout[-3000:])
    return time.perf_counter() - began


def _cuda():
    import torch as th

    return th.cuda.is_available()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--num_channels", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--more_steps", type=int, default=0,
                   help="steps each resume trains (and saves) past the step it resumes")
    a = p.parse_args()
    command = COMMAND + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
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
        resumed = {layout: [] for layout in runs}
        for r in range(a.repeats):
            for layout, run in runs.items():
                start = 1 + a.more_steps * r
                extra = ["--max_steps", str(start + a.more_steps)] if a.more_steps else []
                job = train(a.ranks, ["--data_dir", data, "--log_dir", run, "--num_workers",
                                      "0", *extra])
                times[layout].append(job)
                log = (run / "log.txt").read_text()
                if f"resumed at step {start} " not in log:
                    raise SystemExit(f"--save_layout {layout}: the resume did not say "
                                     f"'resumed at step {start}' in {run}/log.txt")
                resumed[layout].append(start)
        for layout, jobs in times.items():
            print(json.dumps({"figure": "fsdp_resume_job_s", "layout": layout,
                              "ranks": a.ranks, "job_s": [round(t, 2) for t in jobs],
                              "job_s_median": round(sorted(jobs)[len(jobs) // 2], 2),
                              "step_bytes": sum(f.stat().st_size for f in runs[layout].rglob("*")
                                                if f.is_file() and "000001" in str(f)),
                              "resumed_at_steps": resumed[layout], "more_steps": a.more_steps,
                              "device": "cuda" if _cuda() else "cpu",
                              "command": command}), flush=True)


if __name__ == "__main__":
    main()
