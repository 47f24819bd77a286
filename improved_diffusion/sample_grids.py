"""
Samples while training (``--sample_interval N``): rank 0 writes a grid of EMA samples,
``LOG_DIR/samples/grid_{step:06d}.png``, every N steps and at the end of the run (and the grid
to TensorBoard, when the logger has a TensorBoard output: ``--tensorboard``).

    grids = SampleGrids(model=..., params=ema_params, diffusion=..., log_dir=..., interval=N)
    grids.at_step(step, shape, resumed=...)   # the loop, each step, before training the next
    grids.at_end(step)                        # the loop, after its final save

What a grid is: ``count`` samples of the EMA (TrainLoop gives the first --ema_rate's), by DDIM
(eta 0) on ``steps`` of the training diffusion's timesteps (respace.respaced), sample ``i`` from
its own seeds (sampling.sample_seed(seed, i): noise) and, for a class-conditional model, label
``i % num_classes``. So the grids of two steps differ only by the weights, and a grid shows the
first ``count`` samples that ``sample.py --model_path ema_RATE_STEP.pt --use_ddim True
--timestep_respacing STEPS --seed SEED [--classes 0,1,...]`` draws from the EMA file of that step.
Any model called as ``model(x, t, **kwargs)`` works: a model that needs other keyword arguments
(a super-resolution model's ``low_res``) gets them from ``model_kwargs(indices)``. Samples must be
images (1 or 3 channels): a latent model's are refused at the first step (UsageError).

What it leaves alone:

- the training model: a copy holds the EMA parameters and the model's live buffers (BatchNorm
  statistics), in eval mode; nothing runs through the model or its DDP wrapper (rule 11);
- training's RNG streams: all noise comes from the per-sample generators, and the process's
  global RNG states (rng.get_rng_state) are put back afterwards, whatever the model draws;
- the other ranks: sampling calls no collective; they go on into the next step and wait for
  rank 0 in its first collective, as long as the sampling takes (a sharded model, --fsdp True,
  is the exception, below). That wait is bounded by
  --dist_timeout (the process group's timeout): a grid gets half of it (``budget_s``); the clock
  is read before each model call, and a grid whose time is up stops there, writes nothing, says
  so in one line, and turns grids off for the rest of the job, long before another rank times
  out. With one rank there is no bound.

A sharded model (--fsdp True: no rank holds the whole model, and its forward is collective):
every rank samples the grid together, the EMA's slices swapped into the live shards in place
(fsdp.params_swapped_in: the parameters, buffers and modes put back bit for bit afterwards, so
the training is the same to the bit), the same samples on every rank; rank 0 alone writes them.
No rank waits for another, so a grid has no budget there; a grid that fails on one rank turns
grids off on every rank alike (one exchange of flags after it).

A grid that fails (a model that cannot be copied, out of memory, a full disk) logs its traceback
and turns grids off for the rest of the job; training goes on. Each grid logs one line: its file,
what it drew and how long it took.

When: the steps that are multiples of ``interval``, and the last step of a run. The grid of step
S is drawn from the state after S steps, before step S + 1 trains, so a resumed job writes the
grid of its resume step only when that file is missing (a job preempted right after it saved a
multiple of the interval) and then goes on at the same steps as a straight run.
"""
import contextlib
import copy
import os
import time
import traceback

import numpy as np
import torch as th

from . import dist_util, logger, sampling
from .infra import fsdp
from .infra.errors import UsageError
from .gaussian_diffusion import GaussianDiffusion
from .respace import respaced
from .infra import storage as bf  # blobfile's names: local paths and s3://, gs://, az://
from .ckpt.rng import get_rng_state, set_rng_state

# The share of --dist_timeout a grid may take: the other ranks wait for it in a collective.
BUDGET_SHARE = 0.5
# Images per row of a grid; a class-conditional model's grid has a column per class instead
# (labels ``i % num_classes``: each column one class) up to MAX_CLASS_COLUMNS classes.
GRID_COLUMNS = 8
MAX_CLASS_COLUMNS = 16


class OverBudget(Exception):
    """A grid's time was up (raised by TimedModel before a model call)."""


class TimedModel:
    """``model(x, t, **kwargs)``, refused (OverBudget) once ``clock()`` is past ``deadline``."""

    def __init__(self, model, deadline, clock=time.monotonic):
        self.model, self.deadline, self.clock = model, deadline, clock

    def __call__(self, *args, **kwargs):
        if self.deadline is not None and self.clock() > self.deadline:
            raise OverBudget
        return self.model(*args, **kwargs)


def copy_with_params(model, params):
    """
    A copy of ``model`` in eval mode whose parameters are copies of ``params`` (tensors in
    ``model.parameters()`` order, e.g. an EMA) and whose buffers are copies of the model's: what
    runs through the copy leaves ``model`` as it was. The model's parameters and gradients are
    not copied (deepcopy is handed the new parameters).
    """
    own = list(model.parameters())
    params = list(params)
    if len(own) != len(params):
        raise ValueError(f"{len(params)} tensors for a model of {len(own)} parameters")
    memo = {id(p): th.nn.Parameter(q.detach().clone(), requires_grad=False)
            for p, q in zip(own, params)}
    out = copy.deepcopy(model, memo)
    return out.eval()


def model_with_params(model, params):
    """A context giving ``model`` with ``params`` (tensors in ``model.parameters()`` order) to
    sample from, leaving the training model as it was: a copy (copy_with_params), or for a
    sharded model (--fsdp True) the live one with the params' slices swapped in
    (fsdp.params_swapped_in), whose forward is collective: every rank then calls it alike."""
    if fsdp.is_sharded(model):
        return fsdp.params_swapped_in(model, params)
    return contextlib.nullcontext(copy_with_params(model, params))


def ddim_diffusion(diffusion, steps, flag):
    """The training ``diffusion`` respaced to ``steps`` timesteps (--sample_steps) for sampling
    while training; UsageError naming ``flag`` (the feature's on/off flag) or --sample_steps
    when it cannot be."""
    if not isinstance(diffusion, GaussianDiffusion):
        raise UsageError(f"{flag}: the diffusion is a {type(diffusion).__name__}, not a "
                         f"GaussianDiffusion; pass {flag} 0")
    if steps > diffusion.num_timesteps:
        raise UsageError(f"--sample_steps {steps} is more than the diffusion's "
                         f"{diffusion.num_timesteps} timesteps; pass --sample_steps "
                         f"{diffusion.num_timesteps} or fewer")
    return respaced(diffusion, str(steps))


def check_image_channels(shape, flag, what_to_do):
    """UsageError unless samples of shape [C, H, W] ``shape`` are images (1 or 3 channels, not
    latents): the one line names ``flag`` and ends with ``what_to_do``."""
    if int(shape[0]) not in (1, 3):
        raise UsageError(f"{flag}: the samples have {int(shape[0])} channels (latents?), not an "
                         f"image's 1 or 3, so {what_to_do}")


def grid_path(log_dir, step):
    """LOG_DIR/samples/grid_{step:06d}.png."""
    return bf.join(log_dir, "samples", f"grid_{step:06d}.png")


class SampleGrids:
    """
    The grids of one training job (module docstring). Build it on every rank with the same
    arguments (it checks them: UsageError naming the flag); at_step/at_end are called by every
    rank and return at once off rank 0, but for a sharded model (every rank samples: they are
    collective then).

    model: the bare training module (its parameters' device is the grid's); params: the tensors
    to sample with, in model.parameters() order; what: how the log line names them ("EMA 0.9999");
    diffusion: the training diffusion (a GaussianDiffusion or SpacedDiffusion); log_dir: where
    samples/ goes; interval, count, steps: --sample_interval, --sample_count, --sample_steps;
    seed: of the samples' noise and labels; num_classes: label samples ``i % num_classes`` (None:
    no labels); model_kwargs: ``indices (int64 [n]) -> {name: tensor [n, ...]}``, more keyword
    arguments of the model; budget_s: the most seconds a grid may take (None: no bound).
    """

    def __init__(self, *, model, params, diffusion, log_dir, interval, count, steps, seed=0,
                 what="EMA", num_classes=None, model_kwargs=None, budget_s=None,
                 clock=time.monotonic):
        self.diffusion = ddim_diffusion(diffusion, steps, "--sample_interval")
        self.model, self.params, self.what = model, params, what
        self.log_dir, self.interval, self.count, self.steps = log_dir, interval, count, steps
        self.seed, self.num_classes, self.model_kwargs = seed, num_classes, model_kwargs
        self.budget_s, self.clock = budget_s, clock
        self.rank0 = dist_util.get_rank() == 0
        self.sharded = fsdp.is_sharded(model)  # every rank samples (module docstring)
        if self.sharded:
            self.budget_s = None  # no rank waits for another
        self.shape = None  # [C, H, W] of a sample: the training batches'
        self.off = False
        self.written = None  # the step of this job's last grid

    @classmethod
    def of_training(cls, config, model, ema_params, diffusion, model_flags, sample_kwargs=None):
        """The grids of a TrainLoop (``config``: its TrainConfig): of the first EMA (the model's
        parameters without --ema_rate), labelled by model_flags' classes unless
        ``sample_kwargs`` gives the model's keyword arguments. Build on every rank."""
        params, what = ((ema_params[0], f"EMA {config.ema_rates[0]}") if ema_params
                        else (list(model.parameters()), "model (no --ema_rate)"))
        return cls(
            model=model, params=params, what=what, diffusion=diffusion,
            log_dir=config.checkpoint.log_dir, interval=config.sample_interval,
            count=config.sample_count, steps=config.sample_steps, seed=config.seed,
            model_kwargs=sample_kwargs,
            num_classes=None if sample_kwargs else label_count(model_flags),
            budget_s=cls.budget_of_job())

    @classmethod
    def budget_of_job(cls):
        """BUDGET_SHARE of the process group's --dist_timeout; None with one rank."""
        timeout = dist_util.timeout_s() if dist_util.get_world_size() > 1 else None
        return None if timeout is None else BUDGET_SHARE * timeout

    def at_step(self, step, shape, resumed=False):
        """Before training step ``step`` + 1, with a batch of samples [C, H, W] ``shape``: the grid
        of ``step`` if it is a multiple of the interval (``resumed``: the job's first step, the
        state it resumed: only when the file is missing). Not collective (but for a sharded
        model). Samples that are no image (latents: not 1 or 3 channels) are a UsageError,
        raised on every rank at the first step."""
        if self.shape is None:
            check_image_channels(shape, f"--sample_interval {self.interval}",
                                 "no grid can show them; pass --sample_interval 0 and decode "
                                 "sample.py's latents (datasets/vae_latents.py)")
        self.shape = tuple(int(s) for s in shape)
        if not self._mine or step == 0 or step % self.interval:
            return None
        if resumed and self._exists(grid_path(self.log_dir, step)):
            return None
        return self.write(step)

    @property
    def _mine(self):
        """Whether this rank samples: rank 0, or every rank for a sharded model."""
        return self.rank0 or self.sharded

    def _exists(self, path):
        """Whether ``path`` exists, as rank 0 sees it (every rank gets its answer for a sharded
        model: collective then)."""
        if self.sharded:
            return dist_util.run_on_rank0(lambda: bf.exists(path))
        return bf.exists(path)

    def at_end(self, step):
        """After the run's final step ``step``: its grid, unless this job drew it already or
        trained no step (nothing tells it the samples' shape then). Not collective (but for a
        sharded model)."""
        if not self._mine or self.shape is None or self.written == step:
            return None
        return self.write(step)

    @property
    def columns(self):
        """Images per row: one column per class for labelled samples (their labels are
        ``i % num_classes``, so a column holds one class), else GRID_COLUMNS; never more than the
        grid's images. E.g. 10 classes, --sample_count 20: two rows of the classes 0-9."""
        per_row = GRID_COLUMNS
        if self.num_classes is not None and self.num_classes <= MAX_CLASS_COLUMNS:
            per_row = self.num_classes
        return min(self.count, per_row)

    def write(self, step):
        """Rank 0 (every rank for a sharded model): sample the grid of ``step``; rank 0 writes it
        (PNG, and TensorBoard's "sample_grid" image when the logger has one); one log line.
        Returns its path, or None when grids are off or it did not end. Not collective, but for
        a sharded model."""
        if not self._mine or self.off or self.shape is None:
            return None
        t0 = self.clock()
        deadline = None if self.budget_s is None else t0 + self.budget_s
        path = grid_path(self.log_dir, step)
        state = get_rng_state()
        failed = None
        try:
            with self._sampling_model() as model:
                images = self.sample(TimedModel(model, deadline, self.clock))
            if self.rank0:
                grid = write_png(path, images, ncol=self.columns)
                logger.write_image("sample_grid", grid, step)
        except OverBudget:
            self.off = True
            logger.warn(
                f"samples: the grid of step {step} stopped after {self.clock() - t0:.1f}s, its "
                f"budget ({BUDGET_SHARE:g} x --dist_timeout {self.budget_s / BUDGET_SHARE:g}s: "
                f"the other ranks wait for it); no more grids in this job: lower --sample_count "
                f"or --sample_steps, or raise --dist_timeout")
            return None
        except Exception:
            failed = traceback.format_exc().rstrip()
        finally:
            set_rng_state(state)
        if self.sharded:  # every rank turns grids off alike
            failed_here = failed
            (somewhere,) = dist_util.any_rank_async([failed is not None]).wait()
            failed = failed_here or ("(on another rank)" if somewhere else None)
        if failed is not None:
            self.off = True
            logger.warn(f"samples: the grid of step {step} failed; no more grids in this job, "
                        f"training goes on:\n{failed}")
            return None
        self.written = step
        logger.log(f"samples: {path} ({self.count} samples of the {self.what}, {self.steps} DDIM "
                   f"steps) in {self.clock() - t0:.2f}s")
        return path

    def _sampling_model(self):
        return model_with_params(self.model, self.params)

    def sample(self, model):
        """The grid's samples from ``model``: uint8 [count, H, W, C] numpy."""
        device = next(self.model.parameters()).device
        images, _ = sampling.sample_indices(
            model, self.diffusion, np.arange(self.count, dtype=np.int64), shape=self.shape,
            seed=self.seed, use_ddim=True, num_classes=self.num_classes,
            classes=list(range(self.num_classes)) if self.num_classes else None,
            extra_kwargs=self.model_kwargs, device=device)
        return images


def write_png(path, images, ncol):
    """The grid of ``images`` (uint8 [N, H, W, C]) as a PNG at ``path``, replaced whole (a
    temporary name, then a rename; a URL is written as one object). Returns the grid."""
    bf.makedirs(bf.dirname(path))
    if "://" in path:
        with bf.BlobFile(path, "wb") as f:
            return sampling.grid_png(images, f, ncol=ncol)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            grid = sampling.grid_png(images, f, ncol=ncol)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return grid


def label_count(model_flags):
    """The class count of a class-conditional model's flags (its grid's labels), else None."""
    if not model_flags.get("class_cond"):
        return None
    n = model_flags.get("num_classes")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise UsageError(f"--sample_interval: a class-conditional model needs num_classes in its "
                         f"flags (got {n!r}); pass --num_classes")
    return n
