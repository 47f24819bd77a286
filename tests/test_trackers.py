"""--tracker wandb,mlflow (trackers.py), offline: W&B with WANDB_MODE=offline (its .wandb records
read back with wandb's own protobuf Record), MLflow at its own defaults (no MLFLOW_* variable:
conftest.child_env drops the machine's; the store MLflow chooses, sqlite:///mlflow.db in the
job's working directory, read back with MlflowClient), TensorBoard's event files, progress.csv.
Each step shows once in every one of them, with the values of the run that continued; a resume
continues the tracker run its step's manifest names; a tracker that cannot work costs one
warning line, saying what to do."""
import csv
import glob
import json
import os
import signal
import struct
import time

import pytest

from conftest import (MPIEXEC, PY, REPO, child_env, launched, rank_pids, run_mpi, run_script,
                      write_images)

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "10", "--noise_schedule", "cosine",
        "--batch_size", "2", "--log_interval", "1", "--async_save", "False"]
FAULT_TRAIN = REPO / "tests" / "fault_train.py"
TRACKER_TRAIN = REPO / "tests" / "tracker_train.py"


def tracker_env(**extra):
    """W&B offline (it has no default that works without an account), MLflow untouched."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": "", "WANDB_PROJECT": ""}
    env.update(extra)
    return env


def workdir(tmp_path):
    """The jobs' working directory, where MLflow's defaults put its store."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return work


def tracker_lines(out, name):
    """The lines of tracker ``name``'s own (its warning)."""
    return [line for line in out.stdout.splitlines() if f"--tracker {name}:" in line]


def csv_rows(log):
    with open(log / "progress.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


def manifest_runs(log, step):
    return json.loads((log / f"manifest{step:06d}.json").read_text())["run_flags"]["tracker_runs"]


def wandb_records(path):
    """The Records of a .wandb file (wandb's LevelDB-style log: a 7-byte header, 32 KiB blocks
    of chunks, each chunk crc32c(4) length(2) type(1); type 1 whole, 2/3/4 first/middle/last),
    parsed with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:
            break
        part += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_history(log):
    """(run ids, [(step, {key: value})]) of every offline W&B run file in LOG/wandb, oldest
    first: what `wandb sync` would upload."""
    ids, rows = set(), []
    for path in sorted(glob.glob(str(log / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                items = {("/".join(i.nested_key) or i.key): json.loads(i.value_json)
                         for i in rec.history.item}
                rows.append((rec.history.step.num, items))
    return ids, rows


def wandb_shown(history):
    """({step: row} W&B shows, [(step, row)] it drops) of history records logged in this order:
    a record whose step is not above the highest one before is dropped ("Step 110 < 161;
    dropping"), as `wandb sync` of the offline runs into one run does."""
    shown, dropped = {}, []
    for step, row in history:
        if shown and step <= max(shown):
            dropped.append((step, row))
        else:
            shown[step] = row
    return shown, dropped


def mlflow_runs(work):
    """(MlflowClient, its runs) of the store MLflow's defaults made in ``work``."""
    from mlflow.tracking import MlflowClient

    assert (work / "mlflow.db").is_file(), sorted(os.listdir(work))
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return client, runs


def mlflow_grid_steps(client, run_id):
    """The steps of the run's sample_grid images, one entry per full-size image MLflow has
    (images/sample_grid+step+N+timestamp+T+UUID.png), sorted."""
    names = [f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run_id, "images")]
    return sorted(int(n.split("+")[2]) for n in names
                  if n.startswith("sample_grid+step+") and n.endswith(".png"))


def tensorboard_scalars(log, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.mark.timeout(600)
def test_a_kill_9_past_the_last_save_leaves_each_step_once_in_every_tracker_with_resumed_values(
        tmp_path):
    """2 ranks, a save every 3 steps; rank 0 is killed with SIGKILL after step 5 was logged
    (progress.csv, TensorBoard have steps 4 and 5 of the dead job); a flagless resume on 1 rank
    trains 4.. again. Every tracker shows steps 1..8 once, with progress.csv's values (the resumed
    job's for 4 and 5), in one tracker run: the one the manifests name."""
    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    env = tracker_env()
    flags = [*TINY, "--data_dir", data, "--log_dir", log, "--max_steps", "8",
             "--save_interval", "3", "--tensorboard", "True", "--tracker", "wandb,mlflow",
             "--sample_interval", "4", "--sample_steps", "2", "--sample_count", "2"]
    out = run_mpi(2, FAULT_TRAIN, *flags, check=False, timeout=300, cwd=work,
                  env=dict(env, FAULT_RANK="0", FAULT_STEP="5", FAULT_RAISE="SIGKILL"))
    assert out.returncode != 0, out.stdout[-3000:]
    dead = [r["step"] for r in csv_rows(log)]
    assert dead == [1, 2, 3, 4, 5], out.stdout[-3000:]  # logged past the save of step 3
    assert not (log / "manifest000006.json").exists()
    dead_loss = {r["step"]: r["loss"] for r in csv_rows(log)}

    # flagless, on 1 rank: the global batch halves, so steps 4 and 5 get other values
    out = run_script("train.py", "--data_dir", data, "--log_dir", log, timeout=300, env=env,
                     cwd=work)
    assert "resumed at step 3" in out.stdout, out.stdout[-3000:]
    rows = csv_rows(log)
    assert [r["step"] for r in rows] == list(range(1, 9)), rows  # progress.csv: once each
    loss = {int(r["step"]): r["loss"] for r in rows}
    assert loss[3] == dead_loss[3] and loss[4] != dead_loss[4] and loss[5] != dead_loss[5]

    # TensorBoard: purged past the resumed step
    assert tensorboard_scalars(log, "loss") == [(s, pytest.approx(loss[s], rel=1e-6))
                                                for s in range(1, 9)]

    # MLflow: one run, each step once, progress.csv's values
    client, runs = mlflow_runs(work)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run_id = runs[0].info.run_id
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, 9))
    assert [m.value for m in history] == [pytest.approx(loss[s], rel=1e-9) for s in range(1, 9)]
    assert runs[0].data.params["max_steps"] == "8" and runs[0].info.status == "FINISHED"

    # W&B: one run id, each step once, progress.csv's values, the grids as images
    ids, history = wandb_history(log)
    shown, dropped = wandb_shown(history)
    assert {s: row["loss"] for s, row in shown.items()} == {
        s: pytest.approx(loss[s], rel=1e-9) for s in range(1, 9)}
    assert [s for s, row in shown.items() if "sample_grid/path" in row] == [4, 8]
    # resent by the resume (a killed job's W&B records may not have reached its file): the
    # same committed values, never the killed job's steps 4 and 5
    assert all(s <= 3 and row["loss"] == shown[s]["loss"] for s, row in dropped), dropped
    # the manifests name the W&B run (its id is chosen at the start); MLflow's once the server
    # made it (a short job may save before that): LOG/trackers/mlflow.json names it too, and a
    # resume whose step has no MLflow id continues the run named there
    runs = {"wandb": ids.pop(), "mlflow": run_id}
    assert not ids and manifest_runs(log, 3)["wandb"] == runs["wandb"]
    assert manifest_runs(log, 3).items() <= runs.items() >= manifest_runs(log, 8).items()
    state = {n: json.loads((log / "trackers" / f"{n}.json").read_text()) for n in runs}
    assert state == {n: {"run_id": runs[n], "sent_step": 8} for n in runs}


# make soak: a flagless resume on 1 rank of a 2-rank job continuing its one MLflow run and one
# W&B run id, named by the manifests, stays in make test in
# test_a_kill_9_past_the_last_save_leaves_each_step_once_in_every_tracker_with_resumed_values
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_on_2_ranks_then_a_flagless_resume_on_1_continues_the_same_tracker_runs(
        tmp_path):
    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    env = tracker_env()
    cmd = [MPIEXEC, "-n", "2", PY, REPO / "scripts" / "train.py", *TINY, "--data_dir", data,
           "--log_dir", log, "--max_steps", "100000", "--save_interval", "100000",
           "--tracker", "wandb,mlflow"]
    with launched(cmd, tmp_path / "train.log", env=child_env(env), cwd=work) as proc:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if (log / "progress.csv").exists() and len(csv_rows(log)) >= 3:
                break
            time.sleep(0.1)
        os.kill(rank_pids(str(log))[1], signal.SIGTERM)
        rc = proc.wait(timeout=240)
    assert rc == 75, (tmp_path / "train.log").read_text()[-3000:]
    saved = max(int(p.name[8:14]) for p in log.glob("manifest*.json"))
    first = manifest_runs(log, saved)
    assert set(first) <= {"wandb", "mlflow"} and "wandb" in first

    # flagless (--tracker and --max_steps taken from the manifest), on 1 rank: 2 more steps
    out = run_script("train.py", "--data_dir", data, "--log_dir", log, "--max_steps",
                     str(saved + 2), env=env, timeout=300, cwd=work)
    assert f"resumed at step {saved}" in out.stdout, out.stdout[-3000:]
    runs = manifest_runs(log, saved + 2)
    assert runs.items() >= first.items()  # the same runs (MLflow's id may come after a save)
    client, found = mlflow_runs(work)
    assert [r.info.run_id for r in found] == [runs.get("mlflow", found[0].info.run_id)]
    assert sorted(m.step for m in client.get_metric_history(found[0].info.run_id, "loss")) == list(
        range(1, saved + 3))
    ids, history = wandb_history(log)
    assert ids == {first["wandb"]}
    assert sorted(wandb_shown(history)[0]) == list(range(1, saved + 3))


@pytest.mark.timeout(300)
def test_a_tracker_that_fails_at_its_start_is_one_warning_line_in_a_run_of_many_saves(tmp_path):
    """An unreachable MLflow server: the tracker has failed before the first step (the driver
    waits for it), then 8 rows and 4 saves, each of which hands the trackers their rows: the
    warning is one line in the whole run, and training completes."""
    data, log = write_images(tmp_path / "data", n=8), tmp_path / "log"
    env = tracker_env(MLFLOW_TRACKING_URI="http://127.0.0.1:9", TRACKER_SETTLE="1",
                      MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    out = run_script("../tests/tracker_train.py", *TINY, "--data_dir", data, "--log_dir", log,
                     "--max_steps", "8", "--save_interval", "2", "--tracker", "mlflow", env=env,
                     timeout=240, cwd=workdir(tmp_path))
    lines = tracker_lines(out, "mlflow")
    assert len(lines) == 1 and lines[0].startswith("warning:"), out.stdout[-3000:]
    assert "http://127.0.0.1:9" in lines[0] and lines[0].endswith(
        "the tracker is off for the rest of this job; training goes on"), lines
    assert [r["step"] for r in csv_rows(log)] == list(range(1, 9))
    assert (log / "manifest000008.json").exists()


@pytest.mark.timeout(300)
def test_mlflow_at_its_own_defaults_gets_every_step_in_mlflow_db_in_the_working_directory(
        tmp_path):
    """No MLFLOW_* variable (what a user who ran pip install '.[tracking]' has): MLflow's default
    store, sqlite:///mlflow.db where the job runs, holds the run, each step once, with
    progress.csv's values, and its grids; no warning."""
    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    out = run_script("train.py", *TINY, "--data_dir", data, "--log_dir", log, "--max_steps",
                     "4", "--save_interval", "2", "--tracker", "mlflow", "--sample_interval",
                     "2", "--sample_steps", "2", "--sample_count", "2", env=tracker_env(),
                     timeout=240, cwd=work)
    assert tracker_lines(out, "mlflow") == [], out.stdout[-3000:]
    client, runs = mlflow_runs(work)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    run = runs[0]
    assert client.get_experiment(run.info.experiment_id).name == "improved-diffusion"
    assert run.info.run_name == "log" and run.data.params["max_steps"] == "4"
    loss = {int(r["step"]): r["loss"] for r in csv_rows(log)}
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [
        (s, pytest.approx(loss[s], rel=1e-9)) for s in range(1, 5)]
    assert mlflow_grid_steps(client, run.info.run_id) == [2, 4]
    # MLflow makes the run's id (here after the last save: its store is new): the log dir's
    # record names it, for a resume
    assert json.loads((log / "trackers" / "mlflow.json").read_text()) == {
        "run_id": run.info.run_id, "sent_step": 4}


@pytest.mark.timeout(300)
def test_mlflow_skinny_without_sqlalchemy_is_one_line_naming_the_extra_and_the_variable(
        tmp_path):
    """mlflow-skinny alone (sqlalchemy and alembic not installed) cannot open MLflow's default
    store: one warning line that says what to install or set, and training completes."""
    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    env = tracker_env(TRACKER_NOT_INSTALLED="sqlalchemy,alembic", TRACKER_SETTLE="1")
    out = run_script("../tests/tracker_train.py", *TINY, "--data_dir", data, "--log_dir", log,
                     "--max_steps", "4", "--save_interval", "2", "--tracker", "mlflow", env=env,
                     timeout=240, cwd=work)
    assert tracker_lines(out, "mlflow") == [
        f"warning: --tracker mlflow: the tracking store sqlite:///{work / 'mlflow.db'} "
        f"(MLflow's default store: MLFLOW_TRACKING_URI is not set) needs the sqlalchemy and "
        f"alembic packages: pip install -e '.[tracking]' (or set MLFLOW_TRACKING_URI to your "
        f"MLflow server, http://HOST:PORT); the tracker is off for the rest of this job; "
        f"training goes on"], out.stdout[-3000:]
    assert [r["step"] for r in csv_rows(log)] == [1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_a_legacy_mlruns_folder_is_one_line_with_mlflows_own_advice_in_full(tmp_path,
                                                                           monkeypatch):
    """A working directory with an older MLflow's ./mlruns (MLflow's default is then its file
    store, which refuses to start unless MLFLOW_ALLOW_FILE_STORE=true): the warning line holds
    MLflow's whole message, to its last sentence, which says what to set."""
    from mlflow.tracking import MlflowClient

    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's older runs, made here
    MlflowClient(f"file:{work / 'mlruns'}").create_experiment("older")
    out = run_script("../tests/tracker_train.py", *TINY, "--data_dir", data, "--log_dir", log,
                     "--max_steps", "4", "--save_interval", "2", "--tracker", "mlflow",
                     env=tracker_env(TRACKER_SETTLE="1"), timeout=240, cwd=work)
    lines = tracker_lines(out, "mlflow")
    assert len(lines) == 1, out.stdout[-3000:]
    assert lines[0].startswith("warning: --tracker mlflow: MlflowException: The filesystem "
                               "tracking backend (e.g., './mlruns') is in maintenance mode")
    assert lines[0].endswith("If the filesystem backend is required for your workflow, set "
                             "`MLFLOW_ALLOW_FILE_STORE=true` to opt out of this exception.; the "
                             "tracker is off for the rest of this job; training goes on"), lines
    assert [r["step"] for r in csv_rows(log)] == [1, 2, 3, 4]


@pytest.mark.timeout(600)
def test_a_kill_9_between_mlflows_send_and_its_record_resumed_on_1_rank_logs_each_step_once(
        tmp_path):
    """2 ranks, a save every 3 steps, a grid every 4: the save of step 9 hands the trackers
    rows 7, 8, the grid of 8 and row 9; the job is killed (SIGKILL) as soon as MLflow has the
    grid of step 8, before the tracker records what it sent (LOG_DIR/trackers/mlflow.json still
    says 6). A flagless resume on 1 rank sends what the run lacks: MLflow's reader then shows
    each step and each grid once, with progress.csv's values, in one run; W&B too."""
    data, log, work = write_images(tmp_path / "data", n=8), tmp_path / "log", workdir(tmp_path)
    env = tracker_env()
    flags = [*TINY, "--data_dir", data, "--log_dir", log, "--max_steps", "12",
             "--save_interval", "3", "--tracker", "wandb,mlflow", "--sample_interval", "4",
             "--sample_steps", "2", "--sample_count", "2"]
    out = run_mpi(2, TRACKER_TRAIN, *flags, check=False, timeout=300, cwd=work,
                  env=dict(env, TRACKER_KILL_AFTER="mlflow:image:8"))
    assert out.returncode != 0 and "FAULT: killed after mlflow's image of step 8" in out.stdout, \
        out.stdout[-3000:]
    saved = max(int(p.name[8:14]) for p in log.glob("manifest*.json"))
    assert saved >= 9, saved
    client, runs = mlflow_runs(work)
    run_id = runs[0].info.run_id
    state = json.loads((log / "trackers" / "mlflow.json").read_text())
    assert state == {"run_id": run_id, "sent_step": 6}  # the kill came between send and record
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 9))
    assert mlflow_grid_steps(client, run_id) == [4, 8]

    end = saved + 3
    out = run_script("train.py", "--data_dir", data, "--log_dir", log, "--max_steps", str(end),
                     timeout=300, env=env, cwd=work)
    assert f"resumed at step {saved}" in out.stdout, out.stdout[-3000:]
    assert tracker_lines(out, "mlflow") == [] == tracker_lines(out, "wandb"), out.stdout[-3000:]
    rows = csv_rows(log)
    assert [r["step"] for r in rows] == list(range(1, end + 1))
    loss = {int(r["step"]): r["loss"] for r in rows}

    client, runs = mlflow_runs(work)
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    for key in ("loss", "step", "lr"):  # in the order of their times: the resent come later
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(
            range(1, end + 1)), key
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss")) == [
        (s, pytest.approx(loss[s], rel=1e-9)) for s in range(1, end + 1)]
    assert mlflow_grid_steps(client, run_id) == sorted({*range(4, end + 1, 4), end})  # + the last

    ids, history = wandb_history(log)
    shown, dropped = wandb_shown(history)
    assert ids == {manifest_runs(log, end)["wandb"]}
    assert {s: row["loss"] for s, row in shown.items()} == {
        s: pytest.approx(loss[s], rel=1e-9) for s in range(1, end + 1)}
    assert all(row["loss"] == shown[s]["loss"] for s, row in dropped), dropped


def test_a_tracker_whose_library_is_missing_is_one_line_naming_the_pip_extra(monkeypatch):
    from improved_diffusion import trackers
    from improved_diffusion.infra.errors import UsageError

    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    assert trackers.parse("mlflow") == ("mlflow",)
    with pytest.raises(UsageError, match=r"^--tracker wandb needs the wandb package: pip "
                                         r"install -e '\.\[tracking\]'$"):
        trackers.parse("mlflow,wandb")
    with pytest.raises(UsageError, match="'comet' is not a tracker"):
        trackers.parse("comet")
