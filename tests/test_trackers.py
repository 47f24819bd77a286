"""--tracker wandb,mlflow (trackers.py), offline: W&B with WANDB_MODE=offline (its .wandb records
read back with wandb's own protobuf Record), MLflow against a local file store (read back with
MlflowClient), TensorBoard's event files, progress.csv. Each step shows once in every one of them,
with the values of the run that continued; a resume continues the tracker run its step's manifest
names; an unreachable tracker costs one warning line."""
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


def tracker_env(tmp_path, **extra):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "WANDB_DIR": "",
           "WANDB_PROJECT": "", "MLFLOW_EXPERIMENT_NAME": ""}
    env.update(extra)
    return env


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


def mlflow_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return client, runs


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
    data, log = write_images(tmp_path / "data", n=8), tmp_path / "log"
    env = tracker_env(tmp_path)
    flags = [*TINY, "--data_dir", data, "--log_dir", log, "--max_steps", "8",
             "--save_interval", "3", "--tensorboard", "True", "--tracker", "wandb,mlflow",
             "--sample_interval", "4", "--sample_steps", "2", "--sample_count", "2"]
    out = run_mpi(2, "../tests/fault_train.py", *flags, check=False, timeout=300,
                  env=dict(env, FAULT_RANK="0", FAULT_STEP="5", FAULT_RAISE="SIGKILL"))
    assert out.returncode != 0, out.stdout[-3000:]
    dead = [r["step"] for r in csv_rows(log)]
    assert dead == [1, 2, 3, 4, 5], out.stdout[-3000:]  # logged past the save of step 3
    assert not (log / "manifest000006.json").exists()
    dead_loss = {r["step"]: r["loss"] for r in csv_rows(log)}

    # flagless, on 1 rank: the global batch halves, so steps 4 and 5 get other values
    out = run_script("train.py", "--data_dir", data, "--log_dir", log, timeout=300, env=env)
    assert "resumed at step 3" in out.stdout, out.stdout[-3000:]
    rows = csv_rows(log)
    assert [r["step"] for r in rows] == list(range(1, 9)), rows  # progress.csv: once each
    loss = {int(r["step"]): r["loss"] for r in rows}
    assert loss[3] == dead_loss[3] and loss[4] != dead_loss[4] and loss[5] != dead_loss[5]

    # TensorBoard: purged past the resumed step
    assert tensorboard_scalars(log, "loss") == [(s, pytest.approx(loss[s], rel=1e-6))
                                                for s in range(1, 9)]

    # MLflow: one run, each step once, progress.csv's values
    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, "loss")
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


@pytest.mark.timeout(600)
def test_sigterm_on_2_ranks_then_a_flagless_resume_on_1_continues_the_same_tracker_runs(
        tmp_path):
    data, log = write_images(tmp_path / "data", n=8), tmp_path / "log"
    env = tracker_env(tmp_path)
    cmd = [MPIEXEC, "-n", "2", PY, REPO / "scripts" / "train.py", *TINY, "--data_dir", data,
           "--log_dir", log, "--max_steps", "100000", "--save_interval", "100000",
           "--tracker", "wandb,mlflow"]
    with launched(cmd, tmp_path / "train.log", env=child_env(env)) as proc:
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
                     str(saved + 2), env=env, timeout=300)
    assert f"resumed at step {saved}" in out.stdout, out.stdout[-3000:]
    runs = manifest_runs(log, saved + 2)
    assert runs.items() >= first.items()  # the same runs (MLflow's id may come after a save)
    client, found = mlflow_runs(tmp_path)
    assert [r.info.run_id for r in found] == [runs.get("mlflow", found[0].info.run_id)]
    assert [m.step for m in client.get_metric_history(found[0].info.run_id, "loss")] == list(
        range(1, saved + 3))
    ids, history = wandb_history(log)
    assert ids == {first["wandb"]}
    assert sorted(wandb_shown(history)[0]) == list(range(1, saved + 3))


@pytest.mark.timeout(300)
def test_an_unreachable_mlflow_server_is_one_warning_line_and_training_completes(tmp_path):
    data, log = write_images(tmp_path / "data", n=8), tmp_path / "log"
    env = tracker_env(tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:9",
                      MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    out = run_script("train.py", *TINY, "--data_dir", data, "--log_dir", log, "--max_steps",
                     "3", "--save_interval", "2", "--tracker", "mlflow", env=env, timeout=240)
    lines = [line for line in out.stdout.splitlines() if "--tracker mlflow" in line]
    assert len(lines) == 1 and lines[0].startswith("warning:"), out.stdout[-3000:]
    assert "training goes on" in lines[0]
    assert [r["step"] for r in csv_rows(log)] == [1, 2, 3]
    assert (log / "manifest000003.json").exists()


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
