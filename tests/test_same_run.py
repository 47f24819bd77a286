"""The same run on any number of ranks (issue 44): --global_batch_size G --microbatch m makes a
step G samples in G/m virtual shards whose randomness and gradient sum do not depend on the rank
count (improved_diffusion/virtual_shards.py). Tested through scripts/train.py (mpiexec and
torchrun) and examples/own_model.py on tiny models, comparing what is on disk bit for bit.
"""
import csv
import hashlib
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import (MPIEXEC, PY, REPO, _run, deep_diff, launched, rank_pids, resumed_step,
                      write_class_folder)
from test_train import train_main

TRAIN = REPO / "scripts" / "train.py"
OWN_MODEL = REPO / "examples" / "own_model.py"
FAULT_TRAIN = REPO / "tests" / "fault_train.py"
AMP_TRAIN = REPO / "tests" / "amp_train.py"
TORCHRUN = str(Path(PY).parent / "torchrun")
RATES = "0.9999,0.99"
# G=12 in shards of 2: K=6, so 1, 2, 3 and 6 ranks work. Class-conditional with label dropout,
# dropout, the loss-aware sampler (its history must be the same) and two EMAs.
RUN = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
       "--attention_resolutions", "8", "--diffusion_steps", "20", "--noise_schedule", "cosine",
       "--class_cond", "True", "--class_dropout_prob", "0.2", "--dropout", "0.1",
       "--schedule_sampler", "loss-second-moment", "--global_batch_size", "12",
       "--microbatch", "2", "--ema_rate", RATES, "--log_interval", "1", "--seed", "3",
       "--save_interval", "1000"]
# progress.csv columns that may differ between rank counts: time, and the rank count itself
OWN_COLUMNS = re.compile(r"time|sec|elapsed|wall|throughput|per_s|world_size", re.I)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_class_folder(tmp_path_factory.mktemp("same_run") / "data", per_class=5)


def launch(ranks, launcher="mpiexec", script=TRAIN):
    if ranks == 1:
        return [PY, script]
    if launcher == "torchrun":
        return [TORCHRUN, "--standalone", "--nproc_per_node", str(ranks), script]
    return [MPIEXEC, "-n", str(ranks), PY, script]


def job(ranks, data, log_dir, *args, launcher="mpiexec", script=TRAIN, timeout=300, check=True,
        env=None):
    """One job; the flags: the job's own plus ``args`` (a resume types no run flag)."""
    cmd = [*launch(ranks, launcher, script), "--data_dir", data, "--log_dir", log_dir,
           "--num_workers", "1", *map(str, args)]
    return _run(cmd, timeout, env=env, check=check)


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def losses(log_dir):
    """{step: {column: text}} of progress.csv, the columns that must not depend on the ranks;
    a preemption's own row (its "preempted" column 1: the window the save cut short) left out."""
    with open(Path(log_dir) / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {int(r["step"]): {k: v for k, v in r.items() if not OWN_COLUMNS.search(k)}
            for r in rows if r.get("step") and r.get("preempted") != "1"}


def same_run(a, b, step, rates=RATES):
    """What differs between the step-``step`` files of log dirs a and b (empty: the same run):
    model and EMA files byte for byte; the opt file's Adam moments, loss-aware sampler history and
    fixed-point state (its trainer state also holds each rank's RNG and the rank count, which
    differ by design); progress.csv's loss, grad norm, lr and sample columns of every step."""
    diffs = []
    names = [f"model{step:06d}.pt"] + [f"ema_{r}_{step:06d}.pt" for r in rates.split(",")]
    for name in names:
        if sha(a / name) != sha(b / name):
            diffs += [f"{name}{d}" for d in deep_diff(load(a / name), load(b / name))] or [name]
    oa, ob = load(a / f"opt{step:06d}.pt"), load(b / f"opt{step:06d}.pt")
    diffs += [f"opt/optimizer{d}" for d in deep_diff(oa["optimizer"], ob["optimizer"])]
    for key in ("schedule_sampler", "virtual_shards", "data", "grad_scaler", "global_batch"):
        diffs += [f"opt/trainer/{key}{d}" for d in deep_diff(oa["trainer"].get(key),
                                                            ob["trainer"].get(key))]
    la, lb = losses(a), losses(b)
    for s in sorted(set(la) & set(lb)):
        diffs += [f"progress.csv step {s} {k}: {la[s][k]} != {lb[s].get(k)}"
                  for k in la[s] if la[s][k] != lb[s].get(k)]
    if sorted(la) != sorted(lb):
        diffs.append(f"progress.csv steps {sorted(la)} != {sorted(lb)}")
    return diffs


# --------------------------------------------------------------------------- straight runs


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    """{ranks: log dir} of straight 4-step runs, made once."""
    made = {}

    def run(ranks, steps=4):
        if (ranks, steps) not in made:
            d = tmp_path_factory.mktemp(f"straight{ranks}x{steps}") / "run"
            job(ranks, data, d, *RUN, "--max_steps", steps)
            made[ranks, steps] = d
        return made[ranks, steps]
    return run


@pytest.mark.timeout(900)
def test_straight_runs_on_1_and_2_ranks_write_bitwise_the_same_files_and_losses(straight):
    """(3 ranks: the chain below trains a step on 3 and ends as the 1-rank straight run.)"""
    one, two = straight(1), straight(2)
    assert load(one / "opt000004.pt")["trainer"]["schedule_sampler"]["_loss_counts"].sum() == 48
    diffs = same_run(one, two, 4)
    assert not diffs, "2 ranks differ from 1 rank:\n" + "\n".join(diffs[:30])
    trainer = load(two / "opt000004.pt")["trainer"]
    assert (trainer["world_size"], trainer["batch_size"], trainer["global_batch"]) == (2, 6, 12)


# --------------------------------------------------------------------------- a chain


def _poll(pred, proc, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    pytest.fail(f"waited {timeout}s for the trainer")


def _logged_steps(log_dir):
    try:
        return len(losses(log_dir))
    except (FileNotFoundError, ValueError, KeyError):
        return 0


@pytest.mark.timeout(1200)
def test_a_run_sigtermed_on_2_ranks_resumed_on_3_by_torchrun_then_on_1_is_the_straight_run(
        tmp_path, data, straight):
    log_dir = tmp_path / "chain"
    # SIGTERM after step 1 or 2: the save is at step 1 to 3, and the chain ends at step 4 (the
    # straight runs' reference, shared) when at least one step is left for each resume
    at = random.Random().randint(1, 2)
    cmd = [*launch(2), "--data_dir", data, "--log_dir", log_dir, "--num_workers", "1", *RUN,
           "--max_steps", 1000]
    with launched(cmd, tmp_path / "seg1.log") as proc:
        assert _poll(lambda: _logged_steps(log_dir) >= at, proc, 300), \
            (tmp_path / "seg1.log").read_text()[-3000:]
        pids = rank_pids(str(log_dir))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[random.choice([0, 1])], signal.SIGTERM)
        rc = proc.wait(timeout=120)
    assert rc == 75, (tmp_path / "seg1.log").read_text()[-3000:]
    saved = load(next(log_dir.glob("opt*.pt")))["trainer"]["step"]
    end = max(4, saved + 2)
    # flagless resumes: G, m and every run flag come from the checkpoint
    out = job(3, data, log_dir, "--max_steps", saved + 1, launcher="torchrun").stdout
    assert resumed_step(out) == saved, out[-3000:]
    assert ("same run on 3 rank(s) (saved on 2) (global batch 12, microbatch 2)" in out), \
        out[-3000:]
    # the flags taken name G and m, not the per-rank batch derived from them (nobody typed it;
    # the trainer state below shows 12/3 used); no "RNG reseeded" line: the training draws from
    # the shards' streams, not the ranks'
    taken = next(ln for ln in out.splitlines() if ln.startswith("resume: from the checkpoint"))
    assert "--global_batch_size 12" in taken, taken
    assert "--batch_size" not in taken.replace("--global_batch_size", ""), taken
    assert "RNG reseeded" not in out, out[-3000:]
    trainer = load(log_dir / f"opt{saved + 1:06d}.pt")["trainer"]
    assert (trainer["world_size"], trainer["batch_size"], trainer["global_batch"]) == (3, 4, 12)
    out = job(1, data, log_dir, "--max_steps", end).stdout
    assert resumed_step(out) == saved + 1 and "same run on 1 rank(s) (saved on 3)" in out, \
        out[-3000:]
    diffs = same_run(straight(1, end), log_dir, end)
    assert not diffs, f"SIGTERM at step {saved} on 2 ranks, then 3, then 1:\n" + "\n".join(
        diffs[:30])


@pytest.mark.timeout(900)
def test_rows_after_a_preemption_mid_window_average_the_same_steps_as_the_straight_run(
        tmp_path, data):
    """--log_interval 3: a SIGTERM at step 4 or 5 on 2 ranks writes that window's row marked
    "preempted" and saves the window's sums (logger.LogWindow); the job resumed on 3 ranks
    writes rows 6 and 8 that average steps 4-6 and 7-8, as the straight 1-rank run's do."""
    i = RUN.index("--log_interval")
    run = RUN[:i] + ["--log_interval", "3"] + RUN[i + 2:]
    straight = tmp_path / "straight"
    job(1, data, straight, *run, "--max_steps", 8)
    assert sorted(losses(straight)) == [3, 6, 8]
    chain = tmp_path / "chain"
    proc = job(2, data, chain, *run, "--max_steps", 8, script=FAULT_TRAIN, check=False,
               env={"FAULT_RANK": "1", "FAULT_STEP": "3", "FAULT_RAISE": "SIGTERM"})
    assert proc.returncode == 75, proc.stdout[-3000:]
    with open(chain / "progress.csv", newline="") as f:
        marked = [int(r["step"]) for r in csv.DictReader(f) if r.get("preempted") == "1"]
    saved = resumed = load(next(chain.glob("opt*.pt")))["trainer"]["step"]
    assert saved in (4, 5) and marked == [saved], (saved, marked)
    out = job(3, data, chain, "--max_steps", 8).stdout
    assert resumed_step(out) == resumed, out[-3000:]
    diffs = same_run(straight, chain, 8)
    assert not diffs, f"preempted at step {saved}, resumed on 3 ranks:\n" + "\n".join(diffs[:30])


# --------------------------------------------------------------------------- variants


@pytest.mark.timeout(900)
def test_an_own_model_with_batchnorm_is_the_same_run_on_1_and_2_ranks_buffers_included(
        tmp_path, data):
    """examples/own_model.py: BatchNorm running statistics are those shard 0 of each step
    leaves (rank 0's, sent to all), so the model file, buffers included, is bitwise too. 4
    shards: each of the 2 ranks runs 2 of them, as the 1 rank runs all 4."""
    own = ["--image_size", "8", "--dim", "16", "--depth", "1", "--heads", "2",
           "--patch_size", "4", "--diffusion_steps", "20", "--global_batch_size", "8",
           "--microbatch", "2", "--ema_rate", RATES, "--log_interval", "1",
           "--save_interval", "1000", "--max_steps", "3"]
    runs = {}
    for ranks in (1, 2):
        runs[ranks] = tmp_path / f"own{ranks}"
        job(ranks, data, runs[ranks], *own, script=OWN_MODEL)
    sd = load(runs[1] / "model000003.pt")["state_dict"]
    assert any(k.endswith("running_mean") for k in sd), sorted(sd)[:20]
    diffs = same_run(runs[1], runs[2], 3)
    assert not diffs, "own model, 1 vs 2 ranks:\n" + "\n".join(diffs[:30])


@pytest.mark.timeout(600)
def test_a_dit_is_the_same_run_on_1_and_2_ranks(tmp_path, data):
    """--arch DiT-S/2 (tiny, as test_dit_train's): its label dropout draws inside the model's
    forward (dit.LabelEmbedder), in each shard's stream."""
    dit = ["--arch", "DiT-S/2", "--dit_depth", "2", "--dit_hidden_size", "32", "--dit_num_heads",
           "2", "--image_size", "8", "--learn_sigma", "True", "--class_cond", "True",
           "--class_dropout_prob", "0.2", "--diffusion_steps", "20", "--schedule_sampler",
           "loss-second-moment", "--global_batch_size", "12", "--microbatch", "2", "--ema_rate",
           RATES, "--log_interval", "1", "--seed", "3", "--save_interval", "1000",
           "--max_steps", "3"]
    runs = {}
    for ranks in (1, 2):
        runs[ranks] = tmp_path / f"dit{ranks}"
        job(ranks, data, runs[ranks], *dit)
    assert load(runs[1] / "model000003.pt")["flags"]["arch"] == "DiT-S/2"
    diffs = same_run(runs[1], runs[2], 3)
    assert not diffs, "DiT, 1 vs 2 ranks:\n" + "\n".join(diffs[:30])


@pytest.mark.timeout(600)
def test_under_fsdp_a_resume_on_another_rank_count_keeps_the_global_batch_and_says_not_bitwise(
        tmp_path, data):
    """--fsdp True with G: the shards, streams and global batch hold, FSDP's float
    reduce-scatter does not (docs/CLUSTERS.md has the measured differences): the resume line
    says so instead of "same run"."""
    log_dir = tmp_path / "fsdp"
    job(2, data, log_dir, *RUN, "--fsdp", "True", "--max_steps", 1)
    out = job(1, data, log_dir, "--max_steps", 2).stdout  # flagless: G, m, --fsdp taken
    assert resumed_step(out) == 1, out[-3000:]
    assert ("resume: the same global batch and shards on 1 rank(s) (saved on 2) (global batch "
            "12, microbatch 2); --fsdp reduce-scatters the gradients in float" in out), out[-3000:]
    assert "same run on" not in out and "RNG reseeded" not in out, out[-3000:]
    trainer = load(log_dir / "opt000002.pt")["trainer"]
    assert (trainer["data"]["position"], trainer["batch_size"], trainer["world_size"]) == (
        24, 12, 1)
    assert trainer["schedule_sampler"]["_loss_counts"].sum() == 24


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cpu_bf16", [False, True], ids=["fp16-gradscaler", "bf16"])
def test_use_fp16_is_the_same_run_on_1_and_2_ranks(tmp_path, data, cpu_bf16):
    runs = {}
    for ranks in (1, 2):
        runs[ranks] = tmp_path / f"amp{ranks}"
        out = job(ranks, data, runs[ranks], *RUN, "--use_fp16", "True", "--max_steps", 3,
                  script=AMP_TRAIN, env={"CPU_BF16": str(int(cpu_bf16))}).stdout
        assert ("--use_fp16: bfloat16 autocast" in out) == cpu_bf16, out[-2000:]
    diffs = same_run(runs[1], runs[2], 3)
    assert not diffs, "--use_fp16, 1 vs 2 ranks:\n" + "\n".join(diffs[:30])


# --------------------------------------------------------------------------- refusals


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,extra,says", [
    (2, ["--global_batch_size", "6", "--microbatch", "2"],
     "3 virtual shards do not split over 2 ranks; run on 1, 3 rank(s)"),
    (1, ["--global_batch_size", "12", "--microbatch", "2", "--batch_size", "6"],
     "--batch_size and --global_batch_size 12 together"),
    (1, ["--global_batch_size", "12"], "--global_batch_size 12 needs --microbatch"),
    (1, ["--global_batch_size", "12", "--microbatch", "5"], "not a multiple of --microbatch 5"),
], ids=["2-ranks-for-3-shards", "with-batch_size", "no-microbatch", "m-not-dividing-G"])
def test_a_global_batch_the_ranks_cannot_split_is_refused_in_one_line_before_anything_is_written(
        tmp_path, data, ranks, extra, says, capsys):
    log_dir = tmp_path / "run"
    if ranks == 1:  # train.py's main() in this process (no interpreter start-up)
        capsys.readouterr()
        code = train_main("--data_dir", data, "--log_dir", log_dir, "--num_workers", "1",
                          "--image_size", "8", *extra)
        out = "".join(capsys.readouterr())
    else:
        proc = job(ranks, data, log_dir, "--image_size", "8", *extra, check=False, timeout=240)
        code, out = proc.returncode, proc.stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and errors and says in errors[0], out[-3000:]
    assert len(set(errors)) == 1, errors
    assert not log_dir.exists() or not any(log_dir.iterdir()), sorted(os.listdir(log_dir))


@pytest.mark.timeout(240)
def test_the_first_step_says_it_measures_the_range_a_real_overflow_says_so_and_a_resume_names_no_batch_size(
        data, tmp_path):
    """Issue 56, item 7: every run's first step logged "a gradient outgrew its fixed-point range
    (or the first step)", the line of a fault; and every flagless resume listed `--batch_size`
    among the flags taken from the checkpoint, a flag derived from G that nobody typed. With
    --lr 10 the weights blow up at once, so step 2's gradients outgrow step 1's range for real."""
    tiny = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
            "--attention_resolutions", "", "--channel_mult", "1,2", "--diffusion_steps", "10",
            "--noise_schedule", "cosine", "--global_batch_size", "4", "--microbatch", "2",
            "--lr", "10", "--save_interval", "1000"]
    out = job(1, data, tmp_path / "run", *tiny, "--max_steps", "2").stdout
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^step (\d+): .*$", out, re.M)}
    assert lines[1] == ("step 1: the exact gradient sum takes each gradient's fixed-point range "
                        "from this first step: its shards run twice"), out
    assert lines[2].startswith("step 2: a gradient outgrew its fixed-point range; the step's "
                               "shards run again at the exact range"), out
    assert out.count("outgrew") == 1, out
    out = job(1, data, tmp_path / "run", "--max_steps", "3").stdout
    taken = next(ln for ln in out.splitlines() if ln.startswith("resume: from the checkpoint"))
    assert "--global_batch_size 4" in taken and "--microbatch 2" in taken, taken
    assert "--batch_size" not in taken.replace("--global_batch_size", ""), taken
    assert "the exact gradient sum takes" not in out, out  # the range came with the checkpoint
