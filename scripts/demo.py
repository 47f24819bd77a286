"""`make demo`: the whole pipeline on real data, end to end, on 2 CPU processes.

    python scripts/demo.py [--out demo_out] [--steps N] [--batch_size B] [--num_samples 100]
    python scripts/demo.py --tiny --out /tmp/demo     # a few steps, a handful of samples (tests)

1. data      scikit-learn's bundled 8x8 digits written as an image folder at --image_size px
             (datasets/digits.py; no download).
2. train     a small class-conditional UNet: `mpiexec -n 2 python scripts/train.py ...`; about
             halfway SIGTERM goes to one rank: all ranks save a complete checkpoint and exit
             with code 75 (what a job scheduler would requeue on); then the very same command
             again auto-resumes from the newest complete step and trains to the end. Four
             times a run it logs the EMA's FID against the real digits (--eval_interval,
             --eval_features digits) and saves post-hoc EMA snapshots (--phema_stds 0.05,0.1).
3. sample    `mpiexec -n 2 python scripts/sample.py` from the EMA weights with DDIM: --num_samples
             digits, classes 0..9 in turn (each grid column one class), npz + PNG grid; the loss
             curve.
4. evaluate  a classifier trained on the real digits scores the samples (scripts/eval_digits.py):
             mean confidence, label agreement, class histogram, Frechet distance vs real halves;
             the same for --num_samples real digits held out (the reference column), and
             ADM's FID, sFID, IS, precision, recall of both (scripts/evaluate.py --features
             digits) against the other real digits; then the post-hoc EMA chosen by FID
             (`ckpt.py phema run --std 0.03,...,0.15 --evaluate eval/ref_digits.npz --features
             digits`: each width reconstructed, sampled and scored; eval/phema_sweep.png).
5. guidance  the model above learnt the null label too (--class_dropout_prob 0.1); a small noised
             classifier is trained with `mpiexec -n 2 python scripts/classifier_train.py`,
             preempted halfway and auto-resumed like the model; then the same seeds and labels
             are sampled with classifier guidance (classifier_sample.py --classifier_scale),
             classifier-free guidance (sample.py --guidance_scale), both, unconditionally (the
             null label) and unconditionally with classifier guidance, each scored as in 4.
6. summary   the figures, summary.txt and index.html.

The stages print as ``=== [N/6] ...``, with these numbers.

Everything lands in --out (default demo_out/ in the repository): data/, run/ (checkpoints and
logs), samples/ (npz, grid PNG and loss curve), eval/ (the real digits as batches: the held-out
ones and the reference; phema_sweep.png), eval.json, phema_sweep.json (the post-hoc EMA
widths' FIDs), classifier/ (its run), guidance/ (the guided samples),
guidance.json (a list of rows {"way", "label_agreement", "mean_confidence", "command", "grid",
...}), demo.json (what was trained, the stages' times), summary.txt and index.html (the page
to look at: figures, grids, loss curve, the guidance table; improved_diffusion/apps/demo_page.py).
An --out that holds a finished run is never overwritten: its summary is shown again (pass a new
--out to run afresh; through make, ``make demo DEMO_ARGS="--out NEW_DIR"``). An --out with an
unfinished run of the same settings is continued (training auto-resumes); different settings are
an error. Exit code 0 on success, 1 when a stage fails, 2 for bad usage.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from improved_diffusion.infra.errors import UsageError, UserError  # noqa: E402
from improved_diffusion.infra.flags import FlagParser  # noqa: E402
BIN = os.path.dirname(sys.executable)
PREEMPTED_EXIT_CODE = 75  # train_util.PREEMPTED_EXIT_CODE (not imported: keep startup light)
NUM_CLASSES = 10  # datasets/digits.NUM_CLASSES: the model's classes, one grid column each
# Stage 5's scales: --classifier_scale (classifier guidance) and --guidance_scale (classifier-free).
GUIDANCE_SCALES = {"classifier_scale": 4.0, "guidance_scale": 2.0}
# Post-hoc EMA: the widths tracked while training, and those stage 4 reconstructs and scores
# (--tiny: the tracked ones only).
PHEMA_STDS = "0.05,0.1"
SWEEP_STDS = "0.03,0.05,0.07,0.1,0.15"
SWEEP = "phema_sweep.json"

# Settings that define a run; an --out holding other values is a different run.
RUN_KEYS = ("image_size", "steps", "batch_size", "lr", "ema_rate", "num_channels",
            "num_res_blocks", "channel_mult", "diffusion_steps", "noise_schedule", "predict_xstart",
            "seed", "ranks", "class_dropout_prob", "classifier_steps", "classifier_batch_size",
            "classifier_lr", "classifier_width", "classifier_scale", "guidance_scale")


def new_out(words="a new --out"):
    """How to pass another --out, as the user runs the demo: through make (`make demo` runs
    this script in a recipe, which has $MAKELEVEL) it is DEMO_ARGS="--out NEW_DIR"."""
    if os.environ.get("MAKELEVEL"):
        return f'{words} (through make: make demo DEMO_ARGS="--out NEW_DIR")'
    return words


class DemoError(UserError):
    """A stage failed or the input is unusable; one line (exit 1). Bad flags: UsageError."""


# ---------------------------------------------------------------------------------------------
# flags


def _bool(v):
    if str(v).lower() in ("1", "true", "yes", "y", "t"):
        return True
    if str(v).lower() in ("0", "false", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {v!r}")


def create_argparser():
    p = FlagParser(  # no prefix matching; an unknown flag: one line, "did you mean"
        prog="demo.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="End-to-end demo: digits -> mpiexec training with preemption and auto-resume "
        "-> DDIM samples -> evaluation.")
    p.add_argument("--out", default=os.path.join(REPO, "demo_out"),
                   help="output directory (default: demo_out/ in the repository)")
    p.add_argument("--tiny", action="store_true",
                   help="a few steps and a handful of samples (what the test suite runs)")
    p.add_argument("--image_size", type=int, default=None, help="digit size in px (default 16)")
    p.add_argument("--steps", type=int, default=None, help="training steps in total")
    p.add_argument("--batch_size", type=int, default=None, help="batch size per rank")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--ema_rate", default=None)
    p.add_argument("--num_channels", type=int, default=None)
    p.add_argument("--num_res_blocks", type=int, default=None)
    p.add_argument("--channel_mult", default=None)
    p.add_argument("--diffusion_steps", type=int, default=None)
    p.add_argument("--noise_schedule", default=None)
    p.add_argument("--predict_xstart", default=None, type=_bool,
                   help="the model predicts x0 instead of the noise (default True)")
    p.add_argument("--num_samples", type=int, default=None, help="digits to sample (default 100)")
    p.add_argument("--sample_steps", default=None, help="DDIM steps (timestep_respacing ddimN)")
    p.add_argument("--sample_batch_size", type=int, default=None)
    p.add_argument("--ranks", type=int, default=2, help="processes for mpiexec (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_preempt", action="store_true", help="skip the preemption/resume show")
    p.add_argument("--classifier_steps", type=int, default=None,
                   help="steps of the noised classifier (stage 5; default 200)")
    p.add_argument("--classifier_scale", type=float, default=None,
                   help=f"classifier guidance scale (default "
                        f"{GUIDANCE_SCALES['classifier_scale']})")
    p.add_argument("--guidance_scale", type=float, default=None,
                   help=f"classifier-free guidance scale (default "
                        f"{GUIDANCE_SCALES['guidance_scale']})")
    return p


def settings_from(args):
    """The demo's settings: defaults (or --tiny's), overridden by the flags given."""
    if args.tiny:
        s = dict(image_size=8, steps=40, batch_size=4, lr=2e-3, ema_rate="0.9",
                 num_channels=32, num_res_blocks=1, channel_mult="1,2", diffusion_steps=20,
                 noise_schedule="cosine", predict_xstart=True, num_samples=10, sample_steps=5,
                 sample_batch_size=10, log_interval=2, classifier_steps=8,
                 classifier_batch_size=4, classifier_log_interval=2, sweep_stds=PHEMA_STDS)
    else:
        s = dict(image_size=16, steps=1000, batch_size=32, lr=2e-3, ema_rate="0.995",
                 num_channels=32, num_res_blocks=1, channel_mult="1,2,2", diffusion_steps=200,
                 noise_schedule="cosine", predict_xstart=True, num_samples=100, sample_steps=25,
                 sample_batch_size=50, log_interval=50, classifier_steps=200,
                 classifier_batch_size=32, classifier_log_interval=50, sweep_stds=SWEEP_STDS)
    # Guidance (stage 5): the model learns the null label too (classifier-free guidance); a
    # small noised classifier steers (classifier guidance).
    s.update(class_dropout_prob=0.1, classifier_lr=1e-3, classifier_width=32,
             classifier_scale=GUIDANCE_SCALES["classifier_scale"],
             guidance_scale=GUIDANCE_SCALES["guidance_scale"])
    for k in list(s):
        v = getattr(args, k, None)
        if v is not None:
            s[k] = v
    s["ranks"] = args.ranks
    s["seed"] = args.seed
    for k in ("steps", "batch_size", "num_samples", "sample_batch_size", "ranks", "image_size",
              "diffusion_steps", "classifier_steps"):
        if int(s[k]) < 1:
            raise UsageError(f"--{k} must be at least 1 (got {s[k]})")
    for k in ("steps", "classifier_steps"):
        if int(s[k]) < 4:
            raise UsageError(f"--{k} {s[k]}: at least 4, to preempt halfway and resume")
    s["sample_steps"] = str(s["sample_steps"]).replace("ddim", "")
    return s


# ---------------------------------------------------------------------------------------------
# child processes


def _threads():
    """The torch threads of each of the demo's processes, its own in-process stages (sampling,
    the evaluation, the post-hoc EMA sweep) as its children's: $OMP_NUM_THREADS, else 1. Many
    threads per process on a machine busy with other work ran those stages 20-30x slower."""
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OPENAI_LOGDIR", None)
    # One thread per rank: the ranks share the cores.
    env["OMP_NUM_THREADS"] = str(_threads())
    # torch's DDP deprecation / bucket-stride notices are noise for a demo.
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")
    return env


def _mpiexec():
    cand = os.path.join(BIN, "mpiexec")
    return cand if os.path.exists(cand) else "mpiexec"


def _descendants(pid):
    """Pids of all descendants of `pid` (Linux /proc); [] where /proc is unavailable."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_pid(launcher_pid, script, rank):
    """The pid of MPI rank `rank` running `script` under the launcher, or None."""
    found = []
    for pid in _descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if script.encode() not in cmd:
            continue
        r = None
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for kv in f.read().split(b"\0"):
                    if kv.startswith(b"PMI_RANK=") or kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                        r = int(kv.split(b"=", 1)[1])
        except (OSError, ValueError):
            pass
        found.append((r, pid))
    for r, pid in found:
        if r == rank:
            return pid
    return found[-1][1] if found else None


# The trainer's progress line (logger.ProgressOutputFormat): "step 300/1200  loss ...".
_STEP_LINE = re.compile(r"^step (\d+)\b")


def step_of(line):
    """The step of a training progress line, else None."""
    m = _STEP_LINE.match(line.strip())
    return int(m.group(1)) if m else None


def run_child(cmd, *, label, on_line=None):
    """Run `cmd`, streaming its output; returns (exit code, output text).

    `on_line(line, proc)` is called for every complete output line.
    """
    print(f"$ {' '.join(_quote(c) for c in cmd)}", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise DemoError(f"{cmd[0]} not found; install the project with `make install` (it "
                        f"brings mpiexec via the mpich package)") from None
    captured = []
    buf = b""
    try:
        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while True:
                i_n, i_r = buf.find(b"\n"), buf.find(b"\r")
                cut = min(i for i in (i_n, i_r) if i >= 0) if max(i_n, i_r) >= 0 else -1
                if cut < 0:
                    break
                raw, end, buf = buf[:cut], buf[cut:cut + 1], buf[cut + 1:]
                line = raw.decode("utf-8", "replace")
                if end == b"\r":  # a progress bar redrawing itself
                    sys.stdout.write("\r" + line)
                    sys.stdout.flush()
                    continue
                captured.append(line)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                if on_line is not None:
                    on_line(line, proc)
        if buf:
            captured.append(buf.decode("utf-8", "replace"))
            sys.stdout.write(captured[-1] + "\n")
        code = proc.wait()
    except BaseException:
        _terminate(proc)
        raise
    print(f"[{label}: exit code {code}, {time.time() - t0:.0f} s]", flush=True)
    return code, "\n".join(captured)


def _terminate(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _quote(s):
    s = str(s)
    return s if s and all(c.isalnum() or c in "-_./=:," for c in s) else repr(s)


# ---------------------------------------------------------------------------------------------
# stages


def stage(n, total, text):
    print(f"\n=== [{n}/{total}] {text}", flush=True)


def prepare_data(out, s):
    """Write the digits image folder (datasets/digits.py; idempotent). Returns the folder."""
    data_dir = os.path.join(out, "data")
    sys.path.insert(0, os.path.join(REPO, "datasets"))
    import digits  # datasets/digits.py

    try:
        digits.write_digits_folder(data_dir, s["image_size"])
    except ValueError as e:
        raise UsageError(f"--image_size {s['image_size']}: {e}") from None
    return data_dir


def quarter(s):
    """A quarter of the run's steps, a multiple of its --log_interval (at least one interval):
    how often it saves (with post-hoc EMA snapshots) and logs the EMA's FID."""
    log = int(s["log_interval"])
    return max(log, int(s["steps"]) // 4 // log * log)


def train_cmd(data_dir, run_dir, s, ref_npz=None):
    """The training command; ``ref_npz``: the real digits its --eval_interval FID is against."""
    evaluation = [] if ref_npz is None else [
        "--eval_interval", str(quarter(s)), "--eval_ref_batch", ref_npz,
        "--eval_num_samples", str(s["num_samples"]), "--eval_features", "digits"]
    return [
        _mpiexec(), "-n", str(s["ranks"]), sys.executable, os.path.join(REPO, "scripts", "train.py"),
        "--data_dir", data_dir, "--log_dir", run_dir,
        "--image_size", str(s["image_size"]),
        "--class_cond", "True", "--num_classes", str(NUM_CLASSES),
        "--num_channels", str(s["num_channels"]), "--num_res_blocks", str(s["num_res_blocks"]),
        "--channel_mult", str(s["channel_mult"]), "--attention_resolutions", "",
        "--learn_sigma", "False", "--predict_xstart", str(s["predict_xstart"]),
        "--diffusion_steps", str(s["diffusion_steps"]),
        "--noise_schedule", str(s["noise_schedule"]),
        "--class_dropout_prob", str(s["class_dropout_prob"]),
        "--lr", str(s["lr"]), "--batch_size", str(s["batch_size"]),
        "--ema_rate", str(s["ema_rate"]), "--max_steps", str(s["steps"]),
        "--log_interval", str(s["log_interval"]), "--save_interval", str(quarter(s)),
        "--keep_checkpoints", "2", "--seed", str(s["seed"]),
        "--resume_checkpoint", "auto",
        # a grid of EMA samples four times a run (run/samples/grid_STEP.png; on the page), one
        # sample of each digit, as the page's other grids
        "--sample_interval", str(max(1, s["steps"] // 4)), "--sample_steps", str(s["sample_steps"]),
        "--sample_count", str(NUM_CLASSES),
        # post-hoc EMA snapshots with each save (stage 4 reconstructs widths from them)
        "--phema_stds", PHEMA_STDS, *evaluation,
    ]


def train_with_preemption(data_dir, run_dir, s, preempt=True, cmd=None, script="train.py",
                          steps=None, label="train", ref_npz=None):
    """Train to ``steps`` (s["steps"]) with ``cmd`` (train_cmd's) running ``script``: preempt
    halfway (SIGTERM to rank 1), then rerun to auto-resume.

    Returns a dict: preempted (bool), preempt_exit (int|None), preempted_at (step|None),
    resumed_from (step|None).
    """
    cmd = cmd or train_cmd(data_dir, run_dir, s, ref_npz)
    steps = steps or s["steps"]
    half = max(1, steps // 2)
    info = {"preempted": False, "preempt_exit": None, "preempted_at": None,
            "resumed_from": None, "command": " ".join(_quote(c) for c in cmd)}
    state = {"sent": False}
    already = _newest_step(run_dir)

    def watch(line, proc):
        step = step_of(line)
        if state["sent"] or not preempt or step is None:
            return
        if step >= half:
            target = _rank_pid(proc.pid, script, rank=min(1, s["ranks"] - 1))
            state["sent"] = True
            if target is None:
                print("  (no rank pid found under /proc; sending SIGTERM to mpiexec)",
                      flush=True)
                target = proc.pid
            print(f"\n>>> preempting: SIGTERM to rank {min(1, s['ranks'] - 1)} (pid {target}) "
                  f"after step {step}; all ranks should save and exit with code "
                  f"{PREEMPTED_EXIT_CODE}\n", flush=True)
            try:
                os.kill(target, signal.SIGTERM)
            except ProcessLookupError:
                pass

    if already is not None and already >= half:
        print(f"{run_dir} already holds step {already} (past halfway): continuing without the "
              f"preemption show", flush=True)
        preempt = False
    code, text = run_child(cmd, label=label, on_line=watch)
    if code == PREEMPTED_EXIT_CODE:
        info.update(preempted=True, preempt_exit=code, preempted_at=_newest_step(run_dir))
        print(f"\n>>> {label} exited with code {code} (preempted) and a complete checkpoint "
              f"at step {info['preempted_at']}. Rerunning the same command: it auto-resumes.\n",
              flush=True)
        code, text = run_child(cmd, label=f"{label} (resumed)")
        for line in text.splitlines():
            if "auto-resume" in line or line.startswith("resumed at step"):
                print(f">>> {line.strip()}", flush=True)
        info["resumed_from"] = info["preempted_at"]
    elif state["sent"]:
        print(">>> training ended before the preemption signal took effect", flush=True)
    if code != 0:
        raise DemoError(f"{label} failed (exit code {code}); see the output above. Rerun the "
                        f"same command to resume from {run_dir}")
    step = _newest_step(run_dir)
    if step is None or step < steps:
        raise DemoError(f"{label} ended at step {step}, not {steps}; rerun to resume")
    return info


def _newest_step(run_dir):
    """Newest complete step in run_dir (None when none)."""
    sys.path.insert(0, REPO)
    from improved_diffusion.ckpt import run_dir as run_dir_mod

    if not os.path.isdir(run_dir):
        return None
    st = run_dir_mod.latest_complete_step(run_dir, warn=lambda m: None)
    return None if st is None else st.step


def sample_cmd(run_dir, samples_dir, s, script="sample.py", extra=()):
    """`mpiexec -n R python scripts/<script>`: --num_samples DDIM samples of the final step's EMA
    weights, classes 0..9 in turn, the demo's seed (``extra``: guidance flags)."""
    ema = os.path.join(run_dir, f"ema_{s['ema_rate']}_{s['steps']:06d}.pt")
    return [
        _mpiexec(), "-n", str(s["ranks"]), sys.executable,
        os.path.join(REPO, "scripts", script),
        "--model_path", ema, "--log_dir", samples_dir, "--num_samples", str(s["num_samples"]),
        "--batch_size", str(s["sample_batch_size"]), "--use_ddim", "True",
        "--timestep_respacing", f"ddim{s['sample_steps']}",
        "--classes", ",".join(str(c) for c in range(NUM_CLASSES)), "--seed", str(s["seed"]),
        "--overwrite", "True", *extra,
    ]


def _samples_npz(samples_dir, s):
    size = s["image_size"]
    return os.path.join(samples_dir, f"samples_{s['num_samples']}x{size}x{size}x3.npz")


def sample(run_dir, samples_dir, s):
    """DDIM samples from the EMA weights of the final step. Returns (npz, png)."""
    code, _ = run_child(sample_cmd(run_dir, samples_dir, s), label="sample")
    if code != 0:
        raise DemoError(f"sampling failed (exit code {code}); see the output above")
    npz = _samples_npz(samples_dir, s)
    return npz, npz[:-len(".npz")] + ".png"


def plot_curve(run_dir, samples_dir):
    """The run's loss curve (by timestep quartile, the preemption marked), beside the sample grid.
    Returns its path."""
    from improved_diffusion.progress_plot import plot_loss_curve, run_events

    png = os.path.join(samples_dir, "loss_curve.png")
    print(f"$ python scripts/plot_progress.py {run_dir} --out {png}   (run in-process)",
          flush=True)
    n = plot_loss_curve(os.path.join(run_dir, "progress.csv"), png,
                        marks=run_events(os.path.join(run_dir, "log.txt")))
    print(f"loss curve of {n} logged steps: {png}", flush=True)
    return png


def _score(npz):
    """The evaluator's figures of an npz of samples (datasets/digits.py, in-process)."""
    sys.path.insert(0, os.path.join(REPO, "datasets"))
    import warnings

    import digits  # datasets/digits.py

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # sklearn's SVC(probability=True) notice
        try:
            return digits.evaluate_npz(npz)
        except (OSError, ValueError) as e:
            raise DemoError(f"evaluation failed: {e}") from None


def real_digit_batches(data_dir, out, s):
    """The real digits as batches for the evaluator, read from stage 1's files (so they went
    through the same --image_size upscaling the model trained on) as RGB uint8 NHWC, the layout
    of sample.py's npz: ``eval/real_N.npz`` N held-out digits (N = --num_samples, at most 890)
    of classes 0..9 in turn, their labels in arr_1 (what the samples were asked to be), and
    ``eval/ref_digits.npz`` all the other digits (the reference batch of ADM's metrics, which
    the held-out ones are not part of). Returns (real_npz, ref_npz)."""
    import numpy as np
    from PIL import Image

    import digits  # datasets/digits.py (on the path: prepare_data)

    _, y = digits.load_real_digits()
    n = min(int(s["num_samples"]), 890)  # ~180 digits a class: half of them at most held out
    rng = np.random.default_rng(s["seed"])
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(digits.NUM_CLASSES)]
    held = [int(by_class[i % digits.NUM_CLASSES][i // digits.NUM_CLASSES]) for i in range(n)]
    rest = sorted(set(range(len(y))) - set(held))

    def images(indices):
        arr = []
        for i in indices:
            with Image.open(os.path.join(data_dir, digits.digit_filename(y[i], i))) as im:
                arr.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
        return np.stack(arr)

    folder = os.path.join(out, "eval")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, idx, labels in ((f"real_{n}.npz", held, True), ("ref_digits.npz", rest, False)):
        path = os.path.join(folder, name)
        arrays = {"arr_0": images(idx)}
        if labels:
            arrays["arr_1"] = y[idx].astype(np.int64)
        np.savez(path + ".tmp.npz", **arrays)
        os.replace(path + ".tmp.npz", path)
        paths.append(path)
    return tuple(paths)


# ADM's five figures (improved_diffusion/evaluation.py, scripts/evaluate.py --features digits).
ADM_KEYS = ("fid", "sfid", "inception_score", "precision", "recall")
ADM_NAMES = {"fid": "FID", "sfid": "sFID", "inception_score": "IS", "precision": "precision",
             "recall": "recall"}


def adm_metrics(ref_npz, npz):
    """ADM's five figures of ``npz`` against the reference batch, with the digits classifier as
    the feature network (what `python scripts/evaluate.py REF NPZ --features digits` prints)."""
    import digits  # datasets/digits.py

    from improved_diffusion import evaluation

    rel = lambda p: os.path.relpath(p, REPO)  # noqa: E731
    print(f"$ python scripts/evaluate.py {rel(ref_npz)} {rel(npz)} --features digits   "
          f"(run in-process)", flush=True)
    try:
        r = evaluation.evaluate(ref_npz, npz, digits.DigitFeatures())
    except evaluation.EvaluationError as e:
        raise DemoError(f"evaluation failed: {e}") from None
    out = {k: (None if r[k] != r[k] else float(r[k])) for k in ADM_KEYS}
    out.update(num_ref=int(r["num_ref"]), num_samples=int(r["num_samples"]))
    print("  " + "  ".join(f"{k} {v:.3f}" if v is not None else f"{k} n/a"
                           for k, v in out.items() if k in ADM_KEYS), flush=True)
    return out


def phema_sweep(run_dir, out, ref_npz, s):
    """The post-hoc EMA chosen by FID: `ckpt.py phema RUN --std SWEEP_STDS --evaluate REF
    --features digits` (in-process): each width reconstructed from the run's snapshots, sampled
    (--num_samples, DDIM --sample_steps) and scored against the real digits; the table printed,
    eval/phema_sweep.png drawn, phema_sweep.json written. Returns its dict."""
    import io

    from improved_diffusion.apps import ckpt_tool

    folder = os.path.join(out, "eval")
    argv = ["phema", run_dir, "--std", s["sweep_stds"], "--evaluate", ref_npz, "--num_samples",
            str(s["num_samples"]), "--features", "digits", "--sample_steps",
            str(s["sample_steps"]), "--sample_batch", str(s["sample_batch_size"]), "--seed",
            str(s["seed"]), "--out", folder]
    rel = lambda p: os.path.relpath(p, REPO) if p.startswith(REPO) else p  # noqa: E731
    print("$ python scripts/ckpt.py " + " ".join(rel(a) for a in argv) + "   (run in-process)",
          flush=True)
    buf, err = io.StringIO(), _Tee(sys.stdout)  # its line per width shown as it comes
    code = ckpt_tool.main(argv + ["--json"], out=buf, err=err)
    if code != 0:
        raise DemoError(f"the post-hoc EMA sweep failed (exit code {code}): "
                        f"{err.getvalue().strip()}")
    rep = json.loads(buf.getvalue())
    from improved_diffusion import phema

    rows = [phema.SweepRow(**r) for r in rep["table"]]
    print("\n".join("  " + line for line in phema.sweep_table(rows)), flush=True)
    rep["plot"] = os.path.relpath(rep["plot"], out)
    rep["command"] = ["python", os.path.join(REPO, "scripts", "ckpt.py"), *argv]
    with open(os.path.join(out, SWEEP + ".tmp"), "w") as f:
        json.dump(rep, f, indent=1)
    os.replace(os.path.join(out, SWEEP + ".tmp"), os.path.join(out, SWEEP))
    return rep


class _Tee:
    """A text stream that writes to ``stream`` (flushed) and keeps what it wrote (getvalue)."""

    def __init__(self, stream):
        import io

        self.stream, self.kept = stream, io.StringIO()

    def write(self, text):
        self.kept.write(text)
        self.stream.write("  " + text if text.strip() else text)
        self.stream.flush()
        return len(text)

    def flush(self):
        self.stream.flush()

    def getvalue(self):
        return self.kept.getvalue()


def training_fids(run_dir):
    """[(step, fid)] of the run's --eval_interval evaluations (run/eval/fid_STEP.json)."""
    folder = os.path.join(run_dir, "eval")
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if re.fullmatch(r"fid_\d+\.json", name):
            with open(os.path.join(folder, name)) as f:
                rec = json.load(f)
            fid = next((v for k, v in rec.items() if k.startswith("fid_")), None)
            found.append((int(rec["step"]), fid))
    return found


def evaluate(npz, out, data_dir, s, batches=None):
    """Score the samples (datasets/digits.py, as scripts/eval_digits.py) and, the same way, N
    held-out real digits (the reference column); then ADM's five figures of both against the
    other real digits. Writes eval.json: the samples' figures, "reference" (the real digits'
    own: mean_confidence, label_agreement, histogram, fid_floor = the Frechet distance of N real
    digits, the floor for N samples, and chance_label_agreement = 1 / classes, what the null
    label gets) and "adm" ({"samples": five figures, "real": five figures, "ref_batch"})."""
    import digits  # datasets/digits.py (on the path: prepare_data)

    print(f"$ python scripts/eval_digits.py {npz}   (run in-process)", flush=True)
    fig = _score(npz)
    print(digits.format_report(fig), flush=True)
    real_npz, ref_npz = batches or real_digit_batches(data_dir, out, s)
    print(f"the reference: {os.path.relpath(real_npz, out)}, real digits held out of "
          f"{os.path.relpath(ref_npz, out)}, scored the same way", flush=True)
    real = _score(real_npz)
    fig["reference"] = {
        "what": f"{real['num_samples']} real digits (stage 1's files, held out of the reference "
                f"batch), scored by the same evaluator",
        "num_samples": real["num_samples"], "mean_confidence": real["mean_confidence"],
        "label_agreement": real["label_agreement"], "histogram": real["histogram"],
        "fid_floor": fig["fid_real_subset_same_n"], "fid_floor_n": fig["fid_real_subset_n"],
        "chance_label_agreement": 1.0 / len(fig["histogram"]),
        "npz": os.path.relpath(real_npz, out),
    }
    fig["adm"] = {"samples": adm_metrics(ref_npz, npz), "real": adm_metrics(ref_npz, real_npz),
                  "ref_batch": os.path.relpath(ref_npz, out)}
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(fig, f, indent=1)
    return fig


# ---------------------------------------------------------------------------------------------
# guidance (stage 5)


def classifier_cmd(data_dir, clf_dir, s):
    """A small noised classifier of the demo's noise process: `mpiexec -n R classifier_train.py`."""
    return [
        _mpiexec(), "-n", str(s["ranks"]), sys.executable,
        os.path.join(REPO, "scripts", "classifier_train.py"),
        "--data_dir", data_dir, "--log_dir", clf_dir, "--image_size", str(s["image_size"]),
        "--classifier_width", str(s["classifier_width"]), "--classifier_depth", "1",
        "--classifier_attention_resolutions", "", "--diffusion_steps", str(s["diffusion_steps"]),
        "--noise_schedule", str(s["noise_schedule"]), "--lr", str(s["classifier_lr"]),
        "--batch_size", str(s["classifier_batch_size"]),
        "--iterations", str(s["classifier_steps"]),
        "--log_interval", str(s["classifier_log_interval"]), "--save_interval", "0",
        "--keep_checkpoints", "2", "--seed", str(s["seed"]), "--resume_checkpoint", "auto",
    ]


# The ways stage 5 samples the same seeds and labels: (name, script, guidance flags). "{cs}" and
# "{gs}" are the demo's --classifier_scale and --guidance_scale.
GUIDANCE_WAYS = (
    ("unguided (class-conditional)", None, []),
    ("classifier guidance", "classifier_sample.py", ["--classifier_scale", "{cs}"]),
    ("classifier-free guidance", "sample.py", ["--guidance_scale", "{gs}"]),
    ("both", "classifier_sample.py", ["--classifier_scale", "{cs}", "--guidance_scale", "{gs}"]),
    ("unconditional (null label)", "sample.py", ["--guidance_scale", "0"]),
    ("unconditional + classifier guidance", "classifier_sample.py",
     ["--classifier_scale", "{cs}", "--guidance_scale", "0"]),
)


def guidance(data_dir, run_dir, out, s, base_npz, base_fig, preempt=True):
    """Stage 5: train the noised classifier (preempted halfway and resumed), then sample the
    seeds of stage 3 each way of GUIDANCE_WAYS (stage 3's own samples are the unguided row) and
    score them with the evaluator. Writes guidance.json (a list of rows {"way",
    "label_agreement", "mean_confidence", "command"}); returns (rows, classifier info)."""
    clf_dir = os.path.join(out, "classifier")
    info = train_with_preemption(
        data_dir, clf_dir, s, preempt=preempt, cmd=classifier_cmd(data_dir, clf_dir, s),
        script="classifier_train.py", steps=s["classifier_steps"], label="classifier")
    classifier = os.path.join(clf_dir, f"model{s['classifier_steps']:06d}.pt")
    rows = []
    for way, script, flags in GUIDANCE_WAYS:
        if script is None:
            npz, fig, cmd = base_npz, base_fig, sample_cmd(run_dir, os.path.dirname(base_npz), s)
        else:
            flags = [f.format(cs=s["classifier_scale"], gs=s["guidance_scale"]) for f in flags]
            if script == "classifier_sample.py":
                flags = ["--classifier_path", classifier] + flags
            samples = os.path.join(out, "guidance", way.split(" (")[0].replace(" + ", "_plus_")
                                   .replace(" ", "_").replace("-", "_"))
            cmd = sample_cmd(run_dir, samples, s, script=script, extra=flags)
            code, _ = run_child(cmd, label=f"sample: {way}")
            if code != 0:
                raise DemoError(f"sampling ({way}) failed (exit code {code}); see the output above")
            npz = _samples_npz(samples, s)
            fig = _score(npz)
        ref = base_fig.get("reference", {})
        null = script == "sample.py" and flags[-2:] == ["--guidance_scale", "0"]  # no steering
        rows.append({"way": way, "label_agreement": fig["label_agreement"],
                     "mean_confidence": fig["mean_confidence"],
                     "command": " ".join(_quote(c) for c in cmd),
                     "grid": os.path.relpath(npz[:-len(".npz")] + ".png", out),
                     # what the label agreement compares with: chance for the null label, the
                     # real digits' own agreement for the ways that ask for a class
                     "reference_label_agreement": ref.get(
                         "chance_label_agreement" if null else "label_agreement"),
                     "reference_what": "chance (1 / classes)" if null else "real digits"})
    with open(os.path.join(out, "guidance.json.tmp"), "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(os.path.join(out, "guidance.json.tmp"), os.path.join(out, "guidance.json"))
    return rows, info


def guidance_table(rows, s):
    """The rows of guidance.json as aligned text lines (way, agreement, confidence)."""
    lines = [f"guidance (same seeds and labels; classifier scale {s['classifier_scale']}, "
             f"classifier-free scale {s['guidance_scale']}):",
             f"  {'way':<38}{'label agreement':>16}{'mean confidence':>17}"]
    for r in rows:
        lines.append(f"  {r['way']:<38}{r['label_agreement']:>16.3f}{r['mean_confidence']:>17.3f}")
    return lines


# ---------------------------------------------------------------------------------------------
# main


def summary_lines(out, png, npz, fig, info, s, seconds, curve, guided=None, fids=None):
    """The summary; ``guided``: (guidance.json's rows, the classifier's preemption info);
    ``fids``: (training_fids' [(step, fid)], phema_sweep's dict)."""
    hist = fig.get("histogram")
    lines = [
        f"demo finished in {seconds / 60:.1f} min ({s['steps']} steps at batch "
        f"{s['batch_size']} x {s['ranks']} ranks, DDIM {s['sample_steps']} steps)",
        "preemption: " + (
            f"SIGTERM at step {info['preempted_at']} -> exit code {info['preempt_exit']}; "
            f"auto-resumed from step {info['resumed_from']} to {s['steps']}"
            if info.get("preempted") else "not shown this time"),
    ]
    if guided is not None:
        rows, clf = guided
        lines.append(
            f"noised classifier: {s['classifier_steps']} steps on {s['ranks']} ranks, " + (
                f"SIGTERM at step {clf['preempted_at']} -> exit code {clf['preempt_exit']}; "
                f"auto-resumed to {s['classifier_steps']}" if clf.get("preempted")
                else "preemption not shown this time"))
        lines += guidance_table(rows, s)
        lines.append(f"         (rows and commands: {os.path.join(out, 'guidance.json')})")
    ref = fig.get("reference") or {}
    adm = fig.get("adm")
    if adm:
        lines.append(f"ADM's evaluator (scripts/evaluate.py --features digits; reference batch: "
                     f"{adm['samples']['num_ref']} real digits):")
        lines.append(f"  {'':<24}" + "".join(f"{ADM_NAMES[k]:>11}" for k in ADM_KEYS))
        for who, r in (("samples", adm["samples"]),
                       (f"{adm['real']['num_samples']} real digits", adm["real"])):
            lines.append(f"  {who:<24}" + "".join(
                f"{r[k]:>11.3f}" if r[k] is not None else f"{'n/a':>11}" for k in ADM_KEYS))

    if fids is not None:
        during, sweep = fids
        if during:
            lines.append("FID while training (--eval_interval, digits features): " + ", ".join(
                f"step {step} {fid:.2f}" for step, fid in during))
        best = (sweep or {}).get("best")
        if best:
            lines.append(
                f"post-hoc EMA by FID (ckpt.py phema --evaluate): best std {best['std']:.3f} "
                f"(FID {best['fid']:.2f}) of " + ", ".join(
                    f"{r['std']:.3f}: {r['fid']:.2f}" for r in sweep["table"])
                + f"   ({os.path.join(out, sweep['plot'])})")

    def versus(key, f=".3f"):
        v = ref.get(key)
        return f"   (real digits {v:{f}})" if isinstance(v, float) else ""

    lines += [
        f"samples: {npz}",
        f"grid:    {png}   (column c = class c)",
        f"loss:    {curve}   (training loss by timestep quartile)",
        f"mean classifier confidence: {fig['mean_confidence']:.3f}{versus('mean_confidence')}",
        f"label agreement:            {fig['label_agreement']:.3f}{versus('label_agreement')}",
        f"class histogram (0..9):     {' '.join(str(c) for c in hist)}",
        f"Frechet distance (classifier features): generated vs real "
        f"{fig['fid_real_vs_generated']:.2f} | real half vs half {fig['fid_real_halves']:.2f}"
        f" | {fig['num_samples']} real vs real {fig['fid_real_subset_same_n']:.2f}",
    ]
    return lines


RECORD = "demo.json"


def model_parameters(path):
    """The number of weights in the model file at `path` (its state dict's tensors)."""
    from improved_diffusion import sampling

    sd, _ = sampling.load_weights(path, "ema")
    return int(sum(t.numel() for t in sd.values()))


def write_record(out, s, info, clf_info, seconds, run_dir):
    """``demo.json``: what was trained, from this run's own records (the settings it ran with,
    the model file's weights, the stages' wall times, the preemptions), and where the commands'
    programs are (so the page can show them relative): read by demo_page.py."""
    import digits  # datasets/digits.py

    ema = os.path.join(run_dir, f"ema_{s['ema_rate']}_{s['steps']:06d}.pt")
    record = {
        "data": {"name": "scikit-learn's handwritten digits", "images": len(
            digits.load_real_digits()[1]), "classes": digits.NUM_CLASSES,
            "source_px": digits.SOURCE_SIZE, "image_size": s["image_size"]},
        "model": {"kind": "UNet", "class_cond": True, "parameters": model_parameters(ema),
                  "num_channels": s["num_channels"], "channel_mult": s["channel_mult"],
                  "num_res_blocks": s["num_res_blocks"], "diffusion_steps": s["diffusion_steps"],
                  "noise_schedule": s["noise_schedule"], "predict_xstart": s["predict_xstart"],
                  "class_dropout_prob": s["class_dropout_prob"], "ema_rate": s["ema_rate"]},
        "training": {"steps": s["steps"], "batch_size": s["batch_size"], "ranks": s["ranks"],
                     "lr": s["lr"], "command": info.get("command"),
                     "preemption": {k: v for k, v in info.items() if k != "command"},
                     "classifier_steps": s["classifier_steps"],
                     "classifier_preemption": clf_info},
        "sampling": {"num_samples": s["num_samples"], "sample_steps": s["sample_steps"],
                     "weights": os.path.relpath(ema, out)},
        "seconds": seconds,
        "programs": {"repo": REPO, "python": sys.executable, "mpiexec": _mpiexec()},
    }
    with open(os.path.join(out, RECORD + ".tmp"), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(out, RECORD + ".tmp"), os.path.join(out, RECORD))
    return record


def main(argv=None):
    args = create_argparser().parse_args(argv)
    import torch

    torch.set_num_threads(_threads())  # as its children's (_child_env)
    print(f"torch threads per process: {torch.get_num_threads()} (OMP_NUM_THREADS; "
          f"docs/performance.md)", flush=True)
    t0 = time.time()
    s = settings_from(args)
    out = os.path.abspath(args.out)
    run_dir, samples_dir = os.path.join(out, "run"), os.path.join(out, "samples")
    summary_path = os.path.join(out, "summary.txt")
    settings_path = os.path.join(out, "settings.json")
    run_settings = {k: s[k] for k in RUN_KEYS}

    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file; pass {new_out('a new --out directory')}")
    if os.path.exists(summary_path):
        print(f"{out} already holds a finished demo run; its results:\n", flush=True)
        with open(summary_path) as f:
            sys.stdout.write(f.read())
        print(f"\n(nothing was changed; pass {new_out('--out NEW_DIR')} to run the demo again)",
              flush=True)
        return 0
    if os.path.exists(settings_path):
        try:
            with open(settings_path) as f:
                old = json.load(f)
        except ValueError as e:
            raise UsageError(f"--out {out}: {settings_path} is not readable JSON ({e}); "
                             f"pass {new_out()}") from None
        diff = [k for k in RUN_KEYS if str(old.get(k)) != str(run_settings[k])]
        if diff:
            k = diff[0]
            raise UsageError(
                f"--out {out} holds an unfinished run with {k}={old.get(k)} (now {run_settings[k]})"
                f"; pass the same settings to continue it, or {new_out()}")
        print(f"continuing the unfinished demo run in {out}", flush=True)
    elif os.path.isdir(out) and os.listdir(out):
        raise UsageError(f"--out {out} is not empty and holds no demo run; pass {new_out()}")
    os.makedirs(out, exist_ok=True)
    with open(settings_path, "w") as f:
        json.dump(run_settings, f, indent=1)

    total = 6
    print(f"demo settings: {json.dumps(s)}\noutput: {out}", flush=True)
    seconds = {}
    clock = [time.time()]

    def took(name):
        """The stage's time, as demo.json records it (the whole stage: evaluate's includes the
        post-hoc EMA sweep)."""
        now = time.time()
        seconds[name] = round(now - clock[0], 1)
        clock[0] = now
        print(f"[{name} stage: {seconds[name]} s]", flush=True)

    stage(1, total, f"data: scikit-learn digits as {s['image_size']}px images")
    data_dir = prepare_data(out, s)
    batches = real_digit_batches(data_dir, out, s)  # the held-out digits and the reference
    took("data")
    stage(2, total, f"train with mpiexec -n {s['ranks']}, preempted halfway, then auto-resumed")
    info = train_with_preemption(data_dir, run_dir, s, preempt=not args.no_preempt,
                                 ref_npz=batches[1])
    took("train")
    stage(3, total, f"sample {s['num_samples']} digits from the EMA weights (DDIM); loss curve")
    npz, png = sample(run_dir, samples_dir, s)
    curve = plot_curve(run_dir, samples_dir)
    took("sample")
    stage(4, total, "evaluate with a classifier trained on the real digits")
    fig = evaluate(npz, out, data_dir, s, batches)
    sweep = phema_sweep(run_dir, out, batches[1], s)
    took("evaluate")
    stage(5, total, "guidance: a noised classifier (2 ranks, preempted, resumed), then the same "
          "seeds sampled with classifier guidance, classifier-free guidance, both, and without")
    guided = guidance(data_dir, run_dir, out, s, npz, fig, preempt=not args.no_preempt)
    took("guidance")
    stage(6, total, "summary")
    seconds["total"] = round(time.time() - t0, 1)
    write_record(out, s, info, guided[1], seconds, run_dir)
    lines = summary_lines(out, png, npz, fig, info, s, seconds["total"], curve, guided,
                          (training_fids(run_dir), sweep))
    with open(summary_path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(summary_path + ".tmp", summary_path)
    print("\n".join(lines), flush=True)
    from improved_diffusion.apps.demo_page import write_page

    print(f"page:    {write_page(out)}   (open it in a browser)", flush=True)
    return 0


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    try:
        code = main()
    except UserError as e:  # DemoError, UsageError
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to continue", file=sys.stderr, flush=True)
        sys.exit(130)
    exit_process(code)
