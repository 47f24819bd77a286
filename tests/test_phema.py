"""Post-hoc EMA (EDM2): the math and the tracker against NVlabs/edm2's own numbers, the snapshot
files in a run directory (named, listed, verified, never pruned), and `ckpt.py phema`'s
reconstruction, streamed over the files, into an EMA file that sample.py takes as it is."""
import gc
import io
import json
import os
import re
import weakref
import zipfile

import numpy as np
import pytest
import torch as th

from conftest import FIXTURES, run_script_here
from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion.ckpt import file_writer as W
from improved_diffusion import phema as P
from improved_diffusion.ckpt import run_dir as R
from improved_diffusion.apps.ckpt_tool import main as ckpt_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REF = th.load(FIXTURES / "phema_reference.pt", weights_only=True)
TINY_FLAGS = {"model": "Linear(8, 2, bias=False)"}
CASES = ["edm2_8snap", "unit_time_8snap", "tiny_800", "edm2_mid_6of8", "edm2_single_std0.05",
         "edm2_target_is_input"]


def npy(t):
    return t.numpy() if isinstance(t, th.Tensor) else t


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main([str(a) for a in argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# the math, against EDM2's outputs


def test_std_and_exponent_conversions_match_edm2():
    assert np.array_equal(P.std_to_exp(npy(REF["stds"])), npy(REF["std_to_exp"]))
    assert np.array_equal(P.exp_to_std(npy(REF["exps"])), npy(REF["exp_to_std"]))
    assert np.array_equal(P.exp_to_std(P.std_to_exp(npy(REF["stds"]))),
                          npy(REF["exp_to_std_of_std_to_exp"]))
    assert P.std_to_exp(0.05).shape == () and P.std_to_exp([[0.05, 0.1]]).shape == (1, 2)


@pytest.mark.parametrize("std", ["0.050", "0.070", "0.100"])
def test_per_step_betas_match_edm2_to_one_ulp(std):
    beta = P.power_function_beta(float(std), npy(REF["beta_t_next"]), npy(REF["beta_t_delta"]))
    assert beta.dtype == np.float64
    # numpy's float64 power is its SIMD kernel on a CPU with AVX-512 and libm's elsewhere: the
    # two round a few results one ulp apart (seen: an AMD EPYC with AVX2 only against the
    # machine that made the reference), so one ulp, not bit for bit.
    np.testing.assert_array_max_ulp(beta, npy(REF[f"beta_std{std}"]), maxulp=1)
    assert beta[0] == 0.0  # the first step (t_delta == t_next) takes the weights as they are


def test_responses_and_correlations_match_edm2():
    resp = P.power_function_response(npy(REF["response_ofs"]), npy(REF["response_std"]), 25)
    np.testing.assert_allclose(resp, npy(REF["response_len25"]), rtol=1e-13, atol=0)
    pairs = npy(REF["correlation_pairs"])
    corr = P.power_function_correlation(pairs[:, 0], pairs[:, 1], pairs[:, 2], pairs[:, 3])
    np.testing.assert_allclose(corr, npy(REF["correlation"]), rtol=1e-13, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_posthoc_coefficients_match_edm2_in_all_six_cases(case):
    c = REF["coefficients"][case]
    args = (npy(c["in_ofs"]), npy(c["in_std"]), c["out_ofs"], npy(c["out_std"]))
    coefs = P.solve_posthoc_coefficients(*args)
    assert coefs.dtype == np.float64 and coefs.shape == tuple(c["coefs"].shape)
    np.testing.assert_allclose(coefs, npy(c["coefs"]), rtol=0, atol=1e-13)
    np.testing.assert_allclose(coefs.sum(axis=0), 1.0, rtol=0, atol=1e-13)
    if "A" in c:
        a, b, _ = P._gram(*args)
        np.testing.assert_allclose(a, npy(c["A"]), rtol=1e-14, atol=0)
        np.testing.assert_allclose(b, npy(c["B"]), rtol=1e-14, atol=0)


def test_profile_error_is_nil_for_a_snapshot_and_grows_away_from_the_snapshot_stds():
    c = REF["coefficients"]["edm2_8snap"]
    ins = (npy(c["in_ofs"]), npy(c["in_std"]), c["out_ofs"])
    err = {s: float(P.profile_error(*ins, s, P.solve_posthoc_coefficients(*ins, s))[0])
           for s in (0.005, 0.03, 0.05, 0.07, 0.12, 0.28)}
    assert err[0.05] < 1e-6                              # a snapshot's own profile: exact
    assert err[0.07] < 0.02 and err[0.12] < 0.02         # between/near the snapshot stds
    assert err[0.005] > err[0.03] > err[0.07] and err[0.28] > err[0.12]
    assert err[0.005] > P.MAX_PROFILE_ERROR and err[0.28] > P.MAX_PROFILE_ERROR


# ---------------------------------------------------------------------------------------------
# the tracker, on EDM2's tiny end-to-end run


def _tiny_loop(dtype, upto=800, tracker=None, direct=None, start=0, on_snapshot=None):
    """EDM2's training_loop on the reference's weights tiny_w (batch 1, so images == steps): a
    snapshot at every 100 images (0 included), then the step, then update(cur_nimg, 1)."""
    w = REF["tiny_w"].to(dtype)
    lin = th.nn.Linear(8, 2, bias=False).to(dtype)
    with th.no_grad():
        lin.weight.copy_(w[start])
    tracker = tracker or P.PowerFunctionEMA(lin.named_parameters(), [0.05, 0.10])
    direct = direct or P.PowerFunctionEMA(lin.named_parameters(), [0.07])
    snaps = []
    for k in range(start, upto + 1):
        if k % 100 == 0:
            snaps += [ema[0].clone() for ema in tracker.emas]
            if on_snapshot is not None:
                on_snapshot(k, tracker, lin)
        if k == upto:
            break
        with th.no_grad():
            lin.weight.copy_(w[k + 1])
        tracker.update(lin.parameters(), k + 1, 1)
        direct.update(list(lin.parameters()), k + 1, 1)
    return tracker, direct, snaps


@pytest.mark.parametrize("dtype", [th.float32, th.float64], ids=["float32", "float64"])
def test_the_tracker_reproduces_edm2s_snapshots_and_direct_ema_bit_for_bit(dtype):
    name = str(dtype).replace("torch.", "")
    tracker, direct, snaps = _tiny_loop(dtype)
    assert th.equal(th.stack(snaps), REF[f"tiny_snapshots_{name}"])
    assert th.equal(direct.emas[0][0], REF[f"tiny_direct_ema_std0.070_{name}"])
    assert tracker.nimg == 800


def test_a_resume_from_the_saved_state_continues_bit_for_bit(tmp_path):
    first, direct, snaps = _tiny_loop(th.float32, upto=400)
    buf = io.BytesIO()
    th.save({"t": first.state_dict(), "d": direct.state_dict()}, buf)
    saved = th.load(io.BytesIO(buf.getvalue()), weights_only=True)
    # a new process: fresh trackers over other initial weights, then the saved state
    lin = th.nn.Linear(8, 2, bias=False)
    resumed = P.PowerFunctionEMA(lin.named_parameters(), [0.10, 0.05])  # order does not matter
    again = P.PowerFunctionEMA(lin.named_parameters(), [0.07])
    resumed.load_state_dict(saved["t"])
    again.load_state_dict(saved["d"])
    assert resumed.nimg == 400
    resumed, again, later = _tiny_loop(th.float32, start=400, tracker=resumed, direct=again)
    assert th.equal(again.emas[0][0], REF["tiny_direct_ema_std0.070_float32"])
    ref = REF["tiny_snapshots_float32"]  # images 0, 0, 100, 100, ... of stds 0.05, 0.10
    assert th.equal(th.stack(later[0::2]), ref[9::2]) and th.equal(th.stack(later[1::2]), ref[8::2])


def test_an_elastic_resume_with_another_global_batch_keeps_the_power_function_profile():
    """The beta follows images seen, not steps or ranks: weights that grow linearly with the
    images (w = images at the step's middle) average to EDM2's continuous profile mean
    t (exp + 1) / (exp + 2), the same with 4 images a step throughout or with 16 after a resume
    (4x the ranks), and the resumed run equals one that changed its batch without stopping."""
    def steps(tracker, p, batches, seen=0):
        for b in batches:
            seen += b
            p.fill_(seen - b / 2)
            tracker.update([p], seen, b)
        return seen

    p = th.zeros(1, dtype=th.float64)
    whole = P.PowerFunctionEMA([("w", p)], [0.05, 0.10])
    steps(whole, p, [4] * 1000 + [16] * 250)
    first = P.PowerFunctionEMA([("w", p)], [0.05, 0.10])
    steps(first, p, [4] * 1000)
    buf = io.BytesIO()
    th.save(first.state_dict(), buf)
    resumed = P.PowerFunctionEMA([("w", th.zeros(1, dtype=th.float64))], [0.05, 0.10])
    resumed.load_state_dict(th.load(io.BytesIO(buf.getvalue()), weights_only=True))
    steps(resumed, p, [16] * 250, seen=4000)
    assert [e[0].item() for e in resumed.emas] == [e[0].item() for e in whole.emas]
    exp = P.std_to_exp(np.float64([0.05, 0.10]))
    np.testing.assert_allclose([e[0].item() for e in resumed.emas], 8000 * (exp + 1) / (exp + 2),
                               rtol=2e-5)


def test_one_steps_snapshots_hold_the_whole_tracker_state():
    payloads = {}

    def keep(k, tracker, lin):
        if k == 300:
            payloads.update(tracker.snapshot_payloads(k, TINY_FLAGS, lin.state_dict()))
            payloads.update({n: {**p, "state_dict": {a: t.clone() for a, t in
                                                     p["state_dict"].items()}}
                             for n, p in payloads.items()})

    _tiny_loop(th.float64, upto=300, on_snapshot=keep)
    lin = th.nn.Linear(8, 2, bias=False).to(th.float64)
    resumed = P.PowerFunctionEMA(lin.named_parameters(), [0.05, 0.10])
    resumed.load_state_dict(P.state_from_snapshots(payloads.values()))
    _, _, later = _tiny_loop(th.float64, start=300, tracker=resumed)
    assert th.equal(th.stack(later), REF["tiny_snapshots_float64"][6:])


def test_the_tracker_refuses_state_of_other_stds_or_parameters():
    lin = th.nn.Linear(8, 2)
    state = P.PowerFunctionEMA(lin.named_parameters(), [0.05, 0.10]).state_dict()
    other = P.PowerFunctionEMA(lin.named_parameters(), [0.05, 0.07])
    before = [t.clone() for t in other.emas[0]]
    with pytest.raises(P.PhemaStateError, match=r"tracks stds 0\.050,0\.100 .* --phema_stds "
                                                r"0\.050,0\.100"):
        other.load_state_dict(state)
    assert all(th.equal(a, b) for a, b in zip(before, other.emas[0]))  # nothing changed
    fewer = P.PowerFunctionEMA([("weight", lin.weight)], [0.05, 0.10])
    with pytest.raises(P.PhemaStateError, match=r"other parameters \(0 missing.*1 unexpected"):
        fewer.load_state_dict(state)
    with pytest.raises(ValueError, match="growing total"):
        other.update(lin.parameters(), 0, 1)


# ---------------------------------------------------------------------------------------------
# snapshot files in a run directory


def test_snapshot_names_are_a_kind_of_their_own():
    assert C.phema_filename(0.05, 12000) == "phema_0.050_012000.pt"
    info = C.name_info("runs/a/phema_0.050_012000.pt")
    assert (info.kind, info.step, info.std_str) == ("phema", 12000, "0.050")
    assert C.slot_of("phema_0.100_000007.pt") == "phema"
    assert C.parse_step("phema_0.100_000007.pt") == 7
    assert C.name_info("phema_0.05x_000007.pt") is None
    assert C.posthoc_ema_filename(0.07, 800) == "ema_phema0.070_000800.pt"
    assert C.name_info("ema_phema0.070_000800.pt").kind == "ema"


def test_a_snapshot_file_carries_its_std_images_flags_and_the_models_buffers(tmp_path):
    model = th.nn.Sequential(th.nn.Linear(3, 4), th.nn.BatchNorm1d(4))
    tracker = P.PowerFunctionEMA(model.named_parameters(), [0.05, 0.1])
    model(th.randn(5, 3))  # moves the BatchNorm statistics
    with th.no_grad():
        model[0].weight.add_(1.0)
    tracker.update(model.parameters(), 96, 32)  # e.g. the 3rd step of a global batch of 32
    files = tracker.snapshot_payloads(3, TINY_FLAGS, model.state_dict())
    assert list(files) == ["phema_0.050_000003.pt", "phema_0.100_000003.pt"]
    R.write_step(str(tmp_path), 3, files)
    manifest = json.loads((tmp_path / "manifest000003.json").read_text())
    assert sorted(manifest["files"]) == sorted(files)
    c = C.load_file(tmp_path / "phema_0.050_000003.pt")
    assert (c.kind, c.tagged, c.step, c.std, c.nimg, c.flags) == (
        "phema", True, 3, 0.05, 96, TINY_FLAGS)
    assert c.param_names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    beta = P.power_function_beta(0.05, 96, 32)
    assert th.allclose(c.state_dict["0.weight"], model[0].weight - beta * 1.0)
    assert th.equal(c.state_dict["1.running_mean"], model[1].running_mean)  # a buffer, as is
    assert C.peek_file(tmp_path / "phema_0.050_000003.pt").nimg == 96


def _steps_with_snapshots(d, steps):
    """Complete steps (model + snapshots + manifest) written as a loop would."""
    lin = th.nn.Linear(8, 2, bias=False)
    tracker = P.PowerFunctionEMA(lin.named_parameters(), [0.05, 0.10])
    os.makedirs(d, exist_ok=True)
    for s in steps:
        tracker.update(lin.parameters(), 4 * s, 4)
        files = {C.model_filename(s): C.model_payload(s, lin.state_dict(), TINY_FLAGS)}
        files.update(tracker.snapshot_payloads(s, TINY_FLAGS, lin.state_dict()))
        R.save_step(d, s, files)


def test_pruning_keeps_every_snapshot_unless_asked_and_kept_ones_are_no_step(tmp_path):
    d = str(tmp_path / "run")
    _steps_with_snapshots(d, [1, 2, 3, 4])
    R.prune(d, 2)
    names = sorted(os.listdir(d))
    assert [n for n in names if n.startswith("model")] == ["model000003.pt", "model000004.pt"]
    assert len([n for n in names if n.startswith("phema_")]) == 8
    assert [st.step for st in R.list_steps(d)] == [4, 3]  # pruned steps' snapshots are no step
    assert [(s.step, s.std_str) for s in R.list_snapshots(d)][:3] == [
        (1, "0.050"), (1, "0.100"), (2, "0.050")]
    code, out, _ = cli("verify", d)
    assert code == 0, out
    assert "snapshots: 8 post-hoc EMA snapshot(s), stds 0.050, 0.100, at 4 step(s) 1..4 (4 of " \
           "pruned steps" in out
    code, out, _ = cli("convert", d, "--to", "raw", "--out", tmp_path / "raw")
    assert code == 0 and "phema_0.050_000004.pt: post-hoc EMA snapshot skipped" in out
    code, out, _ = cli("prune", d, "--keep", "1")
    assert code == 0 and "8 post-hoc EMA snapshot(s) kept" in out
    code, out, _ = cli("prune", d, "--keep", "1", "--delete_snapshots")
    assert code == 0
    assert sorted(os.listdir(d)) == ["manifest000004.json", "model000004.pt",
                                     "phema_0.050_000004.pt", "phema_0.100_000004.pt"]


def test_an_interrupted_save_of_snapshots_only_is_set_aside_by_the_resume(tmp_path):
    d = str(tmp_path)
    _steps_with_snapshots(d, [1, 2])
    lin = th.nn.Linear(8, 2, bias=False)
    tracker = P.PowerFunctionEMA(lin.named_parameters(), [0.05])
    tracker.update(lin.parameters(), 12, 4)
    name, payload = next(iter(tracker.snapshot_payloads(3, TINY_FLAGS, lin.state_dict()).items()))
    W.atomic_write(os.path.join(d, name), payload)  # the save died after its first file
    plan = R.plan_resume(d)
    assert plan.step == 2 and plan.newer_than(2) == [3]
    R.tidy_for_resume(plan, 2)
    assert os.path.exists(os.path.join(d, "incomplete", "step000003", name))
    assert not os.path.exists(os.path.join(d, name))  # the resumed run can write step 3 again


def test_inspect_knows_snapshots_and_their_name_mistakes(tmp_path):
    d = str(tmp_path)
    _steps_with_snapshots(d, [5])
    code, out, _ = cli("inspect", os.path.join(d, "phema_0.100_000005.pt"))
    assert code == 0, out
    assert "kind        phema, tagged" in out and "std 0.1, 20 images seen" in out
    assert "flags       --model" in out
    os.rename(os.path.join(d, "phema_0.100_000005.pt"), os.path.join(d, "phema_0.200_000005.pt"))
    code, out, _ = cli("inspect", os.path.join(d, "phema_0.200_000005.pt"))
    assert code == 1 and "file name says std 0.200 but the file holds std 0.1" in out


# ---------------------------------------------------------------------------------------------
# reconstruction: ckpt.py phema


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """EDM2's tiny run in float32 and float64, its snapshots written as complete steps."""
    runs = {}
    for dtype in (th.float32, th.float64):
        d = tmp_path_factory.mktemp(str(dtype).replace("torch.", ""))

        def save(k, tracker, lin, d=d):
            files = {C.model_filename(k): C.model_payload(k, lin.state_dict(), TINY_FLAGS)}
            files.update(tracker.snapshot_payloads(k, TINY_FLAGS, lin.state_dict()))
            R.save_step(str(d), k, files)

        _tiny_loop(dtype, on_snapshot=save)
        runs[dtype] = str(d)
    return runs


def test_the_reconstruction_from_snapshot_files_equals_edm2s(tiny_runs, tmp_path):
    out = tmp_path / "ema07.pt"
    code, text, err = cli("phema", tiny_runs[th.float64], "--std", "0.07", "--out", out)
    assert code == 0, err
    assert f"wrote {out}: std 0.070 at step 800 (800 images) from 16 snapshots" in text
    c = C.load_file(out)
    assert (c.kind, c.step, c.flags, c.rate_str) == ("ema", 800, TINY_FLAGS, "phema0.070")
    np.testing.assert_allclose(npy(c.state_dict["weight"]), npy(REF["tiny_reconstructed_float64"]),
                               rtol=0, atol=1e-13)
    coefs = [coef for _, coef in c.raw["phema"]["inputs"]]
    np.testing.assert_allclose(coefs, npy(REF["tiny_coefs"])[:, 0], rtol=0, atol=1e-13)
    code, text, _ = cli("inspect", out)
    assert code == 0 and "ema rate    phema0.070" in text
    assert re.search(r"phema +reconstructed post hoc: std 0\.07 at 800 images from 16 snapshots "
                     r"\(profile error 1\.3%\)", text), text
    # float32 snapshots: float32 sums, within float32 rounding of the float64 reconstruction
    code, _, err = cli("phema", tiny_runs[th.float32], "--std", "0.07", "--out", tmp_path / "f32")
    assert code == 0, err
    w32 = C.load_file(tmp_path / "f32" / "ema_phema0.070_000800.pt").state_dict["weight"]
    assert w32.dtype == th.float32
    np.testing.assert_allclose(npy(w32.double()), npy(REF["tiny_reconstructed_float64"]),
                               rtol=0, atol=1e-6)
    direct = REF["tiny_direct_ema_std0.070_float32"]
    assert (w32 - direct).abs().max() < 5e-3  # reconstructed vs tracked directly (EDM2: 4.5e-3)


def test_several_stds_at_an_earlier_step_each_solve_over_the_snapshots_up_to_it(tiny_runs,
                                                                              tmp_path):
    run = tiny_runs[th.float64]
    code, text, err = cli("phema", run, "--std", "0.07", "--std", "0.05,0.12", "--step", "600",
                          "--out", tmp_path / "o", "--json")
    assert code == 0, err
    rep = json.loads(text)
    assert rep["step"] == 600 and len(rep["inputs"]) == 12
    assert [w["std"] for w in rep["written"]] == [0.05, 0.07, 0.12]
    snaps = npy(REF["tiny_snapshots_float64"])[2:14]  # images 100..600
    nimg, stds = npy(REF["tiny_snapshot_nimg"])[2:14], npy(REF["tiny_snapshot_std"])[2:14]
    coefs = P.solve_posthoc_coefficients(nimg, stds, 600, [0.05, 0.07, 0.12])
    for j, std in enumerate(["0.050", "0.070", "0.120"]):
        got = C.load_file(tmp_path / "o" / f"ema_phema{std}_000600.pt").state_dict["weight"]
        np.testing.assert_allclose(npy(got), np.einsum("i,ikl->kl", coefs[:, j], snaps),
                                   rtol=0, atol=1e-13)
    # the snapshot's own std at a snapshot step is that snapshot
    same = C.load_file(tmp_path / "o" / "ema_phema0.050_000600.pt").state_dict["weight"]
    np.testing.assert_allclose(npy(same), snaps[-2], rtol=0, atol=1e-9)


def test_the_reconstruction_holds_one_snapshot_at_a_time(tiny_runs, tmp_path, monkeypatch,
                                                         request):
    """Memory by construction: when a snapshot is loaded, no earlier one is still alive; with
    --batch 1 the files are read once per std, with --batch 3 once, to the same bytes."""
    alive, loads, most = [], [], [0]
    real = P._load_snapshot

    def counting(path):
        gc.collect()
        most[0] = max(most[0], sum(r() is not None for r in alive))
        c = real(path)
        alive.append(weakref.ref(c.state_dict["weight"]))
        loads.append(os.path.basename(path))
        return c

    monkeypatch.setattr(P, "_load_snapshot", counting)
    gc.collect()
    gc.freeze()  # the collections above then walk only what the reconstruction made, not torch
    request.addfinalizer(gc.unfreeze)
    run = tiny_runs[th.float32]
    assert cli("phema", run, "--std", "0.05,0.07,0.1", "--out", tmp_path / "one")[0] == 0
    assert most[0] == 0 and len(loads) == 3 * 16
    loads.clear()
    assert cli("phema", run, "--std", "0.05,0.07,0.1", "--out", tmp_path / "all",
               "--batch", "3")[0] == 0
    assert most[0] == 0 and len(loads) == 16
    for name in os.listdir(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() != b""
        a = C.load_file(tmp_path / "one" / name).state_dict
        b = C.load_file(tmp_path / "all" / name).state_dict
        assert th.equal(a["weight"], b["weight"])


def test_bad_input_is_one_line_naming_the_flag_or_file(tiny_runs, tmp_path):
    run = tiny_runs[th.float32]
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ((empty, "--std", "0.07", "--out", tmp_path / "x.pt"), 1,
         rf"^error: {empty}: no post-hoc EMA snapshots \(phema_STD_STEP\.pt files\) .*"
         r"--phema_stds\n$"),
        ((run, "--std", "0.07", "--step", "-5", "--out", tmp_path / "x.pt"), 1,
         r"^error: --step -5: before the first snapshot in .* \(step 0\); give a step with "
         r"snapshots: 0, 100, 200"),
        ((run, "--std", "0.07", "--step", "150", "--out", tmp_path / "x.pt"), 1,
         r"^error: --step 150: .* has no snapshots at that step; give a step with snapshots: "
         r"0, 100, 200, 300, 400, 500, \.\.\. 800\n$"),
        ((run, "--std", "0.07", "--step", "0", "--out", tmp_path / "x.pt"), 1,
         r"^error: --step 0: the snapshots up to that step hold no training yet"),
        ((run, "--std", "0.3", "--out", tmp_path / "x.pt"), 2,
         r"^error: --std 0\.3: a relative width must lie strictly between 0 and 0\.289"),
        ((run, "--std", "0.005", "--out", tmp_path / "x.pt"), 1,
         r"^error: --std 0\.005: the snapshots in .* \(stds 0\.050, 0\.100, 16 up to step 800\) "
         r"cannot represent it \(its reconstructed profile is \d+% off"),
        ((run, "--std", "0.05,0.1", "--out", tmp_path / "x.pt"), 2,
         r"^error: --out .*x\.pt: 2 --std values need a directory"),
        ((run, "--std", "0.07", "--out", run), 2,
         r"^error: --out .*: inside the run directory"),
        ((run, "--std", "0.07", "--out", os.path.join(run, "model000800.pt")), 2,
         r"^error: --out .*: inside the run directory"),
    ]
    for argv, code, pattern in cases:
        got, out, err = cli("phema", *argv)
        assert (got, out) == (code, ""), (argv, err)
        assert len(err.splitlines()) == 1 and re.search(pattern, err), (argv, err)
    assert not (tmp_path / "x.pt").exists()
    (tmp_path / "x.pt").write_bytes(b"mine")
    got, _, err = cli("phema", run, "--std", "0.07", "--out", tmp_path / "x.pt")
    assert got == 1 and "x.pt: already exists; refusing to overwrite" in err
    assert (tmp_path / "x.pt").read_bytes() == b"mine"


def _flip_bits_in_the_weights(path):
    """Flip 8 bits inside the first tensor record of a torch zip file (its tags still read)."""
    with zipfile.ZipFile(path) as z:
        rec = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(open(path, "rb").read())
    start = rec.header_offset + 30 + int.from_bytes(raw[rec.header_offset + 26:
                                                        rec.header_offset + 28], "little") \
        + int.from_bytes(raw[rec.header_offset + 28:rec.header_offset + 30], "little")
    raw[start + 5] ^= 0xFF
    open(path, "wb").write(bytes(raw))


def test_a_damaged_snapshot_leaves_its_step_out_named_in_one_warning(tmp_path):
    d = str(tmp_path / "run")
    _steps_with_snapshots(d, [1, 2, 3])
    path = os.path.join(d, "phema_0.100_000002.pt")
    _flip_bits_in_the_weights(path)  # the tags still read
    code, out, err = cli("phema", d, "--std", "0.07,0.08", "--out", tmp_path / "out", "--json")
    # its step's manifest no longer verifies it: the step is left out, named in one line, and
    # the others make the reconstruction
    assert code == 0, err
    assert err.splitlines() == ["warning: post-hoc EMA snapshots: step 2 left out: "
                                "phema_0.100_000002.pt does not match its checksum in the "
                                "manifest"]
    rep = json.loads(out)
    assert rep["left_out"] == [{"step": 2, "why": "phema_0.100_000002.pt does not match its "
                                                  "checksum in the manifest"}]
    assert not any(name.endswith("000002.pt") for name in rep["inputs"]), rep["inputs"]
    assert len(os.listdir(tmp_path / "out")) == 2


def test_a_snapshot_of_another_model_shape_is_named(tmp_path):
    d = str(tmp_path / "run")
    _steps_with_snapshots(d, [1, 2])
    wide = th.nn.Linear(8, 3, bias=False)
    tracker = P.PowerFunctionEMA(wide.named_parameters(), [0.05, 0.10])
    tracker.update(wide.parameters(), 12, 4)
    R.save_step(d, 3, tracker.snapshot_payloads(3, TINY_FLAGS, wide.state_dict()))
    code, _, err = cli("phema", d, "--std", "0.07", "--out", tmp_path / "x.pt")
    assert code == 1
    assert "phema_0.050_000001.pt: its weights differ from those of phema_0.100_000003.pt (1 " \
           "key(s), e.g. weight): the model changed during the run; reconstruct with --step " \
           "before the change" in err


@pytest.mark.timeout(180)
def test_sample_py_samples_from_a_reconstructed_file(tmp_path, capsys):
    from improved_diffusion import script_util as su

    flags = su.model_and_diffusion_defaults()
    flags.update(image_size=8, num_channels=32, num_res_blocks=1, channel_mult="1,2",
                 attention_resolutions="", diffusion_steps=20, noise_schedule="cosine")
    th.manual_seed(0)
    model, _ = su.create_model_and_diffusion(**flags)
    tracker = P.PowerFunctionEMA(model.named_parameters(), [0.05, 0.10])
    run = str(tmp_path / "run")
    os.makedirs(run)
    for step in (1, 2, 3, 4):  # "training": the weights drift a little each step
        with th.no_grad():
            for p in model.parameters():
                p.add_(0.01 * th.randn_like(p))
        tracker.update(model.parameters(), 2 * step, 2)
        files = {C.model_filename(step): C.model_payload(step, model.state_dict(), flags)}
        files.update(tracker.snapshot_payloads(step, flags, model.state_dict()))
        R.save_step(run, step, files)
    code, _, err = cli("phema", run, "--std", "0.08", "--out", tmp_path / "rec")
    assert code == 0, err
    ema = tmp_path / "rec" / "ema_phema0.080_000004.pt"
    code, out = run_script_here("sample.py", "--model_path", ema, "--log_dir", tmp_path / "s",
                                "--num_samples", "2", "--batch_size", "2",
                                "--timestep_respacing", "3", capsys=capsys)  # in this process
    assert code == 0, out[-3000:]
    assert "ema weights at step 4, flags stored in the file" in out
    with np.load(tmp_path / "s" / "samples_2x8x8x3.npz") as z:
        assert z["arr_0"].shape == (2, 8, 8, 3)


def test_a_snapshot_damaged_after_the_plan_says_to_run_the_reconstruction_again(tmp_path):
    """Issue 29, item 13: the CRC error of a snapshot read by the reconstruction said "resume
    from another step" (a resume's advice)."""
    d = str(tmp_path / "run")
    _steps_with_snapshots(d, [1, 2, 3])
    plan = P.plan_reconstruction(d, [0.07])
    path = os.path.join(d, "phema_0.100_000002.pt")
    _flip_bits_in_the_weights(path)
    with pytest.raises(P.PhemaError) as e:
        list(P.reconstruct(plan))
    assert "CRC mismatch" in str(e.value) and "run the reconstruction again" in str(e.value)
    assert "resume from another step" not in str(e.value)


def test_a_snapshot_its_steps_manifest_does_not_list_leaves_the_step_out(tmp_path):
    """Issue 37, item 22 (a promise): a snapshot beside a complete step that its manifest does not
    list (written after it, or copied in) is no part of that step: the step is left out, named
    in one warning, and the reconstruction is made of the others (ckpt.py phema, in process;
    test_fsdp_parity runs scripts/ckpt.py phema itself)."""
    d = str(tmp_path / "run")
    _steps_with_snapshots(d, [1, 2, 3])
    lin = th.nn.Linear(8, 2, bias=False)
    stray = P.PowerFunctionEMA(lin.named_parameters(), [0.20])
    stray.update(lin.parameters(), 8, 4)
    for name, payload in stray.snapshot_payloads(2, TINY_FLAGS, lin.state_dict()).items():
        W.atomic_write(os.path.join(d, name), payload)
    code, out, err = cli("phema", d, "--std", "0.07", "--out", tmp_path / "out", "--json")
    assert code == 0, err
    assert err.splitlines() == ["warning: post-hoc EMA snapshots: step 2 left out: "
                                "phema_0.200_000002.pt is not in manifest000002.json"]
    rep = json.loads(out)
    assert rep["left_out"] == [{"step": 2, "why": "phema_0.200_000002.pt is not in "
                                                  "manifest000002.json"}]
    assert not any(name.endswith("000002.pt") for name in rep["inputs"]), rep["inputs"]
