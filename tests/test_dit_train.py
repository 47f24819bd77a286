"""DiT through the real scripts (issue 22): a 2-rank DiT run on a latent folder resumes bitwise and
elastically, DiT's own train.py checkpoint ({"model", "ema", "opt", "args"}) resumes by name and
converts back to what DiT's sample.py loads, and sample.py / nll.py / the doctor take a DiT run.

Tiny configs: a 2-block, 32-wide DiT-S/2 on 8x8x4 latents (the flags below).
"""
import argparse
import copy
import io
import json
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import deep_diff, resumed_step, run_mpi, run_script, run_script_here
from improved_diffusion import train_util
from improved_diffusion.apps import ckpt_tool
from improved_diffusion.dit import DiT
from improved_diffusion.script_util import create_gaussian_diffusion

TINY_DIT = ["--arch", "DiT-S/2", "--dit_depth", "2", "--dit_hidden_size", "32",
            "--dit_num_heads", "2", "--image_size", "8", "--in_channels", "4",
            "--learn_sigma", "True", "--class_cond", "True", "--diffusion_steps", "1000",
            "--batch_size", "2", "--log_interval", "1", "--seed", "0", "--save_interval", "1000"]
# The same DiT as DiT's constructor takes it (2 classes: the latent folder's).
TINY_KWARGS = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2,
                   num_heads=2, mlp_ratio=4.0, num_classes=2, learn_sigma=True)
FILES_OF_STEP = ("model{:06d}.pt", "ema_0.9999_{:06d}.pt", "opt{:06d}.pt")


def load_pt(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def train(ranks, data, log_dir, *extra, timeout=120):
    args = [*TINY_DIT, "--data_dir", data, "--log_dir", log_dir, *map(str, extra)]
    if ranks == 1:
        return run_script("train.py", *args, timeout=timeout).stdout
    return run_mpi(ranks, "train.py", *args, timeout=timeout).stdout


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    """A folder of 10 latents [4, 8, 8] of classes "3" and "7" (fast-DiT style .npy files)."""
    d = tmp_path_factory.mktemp("latents")
    rng = np.random.default_rng(0)
    for c in ("3", "7"):
        for i in range(5):
            np.save(d / f"{c}_{i:05d}.npy", rng.standard_normal((4, 8, 8)).astype(np.float32))
    return d


@pytest.fixture(scope="module")
def straight(tmp_path_factory, latents):
    """A straight 2-rank run to step 6 that saved step 3 on the way."""
    d = tmp_path_factory.mktemp("dit2") / "straight"
    train(2, latents, d, "--max_steps", 6, "--save_interval", 3)
    return d


def saved_at_3(straight, run):
    """``run``: a log dir holding only step 3 of the straight run (as a job stopped there)."""
    run.mkdir()
    for name in [p.format(3) for p in FILES_OF_STEP] + ["manifest000003.json"]:
        shutil.copy(straight / name, run / name)
    return run


@pytest.mark.timeout(240)
def test_a_2_rank_dit_run_on_latents_resumed_at_step_3_ends_bitwise_equal_to_a_straight_run(
        tmp_path, latents, straight):
    run = saved_at_3(straight, tmp_path / "run")
    out = train(2, latents, run, "--max_steps", 6, "--resume_checkpoint", run / "model000003.pt")
    assert resumed_step(out) == 3, out[-3000:]
    diffs = []
    for pattern in FILES_OF_STEP:
        name = pattern.format(6)
        diffs += [f"{name}{d}" for d in deep_diff(load_pt(straight / name), load_pt(run / name))]
    assert not diffs, "step-6 files differ (straight vs resumed):\n" + "\n".join(diffs[:30])
    flags = load_pt(run / "model000006.pt")["flags"]
    assert (flags["arch"], flags["in_channels"], flags["dit_depth"]) == ("DiT-S/2", 4, 2)
    # pos_embed, DiT's frozen parameter: in every file, never trained, no Adam moments
    pos_embed = [load_pt(d / f"model00000{s}.pt")["state_dict"]["pos_embed"]
                 for d, s in ((straight, 6), (run, 3))]
    assert torch.equal(*pos_embed)
    opt = load_pt(run / "opt000006.pt")["optimizer"]
    assert "pos_embed" in opt["shapes"] and "pos_embed" not in opt["state"]
    assert float(opt["state"]["x_embedder.proj.weight"]["step"]) == 6


# make soak: the elastic resume is train.py's (test_resume's 2to3, test_phema_train's 2 to 1);
# a DiT's bitwise 2-rank resume and its Adam state by name stay here
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_dit_run_saved_on_2_ranks_resumes_on_1_with_its_optimizer(tmp_path, latents, straight):
    run = saved_at_3(straight, tmp_path / "run")
    out = train(1, latents, run, "--max_steps", 5)
    assert resumed_step(out) == 3, out[-3000:]
    assert re.search(r"world size 2 -> 1, global batch size 4 -> 2", out), out[-3000:]
    assert not re.search(r"(?i)fresh optimi[sz]er", out), out[-3000:]
    trainer = load_pt(run / "opt000005.pt")["trainer"]
    assert (trainer["world_size"], trainer["data"]["position"]) == (1, 3 * 4 + 2 * 2)
    state = load_pt(run / "opt000005.pt")["optimizer"]["state"]
    assert float(state["final_layer.linear.weight"]["step"]) == 5


@pytest.mark.timeout(180)
def test_sample_py_nll_py_and_the_doctor_take_a_dit_run(tmp_path, latents, straight, capsys):
    """In this process, through the scripts' entry points (test_sample launches both)."""
    run = straight
    code, out = run_script_here("sample.py", "--model_path", run / "ema_0.9999_000006.pt",
                                "--log_dir", tmp_path / "s", "--num_samples", "3",
                                "--timestep_respacing", "4", "--clip_denoised", "False",
                                capsys=capsys)
    assert code == 0, out[-3000:]
    z = np.load(tmp_path / "s" / "samples_3x4x8x8.npz")  # latents: float32 NCHW, no grid
    assert z["arr_0"].shape == (3, 4, 8, 8) and z["arr_0"].dtype == np.float32
    assert np.isfinite(z["arr_0"]).all() and z["arr_1"].shape == (3,)
    assert not list((tmp_path / "s").glob("*.png"))
    code, out = run_script_here("nll.py", "--model_path", run / "ema_0.9999_000006.pt",
                                "--data_dir", latents, "--log_dir", tmp_path / "n",
                                "--num_samples", "2", "--timestep_respacing", "4", capsys=capsys)
    assert code == 0, out[-3000:]
    assert re.search(r"done 2 samples: bpd=\d", out), out[-2000:]

    text, err = io.StringIO(), io.StringIO()
    assert ckpt_tool.main(["verify", str(run)], out=text, err=err) == 0, text.getvalue()
    assert ckpt_tool.main(["inspect", str(run / "model000006.pt")], out=text, err=err) == 0
    assert "--arch DiT-S/2" in text.getvalue() and "--in_channels 4" in text.getvalue()


# ---------------------------------------------------------------------------------------------
# DiT's own train.py files


def dit_update_ema(ema_model, model, decay=0.9999):
    """DiT's train.py update_ema: every named parameter, pos_embed included."""
    ema = dict(ema_model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            ema[name].mul_(decay).add_(param.data, alpha=1 - decay)


def write_dit_train_py_checkpoint(results, latents, steps=2, class_dropout_prob=0.0):
    """What DiT's train.py leaves after `steps` steps on `latents` (its loop and its save, with
    the VAE encode skipped: the folder holds latents): results/000-DiT-S-2/checkpoints/
    {steps:07d}.pt = {"model", "ema", "opt", "args": argparse.Namespace}. Returns its path."""
    torch.manual_seed(0)
    model = DiT(class_dropout_prob=class_dropout_prob, **TINY_KWARGS)
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad = False
    diffusion = create_gaussian_diffusion(steps=1000, learn_sigma=True,
                                          rescale_learned_sigmas=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    dit_update_ema(ema, model, decay=0)
    model.train()
    ema.eval()
    files = sorted(latents.glob("*.npy"))
    for step in range(steps):
        batch = files[2 * step: 2 * step + 2]
        x = torch.from_numpy(np.stack([np.load(f) for f in batch]))
        y = torch.tensor([0 if f.name.startswith("3_") else 1 for f in batch])
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],))
        loss = diffusion.training_losses(model, x, t, dict(y=y))["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dit_update_ema(ema, model)
    args = argparse.Namespace(
        data_path=str(latents), results_dir=str(results), model="DiT-S/2", image_size=64,
        num_classes=2, epochs=1, global_batch_size=2, global_seed=0, vae="ema", num_workers=4,
        log_every=100, ckpt_every=steps)
    path = results / "000-DiT-S-2" / "checkpoints" / f"{steps:07d}.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                "args": args}, path)
    return path


def check_resumed_from_the_dit_file(dit_file, run, skip=()):
    """Step 3 of `run` continues DiT's step-2 file: Adam moments at step 3 (resumed by name) and
    the EMA exactly rate * file's EMA + (1 - rate) * the step-3 weights, for every trained
    parameter but those in `skip` (which started fresh); the frozen pos_embed's EMA stays the
    file's."""
    file = torch.load(dit_file, weights_only=False)  # the test's own file: a trusted read
    model3 = load_pt(run / "model000003.pt")["state_dict"]
    ema3 = load_pt(run / "ema_0.9999_000003.pt")["state_dict"]
    names = [n for n in file["ema"] if n not in skip and n != "pos_embed"]
    want = [file["ema"][n].clone() for n in names]
    train_util.update_ema(want, [model3[n] for n in names], rate=0.9999)
    assert [n for n, w in zip(names, want) if not torch.equal(w, ema3[n])] == []
    assert torch.equal(ema3["pos_embed"], file["ema"]["pos_embed"])
    state = load_pt(run / "opt000003.pt")["optimizer"]["state"]
    steps = {n: float(e["step"]) for n, e in state.items()}
    assert "pos_embed" not in steps
    assert {n for n, s in steps.items() if s != 3} == set(skip)
    assert all(steps[n] == 1 for n in skip)  # fresh moments: one step since the resume
    trainer = load_pt(run / "opt000003.pt")["trainer"]
    assert trainer["data"]["position"] == 3 * 2  # step 2 x global batch 2, then one step


@pytest.mark.timeout(180)
def test_dits_own_train_py_checkpoint_resumes_model_ema_and_adam_by_name_at_its_step(
        tmp_path, latents):
    dit_file = write_dit_train_py_checkpoint(tmp_path / "results", latents)
    run = tmp_path / "run"
    out = train(1, latents, run, "--max_steps", 3, "--resume_checkpoint", dit_file)
    assert resumed_step(out) == 2, out[-3000:]
    assert "ema: 0000002.pt[ema]; opt: 0000002.pt" in out, out[-3000:]
    assert "index-keyed torch state dict (upstream): 32 parameters restored, 0 fresh" in out
    assert "args: a pickled argparse.Namespace, read as its 12 fields" in out, out[-3000:]
    check_resumed_from_the_dit_file(dit_file, run)
    text = io.StringIO()
    assert ckpt_tool.main(["inspect", str(dit_file), "--json"], out=text,
                          err=io.StringIO()) == 0
    rep = json.loads(text.getvalue())  # the doctor explains the file
    assert (rep["kind"], rep["step"], rep["args"]["model"]) == ("combined", 2, "DiT-S/2")
    assert (rep["flags"]["arch"], rep["flags"]["image_size"]) == ("DiT-S/2", 8)

    # ... and converts back to what DiT's sample.py loads (find_model: torch.load, then "ema"
    # of a train.py dict, else the state dict itself; strict load_state_dict).
    for src in (dit_file, run):
        dest = tmp_path / f"raw_{src.name}"
        assert ckpt_tool.main(["convert", str(src), "--to", "raw", "--out", str(dest)] + (
            ["--step", "3"] if src == run else []), out=io.StringIO(), err=io.StringIO()) == 0
        for ema_file in dest.glob("ema_0.9999_*.pt"):
            checkpoint = torch.load(ema_file, map_location=lambda storage, loc: storage)
            if "ema" in checkpoint:
                checkpoint = checkpoint["ema"]
            DiT(class_dropout_prob=0.0, **TINY_KWARGS).load_state_dict(checkpoint)
        assert sorted(p.name for p in dest.iterdir())[:2] == [
            "ema_0.9999_{:06d}.pt".format(3 if src == run else 2),
            "model{:06d}.pt".format(3 if src == run else 2)]


@pytest.mark.timeout(180)
def test_dits_default_label_dropout_file_resumes_with_allow_model_change(tmp_path, latents):
    """DiT trains with class_dropout_prob 0.1 (a null-label row); a run without label dropout
    takes every other tensor, EMA and Adam moments of the file, the label table fresh."""
    dit_file = write_dit_train_py_checkpoint(tmp_path / "results", latents,
                                             class_dropout_prob=0.1)
    run = tmp_path / "run"
    out = train(1, latents, run, "--max_steps", 3, "--resume_checkpoint", dit_file,
                "--allow_model_change", "True")
    assert resumed_step(out) == 2, out[-3000:]
    assert re.search(r"reshaped.*y_embedder\.embedding_table\.weight", out), out[-3000:]
    check_resumed_from_the_dit_file(dit_file, run, skip={"y_embedder.embedding_table.weight"})
    change = load_pt(run / "opt000003.pt")["trainer"]["model_changes"]
    assert json.dumps(change).count("y_embedder.embedding_table.weight") >= 1
