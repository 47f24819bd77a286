"""The key/value logger: formats, appending on resume, csv header growth, rank-averaged dumps."""
import csv
import io
import json

import pytest
import torch

from improved_diffusion import logger
from conftest import run_module_mpi
from test_disk_faults import can_mount, mounts  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("restore_logger")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rank_zero_writes_stdout_log_and_csv_by_default(tmp_path, capsys):
    logger.configure(dir=str(tmp_path), rank=0)
    logger.log("hello", 3)
    logger.logkv("step", 1)
    logger.logkv_mean("loss", 1.0)
    logger.logkv_mean("loss", 2.0)
    d = logger.dumpkvs()
    assert d == {"step": 1, "loss": 1.5}
    out = capsys.readouterr().out
    assert "hello 3" in out and "| loss" in out and "1.5" in out
    assert logger.get_dir() == str(tmp_path)
    assert "hello 3" in (tmp_path / "log.txt").read_text()
    assert read_csv(tmp_path / "progress.csv") == [{"step": "1", "loss": "1.5"}]
    assert not (tmp_path / "progress.json").exists()


def test_other_ranks_write_nothing_by_default(tmp_path, capsys):
    logger.configure(dir=str(tmp_path), rank=1)
    logger.log("quiet")
    logger.logkv("x", 1)
    logger.dumpkvs()
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []


def test_resumed_log_dir_is_appended_to_and_keeps_old_rows(tmp_path):
    logger.configure(dir=str(tmp_path), format_strs=["log", "csv", "json"], rank=0)
    for step in range(2):
        logger.logkvs({"step": step, "loss": 0.5})
        logger.dumpkvs()
    logger.log("first run")
    logger.configure(dir=str(tmp_path), format_strs="log,csv,json", rank=0)  # the resume
    logger.logkvs({"step": 2, "loss": 0.25})
    logger.dumpkvs()
    rows = read_csv(tmp_path / "progress.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    lines = (tmp_path / "progress.json").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    text = (tmp_path / "log.txt").read_text()
    assert "first run" in text and text.count("Logging to") == 2


def test_new_csv_keys_extend_the_header_without_losing_rows(tmp_path):
    logger.configure(dir=str(tmp_path), format_strs=["csv"], rank=0)
    logger.logkvs({"step": 0, "loss": 1.0})
    logger.dumpkvs()
    logger.configure(dir=str(tmp_path), format_strs=["csv"], rank=0)
    logger.logkvs({"step": 1, "loss": 0.5, "loss_q3": 0.1})
    logger.dumpkvs()
    logger.logkvs({"step": 2, "loss": 0.4, "grad_norm": 2.0})
    logger.dumpkvs()
    header = (tmp_path / "progress.csv").read_text().splitlines()[0]
    assert header == "loss,step,loss_q3,grad_norm"
    assert read_csv(tmp_path / "progress.csv") == [
        {"loss": "1.0", "step": "0", "loss_q3": "", "grad_norm": ""},
        {"loss": "0.5", "step": "1", "loss_q3": "0.1", "grad_norm": ""},
        {"loss": "0.4", "step": "2", "loss_q3": "", "grad_norm": "2.0"},
    ]


def test_resuming_an_upstream_run_dir_continues_its_progress_csv(tmp_path, fixtures_dir):
    src = (fixtures_dir / "upstream_run_small" / "progress.csv").read_text()
    (tmp_path / "progress.csv").write_text(src)
    old_rows = read_csv(tmp_path / "progress.csv")
    logger.configure(dir=str(tmp_path), format_strs=["csv"], rank=0)
    logger.logkvs({"step": 10, "loss": 0.9, "samples": 88})
    logger.dumpkvs()
    rows = read_csv(tmp_path / "progress.csv")
    assert rows[: len(old_rows)] == old_rows
    assert rows[-1]["step"] == "10" and rows[-1]["loss"] == "0.9" and rows[-1]["mse"] == ""


def test_a_row_cut_off_by_a_crash_does_not_swallow_the_next_row(tmp_path):
    (tmp_path / "progress.csv").write_text("loss,step\n1.0,0\n0.9,")
    logger.configure(dir=str(tmp_path), format_strs=["csv"], rank=0)
    logger.logkvs({"step": 2, "loss": 0.8})
    logger.dumpkvs()
    lines = (tmp_path / "progress.csv").read_text().splitlines()
    assert lines[-1] == "0.8,2"


def test_unknown_format_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        logger.configure(dir=str(tmp_path), format_strs=["xml"], rank=0)


@pytest.mark.timeout(120)
def test_dumpkvs_averages_across_ranks_weighted_by_count(tmp_path):
    code = f"""
import torch.distributed as dist
from improved_diffusion import dist_util, logger
dist_util.setup_dist()
r = dist.get_rank()
logger.configure(dir={str(tmp_path)!r}, format_strs=["csv"] if r == 0 else [])
for v in ([1.0] if r == 0 else [2.0, 4.0, 6.0]):
    logger.logkv_mean("loss", v)
if r == 1:
    logger.logkv("only_rank1", 7.0)
logger.logkv("step", 5)
d = logger.dumpkvs()
print("rank", r, sorted(d.items()), flush=True)
dist_util.cleanup()
"""
    run_module_mpi(2, code, timeout=100)
    rows = read_csv(tmp_path / "progress.csv")
    assert len(rows) == 1
    # rank 0: mean 1 over 1 value; rank 1: mean 4 over 3 values -> (1 + 12) / 4
    assert float(rows[0]["loss"]) == pytest.approx(13 / 4)
    assert float(rows[0]["only_rank1"]) == 7.0
    assert rows[0]["step"] == "5"  # an integer agreed by all ranks stays an integer


def test_a_full_disk_under_the_log_dir_is_one_line_naming_the_file_and_keeps_what_was_written(
        tmp_path, can_mount, mounts):  # noqa: F811
    """A real full tmpfs: the next log write raises LogWriteError (a UserError: one line, exit 1)
    naming the disk fault and the file, not an OSError traceback; earlier rows stay on disk."""
    import errno

    from improved_diffusion.infra.errors import UserError

    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=256k", "tmpfs", disk)
    run = disk / "run"
    logger.configure(dir=str(run), format_strs=["log", "csv"], rank=0)
    logger.logkv("step", 1)
    logger.dumpkvs()
    with open(disk / "filler", "wb", buffering=0) as f:  # take every free block
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    logger.logkv("step", 2)
    logger.logkv("note", "x" * 20000)  # needs new blocks in each file
    with pytest.raises(logger.LogWriteError,
                       match=r"no space left on device while writing (log\.txt|progress\.csv)"
                       r".*the saved checkpoints are intact") as info:
        logger.dumpkvs()
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert read_csv(run / "progress.csv")[0]["step"] == "1"  # the row written before is kept


def test_the_tensorboard_format_and_add_tensorboard_share_one_run_without_duplicates(tmp_path):
    """Upstream's "tensorboard" format writes LOG_DIR/tb; --tensorboard's writer to the same
    directory replaces it, so each step is there once; once removed, nothing more is written."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger.configure(dir=str(tmp_path), format_strs="log,tensorboard", rank=0)
    dumps = [{"step": s, "loss": 1 / s, "global_batch": 4} for s in (1, 2, 4, 8)]
    logger.logkvs(dumps[0])
    logger.dumpkvs()
    fmt = logger.add_tensorboard(str(tmp_path / "tb"))
    for d in dumps[1:3]:
        logger.logkvs(d)
        logger.dumpkvs()
    logger.remove_output(fmt)
    logger.logkvs(dumps[3])
    logger.dumpkvs()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1), (2, 0.5), (4, 0.25)]
    assert [e.step for e in events.Scalars("samples_per_s")] == [4]  # the new writer's second


def _log_steps(steps):
    """What a training step logs, for steps ``steps``: a mean on the host, sums on the device,
    a last value."""
    for step in steps:
        values = torch.rand(3, generator=torch.Generator().manual_seed(step), dtype=torch.float32)
        logger.logkv("step", step)
        logger.logkv_mean("host_mean", float(values[0]) / 3)
        logger.logkv_mean_device(["loss", "mse"], values[1:] * 7.1, 1)
        logger.logkv_device("loss_scale", values[0] * 2)


def test_a_window_saved_mid_way_and_restored_in_a_new_logger_gives_the_straight_row_bitwise(
        tmp_path):
    """logger.LogWindow: the sums and counts of an unfinished window go into the save and come
    back in the resumed job, so its next row averages steps 1-10 as a run that never stopped."""
    logger.configure(str(tmp_path / "straight"), format_strs=["csv"])
    _log_steps(range(1, 11))
    straight = logger.dumpkvs()
    logger.configure(str(tmp_path / "chain"), format_strs=["csv"])
    _log_steps(range(1, 8))
    saved = logger.LogWindow(True).state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)  # as the opt file holds it: weights_only-loadable
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    logger.configure(str(tmp_path / "chain"), format_strs=["csv"])  # the resumed job
    logger.LogWindow(True).load_state_dict(saved)
    _log_steps(range(8, 11))
    assert logger.dumpkvs() == straight


def test_a_preemption_row_is_marked_kept_out_of_tensorboard_and_its_window_stays_for_the_save(
        tmp_path):
    logger.configure(str(tmp_path), format_strs=["csv"])
    _log_steps(range(1, 5))
    before = logger.LogWindow(True).state_dict()
    logger.dumpkvs(preempted=True)
    after = logger.LogWindow(True).state_dict()
    assert after["window"]["counts"] == before["window"]["counts"] == {"host_mean": 4}
    assert [torch.equal(a, b) for x, y in zip(after["window"]["device"],
                                              before["window"]["device"])
            for a, b in zip(x[1:], y[1:])] == [True, True]
    assert logger.logged_rows() == []  # what a resume replays to the trackers: not this row
    logger.reset()
    with open(tmp_path / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["preempted"] for r in rows] == ["1"]
    assert not logger.TensorBoardOutputFormat.takes_preempted_rows


def test_a_window_of_another_rank_count_without_global_batch_is_not_restored_and_says_so(
        tmp_path, capsys):
    logger.configure(str(tmp_path), format_strs=["stdout"])
    saved = {"window": {"values": {"loss": 0.5}, "counts": {"loss": 3}, "device": [],
                        "last": {}}, "world_size": 2, "same_on_every_rank": False}
    logger.LogWindow(False).load_state_dict(saved)
    assert "loss" not in logger.getkvs()
    assert "progress.csv's next row averages the steps from here on only" in capsys.readouterr().out
