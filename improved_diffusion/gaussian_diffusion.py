"""
The Gaussian diffusion process: beta schedules, the forward process q, the learned reverse
process p, the training losses, ancestral and DDIM samplers, and bits/dim evaluation.

Written after openai/improved-diffusion (commit 1bc7bbb), itself after Ho et al.'s diffusion
models code; numbers match upstream's. Schedules are float64 NumPy arrays; they are indexed by
timestep and cast to float32 tensors only at the point of use (`_extract_into_tensor`).

Shapes: N is the batch size, x tensors are [N, C, ...] (images [N, C, H, W]), t is a long tensor
[N] of timestep indices into this diffusion's schedule.

Sampling functions take `randn_like`: a callable `randn_like(x) -> tensor shaped like x` through
which ALL noise drawn by the sampler goes (initial noise and per-step noise); None means
`th.randn_like`. A per-sample-seeded `randn_like` makes each sample independent of the batch it
is drawn in.

Guidance (guided-diffusion's API, commit 22e0df8): the samplers take `cond_fn(x, t, **model_kwargs)
-> [N, C, ...]`, the gradient of a log-probability log p(y | x_t) with respect to x_t (already
multiplied by its scale), called with the timesteps as the model sees them. Ancestral steps shift
the mean by it (`condition_mean`), DDIM steps the score (`condition_score`). `cond_fn` comes after
`model_kwargs` in the signatures (improved-diffusion's positions stay; pass it by keyword, as
guided's scripts do).
"""
import enum
import math

import numpy as np
import torch as th

from .losses import discretized_gaussian_log_likelihood, normal_kl


def mean_flat(tensor):
    """Mean over all non-batch dimensions: [N, ...] -> [N]."""
    return tensor.mean(dim=list(range(1, len(tensor.shape))))


# The largest beta of a named schedule: a beta of 1 leaves no signal in x_t (alpha_bar 0).
MAX_BETA = 0.999


def get_named_beta_schedule(schedule_name, num_diffusion_timesteps):
    """
    Get a pre-defined beta schedule for the given name.

    :param schedule_name: "linear" (Ho et al., scaled so any number of steps works) or "cosine"
        (Nichol & Dhariwal).
    :param num_diffusion_timesteps: T, the number of steps.
    :return: float64 np array [T] of betas.
    :raises ValueError: for an unknown name (the `--noise_schedule` flag).
    """
    if schedule_name == "linear":
        # Linear schedule from Ho et al, extended to work for any number of diffusion steps.
        scale = 1000 / num_diffusion_timesteps
        beta_start = scale * 0.0001
        beta_end = scale * 0.02
        betas = np.linspace(beta_start, beta_end, num_diffusion_timesteps, dtype=np.float64)
        # 20 steps end at beta 1 (0.02 * 1000 / 20): alpha_bar_T = 0, so x_0's prediction at
        # t = T divides by sqrt(alpha_bar_T) and every sample is nan (upstream's too). Capped as
        # the cosine schedule caps its betas (max_beta 0.999, Nichol & Dhariwal: "to prevent
        # singularities at the end of the diffusion process"). Fewer steps give betas above 1,
        # left as they are for the caller to refuse (script_util names --diffusion_steps).
        return np.where(betas <= 1, np.minimum(betas, MAX_BETA), betas)
    elif schedule_name == "cosine":
        return betas_for_alpha_bar(
            num_diffusion_timesteps,
            lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2,
        )
    raise ValueError(
        f"unknown beta schedule {schedule_name!r} for --noise_schedule; use 'linear' or 'cosine'"
    )


def betas_for_alpha_bar(num_diffusion_timesteps, alpha_bar, max_beta=MAX_BETA):
    """
    Discretize alpha_bar(t), the cumulative product of (1 - beta) over t in [0, 1], into betas.

    :param num_diffusion_timesteps: T, the number of betas to produce.
    :param alpha_bar: a function t in [0, 1] -> cumulative product of (1 - beta) up to t.
    :param max_beta: the largest beta; values below 1 prevent singularities.
    :return: float64 np array [T].
    """
    betas = []
    for i in range(num_diffusion_timesteps):
        t1 = i / num_diffusion_timesteps
        t2 = (i + 1) / num_diffusion_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return np.array(betas, dtype=np.float64)


class ModelMeanType(enum.Enum):
    """Which quantity the model predicts for the mean."""

    PREVIOUS_X = enum.auto()  # the model predicts x_{t-1}
    START_X = enum.auto()  # the model predicts x_0
    EPSILON = enum.auto()  # the model predicts epsilon


class ModelVarType(enum.Enum):
    """
    What is used as the model's output variance.

    LEARNED_RANGE lets the model output values in [-1, 1] that interpolate (in log space) between
    FIXED_SMALL and FIXED_LARGE.
    """

    LEARNED = enum.auto()
    FIXED_SMALL = enum.auto()
    FIXED_LARGE = enum.auto()
    LEARNED_RANGE = enum.auto()


class LossType(enum.Enum):
    MSE = enum.auto()  # use raw MSE loss (and KL when learning variances)
    RESCALED_MSE = enum.auto()  # use raw MSE loss (with RESCALED_KL when learning variances)
    KL = enum.auto()  # use the variational lower-bound
    RESCALED_KL = enum.auto()  # like KL, but rescale to estimate the full VLB

    def is_vb(self):
        return self == LossType.KL or self == LossType.RESCALED_KL


def _default_randn_like(randn_like):
    return th.randn_like if randn_like is None else randn_like


def _nonzero_mask(t, x):
    """[N] timesteps -> [N, 1, ...] float mask, 0 where t == 0 (no noise on the last step)."""
    return (t != 0).float().view(-1, *([1] * (len(x.shape) - 1)))


def _progress(indices, progress):
    if progress:
        # Lazy import so that the module does not depend on tqdm unless asked.
        from tqdm.auto import tqdm

        return tqdm(indices)
    return indices


class GaussianDiffusion:
    """
    Utilities for training and sampling diffusion models.

    :param betas: a 1-D array [T] of betas for each diffusion timestep, starting at T and going
        to 1 (float64 internally).
    :param model_mean_type: a ModelMeanType.
    :param model_var_type: a ModelVarType.
    :param loss_type: a LossType.
    :param rescale_timesteps: if True, pass timesteps scaled to [0, 1000) to the model, so that
        it always sees the same range as the original paper (T=1000).
    """

    def __init__(self, *, betas, model_mean_type, model_var_type, loss_type,
                 rescale_timesteps=False):
        self.model_mean_type = model_mean_type
        self.model_var_type = model_var_type
        self.loss_type = loss_type
        self.rescale_timesteps = rescale_timesteps

        # Use float64 for accuracy.
        betas = np.array(betas, dtype=np.float64)
        self.betas = betas
        if betas.ndim != 1 or betas.shape[0] < 1:
            raise ValueError(f"betas must be a non-empty 1-D array, got shape {betas.shape}")
        if not ((betas > 0).all() and (betas <= 1).all()):
            raise ValueError("betas must lie in (0, 1]")

        self.num_timesteps = int(betas.shape[0])

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.alphas_cumprod_next = np.append(self.alphas_cumprod[1:], 0.0)

        # calculations for diffusion q(x_t | x_{t-1}) and others
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.log_one_minus_alphas_cumprod = np.log(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)

        # calculations for posterior q(x_{t-1} | x_t, x_0)
        self.posterior_variance = (
            betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        )
        # log calculation clipped because the posterior variance is 0 at the beginning of the
        # diffusion chain. (With a single step there is no t=1 to borrow from.)
        first = self.posterior_variance[1] if self.num_timesteps > 1 else self.betas[0]
        self.posterior_log_variance_clipped = np.log(
            np.append(first, self.posterior_variance[1:])
        )
        self.posterior_mean_coef1 = (
            betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        )
        self.posterior_mean_coef2 = (
            (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        )

    # ----------------------------------------------------------------------------------------
    # The forward process q.

    def q_mean_variance(self, x_start, t):
        """
        The distribution q(x_t | x_0).

        :param x_start: [N, C, ...] noiseless inputs.
        :param t: [N] timesteps (0 means one step).
        :return: (mean, variance, log_variance), each [N, C, ...].
        """
        mean = _extract_into_tensor(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
        variance = _extract_into_tensor(1.0 - self.alphas_cumprod, t, x_start.shape)
        log_variance = _extract_into_tensor(self.log_one_minus_alphas_cumprod, t, x_start.shape)
        return mean, variance, log_variance

    def q_sample(self, x_start, t, noise=None):
        """
        Diffuse the data for a given number of steps: sample from q(x_t | x_0).

        :param x_start: [N, C, ...] initial data.
        :param t: [N] timesteps (0 means one step).
        :param noise: optional [N, C, ...] Gaussian noise (default: th.randn_like(x_start)).
        :return: x_t, [N, C, ...].
        """
        if noise is None:
            noise = th.randn_like(x_start)
        if noise.shape != x_start.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != x_start {tuple(x_start.shape)}")
        return (
            _extract_into_tensor(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
            + _extract_into_tensor(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise
        )

    def q_posterior_mean_variance(self, x_start, x_t, t):
        """
        The diffusion posterior q(x_{t-1} | x_t, x_0).

        :param x_start: [N, C, ...]; x_t: [N, C, ...]; t: [N].
        :return: (posterior_mean, posterior_variance, posterior_log_variance_clipped), each
            [N, C, ...].
        """
        if x_start.shape != x_t.shape:
            raise ValueError(f"x_start {tuple(x_start.shape)} and x_t {tuple(x_t.shape)} differ")
        posterior_mean = (
            _extract_into_tensor(self.posterior_mean_coef1, t, x_t.shape) * x_start
            + _extract_into_tensor(self.posterior_mean_coef2, t, x_t.shape) * x_t
        )
        posterior_variance = _extract_into_tensor(self.posterior_variance, t, x_t.shape)
        posterior_log_variance_clipped = _extract_into_tensor(
            self.posterior_log_variance_clipped, t, x_t.shape
        )
        return posterior_mean, posterior_variance, posterior_log_variance_clipped

    # ----------------------------------------------------------------------------------------
    # The reverse process p.

    def p_mean_variance(self, model, x, t, clip_denoised=True, denoised_fn=None,
                        model_kwargs=None):
        """
        Apply the model to get p(x_{t-1} | x_t), and a prediction of the initial x.

        :param model: callable model(x [N, C, ...], scaled t [N], **model_kwargs) -> [N, C, ...]
            (or [N, 2C, ...] for learned variances).
        :param x: [N, C, ...] x_t.
        :param t: [N] timesteps.
        :param clip_denoised: if True, clip the x_0 prediction to [-1, 1].
        :param denoised_fn: optional function applied to the x_0 prediction before clipping.
        :param model_kwargs: extra keyword arguments for the model (e.g. {"y": labels [N]}).
        :return: dict with "mean", "variance", "log_variance", "pred_xstart", each [N, C, ...].
        """
        if model_kwargs is None:
            model_kwargs = {}
        B, C = x.shape[:2]
        if t.shape != (B,):
            raise ValueError(f"t must have shape ({B},), got {tuple(t.shape)}")
        model_output = model(x, self._scale_timesteps(t), **model_kwargs)

        if self.model_var_type in (ModelVarType.LEARNED, ModelVarType.LEARNED_RANGE):
            _check_model_output(model_output, (B, C * 2, *x.shape[2:]), "learned variance")
            model_output, model_var_values = th.split(model_output, C, dim=1)
            if self.model_var_type == ModelVarType.LEARNED:
                model_log_variance = model_var_values
                model_variance = th.exp(model_log_variance)
            else:
                min_log = _extract_into_tensor(self.posterior_log_variance_clipped, t, x.shape)
                max_log = _extract_into_tensor(np.log(self.betas), t, x.shape)
                # The model_var_values is [-1, 1] for [min_var, max_var].
                frac = (model_var_values + 1) / 2
                model_log_variance = frac * max_log + (1 - frac) * min_log
                model_variance = th.exp(model_log_variance)
        else:
            _check_model_output(model_output, tuple(x.shape), "fixed variance")
            if self.model_var_type == ModelVarType.FIXED_LARGE:
                # The fixed large variance is beta_t, except at t=0 where the posterior variance
                # of t=1 is used (a better decoder log-likelihood).
                first = self.posterior_variance[1] if self.num_timesteps > 1 else self.betas[0]
                variance = np.append(first, self.betas[1:])
                log_variance = np.log(variance)
            elif self.model_var_type == ModelVarType.FIXED_SMALL:
                variance = self.posterior_variance
                log_variance = self.posterior_log_variance_clipped
            else:
                raise NotImplementedError(self.model_var_type)
            model_variance = _extract_into_tensor(variance, t, x.shape)
            model_log_variance = _extract_into_tensor(log_variance, t, x.shape)

        def process_xstart(x_pred):
            if denoised_fn is not None:
                x_pred = denoised_fn(x_pred)
            if clip_denoised:
                return x_pred.clamp(-1, 1)
            return x_pred

        if self.model_mean_type == ModelMeanType.PREVIOUS_X:
            pred_xstart = process_xstart(
                self._predict_xstart_from_xprev(x_t=x, t=t, xprev=model_output)
            )
            model_mean = model_output
        elif self.model_mean_type in (ModelMeanType.START_X, ModelMeanType.EPSILON):
            if self.model_mean_type == ModelMeanType.START_X:
                pred_xstart = process_xstart(model_output)
            else:
                pred_xstart = process_xstart(
                    self._predict_xstart_from_eps(x_t=x, t=t, eps=model_output)
                )
            model_mean, _, _ = self.q_posterior_mean_variance(x_start=pred_xstart, x_t=x, t=t)
        else:
            raise NotImplementedError(self.model_mean_type)

        return {
            "mean": model_mean,
            "variance": model_variance,
            "log_variance": model_log_variance,
            "pred_xstart": pred_xstart,
        }

    def _predict_xstart_from_eps(self, x_t, t, eps):
        return (
            _extract_into_tensor(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
            - _extract_into_tensor(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * eps
        )

    def _predict_xstart_from_xprev(self, x_t, t, xprev):
        return (  # (xprev - coef2*x_t) / coef1
            _extract_into_tensor(1.0 / self.posterior_mean_coef1, t, x_t.shape) * xprev
            - _extract_into_tensor(
                self.posterior_mean_coef2 / self.posterior_mean_coef1, t, x_t.shape
            )
            * x_t
        )

    def _predict_eps_from_xstart(self, x_t, t, pred_xstart):
        return (
            _extract_into_tensor(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
            - pred_xstart
        ) / _extract_into_tensor(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape)

    def _scale_timesteps(self, t):
        """[N] timestep indices -> what the model sees: float t * 1000 / T if rescaling."""
        if self.rescale_timesteps:
            return t.float() * (1000.0 / self.num_timesteps)
        return t

    def original_timesteps(self, model_t):
        """
        What the model (and cond_fn) is given -> the timestep indices [N] of the original
        process (long), the timesteps guided-diffusion's classifiers are trained on: undoes the
        rescaling to 0..1000 (and, in SpacedDiffusion, nothing else: the wrapped model already
        sees original indices). The identity without rescale_timesteps.
        """
        if not self.rescale_timesteps:
            return model_t
        steps = getattr(self, "original_num_steps", self.num_timesteps)
        return th.round(model_t.double() * (steps / 1000.0)).long()

    # ----------------------------------------------------------------------------------------
    # Guidance by the gradient of a log-probability (guided-diffusion's conditioning).

    def condition_mean(self, cond_fn, p_mean_var, x, t, model_kwargs=None):
        """
        The mean of p(x_{t-1} | x_t) shifted towards a condition (Sohl-Dickstein et al. 2015):
        mean + variance * cond_fn(x, t), where cond_fn gives grad_x log p(y | x).

        :param cond_fn: callable (x [N, C, ...], model timesteps [N], **model_kwargs) ->
            [N, C, ...] gradient (already times its scale).
        :param p_mean_var: p_mean_variance's output for x and t.
        :param x: [N, C, ...] x_t; t: [N] timesteps.
        :param model_kwargs: passed to cond_fn (e.g. {"y": labels [N]}).
        :return: [N, C, ...] the new mean (float32).
        """
        gradient = cond_fn(x, self._scale_timesteps(t), **(model_kwargs or {}))
        return p_mean_var["mean"].float() + p_mean_var["variance"] * gradient.float()

    def condition_score(self, cond_fn, p_mean_var, x, t, model_kwargs=None):
        """
        What p_mean_variance would have returned had the model's score been conditioned by
        cond_fn (Song et al. 2020): eps' = eps - sqrt(1 - alpha_bar_t) * cond_fn(x, t), and the
        x_0 prediction and mean that follow from eps' (the x_0 prediction is not clipped again).

        Arguments as condition_mean.
        :return: a copy of p_mean_var with "pred_xstart" and "mean" replaced, [N, C, ...] each.
        """
        alpha_bar = _extract_into_tensor(self.alphas_cumprod, t, x.shape)
        eps = self._predict_eps_from_xstart(x, t, p_mean_var["pred_xstart"])
        eps = eps - (1 - alpha_bar).sqrt() * cond_fn(
            x, self._scale_timesteps(t), **(model_kwargs or {}))
        out = p_mean_var.copy()
        out["pred_xstart"] = self._predict_xstart_from_eps(x, t, eps)
        out["mean"], _, _ = self.q_posterior_mean_variance(x_start=out["pred_xstart"], x_t=x, t=t)
        return out

    # ----------------------------------------------------------------------------------------
    # Ancestral sampling.

    def p_sample(self, model, x, t, clip_denoised=True, denoised_fn=None, model_kwargs=None,
                 cond_fn=None, randn_like=None):
        """
        Sample x_{t-1} from the model at the given timestep.

        :param model: the model (see p_mean_variance).
        :param x: [N, C, ...] current x_t.
        :param t: [N] timesteps.
        :param clip_denoised: if True, clip the x_0 prediction to [-1, 1].
        :param denoised_fn: optional function applied to the x_0 prediction.
        :param model_kwargs: extra keyword arguments for the model (and cond_fn).
        :param cond_fn: optional gradient of log p(y | x_t) (see condition_mean): shifts the mean.
        :param randn_like: callable x -> noise shaped like x (default th.randn_like).
        :return: dict with "sample" [N, C, ...] and "pred_xstart" [N, C, ...].
        """
        randn_like = _default_randn_like(randn_like)
        out = self.p_mean_variance(
            model, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
            model_kwargs=model_kwargs,
        )
        noise = randn_like(x)
        if cond_fn is not None:
            out["mean"] = self.condition_mean(cond_fn, out, x, t, model_kwargs=model_kwargs)
        sample = out["mean"] + _nonzero_mask(t, x) * th.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def p_sample_loop(self, model, shape, noise=None, clip_denoised=True, denoised_fn=None,
                      model_kwargs=None, device=None, progress=False, randn_like=None,
                      cond_fn=None):
        """
        Generate samples from the model.

        :param model: the model (see p_mean_variance).
        :param shape: (N, C, ...) shape of the samples.
        :param noise: optional [N, C, ...] initial x_T (default: randn_like of zeros(shape)).
        :param clip_denoised: if True, clip x_0 predictions to [-1, 1].
        :param denoised_fn: optional function applied to x_0 predictions.
        :param model_kwargs: extra keyword arguments for the model (and cond_fn).
        :param device: device of the samples (default: the model's parameters' device).
        :param progress: if True, show a tqdm progress bar over timesteps.
        :param randn_like: callable x -> noise shaped like x; all noise goes through it.
        :param cond_fn: optional classifier guidance for every step (see p_sample).
        :return: [N, C, ...] samples.
        """
        final = None
        for sample in self.p_sample_loop_progressive(
            model, shape, noise=noise, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
            model_kwargs=model_kwargs, device=device, progress=progress, randn_like=randn_like,
            cond_fn=cond_fn,
        ):
            final = sample
        return final["sample"]

    def p_sample_loop_progressive(self, model, shape, noise=None, clip_denoised=True,
                                  denoised_fn=None, model_kwargs=None, device=None,
                                  progress=False, randn_like=None, cond_fn=None):
        """
        Generate samples, yielding the output of every p_sample step (t = T-1 down to 0).

        Arguments as p_sample_loop. Yields dicts with "sample" and "pred_xstart", [N, C, ...].
        """
        randn_like = _default_randn_like(randn_like)
        device, img = self._initial_noise(model, shape, noise, device, randn_like)
        indices = list(range(self.num_timesteps))[::-1]
        for i in _progress(indices, progress):
            t = th.tensor([i] * shape[0], device=device)
            with th.no_grad():
                out = self.p_sample(
                    model, img, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                    model_kwargs=model_kwargs, cond_fn=cond_fn, randn_like=randn_like,
                )
                yield out
                img = out["sample"]

    def _initial_noise(self, model, shape, noise, device, randn_like):
        if device is None:
            device = next(model.parameters()).device
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"shape must be a tuple or list, got {type(shape).__name__}")
        if noise is not None:
            img = noise
        else:
            img = randn_like(th.zeros(*shape, device=device))
        return device, img

    # ----------------------------------------------------------------------------------------
    # DDIM sampling.

    def ddim_sample(self, model, x, t, clip_denoised=True, denoised_fn=None, model_kwargs=None,
                    eta=0.0, randn_like=None, cond_fn=None):
        """
        Sample x_{t-1} from the model using DDIM.

        Arguments as p_sample, plus `eta` (0 = deterministic DDIM, 1 = DDPM-like noise). Noise
        is drawn (through randn_like) even when eta == 0, as upstream. With `cond_fn` the score
        is conditioned (condition_score) before the step.

        :return: dict with "sample" [N, C, ...] and "pred_xstart" [N, C, ...].
        """
        randn_like = _default_randn_like(randn_like)
        out = self.p_mean_variance(
            model, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
            model_kwargs=model_kwargs,
        )
        if cond_fn is not None:
            out = self.condition_score(cond_fn, out, x, t, model_kwargs=model_kwargs)
        # Usually our model outputs epsilon, but we re-derive it in case we used x_start or
        # x_prev prediction.
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        alpha_bar = _extract_into_tensor(self.alphas_cumprod, t, x.shape)
        alpha_bar_prev = _extract_into_tensor(self.alphas_cumprod_prev, t, x.shape)
        sigma = (
            eta
            * th.sqrt((1 - alpha_bar_prev) / (1 - alpha_bar))
            * th.sqrt(1 - alpha_bar / alpha_bar_prev)
        )
        # Equation 12.
        noise = randn_like(x)
        mean_pred = (
            out["pred_xstart"] * th.sqrt(alpha_bar_prev)
            + th.sqrt(1 - alpha_bar_prev - sigma ** 2) * eps
        )
        sample = mean_pred + _nonzero_mask(t, x) * sigma * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def ddim_reverse_sample(self, model, x, t, clip_denoised=True, denoised_fn=None,
                            model_kwargs=None, eta=0.0):
        """
        Sample x_{t+1} from the model using the DDIM reverse ODE (deterministic; eta must be 0).

        :param x: [N, C, ...] x_t; t: [N].
        :return: dict with "sample" [N, C, ...] and "pred_xstart" [N, C, ...].
        """
        if eta != 0.0:
            raise ValueError("ddim_reverse_sample: the reverse ODE is deterministic; use eta=0")
        out = self.p_mean_variance(
            model, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
            model_kwargs=model_kwargs,
        )
        # Usually our model outputs epsilon, but we re-derive it in case we used x_start or
        # x_prev prediction.
        eps = (
            _extract_into_tensor(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
            - out["pred_xstart"]
        ) / _extract_into_tensor(self.sqrt_recipm1_alphas_cumprod, t, x.shape)
        alpha_bar_next = _extract_into_tensor(self.alphas_cumprod_next, t, x.shape)
        # Equation 12. reversed
        mean_pred = (
            out["pred_xstart"] * th.sqrt(alpha_bar_next) + th.sqrt(1 - alpha_bar_next) * eps
        )
        return {"sample": mean_pred, "pred_xstart": out["pred_xstart"]}

    def ddim_sample_loop(self, model, shape, noise=None, clip_denoised=True, denoised_fn=None,
                         model_kwargs=None, device=None, progress=False, eta=0.0,
                         randn_like=None, cond_fn=None):
        """
        Generate samples from the model using DDIM.

        Arguments as p_sample_loop, plus `eta`.

        :return: [N, C, ...] samples.
        """
        final = None
        for sample in self.ddim_sample_loop_progressive(
            model, shape, noise=noise, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
            model_kwargs=model_kwargs, device=device, progress=progress, eta=eta,
            randn_like=randn_like, cond_fn=cond_fn,
        ):
            final = sample
        return final["sample"]

    def ddim_sample_loop_progressive(self, model, shape, noise=None, clip_denoised=True,
                                     denoised_fn=None, model_kwargs=None, device=None,
                                     progress=False, eta=0.0, randn_like=None, cond_fn=None):
        """
        Use DDIM to sample from the model, yielding the output of every step (t = T-1 .. 0).

        Arguments as ddim_sample_loop. Yields dicts with "sample" and "pred_xstart".
        """
        randn_like = _default_randn_like(randn_like)
        device, img = self._initial_noise(model, shape, noise, device, randn_like)
        indices = list(range(self.num_timesteps))[::-1]
        for i in _progress(indices, progress):
            t = th.tensor([i] * shape[0], device=device)
            with th.no_grad():
                out = self.ddim_sample(
                    model, img, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                    model_kwargs=model_kwargs, eta=eta, randn_like=randn_like, cond_fn=cond_fn,
                )
                yield out
                img = out["sample"]

    # ----------------------------------------------------------------------------------------
    # Losses and likelihoods.

    def _vb_terms_bpd(self, model, x_start, x_t, t, clip_denoised=True, model_kwargs=None):
        """
        One term of the variational lower bound, in bits per dimension.

        :param x_start: [N, C, ...]; x_t: [N, C, ...]; t: [N].
        :return: dict with "output" [N] (decoder NLL where t == 0, else KL) and "pred_xstart"
            [N, C, ...].
        """
        true_mean, _, true_log_variance_clipped = self.q_posterior_mean_variance(
            x_start=x_start, x_t=x_t, t=t
        )
        out = self.p_mean_variance(
            model, x_t, t, clip_denoised=clip_denoised, model_kwargs=model_kwargs
        )
        kl = normal_kl(true_mean, true_log_variance_clipped, out["mean"], out["log_variance"])
        kl = mean_flat(kl) / np.log(2.0)

        decoder_nll = -discretized_gaussian_log_likelihood(
            x_start, means=out["mean"], log_scales=0.5 * out["log_variance"]
        )
        decoder_nll = mean_flat(decoder_nll) / np.log(2.0)

        # At the first timestep return the decoder NLL, otherwise KL(q(x_{t-1}|x_t,x_0) || p).
        output = th.where((t == 0), decoder_nll, kl)
        return {"output": output, "pred_xstart": out["pred_xstart"]}

    def training_losses(self, model, x_start, t, model_kwargs=None, noise=None):
        """
        Compute training losses for a single timestep per example.

        :param model: the model (see p_mean_variance).
        :param x_start: [N, C, ...] inputs.
        :param t: [N] timestep indices.
        :param model_kwargs: extra keyword arguments for the model (e.g. {"y": labels}).
        :param noise: optional [N, C, ...] Gaussian noise to diffuse with.
        :return: dict of [N] tensors: "loss" always; "mse" for MSE losses; "vb" when variances
            are learned (or for the KL losses, "loss" is the vb term).
        """
        if model_kwargs is None:
            model_kwargs = {}
        if noise is None:
            noise = th.randn_like(x_start)
        x_t = self.q_sample(x_start, t, noise=noise)

        terms = {}

        if self.loss_type in (LossType.KL, LossType.RESCALED_KL):
            terms["loss"] = self._vb_terms_bpd(
                model=model, x_start=x_start, x_t=x_t, t=t, clip_denoised=False,
                model_kwargs=model_kwargs,
            )["output"]
            if self.loss_type == LossType.RESCALED_KL:
                terms["loss"] = terms["loss"] * self.num_timesteps
        elif self.loss_type in (LossType.MSE, LossType.RESCALED_MSE):
            model_output = model(x_t, self._scale_timesteps(t), **model_kwargs)

            if self.model_var_type in (ModelVarType.LEARNED, ModelVarType.LEARNED_RANGE):
                B, C = x_t.shape[:2]
                _check_model_output(model_output, (B, C * 2, *x_t.shape[2:]), "learned variance")
                model_output, model_var_values = th.split(model_output, C, dim=1)
                # Learn the variance using the variational bound, but don't let it affect our
                # mean prediction.
                frozen_out = th.cat([model_output.detach(), model_var_values], dim=1)
                terms["vb"] = self._vb_terms_bpd(
                    model=lambda *args, r=frozen_out: r,
                    x_start=x_start, x_t=x_t, t=t, clip_denoised=False,
                )["output"]
                if self.loss_type == LossType.RESCALED_MSE:
                    # Divide by 1000 for equivalence with initial implementation. Without a
                    # factor of 1/1000, the VB term hurts the MSE term.
                    terms["vb"] = terms["vb"] * (self.num_timesteps / 1000.0)

            if self.model_mean_type == ModelMeanType.PREVIOUS_X:
                target = self.q_posterior_mean_variance(x_start=x_start, x_t=x_t, t=t)[0]
            elif self.model_mean_type == ModelMeanType.START_X:
                target = x_start
            elif self.model_mean_type == ModelMeanType.EPSILON:
                target = noise
            else:
                raise NotImplementedError(self.model_mean_type)
            _check_model_output(model_output, tuple(x_start.shape), "mean")
            terms["mse"] = mean_flat((target - model_output) ** 2)
            if "vb" in terms:
                terms["loss"] = terms["mse"] + terms["vb"]
            else:
                terms["loss"] = terms["mse"]
        else:
            raise NotImplementedError(self.loss_type)

        return terms

    def _prior_bpd(self, x_start):
        """
        The prior KL term of the variational lower bound, in bits per dimension: KL(q(x_T|x_0) ||
        N(0, I)). It cannot be optimised; it depends only on the encoder.

        :param x_start: [N, C, ...] inputs.
        :return: [N] KL values in bits per dimension.
        """
        batch_size = x_start.shape[0]
        t = th.tensor([self.num_timesteps - 1] * batch_size, device=x_start.device)
        qt_mean, _, qt_log_variance = self.q_mean_variance(x_start, t)
        kl_prior = normal_kl(mean1=qt_mean, logvar1=qt_log_variance, mean2=0.0, logvar2=0.0)
        return mean_flat(kl_prior) / np.log(2.0)

    def calc_bpd_loop(self, model, x_start, clip_denoised=True, model_kwargs=None,
                      randn_like=None):
        """
        The whole variational lower bound in bits per dimension, and related quantities.

        Noise for each timestep is drawn with `randn_like` (default th.randn_like, the global
        torch generator); a per-sample-seeded one makes each row independent of its batch.

        :param model: the model to evaluate.
        :param x_start: [N, C, ...] inputs.
        :param clip_denoised: if True, clip x_0 predictions.
        :param model_kwargs: extra keyword arguments for the model.
        :return: dict with "total_bpd" [N], "prior_bpd" [N], "vb" [N, T] (per-timestep terms),
            "xstart_mse" [N, T], "mse" [N, T] (epsilon MSE per timestep).
        """
        randn_like = _default_randn_like(randn_like)
        device = x_start.device
        batch_size = x_start.shape[0]

        vb = []
        xstart_mse = []
        mse = []
        for t in list(range(self.num_timesteps))[::-1]:
            t_batch = th.tensor([t] * batch_size, device=device)
            noise = randn_like(x_start)
            x_t = self.q_sample(x_start=x_start, t=t_batch, noise=noise)
            # Calculate VLB term at the current timestep
            with th.no_grad():
                out = self._vb_terms_bpd(
                    model, x_start=x_start, x_t=x_t, t=t_batch, clip_denoised=clip_denoised,
                    model_kwargs=model_kwargs,
                )
            vb.append(out["output"])
            xstart_mse.append(mean_flat((out["pred_xstart"] - x_start) ** 2))
            eps = self._predict_eps_from_xstart(x_t, t_batch, out["pred_xstart"])
            mse.append(mean_flat((eps - noise) ** 2))

        vb = th.stack(vb, dim=1)
        xstart_mse = th.stack(xstart_mse, dim=1)
        mse = th.stack(mse, dim=1)

        prior_bpd = self._prior_bpd(x_start)
        total_bpd = vb.sum(dim=1) + prior_bpd
        return {
            "total_bpd": total_bpd,
            "prior_bpd": prior_bpd,
            "vb": vb,
            "xstart_mse": xstart_mse,
            "mse": mse,
        }


def _check_model_output(output, expected, what):
    if tuple(output.shape) != tuple(expected):
        raise ValueError(
            f"model output has shape {tuple(output.shape)}, expected {tuple(expected)} "
            f"({what}); check that the model's --learn_sigma matches the diffusion's"
        )


def _extract_into_tensor(arr, timesteps, broadcast_shape):
    """
    Extract values from a 1-D numpy array for a batch of indices, as float32.

    :param arr: the 1-D numpy array [T] (float64).
    :param timesteps: a long tensor [N] of indices into the array.
    :param broadcast_shape: a larger shape [N, ...] to broadcast to.
    :return: a float32 tensor of shape broadcast_shape (a view; [N, 1, ...] expanded).
    """
    res = th.from_numpy(arr).to(device=timesteps.device)[timesteps].float()
    while len(res.shape) < len(broadcast_shape):
        res = res[..., None]
    return res.expand(broadcast_shape)
