"""What a script's end costs: Python's own exit against infra/process_exit.exit_process.

Two figures, each as alternating pairs in fresh processes (one torch thread), the reference
beside it in the same run:

- ``exit_cpu_s``: a process that imports torch and torch._dynamo (what every training rank has
  by its first optimizer call), prints, and ends; the CPU seconds (user + sys, getrusage of the
  reaped child) and the wall from its print to its reaping, ending with ``sys.exit(0)`` (Python's
  exit, ``python_exit``) against ``exit_process(0)``;
- ``train_job_cpu_s``: scripts/train.py itself, one rank, a tiny UNet for ``--steps`` steps
  saving at the end, on 8x8 random images: its CPU seconds as it ends now (``exit_process``) and
  with its last line swapped for ``sys.exit`` (``python_exit``: the script run through runpy by
  a two-line wrapper that replaces ``cli.exit_process`` with ``sys.exit``).

One JSON line per figure: the medians, the saving, the command. Usage:

    OMP_NUM_THREADS=1 python benchmarks/exit_cost.py [--pairs 5] [--steps 4]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS = "import torch, torch._dynamo, time; print(time.time(), flush=True)\n"
ENDS = {
    "python_exit": "import sys; sys.exit(0)\n",
    "exit_process": "from improved_diffusion.infra.process_exit import exit_process; "
                    "exit_process(0)\n",
}
WRAPPER = ("import runpy, sys\nfrom improved_diffusion.infra import cli\n"
           "cli.exit_process = sys.exit\nsys.argv = sys.argv[1:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _env():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _child_cpu(cmd, read_stamp=False):
    """(CPU s of the child, wall s from its printed stamp to its reaping; None without)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(), cwd=REPO)
    stamp = float(proc.stdout.readline()) if read_stamp else None
    proc.stdout.read()
    code = proc.wait()
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"exit_cost.py: {' '.join(cmd)} exited {code}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, (end - stamp if stamp is not None else None)


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def exit_figure(pairs):
    got = {k: {"cpu": [], "wall": []} for k in ENDS}
    for i in range(pairs):
        for name in (list(ENDS) if i % 2 == 0 else list(ENDS)[::-1]):
            cpu, wall = _child_cpu([sys.executable, "-c", IMPORTS + ENDS[name]], read_stamp=True)
            got[name]["cpu"].append(cpu)
            got[name]["wall"].append(wall)
    return got


def train_figure(pairs, steps, d):
    images = os.path.join(d, "images")
    os.makedirs(images)
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
            os.path.join(images, f"{i}.png"))
    wrapper = os.path.join(d, "python_exit.py")
    with open(wrapper, "w") as f:
        f.write(WRAPPER)
    train = os.path.join(REPO, "scripts", "train.py")
    flags = ["--data_dir", images, "--image_size", "8", "--num_channels", "32",
             "--num_res_blocks", "1", "--attention_resolutions", "4", "--diffusion_steps", "20",
             "--batch_size", "2", "--max_steps", str(steps), "--save_interval", str(steps)]
    got = {k: {"cpu": []} for k in ENDS}
    for i in range(pairs):
        for name in (list(ENDS) if i % 2 == 0 else list(ENDS)[::-1]):
            head = [sys.executable, train] if name == "exit_process" else [
                sys.executable, wrapper, train]
            cpu, _ = _child_cpu([*head, *flags, "--log_dir", os.path.join(d, f"{name}{i}")])
            got[name]["cpu"].append(cpu)
    return got


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    command = "OMP_NUM_THREADS=1 python benchmarks/exit_cost.py " + " ".join(sys.argv[1:])
    got = exit_figure(args.pairs)
    cpu = {k: _median(v["cpu"]) for k, v in got.items()}
    print(json.dumps({
        "figure": "exit_cpu_s", "what": "a process that imported torch and torch._dynamo, "
        "from its print to its end", "pairs": args.pairs,
        "python_exit_cpu_s": round(cpu["python_exit"], 3),
        "exit_process_cpu_s": round(cpu["exit_process"], 3),
        "saved_cpu_s": round(cpu["python_exit"] - cpu["exit_process"], 3),
        "python_exit_wall_after_print_s": round(_median(got["python_exit"]["wall"]), 3),
        "exit_process_wall_after_print_s": round(_median(got["exit_process"]["wall"]), 3),
        "command": command}), flush=True)
    with tempfile.TemporaryDirectory() as d:
        got = train_figure(args.pairs, args.steps, d)
    cpu = {k: _median(v["cpu"]) for k, v in got.items()}
    print(json.dumps({
        "figure": "train_job_cpu_s", "what": f"scripts/train.py, 1 rank, {args.steps} steps, "
        "one save", "pairs": args.pairs,
        "python_exit_cpu_s": round(cpu["python_exit"], 3),
        "exit_process_cpu_s": round(cpu["exit_process"], 3),
        "saved_cpu_s": round(cpu["python_exit"] - cpu["exit_process"], 3),
        "saved_fraction": round(1 - cpu["exit_process"] / cpu["python_exit"], 3),
        "command": command}), flush=True)


if __name__ == "__main__":
    main()
