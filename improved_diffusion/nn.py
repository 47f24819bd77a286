"""Small building blocks for the UNet, as in upstream improved-diffusion's ``nn.py``.

Pure math: nothing here knows about ranks, files or logging. Layer factories keep upstream's
module structure so that state-dict keys match upstream checkpoints exactly.
"""
import math

import torch as th
import torch.nn as nn
import torch.utils.checkpoint


class SiLU(nn.SiLU):
    """x * sigmoid(x); kept as a name for upstream compatibility (no parameters)."""


class GroupNorm32(nn.GroupNorm):
    """GroupNorm that always computes in float32 and casts back to the input dtype.

    This keeps normalisation statistics accurate under ``torch.autocast`` (fp16/bf16), as
    upstream does for its fp16 training.
    """

    def forward(self, x):
        """:param x: [N x C x ...] tensor of any float dtype. :return: same shape and dtype."""
        return super().forward(x.float()).type(x.dtype)


def conv_nd(dims, *args, **kwargs):
    """Create a 1D, 2D, or 3D convolution module."""
    if dims == 1:
        return nn.Conv1d(*args, **kwargs)
    if dims == 2:
        return nn.Conv2d(*args, **kwargs)
    if dims == 3:
        return nn.Conv3d(*args, **kwargs)
    raise ValueError(f"unsupported dimensions: {dims} (use 1, 2 or 3)")


def linear(*args, **kwargs):
    """Create a linear module."""
    return nn.Linear(*args, **kwargs)


def avg_pool_nd(dims, *args, **kwargs):
    """Create a 1D, 2D, or 3D average pooling module."""
    if dims == 1:
        return nn.AvgPool1d(*args, **kwargs)
    if dims == 2:
        return nn.AvgPool2d(*args, **kwargs)
    if dims == 3:
        return nn.AvgPool3d(*args, **kwargs)
    raise ValueError(f"unsupported dimensions: {dims} (use 1, 2 or 3)")


def update_ema(target_params, source_params, rate=0.99):
    """Update target parameters to be closer to those of source parameters using an EMA:
    targ = rate * targ + (1 - rate) * src, in place. Upstream's formula and rounding (the same
    two operations, mul then add with alpha), each applied to all tensors at once by torch's
    foreach kernels.

    :param target_params: the target parameter sequence (updated in place).
    :param source_params: the source parameter sequence.
    :param rate: the EMA rate (closer to 1 means slower).
    """
    targets = [t.detach() for t in target_params]
    sources = [s.detach() for s in source_params]
    if not targets:
        return
    with th.no_grad():
        th._foreach_mul_(targets, rate)
        th._foreach_add_(targets, sources, alpha=1 - rate)


def zero_module(module):
    """Zero out the parameters of a module and return it."""
    for p in module.parameters():
        p.detach().zero_()
    return module


def scale_module(module, scale):
    """Scale the parameters of a module and return it."""
    for p in module.parameters():
        p.detach().mul_(scale)
    return module


def mean_flat(tensor):
    """Take the mean over all non-batch dimensions: [N x ...] -> [N]."""
    return tensor.mean(dim=list(range(1, len(tensor.shape))))


def normalization(channels):
    """Make a standard normalization layer: GroupNorm32 with 32 groups.

    :param channels: number of input channels (must be divisible by 32).
    """
    return GroupNorm32(32, channels)


def timestep_embedding(timesteps, dim, max_period=10000):
    """Create sinusoidal timestep embeddings (upstream's formula, cos half first).

    :param timesteps: a 1-D Tensor of N indices, one per batch element. These may be fractional.
    :param dim: the dimension of the output.
    :param max_period: controls the minimum frequency of the embeddings.
    :return: an [N x dim] float32 Tensor of positional embeddings.
    """
    half = dim // 2
    freqs = th.exp(
        -math.log(max_period) * th.arange(start=0, end=half, dtype=th.float32) / half
    ).to(device=timesteps.device)
    args = timesteps[:, None].float() * freqs[None]
    embedding = th.cat([th.cos(args), th.sin(args)], dim=-1)
    if dim % 2:
        embedding = th.cat([embedding, th.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


def checkpoint(func, inputs, params, flag):
    """Evaluate ``func(*inputs)``, optionally without caching intermediate activations.

    Upstream's signature; implemented with ``torch.utils.checkpoint`` (non-reentrant), which
    recomputes the forward pass during backward and gives the same outputs and gradients.

    :param func: the function to evaluate.
    :param inputs: the sequence of arguments to pass to ``func``.
    :param params: parameters ``func`` depends on (unused: non-reentrant checkpointing tracks
        them itself; kept for upstream compatibility).
    :param flag: if False, disable gradient checkpointing.
    """
    del params
    if flag and th.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(func, *inputs, use_reentrant=False)
    return func(*inputs)
