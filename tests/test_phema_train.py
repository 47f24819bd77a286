"""Post-hoc EMA in training (issue 23): `train.py --phema_stds` tracks the power-function EMAs on
every rank, writes their snapshots with the saves that are due (in the manifest, never pruned),
and resumes them bit for bit on 1-3 ranks and elastically (time is images, not steps). The
refusals (bad flags, a NaN snapshot, a resume without tracker state, a model change) are tested
in one process; tests/test_phema.py tests the math, the files and the reconstruction."""
import io
import json
import os
import shutil

import pytest
import torch as th

from conftest import deep_diff, hang_s, resumed_step, run_mpi, run_script, write_images
from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion import logger, phema, train_util
from improved_diffusion.ckpt.checkpointer import NonFiniteError
from improved_diffusion.apps.ckpt_tool import main as ckpt_main
from improved_diffusion.infra.errors import UsageError
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

TINY_FLAGS = dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="",
                  diffusion_steps=20, noise_schedule="cosine")
TINY = [a for k, v in TINY_FLAGS.items() for a in (f"--{k}", str(v))] + [
    "--batch_size", "2", "--log_interval", "1", "--seed", "0", "--ema_rate", "0.99"]
# A save every step; snapshots every second step and at the last one.
PHEMA = ["--phema_stds", "0.05,0.1", "--phema_interval", "2", "--save_interval", "1"]
STDS = ("0.050", "0.100")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"), n=14)


def train(ranks, data, log_dir, *extra):
    args = [*TINY, "--data_dir", data, "--log_dir", log_dir, *map(str, extra)]
    if ranks == 1:
        return run_script("train.py", *args, timeout=150).stdout
    return run_mpi(ranks, "train.py", *args, timeout=150).stdout


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def files_of(d, step):
    return sorted(n for n in os.listdir(d) if n.endswith(f"{step:06d}.pt"))


def snapshots(d):
    return sorted(n for n in os.listdir(d) if n.startswith("phema_"))


def stopped_at(src, dst, step):
    """A copy of the run dir ``src`` as a run killed right after its save of ``step`` left it:
    the files of later steps are not there."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        info = C.name_info(name)
        if info is not None and info.step > step:
            os.unlink(os.path.join(dst, name))
    return dst


@pytest.fixture(scope="module")
def straight(tmp_path_factory, images):
    """straight(ranks) -> the log dir of a run of 6 steps on ``ranks`` ranks (made once)."""
    made = {}

    def get(ranks):
        if ranks not in made:
            d = tmp_path_factory.mktemp(f"straight{ranks}") / "run"
            train(ranks, images, d, *PHEMA, "--max_steps", 6)
            made[ranks] = d
        return made[ranks]

    return get


# ---------------------------------------------------------------------------------------------
# through train.py


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2,
                                   pytest.param(3, marks=pytest.mark.slow)])  # 1, 3: make soak
def test_a_run_with_phema_stds_resumed_at_a_step_without_snapshots_ends_bitwise_identical(
        tmp_path, images, straight, ranks):
    done = straight(ranks)
    assert snapshots(done) == [f"phema_{s}_{k:06d}.pt" for s in STDS for k in (2, 4, 6)]
    # Step 3 has no snapshots: the tracker comes back from the trainer state of opt000003.pt.
    resumed = stopped_at(done, tmp_path / "resumed", 3)
    out = train(ranks, images, resumed, *PHEMA, "--max_steps", 6, "--keep_checkpoints", 1,
                "--async_save", "False")
    assert resumed_step(out) == 3, out[-3000:]

    names = files_of(done, 6)
    assert names == files_of(resumed, 6) and {f"phema_{s}_000006.pt" for s in STDS} <= set(names)
    diffs = [f"{n}{p}" for n in names for p in deep_diff(load(done / n), load(resumed / n))]
    assert not diffs, "step 6 differs (straight vs resumed):\n" + "\n".join(diffs[:30])
    # The snapshots are the same bytes (straight: asynchronous saves; resumed: synchronous).
    for name in snapshots(done):
        assert (done / name).read_bytes() == (resumed / name).read_bytes(), name
    manifest = json.loads((resumed / "manifest000006.json").read_text())
    assert {f"phema_{s}_000006.pt" for s in STDS} <= set(manifest["files"])
    # --keep_checkpoints 1 pruned steps 1-5 and kept every snapshot.
    assert snapshots(resumed) == snapshots(done)
    left = sorted(n for n in os.listdir(resumed)
                  if C.name_info(n) is not None and C.name_info(n).kind != "phema")
    assert left == ["ema_0.99_000006.pt", "manifest000006.json", "model000006.pt",
                    "opt000006.pt"], left
    tracked = load(resumed / "opt000006.pt")["trainer"]["phema"]
    assert tracked["nimg"] == 6 * 2 * ranks and tracked["stds"] == [0.05, 0.1]


@pytest.mark.timeout(200)
def test_an_elastic_resume_2_to_1_continues_the_tracker_with_the_new_global_batch(
        tmp_path, images, straight):
    run = stopped_at(straight(2), tmp_path / "run", 2)  # 2 steps of 2 ranks x 2 images
    out = train(1, images, run, "--phema_stds", "0.05,0.1", "--phema_interval", 1,
                "--save_interval", 1, "--max_steps", 5)
    assert resumed_step(out) == 2 and "world size 2 -> 1" in out, out[-3000:]
    for std in STDS:
        before = load(run / f"phema_{std}_000002.pt")
        assert before["nimg"] == 8
        for step in (3, 4, 5):
            snap = load(run / f"phema_{std}_{step:06d}.pt")
            model = load(run / f"model{step:06d}.pt")["state_dict"]
            assert snap["nimg"] == 8 + 2 * (step - 2)  # images seen, whatever the world size
            # EDM2's update with the beta of the images seen and this step's global batch
            weight = 1 - float(phema.power_function_beta(float(std), snap["nimg"], 2))
            for name in snap["param_names"]:
                want = th.lerp(before["state_dict"][name], model[name], weight)
                assert th.equal(snap["state_dict"][name], want), (std, step, name)
            before = snap


# ---------------------------------------------------------------------------------------------
# in one process


def tiny_loop(log_dir, **kw):
    """A TrainLoop of the tiny model in this process, on fixed random batches."""
    flags = dict(model_and_diffusion_defaults(), **TINY_FLAGS)
    flags.update(kw.pop("model_flags", {}))
    train_util.seed_rngs(0)
    model, diffusion = create_model_and_diffusion(**flags)
    gen = th.Generator().manual_seed(1)
    batches = iter(lambda: (th.randn(2, 3, 8, 8, generator=gen), {}), None)
    settings = dict(save_interval=2, async_save=False, phema_stds="0.05,0.1")
    settings.update(kw)
    return train_util.TrainLoop(
        model=model, diffusion=diffusion, data=batches, batch_size=2, microbatch=-1, lr=1e-3,
        ema_rate="0.99", log_interval=100, resume_checkpoint="", log_dir=str(log_dir),
        model_flags=flags, **settings)


@pytest.fixture
def log(tmp_path):
    with logger.scoped_configure(dir=str(tmp_path), format_strs=["log"], rank=0):
        yield tmp_path


def test_phema_flags_are_checked_before_anything_runs():
    def config(**kw):
        return train_util.TrainConfig.from_flags(dict({"log_dir": "x"}, **kw))

    assert config(phema_stds="0.1,0.05").phema_std_list == [0.05, 0.1]
    assert config(phema_stds="0.05", save_interval=100, phema_interval=300).phema_every == 300
    assert config(phema_stds="0.05", save_interval=100).phema_every == 100
    bad = [
        (dict(phema_stds="0.05,x"), "--phema_stds 0.05,x: 'x' is not a number"),
        (dict(phema_stds="0.3"), "--phema_stds 0.3: a relative width must lie strictly between"),
        (dict(phema_stds="0.05", save_interval=100, phema_interval=150),
         "--phema_interval 150: snapshots are written with a step's save, so it must be a "
         "multiple of --save_interval 100 (e.g. 200), or 0 for every save"),
        (dict(phema_stds="0.05", save_interval=0, phema_interval=10),
         "--save_interval 0 saves only at the end"),
        (dict(phema_interval=10), "--phema_interval 10: no post-hoc EMA to snapshot; give "
                                  "--phema_stds"),
        (dict(phema_stds="0.05", phema_interval=-1), "--phema_interval must be >= 0"),
    ]
    for flags, message in bad:
        with pytest.raises(UsageError) as e:
            config(**flags)
        assert message in str(e.value), (flags, str(e.value))


def test_async_and_sync_saves_write_the_same_snapshot_bytes_and_the_doctor_shows_the_tracker(
        log):
    for mode in (True, False):
        (log / str(mode)).mkdir()
        assert tiny_loop(log / str(mode), async_save=mode, max_steps=3).run_loop() == 0
    a, s = log / "True", log / "False"
    assert snapshots(a) == [f"phema_{x}_{k:06d}.pt" for x in STDS for k in (2, 3)]  # 3: the end
    assert sorted(os.listdir(a)) == sorted(os.listdir(s))
    for step in (2, 3):
        ma, ms = (json.loads((d / f"manifest{step:06d}.json").read_text()) for d in (a, s))
        assert ma["files"] == ms["files"] and f"phema_0.050_{step:06d}.pt" in ma["files"]
        for name in files_of(a, step):
            assert (a / name).read_bytes() == (s / name).read_bytes(), name
    out = io.StringIO()  # the doctor shows the tracker an opt file holds
    assert ckpt_main(["inspect", str(a / "opt000003.pt")], out=out, err=io.StringIO()) == 0
    assert "phema_stds=0.050,0.100 phema_nimg=6" in out.getvalue(), out.getvalue()


def test_a_non_finite_post_hoc_ema_is_never_saved(log):
    loop = tiny_loop(log, max_steps=3)
    loop.run_step(*next(loop.data))
    loop.phema.tracker.emas[1][0][0] = float("nan")  # std 0.100, one tensor
    with pytest.raises(NonFiniteError) as e:
        loop.save(wait=True)
    assert "step 1: not saved: the weights hold non-finite values (post-hoc EMA 0.100: 1 " \
           "tensor(s)); no step was saved before" in str(e.value)
    assert not [n for n in os.listdir(log) if C.name_info(n) is not None]


def test_a_resume_of_a_run_trained_without_phema_stds_is_refused_and_changes_nothing(log):
    run = log / "run"
    run.mkdir()
    assert tiny_loop(run, phema_stds="", max_steps=2).run_loop() == 0
    before = sorted(os.listdir(run))
    with pytest.raises(phema.PhemaStateError) as e:
        tiny_loop(run, max_steps=4)
    assert str(e.value) == (
        "--phema_stds 0.050,0.100: the checkpoint of step 2 holds no post-hoc EMA state (trained "
        "without --phema_stds), and a power-function EMA averages over the run from its first "
        "image; resume without --phema_stds, or give it from a run's first step (a new "
        "--log_dir)")
    assert sorted(os.listdir(run)) == before


def test_a_resume_with_other_stds_or_without_them_says_so(log):
    run = log / "run"
    run.mkdir()
    assert tiny_loop(run, max_steps=2).run_loop() == 0
    with pytest.raises(phema.PhemaStateError, match=r"resume with --phema_stds 0.050,0.100"):
        tiny_loop(run, phema_stds="0.07", max_steps=4)
    loop = tiny_loop(run, phema_stds="", max_steps=4)
    assert loop.step == 2 and loop.run_loop() == 0 and not os.path.exists(
        run / "phema_0.050_000004.pt")
    assert "resume: the checkpoint holds phema state, which this run does not use" in (
        log / "log.txt").read_text()


def test_a_model_change_with_phema_stds_is_refused_in_one_line(log):
    run = log / "run"
    run.mkdir()
    assert tiny_loop(run, max_steps=2).run_loop() == 0
    before = sorted(os.listdir(run))
    with pytest.raises(phema.PhemaStateError) as e:
        tiny_loop(run, max_steps=4, allow_model_change=True, model_flags={"learn_sigma": True})
    assert str(e.value) == (
        "--allow_model_change with --phema_stds: the model changed at step 2, and post-hoc EMA "
        "snapshots of two models cannot be combined; resume without --phema_stds (the snapshots "
        "so far stay for `ckpt.py phema`), or train the new model in a new --log_dir")
    assert sorted(os.listdir(run)) == before


# ------------------------------------------------------------- ckpt.py phema after a crash


@pytest.mark.timeout(200)
def test_phema_right_after_a_kill_in_a_snapshot_write_uses_the_last_complete_step(
        tmp_path, images):
    """kill -9 while the second snapshot of a step is written (the first is in place, no
    manifest): ``ckpt.py phema`` run right then, as users do after a job died, reconstructs at
    the last complete step, from snapshots their manifests list, and names the step it left
    out in one warning line (before: it took the lone renamed snapshot of the half-saved step
    as its target)."""
    import signal
    import subprocess
    import time

    from conftest import PY, REPO, child_env

    log_dir = tmp_path / "run"
    cmd = [PY, REPO / "tests" / "slow_save_train.py", *TINY, "--data_dir", images, "--log_dir",
           log_dir, "--phema_stds", "0.05,0.1", "--save_interval", "2", "--max_steps", "1000",
           "--async_save", "False"]
    env = child_env({"SLOW_SAVE_S": "0.4", "SLOW_SAVE_STEP": "6"})  # steps 2 and 4 at once
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        first, second = log_dir / "phema_0.050_000006.pt", log_dir / "phema_0.100_000006.pt"
        deadline = time.monotonic() + hang_s(150)
        while not first.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no save of step 6"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert first.exists() and not second.exists()
    assert not (log_dir / "manifest000006.json").exists()
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main(["phema", str(log_dir), "--std", "0.07", "--out", str(tmp_path / "x.pt"),
                      "--json"], out=out, err=err)
    assert code == 0, err.getvalue()
    rep = json.loads(out.getvalue())
    assert rep["step"] == 4 and all(not n.endswith("000006.pt") for n in rep["inputs"])
    assert err.getvalue().splitlines() == [
        "warning: post-hoc EMA snapshots: step 6 left out: no manifest (the save was "
        "interrupted before it completed)"]
    made = load(tmp_path / "x.pt")
    assert made["step"] == 4 and sorted(rep["inputs"]) == [
        f"phema_{std}_{step:06d}.pt" for std in STDS for step in (2, 4)]
