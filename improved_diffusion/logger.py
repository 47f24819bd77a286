"""
Key/value logging with upstream's API (from OpenAI baselines via improved-diffusion).

Formats: stdout (upstream's key/value table), progress (one line per dump on stdout: step, loss,
grad norm, steps/s, samples/s, elapsed, ETA), log (log.txt, the table), csv (progress.csv), json
(progress.json), tensorboard (when torch.utils.tensorboard is importable; ``add_tensorboard``
adds it to a configured logger, with images through ``write_image``). Rank 0 logs
"stdout,log,csv" by default (``configure(stdout_format="progress")``: "progress,log,csv", what
train.py does); other ranks log nothing unless asked. ``Progress`` reports a long loop: a bar on
a terminal, plain lines otherwise. Files in an existing log directory are APPENDED to, never
truncated, so a resumed run continues its progress.csv (``drop_rows_after`` first removes the rows
of steps after the resumed one); when new keys appear, the csv header is rewritten and the old
rows are kept (padded with empty cells). ``committed`` tells outputs that hold rows back until a
save has them (trackers.py) that a save is complete.

`dumpkvs()` is a collective when torch.distributed is initialised: the values are averaged
across ranks, weighted by how many times each rank logged them, and rank 0 writes.

A log directory in an object store (``s3://``, ``gs://``, ``az://``: ckpt/storage.py) has no
append: the text files (log.txt, progress.csv, progress.json, TensorBoard's event files) are
written to a local spool directory (``_Mirror``; the existing objects downloaded into it first,
so a resumed run continues them) and each changed file is put back whole at every ``dumpkvs``
(at most every ``_Mirror.EVERY_S`` seconds), at ``close``, with each line of
``append_to_log_files`` (an error's, before a job is ended) and at a script's end
(``upload_spools``, from cli.run_main: before the interpreter's exit, where the stores' clients
can no longer run, so the atexit upload is a last resort only). Nothing is written to a local
folder named like the URL. A failed upload is a warning, retried at the next
one (the whole file goes up each time, so nothing is lost while the process lives).
"""
import atexit
import datetime
import json
import os
import os.path as osp
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch as th

from . import dist_util
from .infra import storage
from .infra.errors import UserError

DEBUG = 10
INFO = 20
WARN = 30
ERROR = 40
DISABLED = 50


class LogWriteError(UserError):
    """A log file (log.txt, progress.csv, ...) could not be written: a disk fault, in one line."""


class KVWriter:
    # A preemption's row (dumpkvs(preempted=True): the window cut short by the save) goes to
    # outputs that are logs of this job (stdout, log.txt, progress.csv/json), marked in their
    # "preempted" column; not to TensorBoard or the trackers, which show the run's rows only.
    takes_preempted_rows = False

    def writekvs(self, kvs):
        raise NotImplementedError


class SeqWriter:
    def writeseq(self, seq):
        raise NotImplementedError


class HumanOutputFormat(KVWriter, SeqWriter):
    """A table of key/values and free text lines, to a stream or appended to a file."""

    takes_preempted_rows = True

    def __init__(self, filename_or_file):
        if isinstance(filename_or_file, str):
            self.file = open(filename_or_file, "at")
            self.own_file = True
        else:
            if not hasattr(filename_or_file, "write"):
                raise TypeError(f"expected a file or a file name, got {filename_or_file!r}")
            self.file = filename_or_file
            self.own_file = False

    def writekvs(self, kvs):
        key2str = {}
        for key, val in sorted(kvs.items()):
            if isinstance(val, int) and not isinstance(val, bool):
                valstr = str(val)  # step and sample counts exactly (upstream printed 1.2e+03)
            elif hasattr(val, "__float__"):
                valstr = "%-8.3g" % val
            else:
                valstr = str(val)
            key2str[self._truncate(key)] = self._truncate(valstr)
        if len(key2str) == 0:
            print("WARNING: tried to write empty key-value dict")
            return
        keywidth = max(map(len, key2str.keys()))
        valwidth = max(map(len, key2str.values()))
        dashes = "-" * (keywidth + valwidth + 7)
        lines = [dashes]
        for key, val in sorted(key2str.items(), key=lambda kv: kv[0].lower()):
            lines.append(
                "| %s%s | %s%s |"
                % (key, " " * (keywidth - len(key)), val, " " * (valwidth - len(val)))
            )
        lines.append(dashes)
        self.file.write("\n".join(lines) + "\n")
        self.file.flush()

    def _truncate(self, s):
        maxlen = 30
        return s[: maxlen - 3] + "..." if len(s) > maxlen else s

    def writeseq(self, seq):
        seq = list(seq)
        for i, elem in enumerate(seq):
            self.file.write(str(elem))
            if i < len(seq) - 1:
                self.file.write(" ")
        self.file.write("\n")
        self.file.flush()

    def close(self):
        if self.own_file:
            self.file.close()


def format_duration(seconds):
    """``45s``, ``3m05s``, ``2h07m``: a duration as the progress line shows it."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _short(v):
    num = _as_number(v)
    if num is None:
        return str(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return f"{num:.4g}"


class ProgressOutputFormat(KVWriter, SeqWriter):
    """
    One line per dump on a stream, timed by the format itself between dumps:

        step 300/1200  loss 0.0712  grad_norm 0.512  3.41 steps/s  218 samples/s  elapsed 1m28s
        ETA 4m24s     (one line)

    steps/s and samples/s are over the last interval; ETA (with a known total, see
    ``start_progress``) from the average rate of this job. Free text lines pass through. A dump
    without a "step" key is shown as ``key value`` pairs.
    """

    # key -> label shown after the step, in this order, when logged
    KEYS = (("loss", "loss"), ("train_loss", "loss"), ("train_acc@1", "acc@1"),
            ("val_loss", "val_loss"), ("val_acc@1", "val_acc@1"), ("grad_norm", "grad_norm"),
            ("loss_scale", "loss_scale"))  # train_* / val_*: classifier_train.py
    EVAL = ("fid_", "is_")  # the prefixes of the evaluation's keys, shown after those

    takes_preempted_rows = True

    def __init__(self, file):
        self.file = file
        self.rates = _Rates()
        self.start(None)

    def start(self, step, total_steps=0):
        """Time from now: ``step`` is where this job starts (resumed step), ``total_steps`` the
        step it stops at (0: unknown, no ETA)."""
        self.t0, self.step0, self.total = self.rates.start(step), step, int(total_steps or 0)

    def writekvs(self, kvs):
        now = time.time()
        step = kvs.get("step")
        if step is None:
            line = "  ".join(f"{k} {_short(v)}" for k, v in sorted(kvs.items()))
        else:
            step = int(step)
            parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
            parts += [f"{label} {_short(kvs[k])}" for k, label in self.KEYS if k in kvs]
            # train.py --eval_interval's figures (train_eval.py): fid_ema_RATE, is_ema_RATE
            parts += [f"{k} {_short(kvs[k])}" for k in sorted(kvs) if k.startswith(self.EVAL)]
            if kvs.get("nan_skipped"):
                parts.append("steps skipped (NaN/Inf)")
            if kvs.get("fp16_skipped"):
                parts.append("steps skipped (fp16 overflow)")
            rates = self.rates.update(kvs, now)
            if "steps_per_s" in rates:
                parts.append(f"{rates['steps_per_s']:.3g} steps/s")
            if "samples_per_s" in rates:
                parts.append(f"{rates['samples_per_s']:.3g} samples/s")
            parts.append(f"elapsed {format_duration(now - self.t0)}")
            if self.total and self.step0 is not None and step > self.step0:
                rate = (step - self.step0) / max(now - self.t0, 1e-9)
                parts.append(f"ETA {format_duration(max(0, self.total - step) / rate)}")
        self.file.write("  ".join(parts) + "\n" if step is not None else line + "\n")
        self.file.flush()

    def writeseq(self, seq):
        self.file.write(" ".join(str(e) for e in seq) + "\n")
        self.file.flush()

    def close(self):
        pass


class _Rates:
    """steps/s and samples/s between two dumps that carry a "step" (samples from the "samples"
    key, else the steps times "global_batch"), timed by the wall clock."""

    def __init__(self):
        self.start(None)

    def start(self, step):
        """Time from now, from ``step`` (None: from the first dump). Returns now."""
        now = time.time()
        self.last = (now, step, None)
        return now

    def update(self, kvs, now=None):
        """{"steps_per_s": x, "samples_per_s": y} since the last dump (or start), either absent
        when unknown, for a dump of ``kvs`` with a "step" at ``now``; then times from it."""
        now = time.time() if now is None else now
        step = int(kvs["step"])
        out = {}
        t_last, step_last, samples_last = self.last
        if step_last is not None and step > step_last and now > t_last:
            dt = now - t_last
            out["steps_per_s"] = (step - step_last) / dt
            samples = _as_number(kvs.get("samples"))
            if samples is not None and samples_last is not None and samples > samples_last:
                out["samples_per_s"] = (samples - samples_last) / dt
            elif kvs.get("global_batch"):
                out["samples_per_s"] = (step - step_last) * float(kvs["global_batch"]) / dt
        self.last = (now, step, _as_number(kvs.get("samples")))
        return out


class JSONOutputFormat(KVWriter):
    """One JSON object per dump, appended to the file."""

    takes_preempted_rows = True

    def __init__(self, filename):
        self.file = open(filename, "at")

    def writekvs(self, kvs):
        out = {}
        for k, v in sorted(kvs.items()):
            if hasattr(v, "dtype") or hasattr(v, "item"):
                v = float(v)
            out[k] = v
        self.file.write(json.dumps(out) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


class CSVOutputFormat(KVWriter):
    """
    progress.csv: appends to an existing file (keeping its header); new keys extend the header
    and the file is rewritten with old rows padded, as upstream does within one run.
    """

    takes_preempted_rows = True

    def __init__(self, filename):
        self.filename = filename
        self.keys = []
        self.sep = ","
        self.file = open(filename, "a+t")
        self.file.seek(0)
        lines = self.file.read().split("\n")
        if lines and lines[0].strip():
            self.keys = lines[0].split(self.sep)
        self.file.seek(0, os.SEEK_END)
        # A run killed mid-write may leave a row without its newline; never glue onto it.
        if self.file.tell() > 0:
            self.file.seek(self.file.tell() - 1)
            last = self.file.read(1)
            self.file.seek(0, os.SEEK_END)
            if last != "\n":
                self.file.write("\n")
                self.file.flush()

    def writekvs(self, kvs):
        extra_keys = sorted(set(kvs.keys()) - set(self.keys))
        if extra_keys:
            self.keys.extend(extra_keys)
            self.file.seek(0)
            lines = self.file.read().split("\n")
            if lines and lines[-1] == "":
                lines = lines[:-1]
            self.file.seek(0)
            self.file.truncate()
            self.file.write(self.sep.join(self.keys) + "\n")
            for line in lines[1:]:
                self.file.write(line)
                self.file.write(self.sep * len(extra_keys))
                self.file.write("\n")
        for i, k in enumerate(self.keys):
            if i > 0:
                self.file.write(self.sep)
            v = kvs.get(k)
            if v is not None:
                if not isinstance(v, (int, float, str)) and _as_number(v) is not None:
                    v = _as_number(v)  # numpy / 0-d tensor scalars as plain numbers
                self.file.write(str(v))
        self.file.write("\n")
        self.file.flush()

    def rows(self):
        """The rows so far: [{key: float}] (empty cells and non-numbers left out)."""
        self.file.seek(0)
        lines = self.file.read().split("\n")
        self.file.seek(0, os.SEEK_END)
        out = []
        for line in lines[1:]:
            if line:
                cells = line.split(self.sep)
                out.append({k: float(c) for k, c in zip(self.keys, cells) if _is_float(c)})
        return out

    def drop_rows_after(self, step):
        """Remove the rows of steps after ``step`` (a resumed run's step: a job killed after its
        last save logged them, and they are trained again); returns how many."""
        if "step" not in self.keys:
            return 0
        self.file.seek(0)
        lines = [line for line in self.file.read().split("\n") if line]
        i = self.keys.index("step")
        kept = [lines[0]] + [line for line in lines[1:] if not _after(line.split(self.sep), i,
                                                                        step)]
        if len(kept) < len(lines):
            self.file.seek(0)
            self.file.truncate()
            self.file.write("\n".join(kept) + "\n")
            self.file.flush()
        self.file.seek(0, os.SEEK_END)
        return len(lines) - len(kept)

    def close(self):
        self.file.close()


def _is_float(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _after(cells, i, step):
    return i < len(cells) and _is_float(cells[i]) and float(cells[i]) > step


class TensorBoardOutputFormat(KVWriter):
    """
    Scalars (every numeric key/value of a dump, at its "step"; with one, also steps_per_s and
    samples_per_s since the last dump) and images (``write_image``) to TensorBoard event files in
    `dir` (needs the tensorboard package), flushed at every dump.

    ``purge_step``: the first step this writer will log (a resumed run's step + 1). Events of
    earlier writers in `dir` at this step or later (logged by a run killed after its last saved
    step, whose steps are trained again) are hidden from TensorBoard's readers, so every step
    appears once.
    """

    def __init__(self, dir, purge_step=None):
        from torch.utils.tensorboard import SummaryWriter  # noqa: optional dependency

        os.makedirs(dir, exist_ok=True)
        self.dir = dir
        self.step = 1
        self.rates = _Rates()
        if purge_step is not None:
            self.rates.start(purge_step - 1)
        self.writer = SummaryWriter(log_dir=dir, purge_step=purge_step)

    def start(self, step, total_steps=0):
        """The rates time from now, from ``step`` (logger.start_progress)."""
        self.rates.start(step)

    def writekvs(self, kvs):
        step = kvs.get("step", self.step)
        for k, v in kvs.items():
            if hasattr(v, "__float__"):
                self.writer.add_scalar(k, float(v), int(step))
        if "step" in kvs:
            for k, v in self.rates.update(kvs).items():
                self.writer.add_scalar(k, v, int(step))
        self.writer.flush()
        self.step += 1

    def write_image(self, tag, image, step):
        """``image``: uint8 [H, W, C] numpy, at ``step``."""
        self.writer.add_image(tag, image, int(step), dataformats="HWC")
        self.writer.flush()

    def close(self):
        self.writer.close()


def make_output_format(format, ev_dir, log_suffix="", mirror=None):
    """
    :param format: one of "stdout", "progress", "log", "json", "csv", "tensorboard".
    :param mirror: for a log dir in an object store, its _Mirror: the files are written to its
        spool (the store's copies fetched first) and ``ev_dir`` is not touched.
    :return: a KVWriter, or None for tensorboard when it is not installed (with a warning).
    """
    if mirror is not None:
        appended = {"log": "log%s.txt", "json": "progress%s.json", "csv": "progress%s.csv"}
        if format in appended:
            mirror.fetch(appended[format] % log_suffix)
        ev_dir = mirror.local
    os.makedirs(ev_dir, exist_ok=True)
    if format == "stdout":
        return HumanOutputFormat(sys.stdout)
    elif format == "progress":
        return ProgressOutputFormat(sys.stdout)
    elif format == "log":
        return HumanOutputFormat(osp.join(ev_dir, "log%s.txt" % log_suffix))
    elif format == "json":
        return JSONOutputFormat(osp.join(ev_dir, "progress%s.json" % log_suffix))
    elif format == "csv":
        return CSVOutputFormat(osp.join(ev_dir, "progress%s.csv" % log_suffix))
    elif format == "tensorboard":
        try:
            return TensorBoardOutputFormat(osp.join(ev_dir, "tb%s" % log_suffix))
        except ImportError:
            warnings.warn("tensorboard logging skipped: the tensorboard package is not installed")
            return None
    else:
        raise ValueError(
            f"unknown log format {format!r}; use stdout, progress, log, csv, json or tensorboard"
        )


# ================================================================
# API
# ================================================================


def logkv(key, val):
    """
    Log a value of some diagnostic. Call once per iteration per key; the last value wins.
    """
    get_current().logkv(key, val)


def logkv_mean(key, val):
    """The same as logkv(), but if called many times, the values are averaged."""
    get_current().logkv_mean(key, val)


def logkv_mean_device(keys, totals, counts):
    """logkv_mean() for values that live on a device, without reading them to the host now.

    ``keys``: a name or a list of K names; ``totals``: a tensor (0-d, or [K]) holding the sum of
    the values of each name; ``counts``: how many values each total sums (an int, or a tensor of
    K counts on the same device). Sums and counts accumulate on the device and are read once, by
    the next dumpkvs(), which then writes the same means as K * count logkv_mean() calls would
    (up to float rounding). Call with the same list of names each time (one accumulator per list).
    """
    get_current().logkv_mean_device(keys, totals, counts)


def logkv_device(key, val):
    """logkv() of a 0-d device tensor (the last value wins), read by the next dumpkvs()."""
    get_current().logkv_device(key, val)


def logkvs(d):
    """Log a dictionary of key-value pairs."""
    for (k, v) in d.items():
        logkv(k, v)


def dumpkvs(preempted=False):
    """
    Write all diagnostics of this iteration and clear them (``preempted``: a preemption's row,
    marked, and the window kept for the save: Logger.dumpkvs).

    Collective: call from all ranks with the same arguments (when torch.distributed is
    initialised; values are averaged across ranks weighted by their counts).
    """
    return get_current().dumpkvs(preempted)


class LogWindow:
    """The unfinished log window as a checkpointer state (``states={"log_window": ...}``): the
    sums and counts that the next dumpkvs() would average, saved with the step and restored on
    resume, so that the row after a resume averages the same steps, to the bit, as the row of a
    run that never stopped (a run logging every 10 steps, saved at 18: its row at 20 averages
    steps 11-20 either way).

    The file holds rank 0's window. ``same_on_every_rank``: every rank logs the same values
    (--global_batch_size: the losses are the shards', gathered alike on every rank), so rank 0's
    window is every rank's, on any rank count. Otherwise each rank's values differ: only a
    one-rank run keeps its window (and puts it back on one rank; on more, a line says the next
    row averages from the resume); a run of more ranks keeps none.
    Example::

        ckpt = Checkpointer(cfg, ..., states={"log_window": logger.LogWindow(True)})
    """

    name = "log_window"

    def __init__(self, same_on_every_rank):
        self.same_on_every_rank = bool(same_on_every_rank)

    def state_dict(self):
        """Not collective (reads the device sums: one host sync per save)."""
        world_size = _world_size()
        # rank 0's window alone is the run's only when every rank logs alike or there is one
        # rank: otherwise none is kept (a resume could not use it, and the files of a resumed
        # run stay those of a straight run's)
        keep = self.same_on_every_rank or world_size == 1
        return {"window": get_current().window_state() if keep else None,
                "world_size": world_size, "same_on_every_rank": self.same_on_every_rank}

    def load_state_dict(self, state):
        """Not collective; every rank decides alike (the file's flags and the world size)."""
        window = state.get("window") or {}
        if window and self.restorable(state):
            get_current().load_window_state(window)
        elif window.get("counts") or window.get("device"):
            log(f"resume: progress.csv's next row averages the steps from here on only (the "
                f"saved window is rank 0's of {state.get('world_size')}, not the run's; "
                f"--global_batch_size keeps it)")

    def restorable(self, state):
        return bool(state.get("same_on_every_rank") and self.same_on_every_rank) or (
            state.get("world_size") == 1 and _world_size() == 1)

    def resume_without_state(self, step):
        """A step saved before windows were saved: the next row averages from the resume."""


def _world_size():
    world = _dist_world()
    return 1 if world is None else world[1]


def getkvs():
    return get_current().name2val


def start_progress(step, total_steps=0):
    """The progress line (and TensorBoard's rates) time this job from now, starting at ``step``;
    ``total_steps`` (0: unknown) gives it an ETA. Not collective (a no-op on ranks without a
    progress line)."""
    for fmt in get_current().output_formats:
        if hasattr(fmt, "start"):  # the progress line, TensorBoard, the trackers
            fmt.start(step, total_steps)


def drop_rows_after(step):
    """A resumed run at ``step``: remove progress.csv's rows of later steps (logged by a job
    killed after its last save; trained again now, so each step shows once), with one log line.
    Not collective (a no-op on ranks that write no progress.csv)."""
    dropped = sum(fmt.drop_rows_after(step) for fmt in get_current().output_formats
                  if isinstance(fmt, CSVOutputFormat))
    if dropped:
        log(f"progress.csv: removed {dropped} row(s) of steps after {step}, logged by a job "
            f"that ended before saving them (they are trained again)")
    return dropped


def logged_rows(up_to=None):
    """progress.csv's rows so far ([{key: float}]), those of steps up to ``up_to`` when given;
    [] without one. A preemption's rows (their "preempted" column) are not the run's: left out."""
    for fmt in get_current().output_formats:
        if isinstance(fmt, CSVOutputFormat):
            return [r for r in fmt.rows() if "step" in r and not r.get("preempted")
                    and (up_to is None or r["step"] <= up_to)]
    return []


def committed(step):
    """The save of ``step`` is complete (its manifest written): the outputs that hold rows back
    until a checkpoint has them (trackers.Trackers) send them. Not collective."""
    for fmt in list(get_current().output_formats):
        if hasattr(fmt, "committed"):
            fmt.committed(step)


class _Mirror:
    """The local spool of a log directory in an object store (module docstring): ``local`` is
    where the formats write, ``remote`` the URL the files go to. Not collective (the rank that
    logs)."""

    EVERY_S = 2.0
    _live = weakref.WeakSet()

    def __init__(self, remote):
        self.remote = remote.rstrip("/")
        self.local = tempfile.mkdtemp(prefix="improved-diffusion-logdir-")
        self._sent = {}  # relative path -> (size, mtime_ns) last uploaded
        self._last = 0.0
        self._warned = False
        self._lock = threading.Lock()  # an error line's upload may come from another thread
        _Mirror._live.add(self)

    def fetch(self, name):
        """Download ``name`` into the spool when the store has it (a resumed run appends)."""
        target = osp.join(self.local, name)
        try:
            data = storage.read_bytes(storage.join(self.remote, name))
        except FileNotFoundError:
            return target
        with open(target, "wb") as f:
            f.write(data)
        st = os.stat(target)
        self._sent[name] = (st.st_size, st.st_mtime_ns)
        return target

    def local_path(self, path):
        """The spool's path for ``path`` under the remote directory, else None."""
        path = os.fspath(path).rstrip("/")
        if path == self.remote:
            return self.local
        if path.startswith(self.remote + "/"):
            return osp.join(self.local, path[len(self.remote) + 1:])
        return None

    def sync(self, force=False):
        """Put each file changed since its last upload (at most every EVERY_S unless
        ``force``)."""
        with self._lock:
            self._sync(force)

    def _sync(self, force):
        now = time.monotonic()
        if not force and now - self._last < self.EVERY_S:
            return
        self._last = now
        for root, _, files in os.walk(self.local):
            for fname in files:
                full = osp.join(root, fname)
                rel = osp.relpath(full, self.local)
                try:
                    st = os.stat(full)
                    key = (st.st_size, st.st_mtime_ns)
                    if self._sent.get(rel) == key:
                        continue
                    with open(full, "rb") as f:
                        storage.put(storage.join(self.remote, *rel.split(os.sep)), f.read())
                    self._sent[rel] = key
                except OSError as e:
                    if not self._warned:
                        sys.stderr.write(f"warning: cannot upload {rel} to {self.remote} "
                                         f"({type(e).__name__}: {e}); retried at the next "
                                         f"dump\n")
                        self._warned = True


def upload_spools():
    """Put each changed file of every log dir spool (a log dir in an object store: _Mirror) to
    its store now. A script's end calls it (cli.run_main), before the interpreter's exit: by the
    atexit handlers the stores' clients can no longer run (adlfs: "cannot schedule new futures
    after shutdown"), so the upload there is a last resort for a process that ends otherwise.
    Not collective; never raises (a failed upload is the spool's warning)."""
    for mirror in list(_Mirror._live):
        mirror.sync(force=True)


atexit.register(upload_spools)


def add_tensorboard(dir, purge_step=None):
    """Also write this logger's key/values, and the images of write_image(), to TensorBoard event
    files in ``dir`` (TensorBoardOutputFormat; a writer to the same directory that the logger
    already has, from format "tensorboard", is closed and replaced: one run, no duplicates).
    Returns the output; remove_output() closes it. Not collective: call on the rank that logs."""
    current = get_current()
    if storage.is_remote(dir):  # its event files go to the log dir's spool, then the store
        local = current._mirror.local_path(dir) if current._mirror is not None else None
        if local is None:
            raise ValueError(f"TensorBoard dir {dir} is not under the log dir {current.dir}")
        dir = local
    for fmt in [f for f in current.output_formats if isinstance(f, TensorBoardOutputFormat)]:
        if osp.abspath(fmt.dir) == osp.abspath(dir):
            remove_output(fmt)
    fmt = TensorBoardOutputFormat(dir, purge_step=purge_step)
    current.output_formats.append(fmt)
    return fmt


def remove_output(fmt):
    """Close the output ``fmt`` and take it off the current logger (if still there)."""
    current = Logger.CURRENT
    if current is not None and fmt in current.output_formats:
        current.output_formats.remove(fmt)
    fmt.close()


def write_image(tag, image, step):
    """Write ``image`` (uint8 [H, W, C] numpy) at ``step`` to the outputs that take images
    (TensorBoard, the trackers); a no-op without one. Not collective."""
    get_current()._each_output(KVWriter, lambda fmt: fmt.write_image(tag, image, step)
                               if hasattr(fmt, "write_image") else None)


def append_to_log_files(text):
    """Append ``text`` (a line) to the current logger's text files (log.txt), not to stdout;
    a log dir in an object store gets them at once (a job may be ended right after the line).
    A no-op without a configured logger; never raises for a log dir that went away."""
    current = Logger.CURRENT
    if current is None:
        return
    for fmt in current.output_formats:
        if isinstance(fmt, HumanOutputFormat) and fmt.own_file and not fmt.file.closed:
            try:
                fmt.writeseq([text.rstrip("\n")])
            except OSError:  # the log dir is full or gone: the line is on stderr already
                pass
    if current._mirror is not None:
        current._mirror.sync(force=True)


def log(*args, level=INFO):
    """Write the sequence of args, with no separators, to the text outputs (stdout, log.txt)."""
    get_current().log(*args, level=level)


def debug(*args):
    log(*args, level=DEBUG)


def info(*args):
    log(*args, level=INFO)


def warn(*args):
    log(*args, level=WARN)


def error(*args):
    log(*args, level=ERROR)


def set_level(level):
    """Set logging threshold on current logger."""
    get_current().set_level(level)


def get_dir():
    """The directory log files are written to. Before any configure(), upstream's: a fresh
    temporary directory (openai-...), made now, with log.txt and progress.csv in it."""
    current = get_current()
    if current is Logger.DEFAULT and current.dir is None:
        configure()
        Logger.DEFAULT = Logger.CURRENT
    return get_current().get_dir()


record_tabular = logkv
dump_tabular = dumpkvs


@contextmanager
def profile_kv(scopename):
    logkey = "wait_" + scopename
    tstart = time.time()
    try:
        yield
    finally:
        get_current().name2val[logkey] += time.time() - tstart


def profile(n):
    """Usage: @profile("my_func") def my_func(): code"""

    def decorator_with_name(func):
        def func_wrapper(*args, **kwargs):
            with profile_kv(n):
                return func(*args, **kwargs)

        return func_wrapper

    return decorator_with_name


# ================================================================
# Backend
# ================================================================


def get_current():
    if Logger.CURRENT is None:
        _configure_default_logger()
    return Logger.CURRENT


def _dist_world():
    """(rank, world_size) of the process group, or None without one."""
    if dist_util.is_distributed():
        return dist_util.get_rank(), dist_util.get_world_size()
    return None


def _as_number(v):
    """A python float for numeric values (incl. numpy / 0-d tensors), else None."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        try:
            return float(v.item())
        except (TypeError, ValueError):
            return None
    return None


def weighted_mean_across_ranks(name2valcount):
    """
    Average {name: (value, count)} over all ranks of torch.distributed, weighted by count.
    Keys logged on only some ranks are averaged over those. Non-numeric values keep rank 0's;
    a value that is the same on every rank that logs it is written as it is (integers such as
    step and samples stay integers; --global_batch_size's losses and grad norm, computed alike on
    every rank, are the same numbers on any rank count, unrounded by the sum).

    Collective: call from all ranks with the same arguments.
    """
    local = {}
    for k, (v, c) in name2valcount.items():
        num = _as_number(v)
        is_int = isinstance(v, int) and not isinstance(v, bool)
        local[k] = (v if is_int else (num if num is not None else v), c, num is not None)
    gathered = dist_util.all_gather_object(local)
    sums = defaultdict(float)
    counts = defaultdict(float)
    others = {}
    for d in gathered:
        for k, (v, c, numeric) in d.items():
            if numeric:
                sums[k] += v * c
                counts[k] += c
            elif k not in others:
                others[k] = v
    out = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
    for k in out:
        values = {d[k][0] for d in gathered if k in d}
        if len(values) == 1:
            out[k] = next(iter(values))
    for k, v in others.items():
        out.setdefault(k, v)
    return out


class Progress:
    """
    Progress of a long loop (sampling): a tqdm bar when ``file`` is a terminal; otherwise a plain
    line through ``log`` at most every ``every_s`` seconds and at the end, so that log files get
    no escape sequences. ``enabled=False`` shows nothing.
    """

    def __init__(self, total, desc, unit="it", *, enabled=True, file=None, every_s=10.0,
                 log=None):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.file = file if file is not None else sys.stderr
        self.log_line = log or (lambda text: get_current().log(text))
        self.n, self.t0 = 0, time.time()
        self.t_shown = self.t0
        self.bar = None
        self.enabled = enabled
        self.is_tty = bool(enabled and hasattr(self.file, "isatty") and self.file.isatty())
        if self.is_tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=self.file)

    def update(self, n=1):
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.time() - self.t_shown >= self.every_s and self.n < self.total:
            self._line()

    def _line(self):
        now = time.time()
        self.t_shown = now
        text = (f"{self.desc} {self.n}/{self.total} {self.unit}, "
                f"elapsed {format_duration(now - self.t0)}")
        if 0 < self.n < self.total:
            text += f", ETA {format_duration((self.total - self.n) * (now - self.t0) / self.n)}"
        self.log_line(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._line()


class Logger:
    DEFAULT = None  # A logger with no output files. (See right below class definition)
    CURRENT = None  # Current logger being used by the free functions above

    def __init__(self, dir, output_formats, rank=0):
        self.name2val = defaultdict(float)  # values this iteration
        self.name2cnt = defaultdict(int)
        self.level = INFO
        self.dir = dir
        self.output_formats = output_formats
        self.rank = rank
        self._mirror = None  # a log dir in an object store: its local spool (_Mirror)
        self._device_means = {}  # (names,) -> [sums [K], counts [K]] on the device
        self._device_last = {}  # name -> 0-d tensor

    # Logging API, forwarded
    # ----------------------------------------
    def logkv(self, key, val):
        self.name2val[key] = val

    def logkv_mean(self, key, val):
        oldval, cnt = self.name2val[key], self.name2cnt[key]
        self.name2val[key] = oldval * cnt / (cnt + 1) + val / (cnt + 1)
        self.name2cnt[key] = cnt + 1

    def logkv_mean_device(self, keys, totals, counts):
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        totals = totals.detach().reshape(-1)
        acc = self._device_means.get(keys)
        if acc is not None and acc[0].device != totals.device:  # restored (window_state) on the CPU
            acc = self._device_means[keys] = [a.to(totals.device) for a in acc]
        if acc is None:
            dtype = th.float32 if totals.device.type == "mps" else th.float64
            acc = [th.zeros(len(keys), dtype=dtype, device=totals.device),
                   th.zeros(len(keys), dtype=th.int64, device=totals.device)]
            self._device_means[keys] = acc
        acc[0].add_(totals.to(acc[0].dtype))
        acc[1].add_(counts.reshape(-1) if isinstance(counts, th.Tensor) else counts)

    def logkv_device(self, key, val):
        self._device_last[key] = val.detach().reshape(()).clone()

    def _flush_device_values(self):
        """Fold the device accumulators into name2val/name2cnt: one read of all of them."""
        if not self._device_means and not self._device_last:
            return
        groups = list(self._device_means.items())
        last = list(self._device_last.items())
        parts = [t.double().cpu() for _, (s, c) in groups for t in (s, c)]
        parts += [v.double().reshape(1).cpu() for _, v in last]
        flat = th.cat(parts).tolist() if parts else []
        i = 0
        for keys, _ in groups:
            k = len(keys)
            sums, counts = flat[i:i + k], flat[i + k:i + 2 * k]
            i += 2 * k
            for key, total, count in zip(keys, sums, counts):
                count = int(count)
                if count == 0:
                    continue
                cnt0 = self.name2cnt.get(key, 0)
                val0 = self.name2val[key] if cnt0 else 0.0
                self.name2val[key] = (val0 * cnt0 + total) / (cnt0 + count)
                self.name2cnt[key] = cnt0 + count
        for key, _ in last:
            self.name2val[key] = flat[i]
            i += 1
        self._device_means.clear()
        self._device_last.clear()

    def dumpkvs(self, preempted=False):
        """
        ``preempted``: the row of a window a preemption cuts short: written with "preempted" 1
        to the outputs that take such rows (KVWriter.takes_preempted_rows), and the window kept,
        so that the save that follows holds it (window_state) and the resumed run's next row
        averages the same steps as a straight run's.

        Collective: call from all ranks with the same arguments (when torch.distributed is
        initialised).
        """
        kept = self.window_state() if preempted else None
        self._flush_device_values()
        world = _dist_world()
        if world is None or world[1] == 1:
            d = dict(self.name2val)
        else:
            d = weighted_mean_across_ranks(
                {name: (val, self.name2cnt.get(name, 1)) for (name, val) in self.name2val.items()}
            )
        out = d.copy()  # Return the dict for unit testing purposes
        if preempted:
            d["preempted"] = 1
        self._each_output(KVWriter, lambda fmt: (fmt.writekvs(d) if not preempted or
                                                 fmt.takes_preempted_rows else None))
        if self._mirror is not None:
            self._mirror.sync()
        self.name2val.clear()
        self.name2cnt.clear()
        if kept is not None:
            self.load_window_state(kept)
        return out

    def window_state(self):
        """The unfinished window (what the next dumpkvs() averages), as plain data: {"values",
        "counts", "device": [[names], sums float64 [K], counts int64 [K]] (on the CPU),
        "last": {name: float}}. Reads the device accumulators (one host sync). Not
        collective."""
        device = [[list(keys), s.detach().double().cpu().clone(), c.detach().cpu().clone()]
                  for keys, (s, c) in self._device_means.items()]
        return {"values": {k: (v if isinstance(v, (int, float, str)) else _as_number(v))
                           for k, v in self.name2val.items()},
                "counts": dict(self.name2cnt), "device": device,
                "last": {k: float(v) for k, v in self._device_last.items()}}

    def load_window_state(self, state):
        """Make ``state`` (window_state's) the unfinished window: the next dumpkvs() averages it
        with what is logged from now on, as if no save and resume had come between. Not
        collective."""
        self.name2val = defaultdict(float, state["values"])
        self.name2cnt = defaultdict(int, state["counts"])
        self._device_means = {tuple(keys): [s.clone(), c.clone()]
                              for keys, s, c in state["device"]}
        self._device_last = {k: th.tensor(v, dtype=th.float64) for k, v in state["last"].items()}

    def log(self, *args, level=INFO):
        if self.level <= level:
            self._do_log(args)

    # Configuration
    # ----------------------------------------
    def set_level(self, level):
        self.level = level

    def get_dir(self):
        return self.dir

    def close(self):
        for fmt in self.output_formats:
            fmt.close()
        if self._mirror is not None:
            self._mirror.sync(force=True)

    # Misc
    # ----------------------------------------
    def _do_log(self, args):
        self._each_output(SeqWriter, lambda fmt: fmt.writeseq(map(str, args)))

    def _each_output(self, kind, write):
        """``write(fmt)`` for each output of ``kind``. A disk fault under the log dir (full, quota,
        read-only, vanished directory: storage.write_fault_message) becomes LogWriteError, one
        line naming the file, as a failed checkpoint write does; any other error (a bug, a closed
        stdout) is raised as it is."""
        for fmt in self.output_formats:
            if not isinstance(fmt, kind):
                continue
            try:
                write(fmt)
            except OSError as e:
                name = getattr(getattr(fmt, "file", None), "name", None)
                if not isinstance(name, str) or not self.dir:
                    raise
                msg = storage.write_fault_message(e, self.dir, f"writing {osp.basename(name)}",
                                          "the saved checkpoints are intact")
                if msg is None:
                    raise
                raise LogWriteError(msg) from e


def get_rank_without_dist():
    """
    This process's rank: from torch.distributed when initialised, else from the environment
    variables set by torchrun / mpiexec (MPICH/PMI, Open MPI, Slurm), else 0.
    """
    world = _dist_world()
    if world is not None:
        return world[0]
    for varname in ["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"]:
        if varname in os.environ:
            try:
                return int(os.environ[varname])
            except ValueError:
                continue
    return 0


def configure(dir=None, format_strs=None, rank=None, log_suffix="", stdout_format="table"):
    """
    Make a new current logger.

    :param dir: log directory; None means a new temporary directory (scripts resolve
        $OPENAI_LOGDIR themselves and pass it here). Existing files there are appended to.
    :param format_strs: list (or comma-separated str) of "stdout", "log", "csv", "json",
        "tensorboard"; None means "stdout,log,csv" on rank 0 and nothing on other ranks.
    :param rank: this process's rank; None reads it from torch.distributed or the environment.
    :param stdout_format: with format_strs None, what rank 0 shows on stdout: "table" (upstream's
        key/value table) or "progress" (one line per dump).
    """
    if dir is None:
        dir = osp.join(
            tempfile.gettempdir(),
            datetime.datetime.now().strftime("openai-%Y-%m-%d-%H-%M-%S-%f"),
        )
    dir = os.path.expanduser(os.fspath(dir))
    if rank is None:
        rank = get_rank_without_dist()
    if format_strs is None:
        shown = {"table": "stdout", "progress": "progress"}[stdout_format]
        format_strs = [shown, "log", "csv"] if rank == 0 else []
    elif isinstance(format_strs, str):
        format_strs = format_strs.split(",")
    format_strs = [f for f in format_strs if f]
    if rank > 0 and format_strs:
        log_suffix = log_suffix + "-rank%03i" % rank
    remote = storage.is_remote(dir)
    if not remote:
        os.makedirs(dir, exist_ok=True)

    if Logger.CURRENT is not None and Logger.CURRENT is not Logger.DEFAULT:
        Logger.CURRENT.close()
    mirror = _Mirror(dir) if remote and format_strs else None
    output_formats = [make_output_format(f, dir, log_suffix, mirror) for f in format_strs]
    output_formats = [f for f in output_formats if f is not None]
    Logger.CURRENT = Logger(dir=dir, output_formats=output_formats, rank=rank)
    Logger.CURRENT._mirror = mirror
    if output_formats:
        log("Logging to %s" % dir)
    return Logger.CURRENT


@contextmanager
def quiet():
    """Within: log() and the key/value functions write nothing anywhere (a dry run of code that
    logs, e.g. the flags a resume would take, checked before the job starts)."""
    saved = Logger.CURRENT
    Logger.CURRENT = Logger(dir=None, output_formats=[], rank=get_rank_without_dist())
    try:
        yield
    finally:
        Logger.CURRENT = saved


def _configure_default_logger():
    """The logger of a process that never called configure(): rank 0 prints to stdout and
    nothing is written to disk (a library call such as sampling.generate leaves no files
    behind). Upstream's default made a fresh temporary directory with log.txt and progress.csv
    at once; here that directory is made when something asks for it (`get_dir`)."""
    rank = get_rank_without_dist()
    Logger.CURRENT = Logger(dir=None, output_formats=[HumanOutputFormat(sys.stdout)]
                            if rank == 0 else [], rank=rank)
    Logger.DEFAULT = Logger.CURRENT


def reset():
    if Logger.CURRENT is not Logger.DEFAULT:
        Logger.CURRENT.close()
        Logger.CURRENT = Logger.DEFAULT
        log("Reset logger")


@contextmanager
def scoped_configure(dir=None, format_strs=None, rank=None):
    prevlogger = Logger.CURRENT
    configure(dir=dir, format_strs=format_strs, rank=rank)
    try:
        yield
    finally:
        Logger.CURRENT.close()
        Logger.CURRENT = prevlogger
