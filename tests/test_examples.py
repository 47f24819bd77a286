"""The examples a researcher copies, through the real launcher (mpiexec): their own model
(examples/own_model.py: BatchNorm buffers, a frozen parameter, its own forward) trained with
train.py's machinery, and their own loop (examples/own_loop.py) on the checkpointer alone.

Each resumed run is compared with a straight run file by file, every tensor bit for bit: model
(buffers included), EMA, optimizer and trainer state.
"""
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from conftest import MPIEXEC, PY, REPO, child_env, deep_diff, hang_s, resumed_step, write_images

OWN_MODEL = REPO / "examples" / "own_model.py"
OWN_LOOP = REPO / "examples" / "own_loop.py"
MODEL_FLAGS = ["--image_size", "8", "--dim", "32", "--depth", "1", "--heads", "2",
               "--patch_size", "2", "--diffusion_steps", "20", "--noise_schedule", "cosine",
               "--batch_size", "2", "--microbatch", "1", "--log_interval", "1", "--seed", "0",
               "--save_interval", "3"]
LOOP_FLAGS = ["--batch_size", "2", "--log_interval", "1", "--seed", "3", "--save_interval", "7"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), n=14)


def launch(script, ranks, *args):
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + [PY, script, *map(str, args)]
    return [str(c) for c in cmd]


def run(script, ranks, *args, expect=0, timeout=150):
    proc = subprocess.run(launch(script, ranks, *args), cwd=REPO, env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL, timeout=hang_s(timeout))
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


def preempted(script, ranks, log_dir, *args, after_rows=2, timeout=120):
    """Run ``script`` until its progress.csv has ``after_rows`` steps, SIGTERM the last rank,
    and return (exit code, output)."""
    out_path = log_dir.parent / f"{log_dir.name}.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(launch(script, ranks, *args), cwd=REPO, env=child_env(),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        end = time.monotonic() + hang_s(timeout)
        while _rows(log_dir) < after_rows:
            assert proc.poll() is None, out_path.read_text()[-3000:]
            assert time.monotonic() < end, "the run did not start training"
            time.sleep(0.02)
        os.kill(_rank_pids(str(log_dir), script.name)[ranks - 1], signal.SIGTERM)
        rc = proc.wait(timeout=hang_s(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, out_path.read_text()


def _rows(log_dir):
    try:
        return max(0, len((log_dir / "progress.csv").read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def _rank_pids(marker, script):
    """{rank: pid} of the processes of ``script`` whose command line holds ``marker``."""
    pids = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if marker.encode() in cmdline and script.encode() in cmdline and PY.encode() in cmdline:
            pids[int(env.get(b"PMI_RANK", b"0"))] = int(entry)
    return pids


def load(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def step_files(log_dir, step):
    return sorted(n for n in os.listdir(log_dir) if n.endswith(f"{step:06d}.pt"))


def assert_same_step(a, b, step):
    names = step_files(a, step)
    assert names == step_files(b, step) and (a / f"manifest{step:06d}.json").exists()
    diffs = [f"{n}{d}" for n in names for d in deep_diff(load(a / n), load(b / n))]
    assert not diffs, f"step {step} differs (straight vs resumed):\n" + "\n".join(diffs[:30])


# ------------------------------------------------------------------------ a model of one's own


@pytest.fixture(scope="module")
def own_model_runs(tmp_path_factory, data):
    """{ranks: (straight run to 6, run stopped at 3)} of examples/own_model.py: one run, which
    saved step 3 on its way; the stopped run is a log dir holding only that step (as a job
    stopped there leaves it)."""
    made = {}

    def get(ranks):
        if ranks not in made:
            d = tmp_path_factory.mktemp(f"own_model_{ranks}")
            run(OWN_MODEL, ranks, "--data_dir", data, "--log_dir", d / "straight", *MODEL_FLAGS,
                "--max_steps", 6)
            (d / "half").mkdir()
            for name in [*step_files(d / "straight", 3), "manifest000003.json"]:
                shutil.copy(d / "straight" / name, d / "half" / name)
            made[ranks] = d / "straight", d / "half"
        return made[ranks]

    return get


@pytest.mark.timeout(300)
# 1 and 3: make soak (the 3-rank priming stays guarded in make test by the classifier's
# 3-rank bitwise resume, the same keep_model_state priming)
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2,
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_a_model_with_batchnorm_and_a_frozen_parameter_resumes_bitwise(
        tmp_path, data, own_model_runs, ranks):
    straight, half = own_model_runs(ranks)
    resumed = tmp_path / "resumed"
    shutil.copytree(half, resumed)
    out = run(OWN_MODEL, ranks, "--data_dir", data, "--log_dir", resumed, *MODEL_FLAGS,
              "--max_steps", 6)
    assert resumed_step(out) == 3, out[-3000:]
    assert_same_step(straight, resumed, 6)
    sd = load(resumed / "model000006.pt")["state_dict"]
    # 6 steps of 2 microbatches: one BatchNorm update per forward of a training step, none more
    # (DDP's bucket-priming pass and the resume leave the statistics alone).
    assert int(sd["decoder.2.num_batches_tracked"]) == 12
    first = load(half / "model000003.pt")["state_dict"]
    assert int(first["decoder.2.num_batches_tracked"]) == 6
    assert torch.equal(sd["encoder.pos_embedding"], first["encoder.pos_embedding"])  # frozen
    ema = load(resumed / "ema_0.9999_000006.pt")["state_dict"]  # its EMA stays the parameter
    assert torch.equal(ema["encoder.pos_embedding"], sd["encoder.pos_embedding"])
    assert not torch.equal(sd["decoder.2.running_mean"], first["decoder.2.running_mean"])


@pytest.mark.timeout(200)
def test_a_model_of_ones_own_resumes_elastically_on_fewer_ranks(tmp_path, data, own_model_runs):
    _, half = own_model_runs(2)
    resumed = tmp_path / "resumed"
    shutil.copytree(half, resumed)
    # no flag retyped: the model's (--dim ...) and the run's (--batch_size ...) come from step 3
    out = run(OWN_MODEL, 1, "--data_dir", data, "--log_dir", resumed, "--max_steps", 6)
    assert resumed_step(out) == 3 and "world size 2 -> 1" in out, out[-3000:]
    assert "resume: from the checkpoint (model000003.pt): " in out, out[-3000:]
    trainer = load(resumed / "opt000006.pt")["trainer"]
    assert trainer["data"]["position"] == 3 * 4 + 3 * 2  # 3 steps of 2x2, then 3 of 1x2
    assert int(load(resumed / "model000006.pt")["state_dict"][
        "decoder.2.num_batches_tracked"]) == 12


# ------------------------------------------------------------------------ a loop of one's own


# make soak: one's own loop preempted (exit 75, a step saved) and resumed bitwise as a straight
# run stays in make test in
# test_ones_own_loop_with_a_global_batch_on_2_ranks_resumed_on_1_is_bitwise_a_1_rank_run
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ones_own_loop_is_preempted_with_exit_75_and_resumes_bitwise(tmp_path, data):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["--data_dir", data, *LOOP_FLAGS, "--max_steps", 30]
    out = run(OWN_LOOP, 2, *args, "--log_dir", straight)
    assert "step 30/30  loss" in out, out[-2000:]
    rc, out = preempted(OWN_LOOP, 2, resumed, *args, "--log_dir", resumed)
    assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    stopped = max(int(n[8:14]) for n in os.listdir(resumed) if n.startswith("manifest"))
    assert 2 <= stopped < 30 and f"saved step {stopped}" in out, out[-3000:]
    out = run(OWN_LOOP, 2, *args, "--log_dir", resumed)
    assert resumed_step(out) == stopped, out[-3000:]
    assert_same_step(straight, resumed, 30)
    if stopped < 28:
        assert_same_step(straight, resumed, 28)  # a --save_interval save after the resume


@pytest.mark.timeout(300)
def test_ones_own_loop_with_a_global_batch_on_2_ranks_resumed_on_1_is_bitwise_a_1_rank_run(
        tmp_path, data):
    """issue 44 in a loop of one's own: --global_batch_size 4 --microbatch 1 (VirtualShards):
    2 ranks SIGTERMed, resumed on 1, end as a straight 1-rank run: model, Adam moments, data
    position and fixed-point state bit for bit, and every logged loss."""
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    args = ["--data_dir", data, "--global_batch_size", 4, "--microbatch", 1, "--log_interval", 1,
            "--seed", 3, "--save_interval", 1000, "--max_steps", 12]
    run(OWN_LOOP, 1, *args, "--log_dir", straight)
    rc, out = preempted(OWN_LOOP, 2, chain, *args, "--log_dir", chain)
    assert rc == 75, f"exit {rc}:\n{out[-3000:]}"
    stopped = max(int(n[8:14]) for n in os.listdir(chain) if n.startswith("manifest"))
    assert stopped < 12, out[-3000:]
    out = run(OWN_LOOP, 1, *args, "--log_dir", chain)
    assert resumed_step(out) == stopped and "same run on 1 rank(s) (saved on 2)" in out, out[-3000:]
    a, b = (load(d / "model000012.pt") for d in (straight, chain))
    diffs = deep_diff(a, b)
    a, b = (load(d / "opt000012.pt") for d in (straight, chain))
    diffs += [f"opt/optimizer{d}" for d in deep_diff(a["optimizer"], b["optimizer"])]
    for key in ("data", "virtual_shards", "global_batch"):  # (its RNG: each rank's, by design)
        diffs += [f"opt/trainer/{key}{d}" for d in deep_diff(a["trainer"][key], b["trainer"][key])]
    assert not diffs, "1 rank vs 2 -> 1, step 12:\n" + "\n".join(diffs[:30])
    losses = [(d / "progress.csv").read_text().splitlines() for d in (straight, chain)]
    assert losses[0] == losses[1] and len(losses[0]) == 13, losses


@pytest.mark.slow  # make soak: the lock is the checkpointer's, test_run_lock tests it through train.py
@pytest.mark.timeout(120)
def test_ones_own_loop_holds_the_log_dir_lock(tmp_path, data):
    log = tmp_path / "run"
    args = ["--data_dir", data, *LOOP_FLAGS, "--log_dir", log]
    with open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(launch(OWN_LOOP, 1, *args, "--max_steps", 100000), cwd=REPO,
                                 env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + hang_s(60)
        while _rows(log) < 1:
            assert first.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        second = run(OWN_LOOP, 1, *args, "--max_steps", 3, "--lock_wait", 0, expect=1)
        assert f"log dir {log} is in use by" in second, second[-2000:]
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=hang_s(60)) == 75
