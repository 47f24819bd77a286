"""Sharded training (--fsdp True, FSDP2) and the full layout of its steps (issue 38, items 1-3).

A 2-rank FSDP run with a loader worker, through the real scripts: its resume is bitwise a run that
never stopped; its step 2 loads on 3 ranks (uneven slices), on 1 and under DDP, each writing back
the same weights, EMA and Adam moments bit for bit, and the data go on at the same global sample;
a DDP step goes on under FSDP as the DDP run does (to the order of the reductions); an own model
with tied weights and BatchNorm trains and resumes sharded.

Two module runs are read by most tests: ``straight`` (the full layout) and ``sharded_run`` (the
same training in the sharded layout), each step 2 loaded on other worlds and in other ways. A test
of another model or dtype trains its own straight run; its resume is a copy of that run's log dir
without step 4 (the job that stopped at step 2, started again). Checks that only read a step
(consolidate, verify) run the doctor's ``main`` in this process; scripts/ckpt.py itself runs in
the flipped-byte test.
"""
import csv
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (MPIEXEC, PY, REPO, _run, child_env, ckpt_in_process, deep_diff, hang_s,
                      job_pids, rank_pids, run_mpi, run_script, run_script_here,
                      write_class_folder, write_images)

MODEL = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
         "--attention_resolutions", "4", "--diffusion_steps", "20", "--noise_schedule", "cosine"]
RUN = ["--batch_size", "4", "--max_steps", "4", "--save_interval", "2", "--log_interval", "2",
       "--ema_rate", "0.99"]
KINDS = ("model{:06d}.pt", "ema_0.99_{:06d}.pt", "opt{:06d}.pt")


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def state_of(run, step):
    """{file: payload} of a step's files, the trainer state left out (it names the world size
    and each rank's RNG, which differ by design between rank counts)."""
    out = {}
    for kind in KINDS:
        f = load(run / kind.format(step))
        if "trainer" in f:
            f = {k: v for k, v in f.items() if k != "trainer"}
        out[kind] = f
    return out


def trainer(run, step):
    return load(run / f"opt{step:06d}.pt")["trainer"]


def drop_step(run, step):
    for p in run.iterdir():
        if f"{step:06d}" in p.name:
            p.unlink()


def without_step_4(straight, run):
    """A copy of a straight run's log dir (steps 2 and 4) without step 4: its resume from step 2
    is the job that stopped at 2 and was started again."""
    shutil.copytree(straight, run)
    drop_step(run, 4)
    return run


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("fsdp") / "img", n=16)


@pytest.fixture(scope="module")
def straight(images, tmp_path_factory):
    """2 ranks, --fsdp True, a loader worker: steps 2 and 4."""
    d = tmp_path_factory.mktemp("straight") / "run"
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", d, *MODEL, *RUN, "--fsdp", "True",
            "--num_workers", "1", timeout=300)
    return d


@pytest.mark.timeout(400)
def test_a_flagless_fsdp_resume_on_2_ranks_ends_bitwise_as_the_straight_run(images, straight,
                                                                           tmp_path):
    run = without_step_4(straight, tmp_path / "run")
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--num_workers", "1",
                  "--async_save", "False", timeout=300).stdout
    assert "--fsdp True" in out  # taken from the checkpoint's settings
    assert "resumed at step 2" in out, out[-2000:]
    for kind in KINDS:  # step 4 streamed (--async_save False: one file at a time)
        name = kind.format(4)
        assert deep_diff(load(straight / name), load(run / name)) == [], name
        if not name.startswith("opt"):  # the resumed job's opt pickle shares fewer key strings
            assert (straight / name).read_bytes() == (run / name).read_bytes(), name


@pytest.mark.timeout(600)
def test_a_sharded_step_moves_to_3_ranks_to_1_and_to_ddp_with_every_tensor_unchanged(
        images, straight, tmp_path):
    """Each hop loads step 2 of the one before on another world and writes it back (--max_steps
    2: nothing to train, the step saved in its own log dir): 2 FSDP ranks -> 3 (uneven slices)
    -> 1 -> 2 DDP ranks -> 2 FSDP ranks. Every weight, EMA and Adam moment is the straight run's.
    The hops to 3 and 1 save with --async_save False (gathered and written one file at a time,
    uneven and empty slices on 3), the others through the background writer."""
    want = state_of(straight, 2)
    prev = straight
    for i, (n, sharded) in enumerate(((3, True), (1, True), (2, False), (2, True))):
        run = tmp_path / f"hop{i}"
        out = run_mpi(n, "train.py", "--data_dir", images, "--log_dir", run,
                      "--resume_checkpoint", prev / "model000002.pt", "--max_steps", "2",
                      "--fsdp", str(sharded), "--num_workers", "1", "--async_save",
                      str(n == 2), timeout=300).stdout
        assert "resumed at step 2" in out, out[-2000:]
        assert deep_diff(want, state_of(run, 2)) == [], (n, sharded)
        assert trainer(run, 2)["world_size"] == n
        assert trainer(run, 2)["data"] == trainer(straight, 2)["data"]
        prev = run


@pytest.mark.slow  # make soak: the DDP <-> FSDP state is bitwise in the hops test
@pytest.mark.timeout(500)
def test_a_ddp_run_goes_on_under_fsdp_as_under_ddp_to_the_order_of_the_reductions(
        images, tmp_path):
    ddp = tmp_path / "ddp"
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", ddp, *MODEL, *RUN, timeout=300)
    run = without_step_4(ddp, tmp_path / "run")
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--fsdp", "True",
                  timeout=300).stdout
    assert "resume: --fsdp False -> True" in out, out[-2000:]
    for kind in KINDS:
        a, b = load(ddp / kind.format(4)), load(run / kind.format(4))
        diff = deep_diff(a, b)
        assert diff, "FSDP reduces gradients in another order: not expected bitwise"
        for key in ("state_dict",) if "model" in kind or "ema" in kind else ():
            for name, t in a[key].items():
                if t.is_floating_point():
                    torch.testing.assert_close(b[key][name], t, rtol=1e-4, atol=1e-5)


def logged(log_dir, key):
    with open(log_dir / "progress.csv") as f:
        return {int(float(row["step"])): float(row[key]) for row in csv.DictReader(f)
                if row.get(key)}


@pytest.mark.timeout(500)
def test_under_fsdp_the_grad_norm_the_ema_and_a_nan_on_one_slice_are_the_whole_models(
        images, tmp_path):
    """Issue 43, item 18, each over all slices: the logged grad norm is the DDP run's (not this
    rank's slice's); the EMA follows the weights (ema = 0.5 ema + 0.5 weights, not a frozen
    copy); a NaN, then an Inf, in rank 1's slice of a gradient (tests/nan_train.py) skips the
    step on every rank (--nan_policy skip): steps 3 and 4 hold step 2's weights, EMA and
    moments exactly."""
    flags = ["--data_dir", images, *MODEL, "--batch_size", "4", "--save_interval", "1",
             "--log_interval", "1", "--ema_rate", "0.5", "--nan_policy", "skip",
             "--dist_timeout", "60"]
    ddp, run = tmp_path / "ddp", tmp_path / "fsdp"
    run_mpi(2, "train.py", *flags, "--log_dir", ddp, "--max_steps", "2", timeout=300)
    out = _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "nan_train.py", *flags, "--log_dir", run,
                "--max_steps", "4", "--fsdp", "True"], timeout=300,
               env={"NAN_GRAD_STEPS": "3", "INF_GRAD_STEPS": "4", "NAN_RANKS": "1"}).stdout
    want, got = logged(ddp, "grad_norm"), logged(run, "grad_norm")
    for step in (1, 2):
        assert got[step] == pytest.approx(want[step], rel=1e-3), (step, got, want)
    e1, e2 = (load(run / f"ema_0.5_{s:06d}.pt")["state_dict"] for s in (1, 2))
    w2 = load(run / "model000002.pt")["state_dict"]
    for name, t in e2.items():
        if t.is_floating_point():
            torch.testing.assert_close(t, 0.5 * e1[name] + 0.5 * w2[name], rtol=0, atol=1e-6)
    for step in (3, 4):
        assert f"step {step}: the loss or gradients are not finite" in out, out[-3000:]
        assert deep_diff(tensors_of(run, 2), tensors_of(run, step)) == [], step


@pytest.mark.timeout(400)
def test_the_logged_grad_norm_of_two_fsdp_ranks_is_the_ddp_runs_of_the_same_steps(
        images, straight, tmp_path):
    """Issue 56 item 12: each FSDP rank holds a slice of every gradient; the logged norm is the
    whole gradient's (each rank's sum of squares, all-reduced), the DDP run's of the same two
    steps to the order of the reductions. Without the all-reduce rank 0 logs its slices' norm
    (about 1/sqrt(2) of it): nothing hangs, only this comparison sees it."""
    ddp = tmp_path / "ddp"
    two = [v if RUN[i - 1] != "--max_steps" else "2" for i, v in enumerate(RUN)]
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", ddp, *MODEL, *two,
            "--num_workers", "1", timeout=300)
    want, got = logged(ddp, "grad_norm"), logged(straight, "grad_norm")
    assert list(want) == [2] and want[2] > 0, want
    assert got[2] == pytest.approx(want[2], rel=1e-4), (got, want)


def tensors_of(run, step):
    """The weights, the 0.5 EMA and the Adam moments of a step."""
    return [load(run / f"model{step:06d}.pt")["state_dict"],
            load(run / f"ema_0.5_{step:06d}.pt")["state_dict"],
            load(run / f"opt{step:06d}.pt")["optimizer"]["state"]]


def logged_steps(log_dir):
    with open(log_dir / "progress.csv") as f:
        return [int(float(row["step"])) for row in csv.DictReader(f)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    pytest.param("full", marks=pytest.mark.slow),  # make soak: the signal path is the same;
    "sharded"])                                     # sharded adds the save under way
def test_sigterm_to_every_process_saves_exits_75_and_the_resume_is_bitwise_a_straight_run(
        images, tmp_path, layout):
    """Every rank and loader worker gets SIGTERM (as from a scheduler), --dist_timeout short;
    sharded: the step saved at 5 is still being written in the background when it comes."""
    run = tmp_path / "run"
    args = ["--data_dir", images, "--log_dir", run, *MODEL, "--batch_size", "4",
            "--ema_rate", "0.99", "--save_interval", "5", "--log_interval", "1", "--fsdp",
            "True", "--save_layout", layout, "--num_workers", "1", "--dist_timeout", "60"]
    cmd = [MPIEXEC, "-n", "2", PY, REPO / "scripts" / "train.py", *args, "--max_steps", "1000"]
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=child_env(), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.time() + hang_s(240)
        while ("step 6/" not in (tmp_path / "job.log").read_text() and job.poll() is None
               and time.time() < deadline):
            time.sleep(0.05)
        pids = job_pids(run)
        assert sorted(set(pids.values())) == [0, 1] and len(pids) == 4, pids  # 2 ranks, 2 workers
        for pid in pids:  # as a scheduler does: every process of the job
            os.kill(pid, signal.SIGTERM)
        try:
            rc = job.wait(timeout=hang_s(120))
        except subprocess.TimeoutExpired:
            pytest.fail("no exit {hang_s(120)} s after SIGTERM:\n"
                        + (tmp_path / "job.log").read_text()[-3000:])
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    out = (tmp_path / "job.log").read_text()
    assert rc == 75, out[-3000:]
    saved = sorted(int(p.name[8:14]) for p in run.glob("manifest*.json"))
    assert saved[0] == 5 and saved[-1] == max(logged_steps(run)), (saved, out[-2000:])
    assert ckpt_in_process("verify", run)[0] == 0
    end = saved[-1] + 2
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--max_steps", end,
            "--num_workers", "1", timeout=300)
    straight = tmp_path / "straight"
    run_mpi(2, "train.py", *[straight if a == run else a for a in args], "--max_steps", end,
            timeout=300)
    if layout == "sharded":
        straight = consolidated(straight, end, tmp_path / "s")
        run = consolidated(run, end, tmp_path / "r")
    for kind in KINDS:
        name = kind.format(end)
        assert deep_diff(load(straight / name), load(run / name)) == [], name


@pytest.mark.timeout(500)
def test_an_own_model_with_tied_weights_and_batchnorm_trains_and_resumes_sharded(images, tmp_path):
    """tests/edge_model_train.py's model (``b.weight`` is ``a.weight``, BatchNorm buffers), the
    parameter it leaves out on some ranks turned off: FSDP2 cannot reduce a gradient only some
    ranks have, and --find_unused_parameters True under --fsdp is refused in one line."""
    def train(log_dir, *extra):
        return _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "edge_model_train.py",
                     "--data_dir", images, "--log_dir", log_dir, "--batch_size", "4",
                     "--save_interval", "2", "--fsdp", "True", "--edge_rare", "False",
                     "--num_workers", "1", *extra], timeout=300)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, "--max_steps", "4")
    # resumed from the full layout's step 2, step 4 saved in the sharded layout: rank 0's
    # BatchNorm buffers, as the full layout's (each rank's own differ: its own batches; issue
    # 43, item 18); consolidated, every file is the straight run's
    train(without_step_4(straight, resumed), "--max_steps", "4", "--save_layout", "sharded")
    assert (resumed / "step000004.dcp").is_dir()
    same_step_files(straight, consolidated(resumed, 4, tmp_path / "c"), 4)
    sd = load(tmp_path / "straight" / "model000004.pt")["state_dict"]
    assert torch.equal(sd["a.weight"], sd["b.weight"]) and "norm.running_mean" in sd
    assert int(sd["norm.num_batches_tracked"]) == 4
    proc = _run([PY, REPO / "tests" / "edge_model_train.py", "--data_dir", images, "--log_dir",
                 tmp_path / "refused", "--fsdp", "True", "--find_unused_parameters", "True"],
                timeout=120, check=False)  # a check of the flags: one process is enough
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors and "--fsdp" in errors[0], proc.stdout[-2000:]


def same_step_files(a, b, step):
    names = sorted(p.name for p in a.glob(f"*{step:06d}.pt"))
    assert names and names == sorted(p.name for p in b.glob(f"*{step:06d}.pt"))
    for name in names:
        assert deep_diff(load(a / name), load(b / name)) == [], name


@pytest.mark.timeout(500)
def test_a_dit_run_sharded_on_2_ranks_resumes_bitwise(tmp_path):
    """DiT's blocks are FSDP units, its frozen pos_embed sharded beside them."""
    latents = tmp_path / "latents"
    latents.mkdir()
    rng = np.random.default_rng(0)
    for c in ("3", "7"):
        for i in range(5):
            np.save(latents / f"{c}_{i:05d}.npy", rng.standard_normal((4, 8, 8)).astype("f4"))
    dit = ["--arch", "DiT-S/2", "--dit_depth", "2", "--dit_hidden_size", "32", "--dit_num_heads",
           "2", "--image_size", "8", "--in_channels", "4", "--learn_sigma", "True",
           "--class_cond", "True", "--batch_size", "2", "--save_interval", "2", "--fsdp", "True",
           "--data_dir", latents]
    run_mpi(2, "train.py", *dit, "--log_dir", tmp_path / "straight", "--max_steps", "4",
            timeout=300)
    run_mpi(2, "train.py", "--data_dir", latents, "--log_dir",
            without_step_4(tmp_path / "straight", tmp_path / "resumed"), "--max_steps", "4",
            timeout=300)
    same_step_files(tmp_path / "straight", tmp_path / "resumed", 4)


@pytest.mark.timeout(500)
def test_the_noised_classifier_sharded_under_torchrun_resumes_bitwise(tmp_path):
    train_dir = write_class_folder(tmp_path / "train", per_class=4)
    torchrun = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]

    def train(log_dir, *extra):
        return _run([*torchrun, REPO / "scripts" / "classifier_train.py", "--data_dir",
                     train_dir, "--log_dir", log_dir, *extra], timeout=300).stdout
    tiny = ["--image_size", "8", "--classifier_width", "32", "--classifier_depth", "1",
            "--classifier_attention_resolutions", "4", "--diffusion_steps", "20",
            "--batch_size", "4", "--save_interval", "2", "--fsdp", "True"]
    train(tmp_path / "straight", *tiny, "--max_steps", "4")
    out = train(without_step_4(tmp_path / "straight", tmp_path / "resumed"), "--max_steps", "4")
    assert "--fsdp True" in out, out[-2000:]
    same_step_files(tmp_path / "straight", tmp_path / "resumed", 4)


# ------------------------------------------------------------------------ the sharded layout


def consolidated(run, step, out):
    """The full layout's files of a sharded step (ckpt.py consolidate, in this process)."""
    rc, text = ckpt_in_process("consolidate", run, "--step", step, "--out", out)
    assert rc == 0, text
    return out


@pytest.fixture(scope="module")
def sharded_run(images, tmp_path_factory):
    """The straight run's training with --save_layout sharded (async: DCP's thread)."""
    d = tmp_path_factory.mktemp("sharded") / "run"
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", d, *MODEL, *RUN, "--fsdp", "True",
            "--save_layout", "sharded", "--num_workers", "1", timeout=300)
    return d


@pytest.mark.timeout(500)
def test_a_sharded_run_resumes_bitwise_past_a_flipped_byte_and_consolidates_to_the_full_files(
        images, straight, sharded_run, tmp_path):
    """Step 4 of the sharded run, consolidated by scripts/ckpt.py, is the straight run's. A byte
    flipped in its shard is found by verify, and the resume takes step 2 (one line naming step
    4) and trains on to step 4, saved with --async_save False (DCP's synchronous save):
    consolidated, the straight run's step 4 again."""
    assert sorted(p.name for p in sharded_run.iterdir() if "000004" in p.name) == [
        "manifest000004.json", "step000004.dcp"]
    run_script("ckpt.py", "consolidate", sharded_run, "--step", "4", "--out", tmp_path / "c4")
    same_step_files(straight, tmp_path / "c4", 4)
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    shard = run / "step000004.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run_script("ckpt.py", "verify", run, check=False)
    assert proc.returncode == 1 and "step        4" in proc.stdout, proc.stdout
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--num_workers", "1",
                  "--async_save", "False", timeout=300).stdout
    warned = [line for line in out.splitlines() if "step000004.dcp" in line or "step 4" in line]
    assert warned and "resumed at step 2 from" in out and "step000002.dcp" in out, out[-3000:]
    same_step_files(straight, consolidated(run, 4, tmp_path / "r4"), 4)


@pytest.mark.timeout(600)
def test_a_sharded_step_of_2_ranks_resumes_on_3_and_on_1(images, straight, sharded_run,
                                                         tmp_path):
    """2 ranks -> 3 (uneven shards; writing step 2 back sharded) -> 1 (writing it back in the
    full layout): every weight, EMA and Adam moment is the straight run's step 2. The hop to 3
    adds an EMA rate, which starts from the model weights with one warning, as in the full
    layout (issue 43, item 14)."""
    three = tmp_path / "three"
    out = run_mpi(3, "train.py", "--data_dir", images, "--log_dir", three, "--resume_checkpoint",
                  sharded_run / "step000002.dcp", "--max_steps", "2", "--num_workers", "1",
                  "--ema_rate", "0.99,0.999", timeout=300).stdout
    warned = [line for line in out.splitlines() if "no EMA file for rate 0.999" in line]
    assert len(warned) == 1 and "starts from the model weights" in warned[0], out[-3000:]
    c = consolidated(three, 2, tmp_path / "c")
    assert deep_diff(state_of(straight, 2), state_of(c, 2)) == []
    new_ema = load(c / "ema_0.999_000002.pt")["state_dict"]
    assert deep_diff(load(c / "model000002.pt")["state_dict"], new_ema) == []
    one = tmp_path / "one"
    run_script("train.py", "--data_dir", images, "--log_dir", one, "--resume_checkpoint",
               three / "step000002.dcp", "--max_steps", "2", "--save_layout", "full",
               timeout=300)
    assert deep_diff(state_of(straight, 2), state_of(one, 2)) == []
    assert trainer(one, 2)["data"] == trainer(straight, 2)["data"]


@pytest.mark.timeout(400)
def test_a_sharded_steps_kind_and_flags_are_read_from_its_manifest(images, sharded_run,
                                                                   tmp_path):
    """A noised classifier's sharded step given to train.py, and train.py's to
    classifier_train.py: neither takes the other's flags (the manifest's kind), each refuses in
    one line naming what the step holds (issue 43, item 18)."""
    cls = tmp_path / "cls"
    run_script("classifier_train.py", "--data_dir", write_class_folder(tmp_path / "classes",
                                                                       per_class=2),
               "--log_dir", cls, "--image_size", "8", "--classifier_width", "32",
               "--classifier_depth", "1", "--classifier_attention_resolutions", "4",
               "--diffusion_steps", "20", "--batch_size", "2", "--max_steps", "1",
               "--fsdp", "True", "--save_layout", "sharded", timeout=300)
    assert (cls / "step000001.dcp").is_dir()
    for script, data, step, holds in (
            ("train.py", images, cls / "step000001.dcp", "noised-classifier weights"),
            ("classifier_train.py", tmp_path / "classes", sharded_run / "step000002.dcp",
             "a model state dict")):
        proc = run_script(script, "--data_dir", data, "--log_dir", tmp_path / f"new_{script}",
                          "--resume_checkpoint", step, "--fsdp", "True", timeout=300,
                          check=False)
        errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-3000:]
        assert f"holds {holds}, not" in errors[0], errors
        assert "from the checkpoint" not in proc.stdout, proc.stdout[-3000:]


def resumed_line(out):
    lines = [line for line in out.splitlines() if line.startswith("resumed at step")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.mark.timeout(600)
def test_a_sharded_step_resumes_with_fsdp_false_on_2_ranks_and_1_then_goes_on_on_3_in_full_files(
        images, sharded_run, tmp_path):
    """The same command plus --fsdp False (issue 43, items 2, 3, 13): step 2 of the 2-rank
    sharded run, named with a trailing slash, loads through DCP into the whole model of 2 DDP
    ranks and of 1 process, every weight, EMA and Adam moment the consolidated step's; the
    flags are still the checkpoint's, the layout is full from then on (one line saying so), and
    a flagless continuation on 3 ranks (a loader worker each) trains on in the full layout, its
    data going on at the same global sample (3 ranks x 4 further)."""
    log = (sharded_run / "log.txt").read_text()
    assert "--fsdp True: parameters, gradients, Adam moments and EMAs sharded over 2 rank(s); " \
           "steps saved in the sharded layout" in log, log[-2000:]
    want = state_of(consolidated(sharded_run, 2, tmp_path / "c2"), 2)
    ddp, one = tmp_path / "ddp", tmp_path / "one"
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", ddp, "--resume_checkpoint",
                  f"{sharded_run / 'step000002.dcp'}/", "--fsdp", "False", "--max_steps", "2",
                  "--num_workers", "1", timeout=300).stdout
    line = resumed_line(out)
    assert "step000002.dcp" in line and "ema_0.99_000002.pt" not in line, line
    assert "--num_channels 32" in out and "--fsdp True:" not in out, out[-3000:]
    switched = [ln for ln in out.splitlines() if "save_layout" in ln and "full" in ln]
    assert len(switched) == 1 and "--fsdp False" in switched[0], out[-3000:]
    assert deep_diff(want, state_of(ddp, 2)) == [], "2 DDP ranks"
    before = trainer(tmp_path / "c2", 2)["data"]
    assert trainer(ddp, 2)["data"] == before
    out = run_script("train.py", "--data_dir", images, "--log_dir", one, "--resume_checkpoint",
                     sharded_run / "step000002.dcp", "--fsdp", "False", "--max_steps", "2",
                     timeout=300).stdout
    assert deep_diff(want, state_of(one, 2)) == [], "1 process"
    # issue 56, item 8: DCP's own "UserWarning: torch.distributed is disabled ..." and its
    # source line came between our lines (one process loads without a process group on purpose)
    assert "UserWarning" not in out and "torch.distributed is disabled" not in out, out[-3000:]
    out = run_mpi(3, "train.py", "--data_dir", images, "--log_dir", ddp, "--max_steps", "3",
                  "--num_workers", "1", timeout=300).stdout  # flagless: the full layout goes on
    assert "resumed at step 2" in out and "--fsdp True" not in out, out[-3000:]
    assert sorted(p.name for p in ddp.iterdir() if "000003" in p.name) == [
        "ema_0.99_000003.pt", "manifest000003.json", "model000003.pt", "opt000003.pt"]
    assert ckpt_in_process("verify", ddp)[0] == 0
    assert deep_diff(state_of(ddp, 2)[KINDS[0]], state_of(ddp, 3)[KINDS[0]]), "trained on"
    after = trainer(ddp, 3)["data"]
    assert after["position"] == before["position"] + 3 * 4, (before, after)


@pytest.mark.timeout(300)
def test_a_layout_the_flags_refuse_writes_nothing_into_the_log_dir(images, sharded_run,
                                                                   tmp_path):
    """--save_layout sharded without --fsdp True, on a fresh start and on a resume into a new
    --log_dir: one line, before the log dir is created (issue 43, item 13)."""
    for i, extra in enumerate((["--save_layout", "sharded"],
                               ["--resume_checkpoint", sharded_run, "--fsdp", "False",
                                "--save_layout", "sharded"])):
        log_dir = tmp_path / f"new{i}"
        proc = run_script("train.py", "--data_dir", images, "--log_dir", log_dir, *extra,
                          timeout=120, check=False)
        errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:]
        assert "--save_layout sharded needs --fsdp True" in errors[0], errors
        assert not log_dir.exists(), sorted(p.name for p in log_dir.iterdir())


# ------------------------------------------------------------------- sampling a sharded step


def samples_of(script, model_path, out, capsys, *extra, data=None):
    """scripts/sample.py's arrays (nll.py's: its vb terms and its bits/dim line) for
    ``model_path``, in this process: the script's entry point, one rank, no process group."""
    args = ["--model_path", model_path, "--log_dir", out, *extra]
    if script == "nll.py":
        args += ["--data_dir", data, "--num_samples", "3", "--batch_size", "2"]
    else:
        args += ["--num_samples", "3", "--batch_size", "2", "--seed", "5"]
    code, text = run_script_here(script, *args, capsys=capsys)
    assert code == 0, text[-3000:]
    assert not torch.distributed.is_initialized()
    if script == "nll.py":
        bpd = [line for line in text.splitlines() if line.startswith("done 3 samples: bpd=")]
        return np.load(out / "vb_terms.npz")["arr_0"], bpd
    with np.load(out / "samples_3x8x8x3.npz") as z:
        return z["arr_0"]


@pytest.mark.timeout(400)
def test_sample_py_and_nll_py_read_a_sharded_step_as_bitwise_its_consolidated_files(
        images, sharded_run, tmp_path, capsys):
    """sample.py and nll.py given step 4 of the 2-rank sharded run directly (one process, no
    process group, nothing consolidated): its folder is its EMA (the one it holds), as is the
    EMA's name in the folder and its manifest; --weights model or the model's name in the
    folder is the model's weights. Each draws the samples, and nll.py the bits/dim, of the file
    `ckpt.py consolidate` writes for it, bit for bit, for the same seed; the Python API too."""
    full = consolidated(sharded_run, 4, tmp_path / "full")
    step = sharded_run / "step000004.dcp"
    wants = {}
    for kind, forms in (
            ("ema_0.99_000004.pt", [(step, []), (step / "ema_0.99_000004.pt", []),
                                   (sharded_run / "manifest000004.json", [])]),
            ("model000004.pt", [(step, ["--weights", "model"]), (step / "model000004.pt", [])])):
        wants[kind] = want = samples_of("sample.py", full / kind, tmp_path / f"w{kind}", capsys)
        for i, (path, extra) in enumerate(forms):
            got = samples_of("sample.py", path, tmp_path / f"{kind}{i}", capsys, *extra)
            assert np.array_equal(got, want), (kind, path, extra)
        want_nll = samples_of("nll.py", full / kind, tmp_path / f"nll_{kind}", capsys,
                              data=images)
        got_nll = samples_of("nll.py", forms[0][0], tmp_path / f"nll{kind}", capsys,
                             *forms[0][1], data=images)
        assert np.array_equal(got_nll[0], want_nll[0]) and got_nll[1] == want_nll[1], kind
    model = wants["model000004.pt"]
    assert not np.array_equal(model, wants["ema_0.99_000004.pt"])  # a wrong pick is seen

    from improved_diffusion import sampling
    drawn = []
    for path, want in ((step, "model"), (full / "model000004.pt", "auto")):
        m, d, flags, _ = sampling.load_for_sampling(path, want=want, device="cpu")
        drawn.append(sampling.sample_images(m, d, flags, 3, batch_size=2, seed=5)[0])
    assert np.array_equal(drawn[0], drawn[1]) and np.array_equal(drawn[0], model)


@pytest.mark.timeout(300)
def test_a_sharded_step_samples_on_2_ranks_as_on_one(sharded_run, tmp_path):
    """mpiexec -n 2 sample.py on a sharded step: rank 0 reads the EMA, the other rank gets its
    bytes; the samples are the one process's."""
    step = sharded_run / "step000004.dcp"
    for n in (1, 2):
        run_mpi(n, "sample.py", "--model_path", step, "--log_dir", tmp_path / str(n),
                "--num_samples", "3", "--batch_size", "1", timeout=200)
    a, b = (np.load(tmp_path / str(n) / "samples_3x8x8x3.npz")["arr_0"] for n in (1, 2))
    assert np.array_equal(a, b)


@pytest.mark.timeout(300)
def test_a_sharded_step_that_is_incomplete_damaged_or_lacks_the_file_named_is_one_line(
        sharded_run, tmp_path, capsys):
    """A step folder without its manifest (an interrupted save), one with a flipped byte, a file
    the step does not hold and its optimizer state: sample.py ends in one line naming the path
    and what to give instead, and writes nothing."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(sharded_run / "step000004.dcp", run / "step000004.dcp")
    shutil.copytree(sharded_run / "step000002.dcp", run / "step000002.dcp")
    shutil.copy(sharded_run / "manifest000002.json", run)
    shard = run / "step000002.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run_script("sample.py", "--model_path", run / "step000004.dcp", "--log_dir",
                      tmp_path / "s", "--num_samples", "2", check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-3000:]
    assert f"--model_path {run / 'step000004.dcp'}: step 4 is not complete (no manifest" in \
        errors[0] and "sample from a complete step" in errors[0], errors
    assert "Traceback" not in proc.stdout and not list((tmp_path / "s").glob("*.npz"))
    for path, says in (
            (run / "step000002.dcp", "step 2 is damaged (step000002.dcp/__1_0.distcp does not "
                                     "match its crc32"),
            (sharded_run / "step000004.dcp" / "ema_0.5_000004.pt",
             "step 4 holds no ema_0.5_000004.pt (it holds model000004.pt, ema_0.99_000004.pt, "
             "opt000004.pt); name one of those"),
            (sharded_run / "step000004.dcp" / "opt000004.pt",
             "the optimizer state of step 4, not model weights; name one of model000004.pt, "
             "ema_0.99_000004.pt")):
        code, text = run_script_here("sample.py", "--model_path", path, "--log_dir",
                                     tmp_path / "s", "--num_samples", "2", capsys=capsys)
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1, text[-3000:]
        assert f"--model_path {path}: {says}" in errors[0], errors
    assert not list((tmp_path / "s").glob("*.npz"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bf16", ["0", pytest.param("1", marks=pytest.mark.slow)],
                         ids=["fp16-gradscaler", "bf16"])  # make soak: bf16 (no scaler)
def test_use_fp16_under_fsdp_resumes_bitwise_on_either_cpu_branch(images, tmp_path, bf16):
    """--use_fp16 True --fsdp True through tests/amp_train.py, the CPU branch forced: float16
    with a GradScaler (its first steps overflow and are skipped, the same ones on both ranks)
    or bfloat16; FSDP gathers the blocks in that dtype, the norm layers in float32."""
    def train(log_dir, *extra):
        return _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "amp_train.py", "--data_dir",
                     images, "--log_dir", log_dir, *MODEL, "--batch_size", "4",
                     "--save_interval", "2", "--fsdp", "True", "--use_fp16", "True", *extra],
                    timeout=300, env={"CPU_BF16": bf16}).stdout
    out = train(tmp_path / "straight", "--max_steps", "4")
    assert ("loss_scale" in out) == (bf16 == "0"), out[-2000:]
    assert ("bfloat16 autocast" in out) == (bf16 == "1"), out[-2000:]
    train(without_step_4(tmp_path / "straight", tmp_path / "resumed"), "--max_steps", "4")
    same_step_files(tmp_path / "straight", tmp_path / "resumed", 4)


# ------------------------------------------------------------- the full layout's save, streamed


def _hwm_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [False, True], ids=["streamed", "background"])
def test_a_full_layout_save_under_fsdp_holds_one_file_on_rank_0_not_the_whole_state(
        images, tmp_path, async_save):
    """--fsdp True --save_layout full on 2 ranks, a ~11M-parameter UNet with two EMAs (state:
    model + 2 EMAs + 2 Adam moments, 5 x the weights); rank 0's peak resident memory over rank
    1's (same training, same gathers, nothing kept), against the state:

    - --async_save False: rank 0 gathers and writes one file at a time, so it holds about the
      largest file (the opt file, 0.4 x the state), never the whole state (the old save: >= 1 x);
    - --async_save True (the writer process): the background write needs the host copy of the
      whole step (1 x, as DDP's rank 0 holds it), and each tensor is gathered straight into it,
      never into a whole gathered state copied again (the old save: >= 2 x).

    Freed blocks are returned to the system (MALLOC_MMAP_THRESHOLD_) so that resident memory
    follows what is live."""
    run = tmp_path / "run"
    cmd = [MPIEXEC, "-n", "2", PY, REPO / "scripts" / "train.py", "--data_dir", images,
           "--log_dir", run, "--image_size", "8", "--num_channels", "64", "--channel_mult",
           "1,2,2,2", "--num_res_blocks", "2", "--attention_resolutions", "4,2,1",
           "--diffusion_steps", "20", "--batch_size", "2", "--max_steps", "2" if not async_save
           else "1", "--save_interval", "1", "--ema_rate", "0.9,0.99", "--fsdp", "True",
           "--async_save", str(async_save), "--save_writer", "process", "--num_workers", "0"]
    out = tmp_path / "out.txt"
    hwm, pids = {}, {}
    with open(out, "w") as f:
        job = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                               env=child_env({"MALLOC_MMAP_THRESHOLD_": "131072"}), cwd=REPO)
        deadline = time.monotonic() + 280
        while job.poll() is None and time.monotonic() < deadline:
            if len(pids) < 2:
                pids = {int(r): p for r, p in rank_pids(run).items()}
            for rank, pid in pids.items():
                kb = _hwm_kb(pid)
                if kb is not None:
                    hwm[rank] = max(hwm.get(rank, 0), kb)
            time.sleep(0.02)
        job.wait(timeout=max(1, deadline - time.monotonic()))
    assert job.returncode == 0, out.read_text()[-3000:]
    state = sum((run / n.format(1)).stat().st_size for n in (
        "model{:06d}.pt", "ema_0.9_{:06d}.pt", "ema_0.99_{:06d}.pt", "opt{:06d}.pt")) / 1024
    assert state > 150e3  # KB: big enough for resident memory to see it
    extra = hwm[0] - hwm[1]
    assert extra < (1.5 if async_save else 0.6) * state, (extra, state, hwm)
