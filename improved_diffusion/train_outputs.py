"""What a training run shows besides its checkpoints, beside the loop (TrainLoop holds one
RunOutputs and calls it at a few points): the sample grids (--sample_interval,
sample_grids.py), the FID/IS while training (--eval_interval, train_eval.py), TensorBoard
(--tensorboard, purged past the resumed step), the trackers (--tracker, trackers.py: rank 0,
rows held back until a save commits their step) and --log_sample_indices. None of them changes
the training: they read the EMA weights and their own RNG streams."""
import atexit
import os

import numpy as np

from . import logger, trackers
from .infra import storage as bf  # blobfile's names, for local paths and s3:// gs:// az://
from .sample_grids import SampleGrids
from .train_eval import TrainEval


class RunOutputs:
    """The outputs of one TrainLoop (``loop``: its config, model, EMAs, diffusion, flags, rank
    and step after the resume; ``sample_kwargs``: see TrainLoop; ``runs``: the resumed step's
    tracker runs, None on a fresh start). Construct on every rank (the grids and the evaluation
    are collective); TensorBoard and the trackers are rank 0's."""

    def __init__(self, loop, sample_kwargs, runs):
        cfg, self.rank = loop.config, loop.rank
        self.log_dir, self.log_indices = cfg.checkpoint.log_dir, cfg.log_sample_indices
        self.evaluator = (TrainEval.of_training(cfg, loop.model, loop.ema_params, loop.diffusion,
                                                loop.model_flags, sample_kwargs)
                          if cfg.eval_interval else None)
        self.grids = (SampleGrids.of_training(cfg, loop.model, loop.ema_params, loop.diffusion,
                                              loop.model_flags, sample_kwargs)
                      if cfg.sample_interval else None)
        self.tensorboard = self.trackers = None
        if cfg.tensorboard and self.rank == 0:  # purge: steps a killed job logged past its save
            self.tensorboard = logger.add_tensorboard(
                os.path.join(self.log_dir, "tb"), purge_step=loop.step + 1)
        if self.rank == 0:  # each step once: progress.csv's rows past the save, the trackers'
            logger.drop_rows_after(loop.step)  # held back until saved (trackers.py)
            self.trackers = trackers.start(
                cfg.tracker, self.log_dir, step=loop.step, settings=loop.checkpointer.settings,
                config={**loop.model_flags, **cfg.flags()}, resumed=runs)

    def at_resume(self, step, signal):
        """Before the first step: the evaluation a killed job left undone at ``step`` (False: a
        preemption abandoned it). Collective."""
        return self.evaluator is None or self.evaluator.at_resume(step, signal)

    def before_step(self, step, batch, resumed, indices):
        """Before training step ``step`` + 1 on ``batch`` [B, C, H, W]: the grid of the state
        after ``step`` steps; this rank's dataset ``indices`` of the batch. Collective."""
        if self.grids is not None:
            self.grids.at_step(step, batch.shape[1:], resumed=resumed)
        if self.log_indices:
            record_indices(self.log_dir, self.rank, step + 1, indices)

    def after_step(self, step, batch, signal):
        """After step ``step``: its evaluation; False when a preemption abandoned it.
        Collective."""
        return self.evaluator is None or self.evaluator.at_step(step, batch.shape[1:], signal)

    def at_end(self, step):
        """After the final save: the last grid. Collective."""
        if self.grids is not None:
            self.grids.at_end(step)

    def close(self, ok=True):
        """Put the spooled rows of a bucket log dir now (at exit a store's client may be gone:
        adlfs) and end TensorBoard and the trackers (``ok``: the run ended without an error).
        Not collective."""
        for spool in _INDEX_SPOOLS.values():
            spool.sync(True)
        if self.tensorboard is not None:
            logger.remove_output(self.tensorboard)
            self.tensorboard = None
        if self.trackers is not None:
            self.trackers.ok = ok
            logger.remove_output(self.trackers)
            self.trackers = None


# --log_sample_indices with a log dir in an object store: this process's local spool of
# sample_indices/ (logger._Mirror, as log.txt's), by the URL of that folder
_INDEX_SPOOLS = {}


def record_indices(log_dir, rank, step, indices):
    """--log_sample_indices: append "step,i1,i2,..." (this rank's dataset indices of the batch of
    ``step``) to log_dir/sample_indices/rank{rank}.csv; nothing for data that has none. A log dir
    in an object store (no append): the rows go to a local spool of that folder (logger._Mirror:
    the object downloaded first, so a resumed run continues it) and the whole file is put back
    at most every _Mirror.EVERY_S seconds, at TrainLoop.close, and at the process's exit (a hook
    of its own, for a run that ends without close; adlfs' client may be gone by then). Not collective: each rank
    writes its own file."""
    if indices is None:
        return
    d = bf.join(log_dir, "sample_indices")
    name = f"rank{rank}.csv"
    line = ",".join([str(step)] + [str(int(i)) for i in np.asarray(indices).ravel()])
    spool = None
    if bf.is_remote(d):
        spool = _INDEX_SPOOLS.get(d)
        if spool is None:
            spool = _INDEX_SPOOLS[d] = logger._Mirror(d)
            spool.fetch(name)  # makes the store's client: the exit hook below runs before its
            # own clean-up (atexit runs last in, first out; logger's runs after it, too late
            # for adlfs)
            atexit.register(spool.sync, True)
        path = os.path.join(spool.local, name)
    else:
        bf.makedirs(d)
        path = os.path.join(d, name)
    with open(path, "a") as f:
        f.write(line + "\n")
    if spool is not None:
        spool.sync()
