"""
FID while training (``--eval_interval N --eval_ref_batch REF.npz --eval_num_samples M``): every N
steps, all ranks sample M images of the EMA together, and rank 0 logs their FID (and Inception
Score) against the reference batch as ``fid_ema_RATE`` / ``is_ema_RATE`` in that step's row of
progress.csv, on the progress line and in TensorBoard.

    ev = TrainEval.of_training(config, model, ema_params, diffusion, model_flags)  # all ranks
    ev.at_resume(step, signal)          # the loop, first: an evaluation a preemption cut short
    ev.at_step(step, shape, signal)     # the loop, after each step, before its dumpkvs

What is drawn: sample ``i`` of ``0..M-1`` from its own seeds (sampling.sample_seed(seed, i)),
by DDIM (eta 0) on --sample_steps of the training diffusion's timesteps, labelled ``i %
num_classes`` for a class-conditional model (as the --sample_interval grids); rank ``r`` draws
the indices ``r::world_size`` (NVlabs/edm's generate.py), a batch of --batch_size at a time, so
the samples, and with the activations put back in index order the figures, do not depend on the
number of ranks. The feature network (``--eval_features``): the FID Inception
(``--inception_weights``, else $ID_INCEPTION_WEIGHTS) or the demo's digits classifier. The
reference's activations are computed once, at start-up, across the ranks, and cached beside it
(evaluation.cached_activations: NAME.acts.npz); its precomputed mu/sigma, when it has them
(ADM's reference batches), are used as evaluate.py uses them.

What it leaves alone (the run with an evaluation is the run without it, bit for bit: the same
model, EMA and optimizer tensors, the same losses):

- the training model: a copy holds the EMA parameters and the model's live buffers, in eval
  mode (sample_grids.copy_with_params); nothing runs through the model or its DDP wrapper. A
  sharded model (--fsdp True) has no whole copy: the EMA's slices are swapped into its shards
  and back (fsdp.params_swapped_in: parameters, buffers and modes put back bit for bit), and as
  its forward is collective, every rank draws each batch at rank 0's batch size (a rank with
  fewer samples pads its batch with sample 0's seeds and drops those samples);
- training's RNG streams: the noise comes from per-sample generators, and every rank's global
  RNG states are put back afterwards;
- the data: nothing is read from the loader.

Preemption: between batches every rank shares [preempted, failed] (one all-reduce). A
preemption signal on any rank during the evaluation abandons it on every rank, logging nothing
for it; at_step returns False and the loop saves that step at once (the preemption save) and
exits 75. Rank 0 records each logged evaluation in ``LOG_DIR/eval/fid_{step:06d}.json`` (the
figures, what was drawn, against what): a job that resumes at an evaluation step without its
record evaluates it first (at_resume, in a progress.csv row of its own), and a step whose record
is there is not evaluated again (a job killed after logging it, resumed from an earlier step),
so an evaluation is neither lost nor logged twice. The checkpoint files are not touched.

A failure (out of memory, a bug in a feature network) on any rank turns the evaluation off for
the rest of the job on every rank, with the traceback logged; training goes on. The flags are
checked at start-up (check_flags, check_inputs): UsageError naming the flag, or one line naming
the file (EvaluationError, InceptionWeightsError), printed once for the job (on several ranks
the files are checked once the ranks have met: rank 0's verdict, raised on every rank).
"""
import contextlib
import json
import os
import sys
import time
import traceback

import numpy as np
import torch as th

from . import dist_util, evaluation, logger, sampling
from .infra import fsdp
from .infra import storage
from .ckpt.rng import get_rng_state, set_rng_state
from .infra.errors import UsageError
from .sample_grids import check_image_channels, ddim_diffusion, label_count, model_with_params


# Images per forward pass of the feature network over the reference batch.
REF_BATCH = 64


def check_flags(config):
    """UsageError naming the flag for eval flags that cannot work together (``config``: a
    TrainConfig). Reads no file."""
    if config.eval_interval < 0:
        raise UsageError(f"--eval_interval must be >= 0 (got {config.eval_interval})")
    if not config.eval_interval:
        return
    n = config.eval_interval
    if not config.eval_ref_batch:
        raise UsageError(f"--eval_interval {n} needs --eval_ref_batch REF.npz: the reference "
                         f"batch (arr_0 uint8 [N, H, W, 3]) the samples' FID is computed against")
    if config.eval_num_samples < 2:
        raise UsageError(f"--eval_num_samples {config.eval_num_samples}: a FID needs at least 2 "
                         f"samples (a covariance); pass --eval_num_samples 2 or more")
    if config.eval_features not in evaluation.FEATURES:
        raise UsageError(f"--eval_features {config.eval_features}: must be one of "
                         f"{', '.join(evaluation.FEATURES)}")
    if n % config.log_interval:
        raise UsageError(f"--eval_interval {n}: must be a multiple of --log_interval "
                         f"{config.log_interval} (the figures go into that step's row of "
                         f"progress.csv)")


def check_inputs(config):
    """The files the evaluation needs, checked before anything is written: the reference batch
    (EvaluationError naming --eval_ref_batch and the file) and, for the Inception, its weights
    file (InceptionWeightsError: where to get it, or what is wrong with it).

    One verdict for the job, printed once: once the process group exists, rank 0's (raised on
    every rank; collective then: call from all ranks); in a single process, its own. A process
    started among several before their process group exists checks nothing here (each rank's
    own error line would be printed once per rank): TrainEval.of_training checks again, after
    the rendezvous."""
    if not config.eval_interval:
        return
    if dist_util.is_distributed():
        dist_util.run_on_rank0(lambda: _check_files(config))
    elif _launch_size() <= 1:
        _check_files(config)


def _check_files(config):
    try:
        evaluation.open_batch(config.eval_ref_batch).close()
    except evaluation.EvaluationError as e:
        raise evaluation.EvaluationError(f"--eval_ref_batch {e}") from None
    if config.eval_features == "inception":
        from . import inception

        inception.check_weights_file(config.inception_weights or None)


def _launch_size():
    """The number of processes the launcher started (torchrun's WORLD_SIZE, an MPI launcher's
    size), 1 when none says so; read before the process group exists."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 1


class TrainEval:
    """
    The training-time evaluation of one job (module docstring). Build it on every rank with the
    same arguments (collective: the feature network and the reference's activations); its
    methods are collective too.

    model: the bare training module; params: the tensors to sample with (model.parameters()
    order, e.g. an EMA); key: the logged name's suffix ("ema_0.9999": ``fid_ema_0.9999``);
    diffusion: the training diffusion; ref_path: the reference batch; features: a feature
    network (evaluation.feature_network); log_dir: where eval/ goes (the records); interval, num_samples, steps, batch_size:
    --eval_interval, --eval_num_samples, --sample_steps, --batch_size (per rank); seed: of the
    samples' noise; num_classes: labels ``i % num_classes`` (None: none); model_kwargs:
    ``indices -> {name: tensor}``, more keyword arguments of the model; shape_hint: [C, H, W]
    of a sample before the first batch tells it (a resume's evaluation; None: unknown).
    """

    def __init__(self, *, model, params, key, diffusion, ref_path, features, log_dir, interval,
                 num_samples, steps, batch_size, seed=0, num_classes=None, model_kwargs=None,
                 shape_hint=None, clock=time.monotonic):
        self.diffusion = ddim_diffusion(diffusion, steps, "--eval_interval")
        self.model, self.params, self.key = model, params, key
        self.ref_path, self.features = os.fspath(ref_path), features
        self.interval, self.num_samples, self.steps = interval, num_samples, steps
        self.batch_size, self.seed = max(1, int(batch_size)), seed
        self.num_classes, self.model_kwargs, self.clock = num_classes, model_kwargs, clock
        self.rank, self.world = dist_util.get_rank(), dist_util.get_world_size()
        self.log_dir, self.shape_hint = log_dir, shape_hint
        self.off = False
        self.evaluated = -1  # the last step whose figures this job logged
        self.shape = None  # [C, H, W] of a sample: the training batches'
        self.ref_stats = None  # rank 0: FIDStatistics of the reference's pool features
        self.ref_num = None

    @classmethod
    def of_training(cls, config, model, ema_params, diffusion, model_flags, sample_kwargs=None):
        """The evaluation of a TrainLoop (``config``: its TrainConfig), of its first EMA (the
        model's parameters without --ema_rate), its reference prepared. Every rank's global RNG
        states are as they were (the feature network draws none; any that a network of its own
        might are put back, as after each evaluation). Collective."""
        params, key = ((ema_params[0], f"ema_{config.ema_rates[0]}") if ema_params
                       else (list(model.parameters()), "model"))
        check_inputs(config)  # rank 0's verdict: one line for the job
        state = get_rng_state()
        try:
            out = cls(model=model, params=params, key=key, diffusion=diffusion,
                      ref_path=config.eval_ref_batch,
                      features=evaluation.feature_network(config.eval_features,
                                                          config.inception_weights or None,
                                                          "--eval_features"),
                      log_dir=config.checkpoint.log_dir, shape_hint=shape_of(model_flags),
                      interval=config.eval_interval, num_samples=config.eval_num_samples,
                      steps=config.sample_steps, batch_size=config.batch_size, seed=config.seed,
                      model_kwargs=sample_kwargs,
                      num_classes=None if sample_kwargs else label_count(model_flags))
            out.prepare()
        finally:
            set_rng_state(state)
        return out

    @property
    def names(self):
        """The logged keys: (fid_KEY, is_KEY)."""
        return f"fid_{self.key}", f"is_{self.key}"

    def prepare(self):
        """The reference's statistics (rank 0), from its activations (cached beside it) or its
        precomputed mu/sigma. Collective."""
        acts = evaluation.cached_activations(self.ref_path, self.features, REF_BATCH)

        def stats():
            pre, _ = evaluation.read_statistics(self.ref_path, *self.features.dims[:2])
            return pre if pre is not None else evaluation.compute_statistics(acts[0])

        self.ref_num = dist_util.run_on_rank0(
            lambda: evaluation.open_batch(self.ref_path).num)
        if self.rank == 0:
            self.ref_stats = stats()
        logger.log(f"evaluation: every {self.interval} steps, {self.num_samples} samples of the "
                   f"{self.key.replace('_', ' ')} against {self.ref_path} ({self.ref_num} images, "
                   f"{self.features.name} features)")

    # ------------------------------------------------------------------ the records

    def record_path(self, step):
        """LOG_DIR/eval/fid_{step:06d}.json: the figures of ``step``, written by rank 0 once
        they are logged (the job's record that this step's evaluation is done)."""
        return os.path.join(self.log_dir, "eval", f"fid_{step:06d}.json")

    def _record(self, step, fid, score, seconds):
        return {"step": int(step), self.names[0]: float(fid), self.names[1]: float(score),
                "num_samples": int(self.num_samples), "sample_steps": int(self.steps),
                "features": dict(self.features.identity), "ref_batch": self.ref_path,
                "ref_images": self.ref_num, "shape": list(self.shape),
                "seconds": round(float(seconds), 3)}

    def _same_kind(self, record):
        return (isinstance(record, dict) and self.names[0] in record
                and record.get("num_samples") == self.num_samples
                and record.get("sample_steps") == self.steps
                and record.get("ref_batch") == self.ref_path
                and record.get("features") == dict(self.features.identity))

    def _read_record(self, step):
        try:
            return json.loads(storage.read_bytes(self.record_path(step)))
        except (OSError, ValueError):
            return None

    def logged(self, step):
        """The figures ({name: value}) of ``step`` (of this evaluation's kind) when a job in this
        log dir logged them already, else None (rank 0 reads its record). Collective."""
        def figures():
            record = self._read_record(step)
            return {n: record[n] for n in self.names} if self._same_kind(record) else None
        return dist_util.run_on_rank0(figures)

    def _write_record(self, record):
        """Rank 0: the record, replaced whole; a disk fault costs only the record (a line)."""
        path = self.record_path(record["step"])
        tmp = f"{path}.tmp{os.getpid()}"
        if storage.is_remote(path):  # one object, put whole
            try:
                storage.put(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
            except OSError as e:
                logger.warn(f"evaluation: its record {path} was not written ({e}); a resume at "
                            f"this step would evaluate it again")
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as e:
            logger.warn(f"evaluation: its record {path} was not written ({e}); a resume at this "
                        f"step would evaluate it again")
            if os.path.exists(tmp):
                os.remove(tmp)

    # ------------------------------------------------------------------ the loop's calls

    def due(self, step):
        return not self.off and step > 0 and step % self.interval == 0

    def at_resume(self, step, signal):
        """Before a resumed job trains: the evaluation of ``step`` when it is an evaluation step
        whose figures were never logged (a preemption abandoned it), in a row of its own.
        Returns False when a preemption abandoned it again. Collective."""
        if not self.due(step) or self.logged(step) is not None:
            return True
        shape = self.shape or self.shape_hint
        if shape is None:
            logger.log(f"evaluation of step {step}: not done (the samples' shape is unknown "
                       f"before the first step)")
            return True
        done = self.at_step(step, shape, signal, check_logged=False)
        if self.evaluated == step:  # the same on every rank
            logger.logkv("step", step)
            logger.dumpkvs()
        return done

    def at_step(self, step, shape, signal, check_logged=True):
        """After training step ``step`` on samples of shape [C, H, W] ``shape``: the evaluation
        of ``step`` when it is due and was not logged before (its figures logged with
        logger.logkv on rank 0, for the loop's next dumpkvs, and recorded); one a job before
        logged (a killed job's step past the resume, whose progress.csv row the resume dropped)
        is not evaluated again: its recorded figures go into this step's row. Returns False when
        a preemption signal on some rank (``signal``: Checkpointer.watch_signals' flag)
        abandoned it, else True. Samples that are no image (not 1 or 3 channels) are a
        UsageError, raised on every rank at the first step. Collective."""
        if self.shape is None:
            check_image_channels(shape, f"--eval_interval {self.interval}",
                                 "no feature network can score them; pass --eval_interval 0")
        self.shape = tuple(int(s) for s in shape)
        if not self.due(step):
            return True
        figures = self.logged(step) if check_logged else None
        if figures is not None:  # a killed job's step past the resume: its row was dropped
            if self.rank == 0:  # (each step once), so the recorded figures go in this one
                for name, value in figures.items():
                    logger.logkv(name, value)
            return True
        t0 = self.clock()
        state = get_rng_state()
        try:
            outcome = self._evaluate(signal)
        finally:
            set_rng_state(state)
        if outcome == "preempted":
            logger.log(f"evaluation of step {step}: abandoned (preemption signal); the step is "
                       f"saved and evaluated when the run resumes")
            return False
        if outcome is None:
            return True
        self.evaluated = step
        fid, score = outcome
        took = self.clock() - t0
        if self.rank == 0:
            logger.logkv(self.names[0], fid)
            logger.logkv(self.names[1], score)
            self._write_record(self._record(step, fid, score, took))
        logger.log(f"evaluation of step {step}: {self.names[0]} {fid:.4g}, {self.names[1]} "
                   f"{score:.4g} ({self.num_samples} samples, {self.steps} DDIM steps, "
                   f"{self.features.name} features) in {took:.1f}s")
        return True

    # ------------------------------------------------------------------ the work

    def my_indices(self, rank=None):
        """This rank's (or ``rank``'s) sample indices, in batches: the same number of batches on
        every rank (some may be empty), so the per-batch exchange matches up; rank 0's are the
        largest."""
        rank = self.rank if rank is None else rank
        mine = np.arange(self.num_samples, dtype=np.int64)[rank::self.world]
        per_rank = -(-self.num_samples // self.world)
        n_batches = max(1, -(-per_rank // self.batch_size))
        return [mine[i * self.batch_size:(i + 1) * self.batch_size] for i in range(n_batches)]

    def _evaluate(self, signal):
        """(fid, inception score) on every rank, "preempted", or None (failed: off from now
        on). Collective."""
        model = failed = None
        pools, logits, indices = [], [], []
        sharded = fsdp.is_sharded(self.model)  # every rank calls the model alike (docstring)
        widths = [len(b) for b in self.my_indices(0)]
        with contextlib.ExitStack() as swapped:
            for idx, width in zip(self.my_indices(), widths):
                if failed is None and (len(idx) or sharded):
                    try:
                        if model is None:
                            model = swapped.enter_context(
                                model_with_params(self.model, self.params))
                        pool, logit = self._features_of(model, idx, width if sharded else None)
                        if len(idx):
                            pools.append(pool)
                            logits.append(logit)
                            indices.append(idx)
                    except Exception:
                        failed = traceback.format_exc().rstrip()
                preempted, any_failed = dist_util.any_rank_async(
                    [bool(signal and signal["set"]), failed is not None]).wait()
                if any_failed:
                    return self._turn_off(failed)
                if preempted:
                    return "preempted"
        del model
        dims = self.features.dims
        gathered = [self._gather(parts, width, dtype) for parts, width, dtype in (
            (indices, None, np.int64), (pools, dims[0], np.float32),
            (logits, dims[2], np.float32))]

        def figures():
            order = np.argsort(gathered[0], kind="stable")  # index order: any rank count
            pool, logit = gathered[1][order], gathered[2][order]
            try:
                fid = evaluation.compute_statistics(pool).frechet_distance(
                    self.ref_stats, method="auto")
            except ValueError as e:  # ADM's imaginary-component check
                return None, f"FID: {e}"
            return (fid, evaluation.compute_inception_score(logit)), None

        result, problem = dist_util.run_on_rank0(figures)
        if problem:
            return self._turn_off(problem if self.rank == 0 else None)
        return result

    def _features_of(self, model, idx, width=None):
        """(pool, logits) float32 of the samples ``idx`` (None for none). ``width``: draw a
        batch of that many, ``idx`` padded with sample 0's (a sharded model's collective
        forward: every rank's batch of rank 0's size), the padding dropped. Not collective but
        for a sharded model."""
        n = len(idx)
        if width is not None and width > n:
            idx = np.concatenate([idx, np.zeros(width - n, np.int64)])
        images, _ = sampling.sample_indices(
            model, self.diffusion, idx, shape=self.shape, seed=self.seed, use_ddim=True,
            num_classes=self.num_classes,
            classes=list(range(self.num_classes)) if self.num_classes else None,
            extra_kwargs=self.model_kwargs, device=next(self.model.parameters()).device)
        images, idx = images[:n], idx[:n]
        if not n:
            return None, None
        if images.shape[-1] == 1:
            images = np.repeat(images, 3, axis=-1)
        pool, _, logit = self.features(images)
        if not (np.isfinite(pool).all() and np.isfinite(logit).all()):
            raise FloatingPointError(f"the {self.features.name} features of samples "
                                     f"{int(idx[0])}..{int(idx[-1])} are not finite")
        return (np.ascontiguousarray(pool, np.float32),
                np.ascontiguousarray(logit, np.float32))

    def _gather(self, parts, width, dtype):
        """Every rank's rows of ``parts`` (a list of arrays), concatenated by rank on rank 0
        (None elsewhere). Collective."""
        shape = (0,) if width is None else (0, width)
        local = np.concatenate(parts, axis=0) if parts else np.zeros(shape, dtype)
        pieces = dist_util.all_gather_varlen(th.from_numpy(np.ascontiguousarray(local).reshape(-1)))
        if self.rank != 0:
            return None
        flat = th.cat(pieces).numpy()
        return flat if width is None else flat.reshape(-1, width)

    def _turn_off(self, why):
        """The evaluation failed on some rank: off for the rest of the job (every rank). Returns
        None."""
        self.off = True
        if why:  # the rank that failed says why
            sys.stderr.write(f"rank {self.rank}: evaluation failed:\n{why}\n")
            sys.stderr.flush()
        logger.warn("evaluation: failed (the traceback above, on the rank that failed); no more "
                    "evaluations in this job, training goes on")
        return None


def shape_of(model_flags):
    """[C, H, W] of a sample by the model's flags (in_channels, image_size or large_size), or
    None when they do not say."""
    flags = model_flags or {}
    side = flags.get("large_size") or flags.get("image_size")
    if not isinstance(side, int) or isinstance(side, bool) or side < 1:
        return None
    channels = flags.get("in_channels", 3)
    return (int(channels) if isinstance(channels, int) else 3, side, side)
