"""The order and atomicity of a save, recorded while scripts/train.py really saves (issue 25).

tests/record_io_train.py records, at the os/io level, every write, fsync, link/rename and removal
in the log dir while train.py saves every step with --keep_checkpoints 1 (synchronously, from the
trainer's thread, and from the writer process, whose operations the recorder records too). The
record is then read as the story of the directory: no checkpoint file is ever opened for writing
under its final name (only a temporary name, fsynced, then renamed into place, the directory
fsynced after), each step's manifest appears after all of its data files, and from the first
complete step on the directory never holds fewer than one complete step, also while pruning
(whose manifests go first).
"""
import json
import os
import re

import pytest

from conftest import MPIEXEC, PY, REPO, _run, write_images

RECORD_IO_TRAIN = REPO / "tests" / "record_io_train.py"
TINY = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
        "--attention_resolutions", "", "--diffusion_steps", "20", "--noise_schedule", "cosine",
        "--batch_size", "2", "--ema_rate", "0.9999,0.99"]
FINAL_RE = re.compile(r"^(?:model(\d{6,})\.pt|opt(\d{6,})\.pt|manifest(\d{6,})\.json|"
                      r"ema_[0-9.]+_(\d{6,})\.pt)$")
RENAMES = ("link", "rename", "replace")


def step_of(name):
    """The step of a final checkpoint name (model/ema/opt/manifest), else None."""
    m = FINAL_RE.match(name)
    return None if m is None else int(next(g for g in m.groups() if g))


def recorded_save(tmp_path, *flags):
    """Train 3 steps, saving each, keeping 1, under the recorder: (events, log dir path)."""
    log, record = tmp_path / "run", tmp_path / "events.jsonl"
    _run([PY, RECORD_IO_TRAIN, *TINY, "--data_dir", write_images(tmp_path / "data", n=4),
          "--log_dir", log, "--max_steps", "3", "--save_interval", "1",
          "--keep_checkpoints", "1", *flags], timeout=120,
         env={"RECORD_IO": str(record), "RECORD_IO_DIR": str(log)})
    events = [json.loads(line) for line in record.read_text().splitlines()]
    return events, os.path.realpath(log)


def in_place_writes(events, log):
    """Checkpoint files opened for writing under their final names."""
    return [f"#{i} {e['path']}" for i, e in enumerate(events) if e["op"] == "write"
            and os.path.dirname(e["path"]) == log and step_of(os.path.basename(e["path"]))]


def renames_into_place(events, log):
    """{final name: index of the rename that made it} and the problems of each such rename: it
    must come from a temporary name beside it (not another checkpoint's name), written then
    fsynced before the rename, and be followed by an fsync of the directory before the next file
    is renamed into place."""
    appeared, problems = {}, []
    for i, e in enumerate(events):
        if e["op"] not in RENAMES or os.path.dirname(e["to"]) != log:
            continue
        name = os.path.basename(e["to"])
        if step_of(name) is None:
            continue
        appeared[name] = i
        src = os.path.basename(e["path"])
        if step_of(src) is not None or os.path.dirname(e["path"]) != log:
            problems.append(f"#{i} {name}: renamed from {e['path']}, not from a temporary name "
                            f"beside it")
            continue
        writes = [j for j in range(i) if events[j] == {"op": "write", "path": e["path"]}]
        syncs = [j for j in range(i) if events[j] == {"op": "fsync", "path": e["path"]}]
        if not writes or not syncs or syncs[-1] < writes[-1]:
            problems.append(f"#{i} {name}: {src} was not written then fsynced before the rename")
        later = [j for j in range(i + 1, len(events)) if events[j]["op"] in RENAMES]
        bound = later[0] if later else len(events)
        if {"op": "fsync", "path": log} not in events[i + 1:bound]:
            problems.append(f"#{i} {name}: the directory was not fsynced after the rename")
    return appeared, problems


def complete_over_time(events, log):
    """Replay the record: the steps whose manifest has appeared and none of whose files has been
    removed since. Returns the problems: moments (after the first complete step) with no complete
    step, and pruned steps whose manifest was not removed first."""
    complete, seen_one, removed, problems = set(), False, {}, []
    for i, e in enumerate(events):
        if e["op"] in RENAMES and os.path.dirname(e["to"]) == log:
            name = os.path.basename(e["to"])
            if name.startswith("manifest") and step_of(name) is not None:
                complete.add(step_of(name))
                seen_one = True
        if e["op"] in ("unlink", *RENAMES) and os.path.dirname(e["path"]) == log:
            name = os.path.basename(e["path"])  # removed, or moved away (link: still there)
            step = step_of(name)
            if step is None or e["op"] == "link":
                continue
            if not name.startswith("manifest") and step not in removed:
                problems.append(f"#{i} {name} removed while step {step}'s manifest is in place")
            removed.setdefault(step, i)
            complete.discard(step)
        if seen_one and not complete:
            problems.append(f"#{i} {e['op']} {os.path.basename(e['path'])}: no complete step left")
    return removed, problems


@pytest.mark.timeout(150)
# make soak: the thread (it runs run_dir.write_step as the synchronous save does, in the trainer's
# process; sync and the writer process keep the recorded order)
@pytest.mark.parametrize("writer", [pytest.param(["--async_save", "True", "--save_writer",
                                                  "thread"], marks=pytest.mark.slow),
                                    ["--async_save", "True", "--save_writer", "process"],
                                    ["--async_save", "False"]],
                         ids=["async-thread", "async-process", "sync"])
def test_a_save_writes_temporary_files_renames_them_in_order_manifest_last_and_prunes_after(
        tmp_path, writer):
    """Each writer: the trainer's thread, the writer process (which runs the recorder too, as it
    runs a job's importable entry script: writer_process._importable_main), the trainer itself."""
    events, log = recorded_save(tmp_path, *writer)

    assert not in_place_writes(events, log)
    appeared, problems = renames_into_place(events, log)
    assert not problems, "\n".join(problems)
    assert sorted({step_of(n) for n in appeared}) == [1, 2, 3], sorted(appeared)
    for step in (1, 2, 3):
        manifest = f"manifest{step:06d}.json"
        data = sorted(n for n in appeared if step_of(n) == step and n != manifest)
        assert data == sorted([f"ema_0.99_{step:06d}.pt", f"ema_0.9999_{step:06d}.pt",
                               f"model{step:06d}.pt", f"opt{step:06d}.pt"]), data
        late = [n for n in data if appeared[n] > appeared[manifest]]
        assert not late, f"step {step}: {late} renamed into place after its manifest"
    with open(os.path.join(log, "manifest000003.json")) as f:
        assert sorted(json.load(f)["files"]) == data  # the files renamed before it

    removed, problems = complete_over_time(events, log)
    assert not problems, "\n".join(problems)
    assert sorted(removed) == [1, 2]  # --keep_checkpoints 1 pruned them, each once the next
    assert all(removed[s] > appeared[f"manifest{s + 1:06d}.json"] for s in (1, 2))  # was complete
    on_disk = sorted(n for n in os.listdir(log) if step_of(n))
    assert on_disk == sorted(data + ["manifest000003.json"]), on_disk


@pytest.mark.timeout(300)
def test_a_sharded_save_fsyncs_every_shard_renames_the_folder_fsyncs_the_log_dir_then_the_manifest(
        tmp_path):
    """--save_layout sharded on 2 ranks (issue 43, item 19), recorded in both ranks: every
    rank's shards and DCP's index are written and fsynced under the temporary folder, the
    folder fsynced, then renamed into place (stepNNNNNN.dcp), the log dir fsynced, and only then
    is the step's manifest written."""
    log, record = tmp_path / "run", tmp_path / "events.jsonl"
    _run([MPIEXEC, "-n", "2", PY, RECORD_IO_TRAIN, *TINY, "--data_dir",
          write_images(tmp_path / "data", n=4), "--log_dir", log, "--max_steps", "2",
          "--save_interval", "1", "--fsdp", "True", "--save_layout", "sharded"], timeout=240,
         env={"RECORD_IO": str(record), "RECORD_IO_DIR": str(log)})
    events = [json.loads(line) for line in record.read_text().splitlines()]
    log = os.path.realpath(log)
    for step in (1, 2):
        final = os.path.join(log, f"step{step:06d}.dcp")
        renames = [(i, e) for i, e in enumerate(events)
                   if e["op"] in RENAMES and e["to"] == final]
        assert len(renames) == 1, renames
        r, tmp = renames[0][0], renames[0][1]["path"]
        assert os.path.basename(tmp).startswith(f"step{step:06d}.dcp.tmp-"), tmp
        shards = sorted(os.listdir(final))
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
        for name in shards:  # DCP writes .metadata as .metadata.tmp, then renames it
            path = os.path.join(tmp, name)
            path = next((e["path"] for e in reversed(events[:r])
                         if e["op"] in RENAMES and e["to"] == path), path)
            writes = [i for i, e in enumerate(events[:r]) if e == {"op": "write", "path": path}]
            syncs = [i for i, e in enumerate(events[:r]) if e == {"op": "fsync", "path": path}]
            assert writes and syncs and syncs[-1] > writes[-1], (step, name)
        assert {"op": "fsync", "path": tmp} in events[:r], f"step {step}: folder not fsynced"
        manifest = f"manifest{step:06d}.json"
        touched = [i for i, e in enumerate(events)
                   if os.path.basename(e.get("to") or e["path"]).startswith(manifest)]
        assert touched and touched[0] > r, f"step {step}: the manifest came before the rename"
        assert {"op": "fsync", "path": log} in events[r + 1:touched[0]], \
            f"step {step}: the log dir was not fsynced between the rename and the manifest"
