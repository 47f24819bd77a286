"""DiT, the diffusion transformer of facebookresearch/DiT (Peebles & Xie), written fresh.

Module structure, and so state-dict keys and shapes, are DiT's (commit ed81ce2, with timm's
PatchEmbed / Attention / Mlp): DiT's published checkpoints load with ``strict=True``. Outputs equal
DiT's for the same weights (tests/test_dit.py, against a reference made with DiT's code). The
constructor arguments, ``forward(x, t, y)``, ``forward_with_cfg(x, t, y, cfg_scale)`` and the model
table ``DiT_models`` ("DiT-S/2" ... "DiT-XL/8") are DiT's, so code written against DiT's
``models.py`` runs. Parameters are created in DiT's order and initialised as DiT does, so the same
seed gives DiT's initial weights.

Shapes: N = batch, C = input channels (3 for pixels, 4 for VAE latents), H = W = ``input_size``,
p = patch size, T = (H / p)^2 tokens, D = ``hidden_size``.

Labels ``y`` ([N] int64):

* ``0 .. num_classes - 1``: the class;
* ``num_classes``: the null label (classifier-free guidance's unconditional row). The table has
  this row when ``class_dropout_prob > 0`` (DiT's rule; in training mode each label is replaced by
  it with that probability) and always when ``num_classes == 0``;
* ``y=None``: the null label for every row. An unconditional DiT (``num_classes=0``: a table of
  the one null row) is called this way, as our trainer calls a model without ``y``. DiT itself
  would build an empty table for ``num_classes=0, class_dropout_prob=0``; here it has the null
  row in that case too.

``pos_embed`` [1, T, D] is the fixed 2-D sin-cos table: a Parameter with ``requires_grad=False``
(DiT's choice), so it is in the state dict and in ``model.parameters()`` but never trained.

Pure math: nothing here knows about ranks, files or logging.
"""
import math

import numpy as np
import torch as th
import torch.nn as nn
import torch.nn.functional as F

# DiT's model table: name -> (depth, hidden_size, patch_size, num_heads).
DIT_CONFIGS = {
    f"DiT-{size}/{patch}": (depth, hidden, patch, heads)
    for size, (depth, hidden, heads) in (("XL", (28, 1152, 16)), ("L", (24, 1024, 16)),
                                         ("B", (12, 768, 12)), ("S", (12, 384, 6)))
    for patch in (2, 4, 8)
}


def modulate(x, shift, scale):
    """adaLN: x [N, T, D] * (1 + scale [N, D]) + shift [N, D], broadcast over the tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# embeddings


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches -> tokens (timm's PatchEmbed as DiT uses it).

    [N, C, H, W] -> [N, T, D] by a p x p convolution with stride p (``proj``).
    """

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size,
                              bias=bias)

    def forward(self, x):
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"input is {tuple(x.shape[-2:])}, this DiT takes {self.img_size} "
                             f"(input_size)")
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps [N] -> [N, D]: sinusoidal features, then a two-layer MLP (``mlp``)."""

    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        """Sinusoidal features of timesteps, as GLIDE/DiT: [cos(t f_i), sin(t f_i)].

        :param t: [N] timesteps (may be fractional).
        :param dim: output width; an odd width gets a zero last column.
        :return: float32 [N, dim], frequencies f_i = max_period^(-i / (dim // 2)).
        """
        half = dim // 2
        freqs = th.exp(-math.log(max_period) * th.arange(half, dtype=th.float32) / half)
        args = t[:, None].float() * freqs.to(t.device)[None]
        emb = th.cat([th.cos(args), th.sin(args)], dim=-1)
        if dim % 2:
            emb = th.cat([emb, th.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t):
        """:param t: [N] timesteps. :return: [N, D]."""
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    """Class labels [N] -> [N, D] (``embedding_table``), with DiT's label dropout.

    The table has ``num_classes + 1`` rows when ``dropout_prob > 0`` or ``num_classes == 0``
    (the last row is the null label, index ``num_classes``), else ``num_classes``.
    """

    def __init__(self, num_classes, hidden_size, dropout_prob, drop_in_forward=True):
        super().__init__()
        has_null = dropout_prob > 0 or num_classes == 0
        self.embedding_table = nn.Embedding(num_classes + int(has_null), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.drop_in_forward = drop_in_forward

    @property
    def has_null(self):
        return self.embedding_table.num_embeddings > self.num_classes

    def token_drop(self, labels, force_drop_ids=None):
        """Labels with some replaced by the null label ``num_classes``: where
        ``torch.rand(N) < dropout_prob`` (one draw per label), or where ``force_drop_ids == 1``.

        :param labels: [N] int64. :return: [N] int64.
        """
        if force_drop_ids is None:
            drop = th.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return th.where(drop, self.num_classes, labels)

    def forward(self, labels, train, force_drop_ids=None):
        """:param labels: [N] int64. :param train: drop labels (when dropout_prob > 0).
        :return: [N, D]."""
        if (train and self.drop_in_forward and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


# ---------------------------------------------------------------------------------------------
# transformer


class Attention(nn.Module):
    """Multi-head self-attention over tokens [N, T, D] (timm's Attention as DiT uses it: ``qkv``,
    ``proj``), computed by torch's scaled_dot_product_attention on [N, heads, T, D / heads]
    tensors, so fused kernels apply where the device has them."""

    def __init__(self, dim, num_heads):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        n, t, d = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [N, heads, T, D / heads]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class Mlp(nn.Module):
    """fc1 -> GELU (tanh approximation) -> fc2, on [N, T, D] (timm's Mlp as DiT uses it)."""

    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """A transformer block with adaLN-Zero conditioning: [N, T, D], c [N, D] -> [N, T, D]."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(c).chunk(6, 1)
        x = x + gate_a.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class FinalLayer(nn.Module):
    """adaLN, then a linear map of each token to its p x p x out_channels patch:
    [N, T, D], c [N, D] -> [N, T, p * p * out_channels]."""

    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Diffusion model with a transformer backbone (DiT's constructor, defaults and methods).

    :param input_size: H = W of the input (latent side for latents, image side for pixels).
    :param patch_size: p; input_size must be a multiple of it.
    :param in_channels: C; the output has 2C channels (eps, then the variance interpolation
        values) with ``learn_sigma``, else C.
    :param hidden_size: D (a multiple of 4: the 2-D sin-cos table); depth: blocks;
        num_heads: attention heads (dividing D); mlp_ratio: MLP width / D.
    :param class_dropout_prob: probability of the null label in training (classifier-free
        guidance); > 0 adds the null row to the label table.
    :param num_classes: classes; 0 = unconditional (see the module docstring for ``y``).
    :param drop_labels: (ours, after DiT's arguments) drop labels in the forward in training
        mode, as DiT's own training does; False when the trainer drops them itself (train.py's
        --class_dropout_prob, guidance.drop_labels_in: one place for every model).
    """

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000,
                 learn_sigma=True, drop_labels=True):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size {input_size} is not a multiple of patch_size "
                             f"{patch_size}")
        if hidden_size % 4:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of 4 (the 2-D sin-cos "
                             f"position table)")
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob, drop_labels)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(th.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList(
            [DiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        """DiT's initialisation (in DiT's order, so that a seed gives DiT's weights): Xavier-
        uniform linear layers with zero biases, the sin-cos position table, the patch projection
        as a linear layer, N(0, 0.02) label table and timestep MLP, and adaLN-Zero: every
        modulation layer and the final linear layer zero."""
        def basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(basic_init)
        grid = int(self.x_embedder.num_patches ** 0.5)
        table = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], grid)
        self.pos_embed.data.copy_(th.from_numpy(table).float().unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        for layer in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.constant_(layer.weight, 0)
            nn.init.constant_(layer.bias, 0)

    def unpatchify(self, x):
        """[N, T, p * p * C_out] -> [N, C_out, H, W] (token (i, j) fills pixels [ip:(i+1)p,
        jp:(j+1)p])."""
        c, p = self.out_channels, self.x_embedder.patch_size[0]
        h = w = int(x.shape[1] ** 0.5)
        if h * w != x.shape[1]:
            raise ValueError(f"{x.shape[1]} tokens do not form a square grid")
        x = x.reshape(x.shape[0], h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y=None):
        """
        :param x: [N, C, H, W] inputs (images or latents).
        :param t: [N] diffusion timesteps (may be fractional).
        :param y: [N] int64 labels (``num_classes`` is the null label), or None: the null label
            for every row (an unconditional model; raises ValueError when the table has no null
            row).
        :return: [N, C_out, H, W].
        """
        if y is None:
            if not self.y_embedder.has_null:
                raise ValueError("y is required: this DiT has no null label (class_dropout_prob "
                                 "0 and num_classes > 0)")
            y = th.full((x.shape[0],), self.num_classes, dtype=th.long, device=x.device)
        x = self.x_embedder(x) + self.pos_embed  # [N, T, D]
        c = self.t_embedder(t) + self.y_embedder(y, self.training)  # [N, D]
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))

    def forward_with_cfg(self, x, t, y, cfg_scale):
        """DiT's classifier-free guidance in one batched forward pass.

        The batch is [conditional half; unconditional half] (y's second half the null label),
        as DiT's sample.py builds it; x's first half is used for both halves. Guidance
        ``uncond + cfg_scale * (cond - uncond)`` is applied to output channels 0..2 only, as DiT
        does for exact reproducibility (for a 4-channel latent model channel 3 passes through
        unguided; for a 3-channel pixel model that is all of eps), and both halves get it.

        :param x: [2M, C, H, W]; t: [2M]; y: [2M]. :return: [2M, C_out, H, W].
        """
        half = x[: len(x) // 2]
        out = self.forward(th.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :3], out[:, 3:]
        cond_eps, uncond_eps = th.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return th.cat([th.cat([half_eps, half_eps], dim=0), rest], dim=1)


# ---------------------------------------------------------------------------------------------
# the fixed 2-D sin-cos position table (MAE's, as DiT uses it)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    """float64 [grid_size^2, embed_dim]: for the token at row i, column j (row-major order), the
    1-D table of j in the first half of the columns and of i in the second (MAE's order)."""
    rows, cols = np.meshgrid(np.arange(grid_size, dtype=np.float32),
                             np.arange(grid_size, dtype=np.float32), indexing="ij")
    return np.concatenate([get_1d_sincos_pos_embed(embed_dim // 2, cols),
                           get_1d_sincos_pos_embed(embed_dim // 2, rows)], axis=1)


def get_1d_sincos_pos_embed(embed_dim, pos):
    """float64 [M, embed_dim]: [sin(pos w_k), cos(pos w_k)] with w_k = 10000^(-2k / embed_dim),
    k < embed_dim / 2, for the M positions of ``pos`` (any shape, flattened)."""
    if embed_dim % 2:
        raise ValueError(f"embed_dim {embed_dim} must be even")
    omega = 1.0 / 10000 ** (np.arange(embed_dim // 2, dtype=np.float64) / (embed_dim / 2.0))
    out = np.einsum("m,d->md", np.asarray(pos).reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


# ---------------------------------------------------------------------------------------------
# DiT's model table


def _config_fn(name):
    depth, hidden, patch, heads = DIT_CONFIGS[name]

    def build(**kwargs):
        return DiT(depth=depth, hidden_size=hidden, patch_size=patch, num_heads=heads, **kwargs)

    build.__name__ = name.replace("-", "_").replace("/", "_")
    build.__doc__ = f"{name}: depth {depth}, hidden size {hidden}, patch {patch}, {heads} heads."
    return build


DiT_models = {name: _config_fn(name) for name in DIT_CONFIGS}
globals().update({fn.__name__: fn for fn in DiT_models.values()})  # DiT_XL_2(...) etc., as DiT
