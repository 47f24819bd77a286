"""The UNet of improved-diffusion, with guided-diffusion's additions, and guided-diffusion's
EncoderUNetModel (the UNet's way down and a pooling head: the noised image classifier).

Module structure (and so state-dict keys and shapes) is identical to upstream
openai/improved-diffusion (commit 1bc7bbb) and, for the options it added (``num_head_channels``,
``resblock_updown``, ``use_new_attention_order``, fractional ``channel_mult``) and the classifier,
to openai/guided-diffusion (commit 22e0df8), so published checkpoints load with ``strict=True``.

Shapes: N = batch, C = channels, T = number of spatial positions (H*W).
"""
from abc import abstractmethod

import torch as th
import torch.nn as nn
import torch.nn.functional as F

from .nn import (
    SiLU,
    avg_pool_nd,
    checkpoint,
    conv_nd,
    linear,
    normalization,
    timestep_embedding,
    zero_module,
)


class TimestepBlock(nn.Module):
    """Any module whose forward() takes timestep embeddings as a second argument."""

    @abstractmethod
    def forward(self, x, emb):
        """Apply the module to ``x`` [N x C x ...] given ``emb`` [N x E] timestep embeddings."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    """A sequential module that passes timestep embeddings to the children that take them."""

    def forward(self, x, emb):
        for layer in self:
            if isinstance(layer, TimestepBlock):
                x = layer(x, emb)
            else:
                x = layer(x)
        return x


class Upsample(nn.Module):
    """A nearest-neighbour 2x upsampling layer with an optional convolution.

    :param channels: channels in the inputs and outputs (unless ``out_channels`` is given).
    :param use_conv: whether to apply a 3x3 convolution after upsampling.
    :param dims: 1, 2 or 3. If 3, upsample the inner two dimensions only.
    :param out_channels: output channels of the convolution (default: ``channels``).
    """

    def __init__(self, channels, use_conv, dims=2, out_channels=None):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        self.dims = dims
        if use_conv:
            self.conv = conv_nd(dims, self.channels, self.out_channels, 3, padding=1)

    def forward(self, x):
        """[N x C x ...] -> [N x C' x ...] with spatial size doubled."""
        if x.shape[1] != self.channels:
            raise ValueError(f"Upsample expects {self.channels} channels, got {x.shape[1]}")
        if self.dims == 3:
            x = F.interpolate(x, (x.shape[2], x.shape[3] * 2, x.shape[4] * 2), mode="nearest")
        else:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
        if self.use_conv:
            x = self.conv(x)
        return x


class Downsample(nn.Module):
    """A 2x downsampling layer: strided 3x3 convolution or average pooling.

    :param channels: channels in the inputs and outputs (unless ``out_channels`` is given).
    :param use_conv: convolution (True) or average pooling (False).
    :param dims: 1, 2 or 3. If 3, downsample the inner two dimensions only.
    :param out_channels: output channels of the convolution (default: ``channels``).
    """

    def __init__(self, channels, use_conv, dims=2, out_channels=None):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        self.dims = dims
        stride = 2 if dims != 3 else (1, 2, 2)
        if use_conv:
            self.op = conv_nd(dims, self.channels, self.out_channels, 3, stride=stride, padding=1)
        else:
            if self.channels != self.out_channels:
                raise ValueError("Downsample without a convolution cannot change channel count")
            self.op = avg_pool_nd(dims, kernel_size=stride, stride=stride)

    def forward(self, x):
        """[N x C x ...] -> [N x C' x ...] with spatial size halved."""
        if x.shape[1] != self.channels:
            raise ValueError(f"Downsample expects {self.channels} channels, got {x.shape[1]}")
        return self.op(x)


class ResBlock(TimestepBlock):
    """A residual block that can optionally change the number of channels and resolution.

    :param channels: the number of input channels.
    :param emb_channels: the number of timestep embedding channels.
    :param dropout: the rate of dropout.
    :param out_channels: if specified, the number of out channels.
    :param use_conv: if True and out_channels != channels, use a 3x3 convolution in the skip
        connection instead of a 1x1 convolution.
    :param dims: 1, 2 or 3 spatial dimensions.
    :param use_checkpoint: if True, use gradient checkpointing on this module.
    :param use_scale_shift_norm: condition with FiLM (scale and shift after the norm) instead of
        adding the embedding.
    :param up: if True, use this block for upsampling (guided-diffusion's ``resblock_updown``).
    :param down: if True, use this block for downsampling.
    """

    def __init__(
        self,
        channels,
        emb_channels,
        dropout,
        out_channels=None,
        use_conv=False,
        use_scale_shift_norm=False,
        dims=2,
        use_checkpoint=False,
        up=False,
        down=False,
    ):
        super().__init__()
        self.channels = channels
        self.emb_channels = emb_channels
        self.dropout = dropout
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        self.use_checkpoint = use_checkpoint
        self.use_scale_shift_norm = use_scale_shift_norm

        self.in_layers = nn.Sequential(
            normalization(channels),
            SiLU(),
            conv_nd(dims, channels, self.out_channels, 3, padding=1),
        )

        self.updown = up or down
        if up:
            self.h_upd = Upsample(channels, False, dims)
            self.x_upd = Upsample(channels, False, dims)
        elif down:
            self.h_upd = Downsample(channels, False, dims)
            self.x_upd = Downsample(channels, False, dims)
        else:
            self.h_upd = self.x_upd = nn.Identity()

        self.emb_layers = nn.Sequential(
            SiLU(),
            linear(
                emb_channels,
                2 * self.out_channels if use_scale_shift_norm else self.out_channels,
            ),
        )
        self.out_layers = nn.Sequential(
            normalization(self.out_channels),
            SiLU(),
            nn.Dropout(p=dropout),
            zero_module(conv_nd(dims, self.out_channels, self.out_channels, 3, padding=1)),
        )

        if self.out_channels == channels:
            self.skip_connection = nn.Identity()
        elif use_conv:
            self.skip_connection = conv_nd(dims, channels, self.out_channels, 3, padding=1)
        else:
            self.skip_connection = conv_nd(dims, channels, self.out_channels, 1)

    def forward(self, x, emb):
        """:param x: [N x C x ...] features. :param emb: [N x E] timestep embeddings.
        :return: [N x C' x ...] outputs (spatial size doubled/halved when up/down)."""
        return checkpoint(self._forward, (x, emb), self.parameters(), self.use_checkpoint)

    def _forward(self, x, emb):
        if self.updown:
            in_rest, in_conv = self.in_layers[:-1], self.in_layers[-1]
            h = in_rest(x)
            h = self.h_upd(h)
            x = self.x_upd(x)
            h = in_conv(h)
        else:
            h = self.in_layers(x)
        emb_out = self.emb_layers(emb).type(h.dtype)
        while len(emb_out.shape) < len(h.shape):
            emb_out = emb_out[..., None]
        if self.use_scale_shift_norm:
            out_norm, out_rest = self.out_layers[0], self.out_layers[1:]
            scale, shift = th.chunk(emb_out, 2, dim=1)
            h = out_norm(h) * (1 + scale) + shift
            h = out_rest(h)
        else:
            h = h + emb_out
            h = self.out_layers(h)
        return self.skip_connection(x) + h


class AttentionBlock(nn.Module):
    """Self-attention over all spatial positions.

    ``qkv`` and ``proj_out`` are 1x1 ``Conv1d`` layers, as upstream (keys ``norm``, ``qkv``,
    ``proj_out``).

    :param channels: number of channels.
    :param num_heads: number of heads (used when ``num_head_channels`` is -1).
    :param num_head_channels: if not -1, channels per head; overrides ``num_heads``.
    :param use_checkpoint: gradient checkpointing.
    :param use_new_attention_order: split qkv before heads (QKVAttention) instead of upstream's
        legacy order (heads before the qkv split, QKVAttentionLegacy).
    """

    def __init__(
        self,
        channels,
        num_heads=1,
        num_head_channels=-1,
        use_checkpoint=False,
        use_new_attention_order=False,
    ):
        super().__init__()
        self.channels = channels
        if num_head_channels == -1:
            self.num_heads = num_heads
        else:
            if num_head_channels <= 0 or channels % num_head_channels != 0:
                raise ValueError(
                    f"attention channels {channels} are not divisible by "
                    f"num_head_channels {num_head_channels}"
                )
            self.num_heads = channels // num_head_channels
        if self.num_heads <= 0 or channels % self.num_heads != 0:
            raise ValueError(
                f"attention channels {channels} are not divisible by num_heads {self.num_heads}"
            )
        self.use_checkpoint = use_checkpoint
        self.norm = normalization(channels)
        self.qkv = conv_nd(1, channels, channels * 3, 1)
        if use_new_attention_order:
            self.attention = QKVAttention(self.num_heads)
        else:
            self.attention = QKVAttentionLegacy(self.num_heads)
        self.proj_out = zero_module(conv_nd(1, channels, channels, 1))

    def forward(self, x):
        """[N x C x ...] -> [N x C x ...]."""
        return checkpoint(self._forward, (x,), self.parameters(), self.use_checkpoint)

    def _forward(self, x):
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        qkv = self.qkv(self.norm(x))
        h = self.attention(qkv)
        h = self.proj_out(h)
        return (x + h).reshape(b, c, *spatial)


def _attention(q, k, v):
    """softmax(q^T k / sqrt(C)) applied to v, for q, k, v [N x C x T] -> [N x C x T], through
    torch's scaled_dot_product_attention (a fused kernel where the device has one). Upstream's
    einsum form scaled q and k by C^-1/4 each and took the softmax in float32; SDPA computes the
    same product (its softmax accumulates in float32 for half inputs too)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class QKVAttentionLegacy(nn.Module):
    """QKV attention in upstream improved-diffusion's order: heads first, then split q/k/v."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        """:param qkv: [N x (H * 3 * C) x T] tensor of Qs, Ks and Vs.
        :return: [N x (H * C) x T] tensor after attention."""
        bs, width, length = qkv.shape
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(bs * self.n_heads, ch * 3, length).split(ch, dim=1)
        return _attention(q, k, v).reshape(bs, -1, length)


class QKVAttention(nn.Module):
    """QKV attention in guided-diffusion's new order: split q/k/v first, then heads."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        """:param qkv: [N x (3 * H * C) x T] tensor of Qs, Ks and Vs.
        :return: [N x (H * C) x T] tensor after attention."""
        bs, width, length = qkv.shape
        ch = width // (3 * self.n_heads)
        q, k, v = (x.reshape(bs * self.n_heads, ch, length) for x in qkv.chunk(3, dim=1))
        return _attention(q, k, v).reshape(bs, -1, length)


def _block_factories(emb_channels, dropout, dims, use_checkpoint, use_scale_shift_norm,
                     num_head_channels, use_new_attention_order):
    """The two block makers the UNet and its encoder half share: ``res_block(ch, out_ch,
    up=, down=)`` and ``attention(ch, heads)``."""

    def res_block(ch, out_ch, **kw):
        return ResBlock(
            ch,
            emb_channels,
            dropout,
            out_channels=out_ch,
            dims=dims,
            use_checkpoint=use_checkpoint,
            use_scale_shift_norm=use_scale_shift_norm,
            **kw,
        )

    def attention(ch, heads):
        return AttentionBlock(
            ch,
            num_heads=heads,
            num_head_channels=num_head_channels,
            use_checkpoint=use_checkpoint,
            use_new_attention_order=use_new_attention_order,
        )

    return res_block, attention


def _encoder_blocks(in_channels, model_channels, num_res_blocks, attention_resolutions,
                    channel_mult, conv_resample, dims, resblock_updown, num_heads, res_block,
                    attention):
    """The input blocks (the UNet's way down, upstream's module layout).

    :return: (ModuleList of TimestepEmbedSequential, the channel count after each block (a list),
        channels at the bottom, the downsample rate at the bottom).
    """
    ch = int(channel_mult[0] * model_channels)
    blocks = nn.ModuleList([TimestepEmbedSequential(conv_nd(dims, in_channels, ch, 3, padding=1))])
    chans = [ch]
    ds = 1
    for level, mult in enumerate(channel_mult):
        for _ in range(num_res_blocks):
            layers = [res_block(ch, int(mult * model_channels))]
            ch = int(mult * model_channels)
            if ds in attention_resolutions:
                layers.append(attention(ch, num_heads))
            blocks.append(TimestepEmbedSequential(*layers))
            chans.append(ch)
        if level != len(channel_mult) - 1:
            if resblock_updown:
                down = res_block(ch, ch, down=True)
            else:
                down = Downsample(ch, conv_resample, dims=dims, out_channels=ch)
            blocks.append(TimestepEmbedSequential(down))
            chans.append(ch)
            ds *= 2
    return blocks, chans, ch, ds


def _middle_block(ch, num_heads, res_block, attention):
    """ResBlock, attention, ResBlock at the bottom of the UNet (and of its encoder half)."""
    return TimestepEmbedSequential(res_block(ch, ch), attention(ch, num_heads), res_block(ch, ch))


class UNetModel(nn.Module):
    """The full UNet model with attention and timestep embedding.

    :param in_channels: channels in the input Tensor.
    :param model_channels: base channel count for the model.
    :param out_channels: channels in the output Tensor.
    :param num_res_blocks: number of residual blocks per downsample.
    :param attention_resolutions: a collection of downsample rates at which attention will take
        place (e.g. containing 4 means attention at 4x downsampling).
    :param dropout: the dropout probability.
    :param channel_mult: channel multiplier for each level of the UNet (may be fractional, as
        guided-diffusion's 0.5 for 512x512, as long as ``mult * model_channels`` is an integer).
    :param conv_resample: if True, use learned convolutions for upsampling and downsampling.
    :param dims: 1, 2 or 3 spatial dimensions.
    :param num_classes: if specified (int), the model is class-conditional with this many classes.
    :param use_null_label: with ``num_classes``, one more label embedding row, index
        ``num_classes``: the null label of classifier-free guidance (as DiT's), which training
        with ``--class_dropout_prob`` puts in place of some labels (guidance.drop_labels).
        ``self.null_label`` is that index (None without it).
    :param use_checkpoint: use gradient checkpointing to reduce memory usage.
    :param num_heads: the number of attention heads in each attention layer.
    :param num_head_channels: if not -1, a fixed channel width per attention head (overrides
        ``num_heads``).
    :param num_heads_upsample: heads for the upsampling path (-1: same as ``num_heads``).
        Deprecated upstream; kept for compatibility.
    :param use_scale_shift_norm: use a FiLM-like conditioning mechanism.
    :param resblock_updown: use residual blocks for up/downsampling.
    :param use_new_attention_order: use a different attention pattern (QKVAttention).
    :param use_fp16: guided-diffusion's flag, recorded as ``self.use_fp16``. As there, it does not
        convert anything by itself: the weights stay float32 until ``convert_to_fp16()`` (guided's
        scripts call it when the flag is set). Our trainer's ``--use_fp16`` uses autocast over
        float32 weights instead, so a model built with ``use_fp16=True`` trains as usual.
    """

    def __init__(
        self,
        in_channels,
        model_channels,
        out_channels,
        num_res_blocks,
        attention_resolutions,
        dropout=0,
        channel_mult=(1, 2, 4, 8),
        conv_resample=True,
        dims=2,
        num_classes=None,
        use_checkpoint=False,
        num_heads=1,
        num_head_channels=-1,
        num_heads_upsample=-1,
        use_scale_shift_norm=False,
        resblock_updown=False,
        use_new_attention_order=False,
        use_fp16=False,
        use_null_label=False,
    ):
        super().__init__()

        if num_heads_upsample == -1:
            num_heads_upsample = num_heads

        self.in_channels = in_channels
        self.model_channels = model_channels
        self.out_channels = out_channels
        self.num_res_blocks = num_res_blocks
        self.attention_resolutions = attention_resolutions
        self.dropout = dropout
        self.channel_mult = channel_mult
        self.conv_resample = conv_resample
        self.num_classes = num_classes
        self.null_label = num_classes if use_null_label and num_classes is not None else None
        self.use_checkpoint = use_checkpoint
        self.num_heads = num_heads
        self.num_head_channels = num_head_channels
        self.num_heads_upsample = num_heads_upsample
        self.use_fp16 = use_fp16

        time_embed_dim = model_channels * 4
        self.time_embed = nn.Sequential(
            linear(model_channels, time_embed_dim),
            SiLU(),
            linear(time_embed_dim, time_embed_dim),
        )

        if self.num_classes is not None:
            rows = num_classes + (self.null_label is not None)
            self.label_emb = nn.Embedding(rows, time_embed_dim)

        res_block, attention = _block_factories(
            time_embed_dim, dropout, dims, use_checkpoint, use_scale_shift_norm,
            num_head_channels, use_new_attention_order,
        )
        self.input_blocks, input_block_chans, ch, ds = _encoder_blocks(
            in_channels, model_channels, num_res_blocks, attention_resolutions, channel_mult,
            conv_resample, dims, resblock_updown, num_heads, res_block, attention,
        )
        input_ch = input_block_chans[0]
        self.middle_block = _middle_block(ch, num_heads, res_block, attention)

        self.output_blocks = nn.ModuleList([])
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                ich = input_block_chans.pop()
                layers = [res_block(ch + ich, int(model_channels * mult))]
                ch = int(model_channels * mult)
                if ds in attention_resolutions:
                    layers.append(attention(ch, num_heads_upsample))
                if level and i == num_res_blocks:
                    out_ch = ch
                    if resblock_updown:
                        layers.append(res_block(ch, out_ch, up=True))
                    else:
                        layers.append(Upsample(ch, conv_resample, dims=dims, out_channels=out_ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(
            normalization(ch),
            SiLU(),
            zero_module(conv_nd(dims, input_ch, out_channels, 3, padding=1)),
        )

    def convert_to_fp16(self):
        """Convert the torso of the model (input, middle and output blocks) to float16, as
        upstream: only convolution weights and biases change; normalisation layers, the timestep
        and label embeddings and the output layer stay float32 (GroupNorm32 computes in float32).
        ``forward`` then runs the torso in float16 and returns float32 for float32 inputs."""
        for blocks in (self.input_blocks, self.middle_block, self.output_blocks):
            blocks.apply(_convert_module_to_f16)

    def convert_to_fp32(self):
        """Undo ``convert_to_fp16()``: the torso's convolutions back to float32."""
        for blocks in (self.input_blocks, self.middle_block, self.output_blocks):
            blocks.apply(_convert_module_to_f32)

    @property
    def inner_dtype(self):
        """The dtype the torso runs in (upstream's name): float16 after ``convert_to_fp16()``."""
        return next(self.input_blocks.parameters()).dtype

    @property
    def dtype(self):
        """guided-diffusion's name for ``inner_dtype``."""
        return self.inner_dtype

    def forward(self, x, timesteps, y=None):
        """Apply the model to an input batch.

        :param x: an [N x C x ...] Tensor of inputs.
        :param timesteps: a 1-D [N] batch of timesteps (may be fractional, e.g. rescaled).
        :param y: an [N] Tensor of labels, if class-conditional.
        :return: an [N x C_out x ...] Tensor of outputs (same dtype as ``x`` outside autocast).
        """
        if (y is not None) != (self.num_classes is not None):
            raise ValueError(
                "the model is class-conditional: pass y (labels)"
                if self.num_classes is not None
                else "the model is not class-conditional: do not pass y"
            )
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels))
        if self.num_classes is not None:
            if y.shape != (x.shape[0],):
                raise ValueError(f"labels y must have shape [{x.shape[0]}], got {list(y.shape)}")
            emb = emb + self.label_emb(y)

        hs = []
        # After convert_to_fp16() the torso runs in float16 and the output layer in x's dtype;
        # otherwise (float32 weights, autocast or not) nothing is cast here.
        cast = self.inner_dtype != x.dtype
        h = x.type(self.inner_dtype) if cast else x
        for module in self.input_blocks:
            h = module(h, emb)
            hs.append(h)
        h = self.middle_block(h, emb)
        for module in self.output_blocks:
            h = th.cat([h, hs.pop()], dim=1)
            h = module(h, emb)
        return self.out(h.type(x.dtype) if cast else h)


def _convert_module_to_f16(module):
    """Convolutions to float16 (upstream's fp16_util.convert_module_to_f16)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        module.weight.data = module.weight.data.half()
        if module.bias is not None:
            module.bias.data = module.bias.data.half()


def _convert_module_to_f32(module):
    """Convolutions back to float32 (upstream's fp16_util.convert_module_to_f32)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        module.weight.data = module.weight.data.float()
        if module.bias is not None:
            module.bias.data = module.bias.data.float()


class SuperResModel(UNetModel):
    """A UNetModel that performs super-resolution.

    Expects an extra kwarg ``low_res`` to condition on a low-resolution image: it is upsampled
    bilinearly to the size of ``x`` and concatenated on the channel axis.

    :param image_size: the (large) image size; kept for guided-diffusion compatibility.
    :param in_channels: channels of ``x`` (the model itself sees ``2 * in_channels``).
    """

    def __init__(self, image_size, in_channels, *args, **kwargs):
        super().__init__(in_channels * 2, *args, **kwargs)
        self.image_size = image_size

    def forward(self, x, timesteps, low_res=None, **kwargs):
        """:param x: [N x C x H x W] noisy high-res images. :param low_res: [N x C x h x w].
        :return: [N x C_out x H x W]."""
        if low_res is None:
            raise ValueError("SuperResModel needs low_res (the low-resolution images)")
        _, _, new_height, new_width = x.shape
        upsampled = F.interpolate(low_res, (new_height, new_width), mode="bilinear")
        x = th.cat([x, upsampled], dim=1)
        return super().forward(x, timesteps, **kwargs)


class AttentionPool2d(nn.Module):
    """guided-diffusion's attention pooling (after CLIP's): the mean feature, prepended to the
    spatial features with a learned positional embedding, attends to them all; its output is the
    pooled vector.

    :param spacial_dim: side of the (square) feature map (guided's spelling).
    :param embed_dim: channels of the features.
    :param num_heads_channels: channels per attention head.
    :param output_dim: channels of the result (default ``embed_dim``).
    """

    def __init__(self, spacial_dim, embed_dim, num_heads_channels, output_dim=None):
        super().__init__()
        if num_heads_channels <= 0 or embed_dim % num_heads_channels != 0:
            raise ValueError(f"attention pool channels {embed_dim} are not divisible by "
                             f"num_heads_channels {num_heads_channels}")
        self.positional_embedding = nn.Parameter(
            th.randn(embed_dim, spacial_dim ** 2 + 1) / embed_dim ** 0.5
        )
        self.qkv_proj = conv_nd(1, embed_dim, 3 * embed_dim, 1)
        self.c_proj = conv_nd(1, embed_dim, output_dim or embed_dim, 1)
        self.num_heads = embed_dim // num_heads_channels
        self.attention = QKVAttention(self.num_heads)

    def forward(self, x):
        """[N x C x H x W] (H = W = spacial_dim) -> [N x output_dim]."""
        b, c, *_spatial = x.shape
        x = x.reshape(b, c, -1)  # [N x C x T]
        x = th.cat([x.mean(dim=-1, keepdim=True), x], dim=-1)  # [N x C x (T + 1)]
        x = x + self.positional_embedding[None, :, :].to(x.dtype)
        x = self.qkv_proj(x)
        x = self.attention(x)
        x = self.c_proj(x)
        return x[:, :, 0]


ENCODER_POOLS = ("adaptive", "attention", "spatial", "spatial_v2")


class EncoderUNetModel(nn.Module):
    """guided-diffusion's half UNet: the input blocks and the middle block of UNetModel, then a
    pooling head; the noised image classifier of classifier guidance. Module structure (and so
    state-dict keys and shapes) is guided-diffusion's (commit 22e0df8): its published
    classifiers load with ``strict=True``.

    Arguments as UNetModel's (without the class conditioning and the upsampling path), plus:

    :param image_size: the input side in pixels (sizes the attention pool's embedding).
    :param out_channels: the number of logits (classes).
    :param pool: the head, one of ENCODER_POOLS:
        "adaptive": GroupNorm, SiLU, global average, a zero-initialised 1x1 convolution;
        "attention": GroupNorm, SiLU, AttentionPool2d (needs ``num_head_channels`` != -1);
        "spatial": the spatial mean of every input block's output and of the middle block's,
        concatenated, then Linear(2048), ReLU, Linear(out_channels);
        "spatial_v2": as "spatial" with GroupNorm and SiLU in place of the ReLU.
    :param use_fp16: recorded as ``self.use_fp16``; as UNetModel, ``convert_to_fp16()`` converts.
    """

    def __init__(
        self,
        image_size,
        in_channels,
        model_channels,
        out_channels,
        num_res_blocks,
        attention_resolutions,
        dropout=0,
        channel_mult=(1, 2, 4, 8),
        conv_resample=True,
        dims=2,
        use_checkpoint=False,
        use_fp16=False,
        num_heads=1,
        num_head_channels=-1,
        num_heads_upsample=-1,
        use_scale_shift_norm=False,
        resblock_updown=False,
        use_new_attention_order=False,
        pool="adaptive",
    ):
        super().__init__()
        if pool not in ENCODER_POOLS:
            raise ValueError(f"unknown pool {pool!r}; use one of {', '.join(ENCODER_POOLS)}")
        if pool == "attention" and num_head_channels == -1:
            raise ValueError("the attention pool needs num_head_channels (channels per head)")
        if num_heads_upsample == -1:  # no upsampling path: kept for guided's signature
            num_heads_upsample = num_heads

        self.image_size = image_size
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.out_channels = out_channels
        self.num_res_blocks = num_res_blocks
        self.attention_resolutions = attention_resolutions
        self.dropout = dropout
        self.channel_mult = channel_mult
        self.conv_resample = conv_resample
        self.use_checkpoint = use_checkpoint
        self.use_fp16 = use_fp16
        self.num_heads = num_heads
        self.num_head_channels = num_head_channels
        self.num_heads_upsample = num_heads_upsample
        self.pool = pool

        time_embed_dim = model_channels * 4
        self.time_embed = nn.Sequential(
            linear(model_channels, time_embed_dim),
            SiLU(),
            linear(time_embed_dim, time_embed_dim),
        )
        res_block, attention = _block_factories(
            time_embed_dim, dropout, dims, use_checkpoint, use_scale_shift_norm,
            num_head_channels, use_new_attention_order,
        )
        self.input_blocks, chans, ch, ds = _encoder_blocks(
            in_channels, model_channels, num_res_blocks, attention_resolutions, channel_mult,
            conv_resample, dims, resblock_updown, num_heads, res_block, attention,
        )
        self.middle_block = _middle_block(ch, num_heads, res_block, attention)
        # The spatial pools' input: every input block's channels and the middle block's.
        self._feature_size = sum(chans) + ch
        if pool == "adaptive":
            self.out = nn.Sequential(
                normalization(ch),
                SiLU(),
                nn.AdaptiveAvgPool2d((1, 1)),
                zero_module(conv_nd(dims, ch, out_channels, 1)),
                nn.Flatten(),
            )
        elif pool == "attention":
            self.out = nn.Sequential(
                normalization(ch),
                SiLU(),
                AttentionPool2d(image_size // ds, ch, num_head_channels, out_channels),
            )
        elif pool == "spatial":
            self.out = nn.Sequential(
                nn.Linear(self._feature_size, 2048),
                nn.ReLU(),
                nn.Linear(2048, out_channels),
            )
        else:  # spatial_v2
            self.out = nn.Sequential(
                nn.Linear(self._feature_size, 2048),
                normalization(2048),
                SiLU(),
                nn.Linear(2048, out_channels),
            )

    def convert_to_fp16(self):
        """The torso (input and middle blocks) to float16, as guided's; the head stays float32."""
        for blocks in (self.input_blocks, self.middle_block):
            blocks.apply(_convert_module_to_f16)

    def convert_to_fp32(self):
        """Undo ``convert_to_fp16()``."""
        for blocks in (self.input_blocks, self.middle_block):
            blocks.apply(_convert_module_to_f32)

    @property
    def dtype(self):
        """The dtype the torso runs in: float16 after ``convert_to_fp16()``."""
        return next(self.input_blocks.parameters()).dtype

    def forward(self, x, timesteps):
        """Apply the classifier to a batch of noised images.

        :param x: an [N x C x H x W] Tensor of inputs.
        :param timesteps: a 1-D [N] batch of timesteps (as the diffusion passes them).
        :return: an [N x out_channels] Tensor of logits (x's dtype outside autocast).
        """
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels))
        spatial = self.pool.startswith("spatial")
        results = []
        cast = self.dtype != x.dtype
        h = x.type(self.dtype) if cast else x
        for module in self.input_blocks:
            h = module(h, emb)
            if spatial:
                results.append(h.type(x.dtype).mean(dim=(2, 3)))
        h = self.middle_block(h, emb)
        if spatial:
            results.append(h.type(x.dtype).mean(dim=(2, 3)))
            return self.out(th.cat(results, dim=-1))
        return self.out(h.type(x.dtype) if cast else h)
