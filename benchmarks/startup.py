"""Auto-resume start-up cost with 1 and with 30 steps in the log dir (issue 9).

Writes N tagged steps of a model of about --params parameters (model + one EMA + AdamW state, as
the trainer saves them) into a temp dir, then times, side by side in the same run:

- ``plan``: run_dir.plan_resume (rank 0's listing, manifests, checksums of the chosen step);
- ``startup``: the plan plus the loads of the chosen step's model, EMA and opt files;
- ``reference_verify_all``: the reference, what auto-resume did before: the checksum of every file
  of every step in the log dir (run_dir.list_steps(verify_checksums=True)).

One JSON line per figure. Usage:

    python benchmarks/startup.py [--params 15e6] [--steps 1,30] [--repeat 3]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch as th  # noqa: E402

from improved_diffusion.ckpt import checkpoint, optim_state, run_dir  # noqa: E402


def make_model(params):
    """A plain stack of Linear layers with about ``params`` parameters (what the files hold is
    what matters here, not the architecture)."""
    width = 1024
    n = max(1, int(round(params / (width * width + width))))
    return th.nn.Sequential(*[th.nn.Linear(width, width) for _ in range(n)])


def write_steps(d, model, steps):
    os.makedirs(d, exist_ok=True)
    opt = th.optim.AdamW(model.parameters(), lr=1e-4)
    model(th.zeros(1, 1024)).sum().backward()
    opt.step()
    named = list(model.named_parameters())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for s in range(1, steps + 1):
        run_dir.save_step(d, s, {
            checkpoint.model_filename(s): checkpoint.model_payload(s, sd, {}),
            checkpoint.ema_filename("0.9999", s): checkpoint.ema_payload(s, "0.9999", sd, {}),
            checkpoint.opt_filename(s): checkpoint.opt_payload(
                s, optim_state.named_optimizer_state(opt, named), {"step": s}),
        })


def time_plan(d, repeat):
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = run_dir.plan_resume(d, "")
        out.append(time.perf_counter() - t0)
    return plan, statistics.median(out)


def time_load(d, plan, model, repeat):
    """Plan + the three collective loads of the chosen step (1 process)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = run_dir.plan_resume(d, "")
        ck = checkpoint.load_file_collective(plan.model)
        model.load_state_dict(ck.state_dict)
        beside = plan.files_of(plan.step)
        for p in beside["ema"].values():
            checkpoint.load_file_collective(p)
        checkpoint.load_file_collective(beside["opt"])
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=15e6)
    ap.add_argument("--steps", default="1,30")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    model = make_model(args.params)
    n_params = sum(p.numel() for p in model.parameters())
    cmd = "python benchmarks/startup.py " + " ".join(sys.argv[1:])
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for steps in [int(x) for x in args.steps.split(",")]:
            d = os.path.join(root, f"steps{steps}")
            write_steps(d, model, steps)
            size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
            plan, t_plan = time_plan(d, args.repeat)
            t_start = time_load(d, plan, model, args.repeat)
            t0 = time.perf_counter()
            run_dir.list_steps(d, verify_checksums=True)
            t_all = time.perf_counter() - t0
            for figure, value in (("plan_s", t_plan), ("startup_s", t_start),
                                  ("reference_verify_all_s", t_all)):
                print(json.dumps({"figure": f"auto_resume_{figure}", "steps_in_log_dir": steps,
                                  "value": round(value, 4), "unit": "s", "params": n_params,
                                  "log_dir_bytes": size, "chosen_step": plan.step,
                                  "command": cmd}), flush=True)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
