"""
Timestep respacing: run a diffusion trained with T steps on a subset of its timesteps.

SpacedDiffusion only remaps timesteps: it recomputes betas for the kept steps and wraps the model
(and a guidance cond_fn) so that it still sees the original timesteps.
"""
import numpy as np
import torch as th

from .gaussian_diffusion import GaussianDiffusion


def space_timesteps(num_timesteps, section_counts):
    """
    The set of timesteps to use from an original diffusion process of `num_timesteps` steps.

    The process is divided into equal sections and each section takes the given number of
    evenly-strided steps. With section_counts [10, 15, 20] the first third of the steps gets 10
    steps, the second 15, the last 20. The string "ddimN" uses DDIM's fixed integer striding
    instead, giving exactly N steps.

    :param num_timesteps: the number of steps in the original process.
    :param section_counts: a list of ints, a comma-separated string of ints, or "ddimN".
    :return: a set of timesteps (ints) from the original process to use.
    :raises ValueError: when the request is impossible (the `--timestep_respacing` flag).
    """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            try:
                desired_count = int(section_counts[len("ddim"):])
            except ValueError:
                raise ValueError(
                    f"bad --timestep_respacing {section_counts!r}: write ddimN, e.g. ddim50"
                ) from None
            for i in range(1, num_timesteps):
                if len(range(0, num_timesteps, i)) == desired_count:
                    return set(range(0, num_timesteps, i))
            raise ValueError(
                f"--timestep_respacing {section_counts}: cannot create exactly {desired_count} "
                f"steps from {num_timesteps} with an integer stride; pick another count"
            )
        try:
            section_counts = [int(x) for x in section_counts.split(",")]
        except ValueError:
            raise ValueError(
                f"bad --timestep_respacing {section_counts!r}: write comma-separated step counts "
                "(e.g. 250 or 10,15,20) or ddimN"
            ) from None
    size_per = num_timesteps // len(section_counts)
    extra = num_timesteps % len(section_counts)
    start_idx = 0
    all_steps = []
    for i, section_count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < section_count:
            raise ValueError(
                f"--timestep_respacing: cannot divide a section of {size} steps into "
                f"{section_count}; use fewer steps"
            )
        if section_count <= 1:
            frac_stride = 1
        else:
            frac_stride = (size - 1) / (section_count - 1)
        cur_idx = 0.0
        taken_steps = []
        for _ in range(section_count):
            taken_steps.append(start_idx + round(cur_idx))
            cur_idx += frac_stride
        all_steps += taken_steps
        start_idx += size
    return set(all_steps)


class SpacedDiffusion(GaussianDiffusion):
    """
    A diffusion process which can skip steps in a base diffusion process.

    :param use_timesteps: a collection (sequence or set) of timesteps from the original diffusion
        process to retain.
    :param kwargs: the kwargs to create the base diffusion process (betas of the ORIGINAL T).

    Attributes: `timestep_map` (list: new index -> original timestep), `original_num_steps`,
    `base_betas` (float64 [original T]: the original process's betas).
    """

    def __init__(self, use_timesteps, **kwargs):
        self.use_timesteps = set(use_timesteps)
        self.timestep_map = []
        self.original_num_steps = len(kwargs["betas"])
        self.base_betas = np.array(kwargs["betas"], dtype=np.float64)

        base_diffusion = GaussianDiffusion(**kwargs)
        last_alpha_cumprod = 1.0
        new_betas = []
        for i, alpha_cumprod in enumerate(base_diffusion.alphas_cumprod):
            if i in self.use_timesteps:
                new_betas.append(1 - alpha_cumprod / last_alpha_cumprod)
                last_alpha_cumprod = alpha_cumprod
                self.timestep_map.append(i)
        kwargs["betas"] = np.array(new_betas, dtype=np.float64)
        super().__init__(**kwargs)

    def p_mean_variance(self, model, *args, **kwargs):
        return super().p_mean_variance(self._wrap_model(model), *args, **kwargs)

    def training_losses(self, model, *args, **kwargs):
        return super().training_losses(self._wrap_model(model), *args, **kwargs)

    def condition_mean(self, cond_fn, *args, **kwargs):
        # cond_fn sees the original timesteps, as the model does (guided-diffusion's wrapping).
        return super().condition_mean(self._wrap_model(cond_fn), *args, **kwargs)

    def condition_score(self, cond_fn, *args, **kwargs):
        return super().condition_score(self._wrap_model(cond_fn), *args, **kwargs)

    def _wrap_model(self, model):
        if isinstance(model, _WrappedModel):
            return model
        return _WrappedModel(
            model, self.timestep_map, self.rescale_timesteps, self.original_num_steps
        )

    def _scale_timesteps(self, t):
        # Scaling is done by the wrapped model.
        return t


def respaced(diffusion, section_counts):
    """
    ``diffusion`` (a GaussianDiffusion, or a SpacedDiffusion of one) on a subset of its own
    timesteps: ``space_timesteps(diffusion.num_timesteps, section_counts)``, as a SpacedDiffusion
    of the same original process, so the model sees the original timesteps as under
    ``diffusion``. For an unspaced process of T steps this is the diffusion that
    ``--timestep_respacing section_counts`` builds from the flags (the same schedules, bit for bit).

    :raises ValueError: when the request is impossible (space_timesteps).
    """
    kept = sorted(space_timesteps(diffusion.num_timesteps, section_counts))
    timestep_map = getattr(diffusion, "timestep_map", None)
    if timestep_map is not None:
        kept = [timestep_map[i] for i in kept]
    return SpacedDiffusion(
        kept, betas=getattr(diffusion, "base_betas", diffusion.betas),
        model_mean_type=diffusion.model_mean_type, model_var_type=diffusion.model_var_type,
        loss_type=diffusion.loss_type, rescale_timesteps=diffusion.rescale_timesteps)


class _WrappedModel:
    """Calls the model (or a cond_fn) with original timesteps: [N] spaced indices ->
    timestep_map[t] (scaled)."""

    def __init__(self, model, timestep_map, rescale_timesteps, original_num_steps):
        self.model = model
        self.timestep_map = timestep_map
        self.rescale_timesteps = rescale_timesteps
        self.original_num_steps = original_num_steps

    def __call__(self, x, ts, **kwargs):
        map_tensor = th.tensor(self.timestep_map, device=ts.device, dtype=ts.dtype)
        new_ts = map_tensor[ts]
        if self.rescale_timesteps:
            new_ts = new_ts.float() * (1000.0 / self.original_num_steps)
        return self.model(x, new_ts, **kwargs)
