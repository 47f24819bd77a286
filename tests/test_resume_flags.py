"""A resume takes every flag of the run from its checkpoint (issue 37, items 1, 6, 9 and 12).

`train.py --data_dir D --log_dir RUN` of a run trained with `--lr 2e-3 --batch_size 4
--ema_rate 0.99 --max_steps 6` resumes it as it was trained: the model flags and the run's
settings come from the step the resume loads (not from a newer step it then skips), a flag typed
on the resume overrides the file's and is logged, and a check between flags runs on the flags
the resume took, not on the defaults. Through the real scripts, the resumes that end bitwise on
2 ranks with a loader worker; a job refused before it trains runs the script's main() in the
test's process (the same lines and exit code, without an interpreter's start-up).
"""
import json
import shutil

import pytest
import torch

from conftest import deep_diff, resumed_step, run_mpi, run_script, train_here, write_images
from test_train_eval import _train_main


def in_process(capsys, *argv, script="train.py"):
    """scripts/<script>'s main() in this process (no interpreter start-up, for a job that is
    refused before it trains): (exit code, its output, stdout then stderr)."""
    capsys.readouterr()
    code = _train_main(script)([str(a) for a in argv])
    return code, "".join(capsys.readouterr())

MODEL = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
         "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine"]
# The run's settings, every one other than its default.
RUN = ["--lr", "2e-3", "--batch_size", "4", "--ema_rate", "0.99", "--max_steps", "6",
       "--save_interval", "3", "--log_interval", "3", "--schedule_sampler", "loss-second-moment",
       "--seed", "3", "--weight_decay", "0.05"]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def step_files(d, step):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(f"{step:06d}.pt"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("flags") / "img", n=16)


@pytest.fixture(scope="module")
def straight(images, tmp_path_factory):
    """A 2-rank run of 6 steps with settings other than the defaults, saved at 3 and 6."""
    d = tmp_path_factory.mktemp("straight") / "run"
    run_mpi(2, "train.py", "--data_dir", images, "--log_dir", d, *MODEL, *RUN,
            "--num_workers", "1", timeout=240)
    return d


def stopped_at_3(straight, d):
    """A copy of the straight run as a job preempted after step 3 leaves it."""
    shutil.copytree(straight, d)
    for p in d.iterdir():
        if "000006" in p.name:
            p.unlink()
    return d


@pytest.mark.timeout(400)
def test_a_flagless_resume_on_2_ranks_takes_the_runs_settings_and_ends_bitwise_as_a_straight_run(
        images, straight, tmp_path):
    run = stopped_at_3(straight, tmp_path / "run")
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--num_workers", "1",
                  timeout=240).stdout
    assert resumed_step(out) == 3, out[-3000:]
    line = next(ln for ln in out.splitlines() if "resume: from the checkpoint" in ln)
    for flag in ("--num_channels 32", "--lr 0.002", "--batch_size 4", "--ema_rate 0.99",
                 "--max_steps 6", "--save_interval 3", "--schedule_sampler loss-second-moment",
                 "--seed 3", "--weight_decay 0.05"):
        assert flag in line, (flag, line)
    assert "resume: --" not in out, out[-3000:]  # nothing overridden, nothing to say
    settings = json.loads((run / "manifest000006.json").read_text())["run_flags"]
    assert settings["weight_decay"] == 0.05  # the run's, recorded for its next resume
    groups = load(run / "opt000006.pt")["optimizer"]["param_groups"]
    assert {g["weight_decay"] for g in groups} == {0.05}, groups  # and trained with
    # It stopped at the trained --max_steps, and step 6 is the straight run's, bit for bit.
    assert step_files(run, 6) == step_files(straight, 6) and not step_files(run, 7)
    for name in step_files(straight, 6):
        diffs = deep_diff(load(straight / name), load(run / name))
        assert not diffs, (name, diffs[:10])


@pytest.mark.timeout(300)
def test_a_flag_typed_on_the_resume_overrides_the_checkpoints_and_is_logged(
        images, straight, tmp_path):
    run = stopped_at_3(straight, tmp_path / "run")  # (resumed on 1 rank: no flag says it)
    out = run_script("train.py", "--data_dir", images, "--log_dir", run, "--lr", "1e-3",
                     "--max_steps", "4", "--num_workers", "0", timeout=240).stdout
    assert "resume: --lr 0.002 -> 0.001" in out and "resume: --max_steps 6 -> 4" in out, \
        out[-3000:]
    line = next(ln for ln in out.splitlines() if "resume: from the checkpoint" in ln)
    assert "--lr" not in line and "--max_steps" not in line and "--batch_size 4" in line, line
    settings = json.loads((run / "manifest000004.json").read_text())["run_flags"]
    assert settings["lr"] == 1e-3 and settings["max_steps"] == 4
    assert settings["batch_size"] == 4 and "log_dir" not in settings
    assert "run_flags" not in load(run / "model000004.pt")  # the manifest's, not the weights'
    assert not step_files(run, 5)


@pytest.fixture(scope="module")
def other_model(images, tmp_path_factory):
    """A 1-rank run of other model flags (attention at 8 and 4 px, wider), saved at 2."""
    d = tmp_path_factory.mktemp("other") / "run"
    train_here("--data_dir", images, "--log_dir", d, "--image_size", "8",
               "--num_channels", "64", "--num_res_blocks", "1", "--attention_resolutions",
               "8,4", "--channel_mult", "1,2", "--diffusion_steps", "20", "--batch_size", "2",
               "--max_steps", "2", "--num_workers", "0")
    return d


@pytest.mark.timeout(300)
def test_flags_come_from_the_step_resumed_when_a_newer_one_of_other_flags_fails_its_checksums(
        images, straight, other_model, tmp_path):
    """Item 6: step 6 (another model's) has a flipped byte: the resume skips it and takes step
    3, with step 3's flags (not step 6's, which do not fit step 3's weights)."""
    run = stopped_at_3(straight, tmp_path / "run")
    for p in other_model.iterdir():
        if "000002" in p.name:
            shutil.copy(p, run / p.name.replace("000002", "000006"))
    manifest = (run / "manifest000006.json").read_text().replace("000002", "000006")
    (run / "manifest000006.json").write_text(manifest.replace('"step": 2', '"step": 6'))
    model = run / "model000006.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    proc = run_script("train.py", "--data_dir", images, "--log_dir", run, "--max_steps", "4",
                      "--num_workers", "0", timeout=180, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "skipping step 6" in out and resumed_step(out) == 3, out[-3000:]
    line = next(ln for ln in out.splitlines() if "resume: from the checkpoint" in ln)
    assert "model000003.pt" in line and "--num_channels 32" in line, line
    assert load(run / "model000004.pt")["flags"]["num_channels"] == 32


def clash_error(capsys, images, other_model, tmp_path, *typed):
    """A copy of ``other_model``'s run resumed with the model flags ``typed`` (in_process): (the
    run dir, the one error line), exit 1 asserted."""
    run = tmp_path / "run"
    shutil.copytree(other_model, run)
    code, out = in_process(capsys, "--data_dir", images, "--log_dir", run, *typed,
                           "--num_workers", "0")
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1, out[-3000:]
    return run, errors[0]


@pytest.mark.timeout(300)
def test_list_and_set_flags_written_otherwise_do_not_clash_and_a_noise_clash_is_worded_as_such(
        images, other_model, tmp_path, capsys):
    """Item 12: `--attention_resolutions 4,8` is the file's `8,4` (a set), `--channel_mult
    1.0,2.0` its `1,2`; a noise-schedule clash names the noise process, not a model change."""
    run, error = clash_error(capsys, images, other_model, tmp_path, "--noise_schedule", "cosine")
    assert "--noise_schedule cosine (the file's: linear)" in error, error
    assert "noise process" in error and "change the model" not in error, error
    assert step_files(run, 3) == []
    proc = run_script("train.py", "--data_dir", images, "--log_dir", run,
                      "--attention_resolutions", "4,8", "--channel_mult", "1.0,2.0",
                      "--max_steps", "3", "--num_workers", "0", timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert resumed_step(proc.stdout) == 2 and step_files(run, 3), proc.stdout[-3000:]
    assert "flags differ" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(300)
def test_super_res_resume_typing_the_files_own_large_size_is_checked_against_its_small_size(
        tmp_path, capsys):
    """Item 9: the check --small_size < --large_size runs on the flags the resume took (the
    file's --small_size 8), not on the default --small_size 64."""
    images = write_images(tmp_path / "img", n=8, size=16)
    run = tmp_path / "sr"
    common = ["--data_dir", images, "--log_dir", run, "--num_workers", "0"]
    run_script("super_res_train.py", *common, "--large_size", "16", "--small_size", "8",
               "--num_channels", "32", "--num_res_blocks", "1", "--attention_resolutions", "",
               "--diffusion_steps", "20", "--batch_size", "2", "--max_steps", "1",
               timeout=180)
    proc = run_script("super_res_train.py", *common, "--large_size", "16", "--max_steps", "2",
                      timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert resumed_step(proc.stdout) == 1 and (run / "model000002.pt").exists()
    assert load(run / "model000002.pt")["flags"]["small_size"] == 8
    # A fresh start is still checked before anything is touched.
    code, out = in_process(capsys, "--data_dir", images, "--log_dir", tmp_path / "new",
                           "--large_size", "16", script="super_res_train.py")
    assert code == 2 and "--small_size 64 must be smaller" in out, out[-3000:]
    assert not (tmp_path / "new").exists()


def without_run_flags(run, step):
    """Rewrite manifest{step}.json as releases before run_flags wrote it (still valid: its
    checksums are those of the step's data files)."""
    path = run / f"manifest{step:06d}.json"
    doc = json.loads(path.read_text())
    del doc["run_flags"]
    path.write_text(json.dumps(doc, indent=1) + "\n")


@pytest.mark.timeout(600)
def test_a_manifest_without_run_flags_resumes_with_the_trainer_states_settings_or_names_the_flag(
        images, straight, tmp_path, capsys):
    """Issue 43, item 11: step 3's manifest records no run settings (an older release's). The
    resume takes --batch_size, --lr, --ema_rate and --seed from the trainer state of
    opt000003.pt, not their defaults (batch 1, lr 1e-4, the 0.99 EMA dropped), and ends bitwise
    as the straight run; left out, --max_steps (which the trainer state does not record) is
    asked for in one line, not taken as "no end"."""
    run = stopped_at_3(straight, tmp_path / "run")
    without_run_flags(run, 3)
    unrecorded = ["--save_interval", "3", "--log_interval", "3", "--schedule_sampler",
                  "loss-second-moment"]
    out = run_mpi(2, "train.py", "--data_dir", images, "--log_dir", run, "--num_workers", "1",
                  "--max_steps", "6", *unrecorded, timeout=300).stdout
    assert resumed_step(out) == 3, out[-3000:]
    assert "manifest000003.json records no run settings" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if "resume: from the checkpoint" in ln)
    for flag in ("--lr 0.002", "--batch_size 4", "--ema_rate 0.99", "--seed 3",
                 "--weight_decay 0.05"):
        assert flag in line, (flag, line)
    assert step_files(run, 6) == step_files(straight, 6) and not step_files(run, 7)
    for name in step_files(straight, 6):
        diffs = deep_diff(load(straight / name), load(run / name))
        assert not diffs, (name, diffs[:10])

    run = stopped_at_3(straight, tmp_path / "again")
    without_run_flags(run, 3)
    code, out = in_process(capsys, "--data_dir", images, "--log_dir", run, "--num_workers", "0")
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert "records no run settings" in errors[0] and "type --max_steps N" in errors[0], errors[0]
    assert not step_files(run, 4)


@pytest.mark.timeout(300)
def test_the_wording_of_a_learn_sigma_clash(
        images, other_model, tmp_path, capsys):
    """Issue 43, item 17: the hint of a --learn_sigma clash said "every tensor still fits" (the
    output layer is reshaped and starts fresh). (Its other half, the wording of --fsdp's refusal of
    --sample_interval, went with the refusal: grids work under --fsdp, issue 45.)"""
    _, error = clash_error(capsys, images, other_model, tmp_path, "--learn_sigma", "True")
    assert "--learn_sigma True (the file's: False)" in error, error
    assert "every tensor but the output layer still fits" in error, error
    assert "every tensor still fits" not in error
