"""Post-hoc EMA on the demo's digits (issue 23's figures): what the reconstruction is worth.

One short class-conditional run (datasets/digits.py at 8 px, one process) tracks three
power-function EMAs, `--phema_stds 0.05,0.07,0.1`; the tracker changes nothing in training, so
its std-0.07 snapshots are those of a run tracking 0.07 alone, beside the other two. Then:

1. std 0.07 reconstructed (`ckpt.py phema`) from the 0.05 and 0.10 snapshots alone (copied to a
   directory of their own) against the directly tracked std-0.07 weights of the last step: max
   and mean absolute difference over the parameters, beside the scale they are measured against
   (the mean absolute weight, and the mean absolute difference between the two inputs' last
   snapshots);
2. a sweep of reconstructed stds: 100 DDIM samples each (`sample.py`, 10 per class), scored by
   the demo's classifier (scripts/eval_digits.py: label agreement, mean confidence, Frechet
   distance in its feature space), with the raw model and the --ema_rate EMA for reference.

One JSON line per figure. Usage (a few CPU minutes with the defaults):

    python benchmarks/phema_digits.py [--steps 600] [--batch_size 32] [--save_interval 20]
        [--sweep 0.03,0.05,0.07,0.1,0.15] [--out DIR (default: a temp dir, removed)]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "datasets"))

import torch as th  # noqa: E402

import digits  # noqa: E402  (datasets/digits.py)
from improved_diffusion import phema  # noqa: E402

MODEL = ["--image_size", "8", "--class_cond", "True", "--num_classes", "10",
         "--num_channels", "32", "--num_res_blocks", "1", "--channel_mult", "1,2",
         "--attention_resolutions", "", "--learn_sigma", "False", "--predict_xstart", "True",
         "--diffusion_steps", "100", "--noise_schedule", "cosine"]
TRACKED = "0.05,0.07,0.1"
INPUTS = ("0.050", "0.100")


def child(script, *args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning")
    env.pop("OPENAI_LOGDIR", None)
    cmd = [sys.executable, os.path.join(REPO, "scripts", script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
    return proc.stdout


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def weights_diff(a, b, names):
    """(max, mean) absolute difference over the parameters ``names`` of state dicts a, b."""
    d = th.cat([(a[n].double() - b[n].double()).abs().reshape(-1) for n in names])
    return float(d.max()), float(d.mean())


def score(model_path, samples_dir, seed):
    """Label agreement, confidence and Frechet distance of 100 samples from ``model_path``."""
    child("sample.py", "--model_path", model_path, "--log_dir", samples_dir,
          "--num_samples", 100, "--batch_size", 100, "--use_ddim", "True",
          "--timestep_respacing", "ddim25", "--classes", ",".join(map(str, range(10))),
          "--seed", seed, "--grid", "False", "--progress", "False")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        r = digits.evaluate_npz(os.path.join(samples_dir, "samples_100x8x8x3.npz"))
    return {"label_agreement": r["label_agreement"],
            "mean_confidence": round(r["mean_confidence"], 4),
            "frechet": round(r["fid_real_vs_generated"], 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--save_interval", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ema_rate", default="0.995")
    p.add_argument("--sweep", default="0.03,0.05,0.07,0.1,0.15")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sweep = phema.parse_stds([args.sweep], "--sweep")
    out = args.out or tempfile.mkdtemp(prefix="phema_digits_")
    try:
        run(args, sweep, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


def run(args, sweep, out):
    data, run_dir = os.path.join(out, "data"), os.path.join(out, "run")
    digits.write_digits_folder(data, 8, log=lambda *a: None)
    t0 = time.perf_counter()
    child("train.py", "--data_dir", data, "--log_dir", run_dir, *MODEL, "--lr", args.lr,
          "--batch_size", args.batch_size, "--ema_rate", args.ema_rate,
          "--max_steps", args.steps, "--save_interval", args.save_interval,
          "--keep_checkpoints", 1, "--log_interval", 100, "--seed", args.seed,
          "--phema_stds", TRACKED)
    train_s = time.perf_counter() - t0
    step = args.steps
    snaps = sorted(n for n in os.listdir(run_dir) if n.startswith("phema_"))
    print(json.dumps({"figure": "phema_digits_run", "steps": step, "batch": args.batch_size,
                      "tracked_stds": TRACKED, "snapshot_files": len(snaps),
                      "train_seconds": round(train_s, 1)}), flush=True)

    # 1. std 0.07 from the 0.05 and 0.10 snapshots alone, against the tracked one
    inputs = os.path.join(out, "inputs")
    os.makedirs(inputs)
    for name in snaps:
        if name.split("_")[1] in INPUTS:
            os.link(os.path.join(run_dir, name), os.path.join(inputs, name))
    rec = os.path.join(out, "rec")
    child("ckpt.py", "phema", inputs, "--std", 0.07, "--out", rec)
    plan = phema.plan_reconstruction(inputs, [0.07])
    tracked = load(os.path.join(run_dir, f"phema_0.070_{step:06d}.pt"))
    names = tracked["param_names"]
    got = load(os.path.join(rec, f"ema_phema0.070_{step:06d}.pt"))["state_dict"]
    a = load(os.path.join(inputs, f"phema_0.050_{step:06d}.pt"))["state_dict"]
    b = load(os.path.join(inputs, f"phema_0.100_{step:06d}.pt"))["state_dict"]
    mx, mean = weights_diff(got, tracked["state_dict"], names)
    scale = float(th.cat([tracked["state_dict"][n].abs().reshape(-1) for n in names]).mean())
    print(json.dumps({
        "figure": "phema_reconstructed_vs_tracked", "std": 0.07, "step": step,
        "inputs": len(plan.inputs), "profile_error": round(float(plan.errors[0]), 4),
        "max_abs_diff": mx, "mean_abs_diff": mean, "mean_abs_weight": scale,
        "mean_abs_diff_input_0.05_vs_0.10": weights_diff(a, b, names)[1]}), flush=True)

    # 2. the sweep, from all snapshots of the run but std 0.07's own (the inputs directory)
    sweep_dir = os.path.join(out, "sweep")
    child("ckpt.py", "phema", inputs, *[a for s in sweep for a in ("--std", s)],
          "--out", sweep_dir)
    errors = dict(zip(sweep, phema.plan_reconstruction(inputs, sweep).errors))
    cases = [("model", os.path.join(run_dir, f"model{step:06d}.pt"), None),
             (f"ema {args.ema_rate}", os.path.join(run_dir, f"ema_{args.ema_rate}_{step:06d}.pt"),
              None),
             ("tracked 0.070", os.path.join(run_dir, f"phema_0.070_{step:06d}.pt"), None)]
    cases += [(f"reconstructed {phema.std_str(s)}",
               os.path.join(sweep_dir, f"ema_phema{phema.std_str(s)}_{step:06d}.pt"), s)
              for s in sweep]
    for label, path, std in cases:
        fig = {"figure": "phema_digits_sweep", "weights": label, "step": step}
        if std is not None:
            fig["profile_error"] = round(float(errors[std]), 4)
        fig.update(score(path, os.path.join(out, "samples", label.replace(" ", "_")), args.seed))
        print(json.dumps(fig), flush=True)


if __name__ == "__main__":
    main()
