"""
--tracker wandb,mlflow: the run in Weights & Biases and/or MLflow, beside log.txt, progress.csv
and TensorBoard, one tracker run per training run however often it resumes.

What rank 0 sends each tracker: every row of progress.csv (the scalars of each dumpkvs: loss and
its quartiles, grad norm, lr, samples, FID/IS when evaluated, ...) at its step, with steps/s and
samples/s since the row before; the --sample_interval grids as images ("sample_grid"); the run's
flags as the tracker run's config (W&B) or parameters (MLflow).

Every step once, with the values of the run that continued. W&B drops a step lower than the
highest it has seen, and MLflow appends a second value for a step logged twice; neither can take
back a step. So a step reaches the trackers only once a checkpoint holds it: the rows (and grids)
are held back in memory and sent when the save of a step at or past theirs is complete
(``committed``, called when the checkpointer logs the save: its manifest is written; the final
save and the preemption save included). A job killed between a logged step and the next save
has sent none of the steps after that save; its resume trains them again and sends them once.
The steps of the resumed step and before that the killed job had not sent yet (killed while
they were queued, or between the manifest and the send) are sent by the resume, from
progress.csv and LOG_DIR/samples/ (``_replay``), after what the tracker run already holds
(``_held``): MLflow's run is asked (the last step of its rows, the steps of its grids), since a
kill between a send and its record would otherwise send a step twice, which MLflow keeps;
W&B's is the last step recorded in LOG_DIR/trackers/NAME.json at a clean end (its service
process dies with a killed job and may lose what it was given; W&B drops a resent step it has,
whose values are the same). That file also names the tracker run, for a resume whose step's
manifest was written before the run had an id.

The tracker run's id is recorded in each step's manifest (its ``run_flags``' ``tracker_runs``,
beside the run's settings), so a resume from that step, flagless or not, on any number of ranks,
continues that tracker run (W&B: ``resume="allow"`` with the id; MLflow: the run id).

A tracker never stops or slows training: each one runs in a thread of its own (the training
loop only appends to a queue); a tracker that fails (unreachable server, missing credentials)
logs one warning line and is off for the rest of the job. At the end of the job each tracker has
``CLOSE_WAIT_S`` seconds to finish sending.

Where they log: the libraries' own settings (W&B: WANDB_MODE, WANDB_PROJECT (default
"improved-diffusion"), WANDB_ENTITY, WANDB_API_KEY, WANDB_DIR (default LOG_DIR/wandb for a
local log dir); MLflow: MLFLOW_TRACKING_URI (MLflow's default: sqlite:///mlflow.db in the
working directory, its artifacts in ./mlruns; the sqlite store needs sqlalchemy and alembic,
which the tracking extra installs beside mlflow-skinny), MLFLOW_EXPERIMENT_NAME (default
"improved-diffusion")). The tracker run is named after the log dir. A store that cannot be
opened is the tracker's one warning line, with the library's own advice in full (MLflow's
legacy ./mlruns file store: "set `MLFLOW_ALLOW_FILE_STORE=true`"; a database store without
sqlalchemy: the extra to install).
"""
import importlib.util
import json
import os
import queue
import re
import secrets
import string
import threading
import time

from . import logger
from .infra import storage
from .infra.errors import UsageError

# --tracker NAME -> the module it needs
LIBRARIES = {"wandb": "wandb", "mlflow": "mlflow"}
EXTRA = "tracking"  # setup.py's extra that installs them
MANIFEST_KEY = "tracker_runs"  # in each step's manifest run_flags: {tracker: run id}
PROJECT = "improved-diffusion"  # the W&B project / MLflow experiment unless set
CLOSE_WAIT_S = 60.0
IMAGE_TAG = "sample_grid"
WARNING_CHARS = 1500  # a failure's message in the warning line, whole up to this (an HTML body
# of a proxy's error page is cut; every library's advice we know of is far shorter)


class Unusable(Exception):
    """A tracker that cannot work as configured: the message says what to set or install (the
    warning line gives it without the exception's name)."""


def parse(text):
    """--tracker's names ("wandb,mlflow" -> ("wandb", "mlflow"); "" -> ()). UsageError for a
    name that is no tracker, or one whose library is not installed (naming the pip extra)."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text or "").split(",") if n.strip()))
    for name in names:
        if name not in LIBRARIES:
            raise UsageError(f"--tracker: {name!r} is not a tracker; use wandb, mlflow or both "
                             f"(wandb,mlflow)")
        if importlib.util.find_spec(LIBRARIES[name]) is None:
            raise UsageError(f"--tracker {name} needs the {LIBRARIES[name]} package: pip install "
                             f"-e '.[{EXTRA}]'")
    return names


def start(names, log_dir, *, step, config, resumed=None, settings=None):
    """Rank 0 of a training job: the Trackers of ``names`` (parse), added to the current logger
    as an output, from ``step`` (the resumed step, 0 on a fresh start: it and the steps before
    are committed). ``resumed``: the resumed step's manifest's tracker runs ({name: id});
    ``settings``: the checkpointer's settings, which the manifests record: its MANIFEST_KEY
    gets the runs' ids. Returns the Trackers (logger.remove_output ends them), or None when no
    tracker is asked for. Not collective."""
    names = parse(names)
    if not names:
        return None
    fmt = Trackers(names, log_dir, step=step, config=config, resumed=resumed, settings=settings)
    logger.get_current().output_formats.append(fmt)
    return fmt


class Trackers(logger.KVWriter):
    """The logger output of the trackers (module docstring): holds each row and grid back until
    a save commits its step, then hands it to each tracker's thread. Main thread of rank 0."""

    def __init__(self, names, log_dir, *, step, config, resumed=None, settings=None):
        self.log_dir = os.fspath(log_dir)
        self.committed_step = int(step)
        self.pending = []  # (step, kind, payload), in the order logged
        self.rates = logger._Rates()
        self.rates.start(step)
        self.ok = True  # False: the job ended with an error (the tracker runs are marked so)
        self.settings = settings if settings is not None else {}
        runs = dict(resumed or {})
        replay_rows = logger.logged_rows(up_to=step)
        self.backends = []
        for name in names:
            cls = WandbTracker if name == "wandb" else MlflowTracker
            self.backends.append(cls(self.log_dir, runs.get(name) or self._started(name, step),
                                     config, step, replay_rows, self._grids(step)))
        self.runs = runs  # trackers not used now keep their runs (a later resume may)
        self._record_runs()

    # the logger's calls ------------------------------------------------------------

    def writekvs(self, kvs):
        if "step" not in kvs:
            return
        step = int(kvs["step"])
        row = {k: logger._as_number(v) for k, v in kvs.items()}
        row = {k: v for k, v in row.items() if v is not None}
        row.update(self.rates.update(kvs))
        self._hold(step, "row", (row, time.time()))

    def write_image(self, tag, image, step):
        self._hold(int(step), "image", (tag, image))

    def start(self, step, total_steps=0):
        """The rates time from now, from ``step`` (logger.start_progress)."""
        self.rates.start(step)

    def committed(self, step):
        """The save of ``step`` is complete (its manifest written): send what it holds."""
        self.committed_step = max(self.committed_step, int(step))
        self._release()

    def close(self):
        """Send what the saves committed (the rest was not saved: a resume trains it again),
        end each tracker run, wait for the threads (CLOSE_WAIT_S each at most)."""
        self._release()
        for b in self.backends:
            b.finish(self.ok)
        self._record_runs()

    # ------------------------------------------------------------------------------

    def _hold(self, step, kind, payload):
        self.pending.append((step, kind, payload))
        self._release()

    def _release(self):
        n = 0
        while n < len(self.pending) and self.pending[n][0] <= self.committed_step:
            n += 1
        ready, self.pending = self.pending[:n], self.pending[n:]
        for b in self.backends:
            if ready:
                b.send(ready)
        self._record_runs()

    def _record_runs(self):
        """The runs' ids into the manifests' settings (a new dict: a background save may be
        copying the old one) and each tracker's warning, once, into the log."""
        for b in self.backends:
            if b.run_id:
                self.runs[b.name] = b.run_id
            line = b.take_warning()
            if line:
                logger.warn(line)
        if self.runs and self.settings.get(MANIFEST_KEY) != self.runs:
            self.settings[MANIFEST_KEY] = dict(self.runs)

    def _started(self, name, step):
        """The run of tracker ``name`` that a job in this log dir started after the save of
        the resumed step ``step`` (its id known too late for a manifest), when it holds no
        later step; else None."""
        doc = read_state(self.log_dir, name)
        if step and doc.get("run_id") and int(doc.get("sent_step", 0)) <= step:
            return str(doc["run_id"])
        return None

    def _grids(self, step):
        """{step: path} of the grids in LOG_DIR/samples/ of steps up to ``step``."""
        d = storage.join(self.log_dir, "samples")
        try:
            names = storage.listdir(d)
        except OSError:
            return {}
        out = {}
        for n in names:
            m = re.fullmatch(r"grid_(\d+)\.png", n)
            if m and int(m.group(1)) <= step:
                out[int(m.group(1))] = storage.join(d, n)
        return out


class _Tracker:
    """One tracker's run, fed by a thread of its own (``send`` only queues). Subclasses:
    ``open(run_id, config) -> run id``, ``log(step, row, seconds)``, ``image(step, tag,
    array)``, ``end(ok)``."""

    name = None
    # whether a sent row is kept once the call returns (MLflow's server has it); W&B's records
    # are written by its own service process, which a kill -9 of the job ends too: its sent
    # step is recorded when the run ends cleanly (a resume resends the rest, which W&B drops
    # where it has the step: the same committed values)
    durable = True

    def __init__(self, log_dir, run_id, config, step, rows, grids):
        self.log_dir, self.run_id, self.config = log_dir, run_id, dict(config)
        self.resumed = run_id is not None  # a run of an earlier job, to continue
        self.run_id = run_id or self.new_id()
        self.step = int(step)  # the committed step the job starts from
        self.queue = queue.Queue()
        self.queued_step = self.sent_step = None  # the last step queued / sent (the thread's)
        self.dead = False
        self._warning, self._warned = None, False
        self._held_rows, self._held_grids = 0, set()  # what the run holds at the start (_held)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, args=(rows, grids), daemon=True,
                                       name=f"tracker-{self.name}")
        self.thread.start()

    def new_id(self):
        """The id of a new run, when the client chooses it (None: the tracker does)."""
        return None

    # main thread ------------------------------------------------------------------

    def send(self, items):
        if not self.dead:
            self.queue.put(("items", items))
            self.queued_step = items[-1][0]

    @property
    def drained(self):
        """Whether everything queued was sent (or the tracker is off)."""
        return self.dead or (self.sent_step is not None and (self.queued_step is None or
                                                             self.sent_step >= self.queued_step))

    def finish(self, ok):
        self.queue.put(("end", ok))
        self.thread.join(CLOSE_WAIT_S)
        if self.thread.is_alive():
            self._warn(f"not done after {CLOSE_WAIT_S:g} s (unreachable?); what it had not sent "
                       f"is dropped")

    def take_warning(self):
        """The warning line to log (once per job), or None."""
        with self._lock:
            if self._warning is None or self._warned:
                return None
            self._warned = True
            return self._warning

    # the thread -------------------------------------------------------------------

    def _warn(self, what):
        with self._lock:
            if self._warning is None:
                self._warning = f"warning: --tracker {self.name}: {what}; training goes on"

    def _work(self, rows, grids):
        try:
            self.run_id = self.open(self.run_id, self.config)
            if self.resumed:
                self._held_rows, self._held_grids = self._held()
            self._record_sent(self._held_rows)  # the run is known in the log dir from now on
            self._replay(rows, grids)
            while True:
                kind, payload = self.queue.get()
                if kind == "end":
                    self.end(payload)
                    self._record_sent(self.sent_step, durable=True)
                    return
                self._send(payload)
                self._record_sent(payload[-1][0])
        except Exception as e:  # noqa: BLE001 - any failure of a tracker: off, one line
            self.dead = True
            text = " ".join(str(e).split())  # the library's own advice, whole, on one line
            if len(text) > WARNING_CHARS:
                text = text[:WARNING_CHARS] + "..."
            what = text if isinstance(e, Unusable) else f"{type(e).__name__}: {text}"
            self._warn(f"{what}; the tracker is off for the rest of this job")

    def _held(self):
        """What the continued run holds already: (the last step of its rows, the steps of its
        grids). Here: the last step a job recorded sending (``_record_sent``), rows and grids
        alike; MlflowTracker asks its run."""
        sent = self._sent_step()
        return sent, range(1, sent + 1)

    def _send(self, items):
        """Send ``items`` [(step, "row" | "image" | "grid", data)], but a row or grid of a step
        the run held when the job started (``_held``)."""
        for step, what, data in items:
            if what == "row":
                if step > self._held_rows:
                    self.log(step, *data)
            elif step not in self._held_grids:
                if what == "grid":  # a grid of LOG_DIR/samples/ (_replay)
                    self.image(step, IMAGE_TAG, _read_png(data))
                else:
                    self.image(step, *data)

    def _replay(self, rows, grids):
        """Send the committed steps up to the job's start step (the rows of progress.csv and
        the grids of LOG_DIR/samples/) that the run does not hold yet."""
        items = [(int(r["step"]), "row", (r, None)) for r in rows if r["step"] <= self.step]
        items += [(s, "grid", path) for s, path in grids.items() if s <= self.step]
        items.sort(key=lambda it: (it[0], it[1] != "row"))
        self._send(items)
        self._record_sent(max(self.step, self._held_rows))

    def _state_path(self):
        return state_path(self.log_dir, self.name)

    def _sent_step(self):
        """The last step sent to this run (0 when no job recorded one for it)."""
        doc = read_state(self.log_dir, self.name)
        return int(doc.get("sent_step", 0)) if doc.get("run_id") == self.run_id else 0

    def _record_sent(self, step, durable=None):
        self.sent_step = int(step)
        if not (self.durable if durable is None else durable):
            return
        data = json.dumps({"run_id": self.run_id, "sent_step": int(step)}).encode()
        path = self._state_path()
        if storage.is_remote(path):
            storage.put(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


class WandbTracker(_Tracker):
    name = "wandb"
    durable = False

    def new_id(self):  # chosen here, so that the next manifest records it at once
        # not the training's seeded RNG: its state stays untouched, and runs get other ids
        return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))

    def open(self, run_id, config):
        import wandb

        kwargs = {}
        if not storage.is_remote(self.log_dir) and not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = self.log_dir
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, id=run_id,
                              resume="allow", name=_run_name(self.log_dir),
                              settings=wandb.Settings(console="off"), **kwargs)
        self.run.config.update(config, allow_val_change=True)
        return run_id

    def log(self, step, row, seconds=None):
        self.run.log(dict(row), step=step)

    def image(self, step, tag, array):
        import wandb

        self.run.log({tag: wandb.Image(array)}, step=step)

    def end(self, ok):
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker(_Tracker):
    name = "mlflow"

    def open(self, run_id, config):
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, else MLflow's default
        _check_store(uri)
        self.client = MlflowClient(uri)
        if run_id is not None:
            known = self.client.get_run(run_id).data.params
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=_run_name(self.log_dir)).info.run_id
            self.run_id, known = run_id, {}  # known at once: the next manifest records it
        # parameters cannot change in MLflow: a resume adds the new ones only
        params = [Param(k, str(v)[:6000]) for k, v in sorted(config.items()) if k not in known]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def _held(self):
        """What the run holds, from MLflow itself. Rows: every row has the metric "step" (its
        step), whose latest value (MLflow's latest: the highest step) is the last row stored;
        the rows before it are stored too (each row is one log_batch, which MLflow stores
        whole or not at all, sent one after the other in step order, each once the one before
        returned). Grids: the steps in the names of the image files log_image wrote."""
        last = int(self.client.get_run(self.run_id).data.metrics.get("step", 0))
        grids = set()
        for f in self.client.list_artifacts(self.run_id, "images"):
            # images/KEY+step+N+timestamp+T+UUID.png (and ...+compressed.webp; "%" before 3.x)
            m = re.fullmatch(rf"(?:.*/)?{IMAGE_TAG}[+%]step[+%](\d+)[+%].*", f.path)
            if m:
                grids.add(int(m.group(1)))
        return last, grids

    def log(self, step, row, seconds=None):
        from mlflow.entities import Metric

        ms = int(1000 * (seconds if seconds is not None else time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ms, step)
                                                    for k, v in sorted(row.items())])

    def image(self, step, tag, array):
        self.client.log_image(self.run_id, array, key=tag, step=step)

    def end(self, ok):
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _check_store(uri):
    """Unusable, saying what to install or set, for a tracking store this MLflow cannot open
    as installed: a database store (MLflow's default, sqlite:///mlflow.db) without
    sqlalchemy and alembic, which mlflow-skinny leaves out (MLflow's own error blames its model
    registry and names no package)."""
    from mlflow.store.db.db_types import DATABASE_ENGINES

    scheme = uri.split(":", 1)[0].split("+", 1)[0]
    missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
    if scheme in DATABASE_ENGINES and missing:
        where = ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI")
                 else "MLflow's default store: MLFLOW_TRACKING_URI is not set")
        raise Unusable(f"the tracking store {uri} ({where}) needs the {' and '.join(missing)} "
                       f"package{'s' if len(missing) > 1 else ''}: pip install -e '.[{EXTRA}]' "
                       f"(or set MLFLOW_TRACKING_URI to your MLflow server, http://HOST:PORT)")


def state_path(log_dir, name):
    """LOG_DIR/trackers/NAME.json: {"run_id": the tracker's run, "sent_step": the last step
    sent to it}."""
    return storage.join(log_dir, "trackers", f"{name}.json")


def read_state(log_dir, name):
    """state_path's content ({} when absent or unreadable)."""
    try:
        doc = json.loads(storage.read_bytes(state_path(log_dir, name)))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _run_name(log_dir):
    return storage.basename(os.fspath(log_dir).rstrip("/")) or "run"


def _read_png(path):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(storage.read_bytes(path))).convert("RGB"))
