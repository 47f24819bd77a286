"""Resume into a changed model (issue 12): train.py --allow_model_change True and ckpt.py adapt.

The matrix goes through the real train.py (tests/model_change_jobs.py runs its jobs one after the
other in one process, dumping each rank's state right after the resume): class_cond off -> on,
learn_sigma off -> on (the output layer's shape changes), an attention resolution added,
num_res_blocks 1 -> 2, and the reverse of each. For each: every kept tensor (model, both EMAs,
Adam moments) equals the file's bit for bit, every new or reshaped one equals a fresh model's
initialisation, the data position, RNG and sampler history are the file's, and training goes on
from the same step, its next save recording the change. The same matrix through `ckpt.py adapt`
gives the same tensors, and a plain strict resume from its output works.
"""
import io
import json
import re

import pytest
import torch as th

from conftest import deep_diff, run_mpi, run_script, write_class_folder, write_images
from improved_diffusion import logger, train_util
from improved_diffusion.apps import ckpt_tool
from improved_diffusion.ckpt import optim_state
from improved_diffusion.infra.errors import UserError
from improved_diffusion.script_util import create_model_and_diffusion

import model_change_jobs

SEED = 3
BASE = [
    "--image_size", "8", "--num_channels", "32", "--channel_mult", "1", "--num_res_blocks", "1",
    "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
    "--batch_size", "2", "--log_interval", "1", "--save_interval", "1", "--ema_rate", "0.9,0.99",
    "--schedule_sampler", "loss-second-moment", "--seed", str(SEED),
]
# transition: (flags that switch it on, flags that switch it back off)
VARIANTS = {
    "class_cond": (["--class_cond", "True", "--num_classes", "3"], ["--class_cond", "False"]),
    "learn_sigma": (["--learn_sigma", "True"], ["--learn_sigma", "False"]),
    "attention": (["--attention_resolutions", "8"], ["--attention_resolutions", ""]),
    "res_blocks": (["--num_res_blocks", "2"], ["--num_res_blocks", "1"]),
}
RATES = ("0.9", "0.99")


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


def adapt(*args):
    """`ckpt.py adapt ARGS` in this process: (exit code, its output: stdout, then stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_tool.main(["adapt", *map(str, args)], out=out, err=err)
    return code, out.getvalue() + err.getvalue()


def flag_text(args):
    return " ".join(a if a else "''" for a in args)


def matrix_jobs(root, names, extra=()):
    """base (1 step) -> each variant on (step 2) -> back off (step 3); and each as adapt targets."""
    data = write_images(root / "data", n=6)
    common = [*BASE, "--data_dir", data, *extra]
    jobs = [("base", [*common, "--log_dir", root / "base", "--max_steps", 1])]
    for v in names:
        on, off = VARIANTS[v]
        jobs.append((f"on_{v}", [*common, *on, "--log_dir", root / f"on_{v}", "--max_steps", 2,
                                 "--resume_checkpoint", root / "base", "--allow_model_change",
                                 "True"]))
        jobs.append((f"off_{v}", [*common, *off, "--log_dir", root / f"off_{v}", "--max_steps",
                                  3, "--resume_checkpoint", root / f"on_{v}",
                                  "--allow_model_change", "True"]))
    return jobs


def fresh_model(flags):
    """The model train.py builds from `flags` (a saved file's "flags"): its initialisation."""
    train_util.seed_rngs(SEED, 0, 0)
    model, _ = create_model_and_diffusion(**flags)
    return model


def check_transition(src, step, dst, dumps, name, ranks=1):
    """Every rank's state after resuming `src` (a log dir, at `step`) into the model of `dst`."""
    src_model = load(src / f"model{step:06d}.pt")["state_dict"]
    src_opt = load(src / f"opt{step:06d}.pt")
    dst_flags = load(dst / f"model{step + 1:06d}.pt")["flags"]
    fresh = fresh_model(dst_flags)
    fresh_sd = fresh.state_dict()
    params = [n for n, _ in fresh.named_parameters()]
    same = {k for k, v in fresh_sd.items() if k in src_model and src_model[k].shape == v.shape}
    assert same and len(same) < len(fresh_sd) or set(src_model) - set(fresh_sd), name
    for r in range(ranks):
        got = load(dumps / f"{name}_loaded_rank{r}.pt")
        where = f"{name}, rank {r}"
        assert got["step"] == step, where
        assert list(got["model"]) == list(fresh_sd), where
        for k, v in got["model"].items():
            want = src_model[k] if k in same else fresh_sd[k]
            assert th.equal(v, want), f"{where}: model {k} ({'kept' if k in same else 'new'})"
        for rate, ema in zip(RATES, got["ema"]):
            src_ema = load(src / f"ema_{rate}_{step:06d}.pt")["state_dict"]
            for k, v in zip(params, ema):
                want = src_ema[k] if k in same else fresh_sd[k]
                assert th.equal(v, want), f"{where}: EMA {rate} {k}"
        state = got["optimizer"]["state"]
        assert set(state) == same & set(src_opt["optimizer"]["state"]), where
        for k, st in state.items():
            for m in ("exp_avg", "exp_avg_sq", "step"):
                assert th.equal(st[m], src_opt["optimizer"]["state"][k][m]), f"{where}: {k}.{m}"
        trainer = load(dumps / f"{name}_trainer_rank{r}.pt")
        saved = src_opt["trainer"]
        assert trainer["data"] == saved["data"], where
        assert not deep_diff(trainer["rng"], saved["rng"][r]), where
        assert not deep_diff(trainer["sampler"], saved["schedule_sampler"]), where
    after = load(dst / f"opt{step + 1:06d}.pt")["trainer"]
    assert after["step"] == step + 1 and after["data"]["position"] == (step + 1) * 2 * ranks
    change = after["model_changes"][-1]
    assert change["step"] == step and change["kept"] == len(same)
    assert set(change["new"]) | set(change["reshaped"]) == set(fresh_sd) - same
    assert set(change["dropped"]) == set(src_model) - set(fresh_sd)
    assert after["model_changes"][:-1] == saved.get("model_changes", [])
    log = (dst / "log.txt").read_text()
    assert re.search(rf"model change at step {step}: {len(same)} kept, ", log), log[-2000:]
    return change


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The whole matrix on 1 rank, in this process (no python start per job)."""
    root = tmp_path_factory.mktemp("matrix1")
    try:
        assert model_change_jobs.run_jobs(root / "dumps", matrix_jobs(root, VARIANTS)) == 0
    finally:
        logger.reset()
    return root


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resuming_into_each_changed_model_and_back_keeps_matching_tensors_on_one_rank(
        one_rank, variant):
    on = check_transition(one_rank / "base", 1, one_rank / f"on_{variant}", one_rank / "dumps",
                          f"on_{variant}")
    off = check_transition(one_rank / f"on_{variant}", 2, one_rank / f"off_{variant}",
                           one_rank / "dumps", f"off_{variant}")
    assert on["new"] or on["reshaped"]
    assert off["dropped"] or off["reshaped"]
    flag = VARIANTS[variant][0][0][2:]
    assert flag in on["flags"] and flag in off["flags"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ckpt_adapt_writes_the_same_tensors_and_a_strict_resume_from_it_trains_on(
        one_rank, variant, tmp_path):
    for name, src, step, flags in (
            (f"on_{variant}", one_rank / "base", 1, VARIANTS[variant][0]),
            (f"off_{variant}", one_rank / f"on_{variant}", 2, VARIANTS[variant][1])):
        out = tmp_path / name
        buf = io.StringIO()
        code = ckpt_tool.main(["adapt", str(src), "--flags", flag_text(flags), "--out",
                               str(out)], out=buf)
        assert code == 0, buf.getvalue()
        assert f"model change at step {step}: " in buf.getvalue()
        assert f"--seed {SEED}" in buf.getvalue()  # the run's seed, read from its opt file
        got = load(one_rank / "dumps" / f"{name}_loaded_rank0.pt")
        model = load(out / f"model{step:06d}.pt")
        assert not deep_diff(model["state_dict"], got["model"]), name
        params = list(got["model"])
        for rate, ema in zip(RATES, got["ema"]):
            sd = load(out / f"ema_{rate}_{step:06d}.pt")["state_dict"]
            assert all(th.equal(sd[k], v) for k, v in zip(params, ema)), f"{name} EMA {rate}"
        opt = load(out / f"opt{step:06d}.pt")
        assert not deep_diff(opt["optimizer"]["state"], got["optimizer"]["state"]), name
        assert opt["trainer"]["model_changes"][-1]["step"] == step
        # the source step's run settings go with it (a flagless resume of --out takes them)
        settings = json.loads((src / f"manifest{step:06d}.json").read_text())["run_flags"]
        assert settings["max_steps"] == step
        assert json.loads((out / f"manifest{step:06d}.json").read_text())["run_flags"] == settings
        # a plain strict resume (no --allow_model_change) from the adapted step trains on
        log = tmp_path / f"strict_{name}"
        data = one_rank / "data"
        argv = [*BASE, *flags, "--data_dir", data, "--log_dir", log, "--resume_checkpoint", out,
                "--max_steps", step + 1]
        try:
            assert model_change_jobs.run_jobs(tmp_path / "dumps", [(name, argv)]) == 0
        finally:
            logger.reset()
        resumed = load(tmp_path / "dumps" / f"{name}_loaded_rank0.pt")
        assert resumed["step"] == step and not deep_diff(resumed["model"], got["model"])
        assert load(log / f"opt{step + 1:06d}.pt")["trainer"]["step"] == step + 1
        assert "model change" not in (log / "log.txt").read_text()


def run_matrix_on_two_ranks(tmp_path, names):
    jobs = matrix_jobs(tmp_path, names)
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([[n, [str(a) for a in argv]] for n, argv in jobs]))
    run_mpi(2, "../tests/model_change_jobs.py", tmp_path / "dumps", spec, timeout=280)
    for v in names:
        check_transition(tmp_path / "base", 1, tmp_path / f"on_{v}", tmp_path / "dumps",
                         f"on_{v}", ranks=2)
        check_transition(tmp_path / f"on_{v}", 2, tmp_path / f"off_{v}", tmp_path / "dumps",
                         f"off_{v}", ranks=2)


@pytest.mark.timeout(300)
def test_learn_sigma_on_and_off_again_on_two_ranks_keeps_the_same_tensors_on_every_rank(
        tmp_path):
    run_matrix_on_two_ranks(tmp_path, ["learn_sigma"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_whole_matrix_on_two_ranks_keeps_the_same_tensors_on_every_rank(tmp_path):
    run_matrix_on_two_ranks(tmp_path, list(VARIANTS))


# ------------------------------------------------------------------ without the flag; adapt


@pytest.mark.timeout(120)
def test_without_the_flag_a_changed_model_is_a_one_line_error_naming_the_flag(one_rank,
                                                                              tmp_path):
    log = tmp_path / "log"
    argv = [*BASE, "--class_cond", "True", "--data_dir", one_rank / "data", "--log_dir", log,
            "--resume_checkpoint", one_rank / "base", "--max_steps", 2]
    try:
        with pytest.raises(train_util.ResumeError,
                           match=r"1 missing \(label_emb.weight\).*check --class_cond.*"
                                 r"--allow_model_change True"):
            model_change_jobs.run_jobs(tmp_path / "dumps", [("refused", argv)])
    finally:
        logger.reset()
    assert not list(log.glob("*.pt")) and not list(log.glob("manifest*"))


@pytest.mark.timeout(120)
def test_adapt_refuses_an_out_dir_that_holds_steps_and_changes_nothing(one_rank, tmp_path):
    before = {p.name: p.read_bytes() for p in (one_rank / "on_class_cond").glob("*.pt")}
    err = io.StringIO()
    code = ckpt_tool.main(["adapt", str(one_rank / "base"), "--flags", "--class_cond True",
                           "--out", str(one_rank / "on_class_cond")], out=io.StringIO(), err=err)
    assert code == 1 and "already holds checkpoint files" in err.getvalue()
    assert {p.name: p.read_bytes() for p in (one_rank / "on_class_cond").glob("*.pt")} == before


@pytest.mark.timeout(120)
def test_adapt_of_an_upstream_run_dir_matches_moments_by_the_files_own_names(fixtures_dir,
                                                                            tmp_path):
    src = fixtures_dir / "upstream_run_small"
    out = tmp_path / "adapted"
    buf = io.StringIO()
    flags = ("--image_size 32 --num_channels 32 --num_res_blocks 1 --attention_resolutions 16 "
             "--learn_sigma False --diffusion_steps 100 --noise_schedule cosine")
    assert ckpt_tool.main(["adapt", str(src), "--flags", flags, "--out", str(out)],
                          out=buf) == 0, buf.getvalue()
    assert "the file stores no model flags" in buf.getvalue()
    raw_opt = load(src / "opt000010.pt")
    raw_model = load(src / "model000010.pt")
    opt = load(out / "opt000010.pt")
    names = list(raw_model)  # upstream's index-keyed moments follow model.parameters() order
    kept = [n for n in names if n in opt["optimizer"]["state"]]
    assert set(names) - set(kept) == {"out.2.weight", "out.2.bias"}  # 6 -> 3 output channels
    for n in kept:
        assert th.equal(opt["optimizer"]["state"][n]["exp_avg"],
                        raw_opt["state"][names.index(n)]["exp_avg"])
    model = load(out / "model000010.pt")
    assert model["state_dict"]["out.2.weight"].shape[0] == 3
    assert th.equal(model["state_dict"]["input_blocks.0.0.weight"],
                    raw_model["input_blocks.0.0.weight"])
    assert (out / "manifest000010.json").exists()
    rep = ckpt_tool.inspect_file(out / "opt000010.pt")
    assert rep["model_changes"][0]["reshaped"] == ["out.2.weight", "out.2.bias"]
    shown = io.StringIO()
    assert ckpt_tool.main(["inspect", str(out / "opt000010.pt")], out=shown) == 0
    assert re.search(r"changed +model change at step 10: \d+ kept, 0 new, 0 dropped, 2 reshaped "
                     r"\(out.2.weight, out.2.bias\), no flags in the file", shown.getvalue()), \
        shown.getvalue()


@pytest.mark.timeout(120)
def test_adapt_of_a_raw_file_without_its_flags_says_they_are_needed_and_writes_nothing(
        fixtures_dir, tmp_path):
    """Issue 37, item 5: `ckpt.py adapt` of upstream's raw files with one flag built the default
    model for the rest, kept 1 of 166 tensors and wrote 368 MB, exit 0."""
    out = tmp_path / "adapted"
    code, text = adapt(fixtures_dir / "upstream_run_small", "--flags", "--learn_sigma False",
                       "--out", out)
    assert code == 1, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert re.search(r"model000010.pt: the model of these flags keeps only \d+ of the file's 204 "
                     r"tensors \(\d+ reshaped \(time_embed.0.weight \[128, 32\] -> \[512, 128\]",
                     errors[0]), errors[0]
    assert ("the file stores no model flags, so those --flags does not give took their defaults: "
            'give all its model flags, --flags "--image_size N --num_channels N ..." as it was '
            "trained (likely") in errors[0]
    assert "--num_channels (file: 32, model: 128)" in errors[0]
    assert errors[0].endswith("or pass --force to write it anyway")
    assert not out.exists()


@pytest.mark.timeout(200)
def test_adapt_keeping_less_than_half_of_the_tensors_is_refused_unless_forced(
        one_rank, tmp_path):
    """Issue 37, item 5: --num_channels 64 on a 32-channel run keeps 1 of its 70 tensors: one
    line naming what did not fit, nothing written; `adapt --force` writes it anyway."""
    wider = [*BASE, "--num_channels", "64"]
    out = tmp_path / "adapted"
    code, text = adapt(one_rank / "base", "--flags", flag_text(wider), "--out", out)
    assert code == 1, text
    assert text.count("error:") == 1 and "Traceback" not in text, text
    assert re.search(r"^error: \S+model000001.pt: the model of these flags keeps only 1 of the "
                     r"file's 70 tensors \(\d+ reshaped .*check --num_channels \(file: 32, "
                     r"model: 64\).*, or pass --force to write it anyway$", text, re.M), text
    assert not out.exists()
    code, text = adapt(one_rank / "base", "--flags", flag_text(wider), "--out", out, "--force")
    assert code == 0, text
    assert "model change at step 1: 1 kept, 0 new, 0 dropped, 69 reshaped" in text
    assert load(out / "model000001.pt")["flags"]["num_channels"] == 64
    assert (out / "manifest000001.json").exists()


@pytest.mark.timeout(120)
def test_a_resume_into_a_model_keeping_less_than_half_of_the_tensors_is_refused(one_rank,
                                                                                tmp_path):
    """Issue 37, item 5: train.py --allow_model_change True, the same rule as adapt's, one line
    naming what did not fit and the way to force it (`ckpt.py adapt --force`)."""
    wider = [*BASE, "--num_channels", "64"]
    log = tmp_path / "log"
    argv = [*wider, "--data_dir", one_rank / "data", "--log_dir", log, "--resume_checkpoint",
            one_rank / "base", "--allow_model_change", "True", "--max_steps", 2]
    try:  # train.py's job in this process, as the refusal without the flag above
        with pytest.raises(UserError) as e:
            model_change_jobs.run_jobs(tmp_path / "dumps", [("refused", argv)])
    finally:
        logger.reset()
    error = str(e.value)
    assert e.value.exit_code == 1 and "\n" not in error, error
    assert "keeps only 1 of the file's 70 tensors" in error
    assert "check --num_channels (file: 32, model: 64)" in error
    assert "--force --out DIR` and resume it (--resume_checkpoint DIR)" in error
    assert not list(log.glob("*.pt")) and not list(log.glob("manifest*"))


@pytest.mark.timeout(120)
def test_adapt_of_a_combined_dict_gives_the_tensors_train_py_would_with_the_same_seed(one_rank,
                                                                                     tmp_path):
    base = one_rank / "base"
    combined = tmp_path / "combined.pt"
    th.save({"model": load(base / "model000001.pt")["state_dict"],
             "ema": load(base / "ema_0.9_000001.pt")["state_dict"],
             "optimizer": load(base / "opt000001.pt")["optimizer"], "step": 1}, combined)
    out = tmp_path / "adapted"
    buf = io.StringIO()
    assert ckpt_tool.main(["adapt", str(combined), "--flags", flag_text(
        [*BASE, *VARIANTS["class_cond"][0]]), "--seed", str(SEED), "--out", str(out)],
        out=buf) == 0, buf.getvalue()
    assert "ignored non-model flags: --batch_size 2" in buf.getvalue()
    got = load(one_rank / "dumps" / "on_class_cond_loaded_rank0.pt")
    assert not deep_diff(load(out / "model000001.pt")["state_dict"], got["model"])
    ema = load(out / "ema_0.9999_000001.pt")["state_dict"]  # a combined dict does not say
    assert all(th.equal(ema[k], v) for k, v in zip(got["model"], got["ema"][0]))
    assert not deep_diff(load(out / "opt000001.pt")["optimizer"]["state"],
                         got["optimizer"]["state"])
    assert (out / "manifest000001.json").exists()


@pytest.mark.timeout(200)
def test_the_readmes_adapt_flow_counts_the_classes_and_the_resume_takes_the_checkpoints_count(
        tmp_path):
    """README: `ckpt.py adapt runs/uncond --flags "--class_cond True" --data_dir D --out DIR`,
    then `train.py --class_cond True --resume_checkpoint DIR` (no --num_classes) resumes."""
    data = write_class_folder(tmp_path / "data", classes=("a", "b", "c", "d"), per_class=2)
    tiny = [a for a in BASE if a not in ("--schedule_sampler", "loss-second-moment")]
    run_script("train.py", *tiny, "--data_dir", data, "--log_dir", tmp_path / "uncond",
               "--max_steps", 1)
    flags = "--class_cond True"
    err = io.StringIO()
    assert ckpt_tool.main(["adapt", str(tmp_path / "uncond"), "--flags", flags, "--out",
                           str(tmp_path / "nowhere")], out=io.StringIO(), err=err) == 1
    assert "pass --data_dir" in err.getvalue() and not (tmp_path / "nowhere").exists()
    out = io.StringIO()
    assert ckpt_tool.main(["adapt", str(tmp_path / "uncond"), "--flags", flags, "--data_dir",
                           str(data), "--out", str(tmp_path / "start")], out=out) == 0, out
    assert load(tmp_path / "start" / "model000001.pt")["flags"]["num_classes"] == 4
    fewer = write_class_folder(tmp_path / "fewer", classes=("a", "b"), per_class=3)
    proc = run_script("train.py", *tiny, "--data_dir", fewer, "--class_cond", "True",
                      "--resume_checkpoint", tmp_path / "start", "--log_dir", tmp_path / "cond",
                      "--max_steps", 2)
    assert "num_classes=4, the checkpoint's (2 classes in --data_dir" in proc.stdout
    assert "resumed at step 1" in proc.stdout
    assert load(tmp_path / "cond" / "model000002.pt")["flags"]["num_classes"] == 4
    # (2 files a class: a folder whose every file is its own class is refused first)
    more = write_class_folder(tmp_path / "more", classes=tuple("abcdef"), per_class=2)
    proc = run_script("train.py", *tiny, "--data_dir", more, "--class_cond", "True",
                      "--log_dir", tmp_path / "cond", "--max_steps", 3, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert ("--data_dir " + str(more) + " holds 6 classes, but the checkpoint to resume was "
            "trained with 4") in proc.stdout
    assert not (tmp_path / "cond" / "model000003.pt").exists()


# ------------------------------------------------------------------ optimizer groups; subclass


def _digits(seed, batch=2):
    g = th.Generator().manual_seed(seed)
    while True:
        yield th.rand(batch, 3, 8, 8, generator=g) * 2 - 1, {}


def _loop(cls, log_dir, max_steps, weight_decay=0.1):
    from improved_diffusion.script_util import model_and_diffusion_defaults
    flags = dict(model_and_diffusion_defaults(), image_size=8, num_channels=32, channel_mult="1",
                 num_res_blocks=1,
                 attention_resolutions="", diffusion_steps=20, noise_schedule="cosine")
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = create_model_and_diffusion(**flags)
    return cls(model=model, diffusion=diffusion, data=_digits(0), batch_size=2, microbatch=-1,
               lr=1e-3, ema_rate="0.9", log_interval=1, save_interval=1, resume_checkpoint="",
               log_dir=str(log_dir), model_flags=flags, max_steps=max_steps, seed=0,
               weight_decay=weight_decay)


class NoDecayForVectors(train_util.TrainLoop):
    """Two param groups: weight decay off for biases and norms (parameters with ndim <= 1)."""

    def _make_optimizer(self):
        params = list(self.model.named_parameters())
        return th.optim.AdamW([
            {"params": [p for _, p in params if p.ndim > 1]},
            {"params": [p for _, p in params if p.ndim <= 1], "weight_decay": 0.0},
        ], lr=self.lr, weight_decay=self.weight_decay)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first,second", [(train_util.TrainLoop, NoDecayForVectors),
                                          (NoDecayForVectors, train_util.TrainLoop)])
def test_adam_moments_follow_each_parameter_into_its_new_param_group(tmp_path, first, second):
    log = tmp_path / "log"
    with logger.scoped_configure(dir=str(log), format_strs=["log"], rank=0):
        assert _loop(first, log, 2).run_loop() == 0
        saved = load(log / "opt000002.pt")["optimizer"]
        loop = _loop(second, log, 3, weight_decay=0.05)
    vectors = {n for n, p in loop.model.named_parameters() if p.ndim <= 1}
    state = optim_state.named_optimizer_state(loop.opt, loop.named_params)
    assert not deep_diff(state["state"], saved["state"])  # every moment followed its name
    assert [g["weight_decay"] for g in loop.opt.param_groups] == (
        [0.05, 0.0] if second is NoDecayForVectors else [0.05])  # the run's, not the file's
    text = (log / "log.txt").read_text()
    assert f"{len(vectors)} parameter(s) changed param group" in text


@pytest.mark.timeout(120)
def test_a_subclass_overriding_load_optimizer_state_is_called_on_resume(tmp_path):
    calls = []

    class Logged(train_util.TrainLoop):
        def _load_optimizer_state(self):
            calls.append(self.step)
            super()._load_optimizer_state()

        def _load_ema_parameters(self, rate):
            calls.append(rate)
            return super()._load_ema_parameters(rate)

    log = tmp_path / "log"
    with logger.scoped_configure(dir=str(log), format_strs=["log"], rank=0):
        assert _loop(Logged, log, 2).run_loop() == 0
        assert calls == []  # a fresh start loads nothing
        loop = _loop(Logged, log, 3)
    assert calls == [0.9, 2] and loop.step == 2
    saved = load(log / "opt000002.pt")["optimizer"]["state"]
    assert not deep_diff(optim_state.named_optimizer_state(loop.opt, loop.named_params)["state"],
                         saved)
