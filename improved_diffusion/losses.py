"""
Likelihood helpers for the diffusion losses: Gaussian KL divergence and the discretized Gaussian
log-likelihood of 8-bit images (as upstream improved-diffusion, after the original DDPM code).

All functions work elementwise and broadcast; shapes below are typical, e.g. [N, C, H, W].
"""
import numpy as np
import torch as th


def normal_kl(mean1, logvar1, mean2, logvar2):
    """
    KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))), elementwise, in nats.

    Arguments may be tensors or Python floats (broadcast); at least one must be a tensor.

    :return: a tensor of the broadcast shape, e.g. [N, C, H, W].
    """
    tensor = None
    for obj in (mean1, logvar1, mean2, logvar2):
        if isinstance(obj, th.Tensor):
            tensor = obj
            break
    if tensor is None:
        raise TypeError("normal_kl: at least one argument must be a tensor")

    # Force variances to be tensors; broadcasting helps convert scalars to tensors, but it does
    # not work for th.exp().
    logvar1, logvar2 = [
        x if isinstance(x, th.Tensor) else th.tensor(x).to(tensor) for x in (logvar1, logvar2)
    ]
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + th.exp(logvar1 - logvar2)
        + ((mean1 - mean2) ** 2) * th.exp(-logvar2)
    )


def approx_standard_normal_cdf(x):
    """
    A fast approximation of the standard normal CDF (the tanh form used upstream).

    :param x: a tensor of any shape.
    :return: a tensor of the same shape, values in (0, 1).
    """
    return 0.5 * (1.0 + th.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * th.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, *, means, log_scales):
    """
    Log-likelihood of a Gaussian discretized to 256 bins over [-1, 1] (8-bit images rescaled).

    :param x: the target images, [N, C, H, W] (any shape), values in [-1, 1].
    :param means: the Gaussian means, same shape as x.
    :param log_scales: the Gaussian log standard deviations, same shape as x.
    :return: log probabilities in nats, same shape as x.
    """
    if not (x.shape == means.shape == log_scales.shape):
        raise ValueError(
            f"discretized_gaussian_log_likelihood: shapes differ: x {tuple(x.shape)}, "
            f"means {tuple(means.shape)}, log_scales {tuple(log_scales.shape)}"
        )
    centered_x = x - means
    inv_stdv = th.exp(-log_scales)
    plus_in = inv_stdv * (centered_x + 1.0 / 255.0)
    cdf_plus = approx_standard_normal_cdf(plus_in)
    min_in = inv_stdv * (centered_x - 1.0 / 255.0)
    cdf_min = approx_standard_normal_cdf(min_in)
    log_cdf_plus = th.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = th.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    log_probs = th.where(
        x < -0.999,
        log_cdf_plus,
        th.where(x > 0.999, log_one_minus_cdf_min, th.log(cdf_delta.clamp(min=1e-12))),
    )
    return log_probs
