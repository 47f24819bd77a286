"""
Guidance, both kinds: classifier guidance (guided-diffusion's noised classifier, Dhariwal & Nichol
2021) and classifier-free guidance (Ho & Salimans 2022; DiT's conventions).

Pure math: nothing here knows about ranks, files or logging.

* `classifier_cond_fn`: the ``cond_fn`` of the diffusion's samplers, grad_x log p(y | x_t) times a
  scale, from a classifier ``(x, t) -> logits`` (guided-diffusion's scripts/classifier_sample.py).
* `drop_labels`: training with ``--class_dropout_prob P``: each label becomes the null label (index
  ``num_classes``) with probability P, drawn from the torch RNG the trainer seeds and saves.
* `cfg_forward`: a model-agnostic classifier-free guided forward. Given any forward
  ``(x, t, y=labels, **kw) -> out`` it runs the conditional and the null-label batch in one call
  and combines them with `cfg_combine`; a model with its own guided forward (DiT's
  ``forward_with_cfg``) can be wrapped the same way by the sampler instead.

Shapes: N = batch, C = image channels; model outputs are [N, C, ...] or, with learned sigma,
[N, 2C, ...] (mean channels first).
"""
import torch as th
import torch.nn.functional as F


def classifier_cond_fn(classifier, scale, timesteps=None):
    """The cond_fn of classifier guidance: ``cond_fn(x, t, y) = scale * grad_x log_softmax(
    classifier(x, t))[y]``, guided-diffusion's.

    :param classifier: callable (x [N, C, H, W], timesteps [N]) -> logits [N, K].
    :param scale: guided-diffusion's ``classifier_scale``.
    :param timesteps: optional callable turning the timesteps the diffusion passes (as the model
        sees them) into those the classifier was trained on (e.g. the diffusion's
        ``original_timesteps``); None passes them as they come, as guided-diffusion's script.
    :return: cond_fn(x [N, C, ...], t [N], y=labels [N], **other model kwargs) -> [N, C, ...].
    """

    def cond_fn(x, t, y=None, **_):
        if y is None:
            raise ValueError("classifier guidance needs labels: pass y in model_kwargs")
        with th.enable_grad():
            x_in = x.detach().requires_grad_(True)
            logits = classifier(x_in, t if timesteps is None else timesteps(t))
            log_probs = F.log_softmax(logits, dim=-1)
            selected = log_probs[range(len(logits)), y.view(-1)]
            return th.autograd.grad(selected.sum(), x_in)[0] * scale

    return cond_fn


def drop_labels(y, prob, null_label, generator=None):
    """Classifier-free guidance training: each label replaced by the null label with probability
    ``prob`` (DiT's token_drop rule: dropped where ``th.rand(N) < prob``).

    :param y: long tensor [N] of labels.
    :param prob: the probability in [0, 1); 0 returns ``y`` itself and draws nothing, so the RNG
        stream (and a run without guidance) is unchanged.
    :param null_label: the null label's index (the model's ``num_classes``).
    :param generator: a torch.Generator; None draws from the default one of y's device (the one
        the trainer seeds, saves and restores, so a resumed run stays bitwise).
    :return: long tensor [N].
    """
    if not prob:
        return y
    drop = th.rand(y.shape[0], device=y.device, generator=generator) < prob
    return th.where(drop, th.full_like(y, null_label), y)


def drop_labels_in(cond, flags, generator=None):
    """`drop_labels` on a batch's model kwargs as the training loop holds them, for a model built
    from ``flags`` (model_and_diffusion_defaults' keys): ``cond["y"]`` with probability
    ``flags["class_dropout_prob"]`` becomes ``flags["num_classes"]``. Without the flag (or 0, or
    no labels) ``cond`` is returned unchanged and nothing is drawn.

    :param cond: dict of model kwargs, tensors [N, ...] (e.g. {"y": labels [N]}).
    :return: the dict (a new one when labels were dropped).
    """
    prob = (flags or {}).get("class_dropout_prob") or 0.0
    if not prob or "y" not in cond:
        return cond
    return dict(cond, y=drop_labels(cond["y"], prob, flags["num_classes"], generator))


def cfg_combine(cond, uncond, scale, mean_channels):
    """Classifier-free guidance of one model output: ``uncond + scale * (cond - uncond)`` on the
    first ``mean_channels`` channels (the noise / mean prediction); the other channels (a learned
    variance) are the conditional output's, unguided (DiT's choice).

    :param cond, uncond: [N, C', ...] outputs with the real labels and with the null label.
    :param mean_channels: how many leading channels are guided (C for a model with C output
        channels, or C of 2C with learned sigma).
    :return: [N, C', ...].
    """
    c, u = cond[:, :mean_channels], uncond[:, :mean_channels]
    guided = u + scale * (c - u)
    if cond.shape[1] == mean_channels:
        return guided
    return th.cat([guided, cond[:, mean_channels:]], dim=1)


def cfg_forward(forward, scale, null_label, mean_channels=None):
    """A classifier-free guided forward with the signature of ``forward``.

    ``forward(x, t, y=labels, **kw)`` is any model's forward. The guided one calls it once on
    the doubled batch (x, t, kw twice; the labels, then the null label for every row) and
    combines the halves with `cfg_combine`. Scale 1 is exactly ``forward`` (one plain
    conditional pass, bitwise the samples of conditional sampling); scale 0 is one pass with the
    null label (unconditional).

    :param scale: the guidance scale S.
    :param null_label: the null label's index.
    :param mean_channels: guided output channels; None: as many as x has (so with learned sigma
        the mean is guided and the conditional variance kept).
    :return: callable (x [N, C, ...], t [N], y=labels [N], **kw) -> [N, C', ...].
    """
    scale = float(scale)

    def guided(x, t, y=None, **kwargs):
        if y is None:
            raise ValueError("classifier-free guidance needs labels: pass y")
        if scale == 1.0:
            return forward(x, t, y=y, **kwargs)
        null = th.full_like(y, null_label)
        if scale == 0.0:
            return forward(x, t, y=null, **kwargs)
        twice = {k: th.cat([v, v]) if isinstance(v, th.Tensor) else v for k, v in kwargs.items()}
        out = forward(th.cat([x, x]), th.cat([t, t]), y=th.cat([y, null]), **twice)
        cond, uncond = out.chunk(2)
        return cfg_combine(cond, uncond, scale, x.shape[1] if mean_channels is None
                           else mean_channels)

    return guided
