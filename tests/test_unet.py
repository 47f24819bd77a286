"""The UNet: upstream-identical state dicts, upstream's numbers, shapes, checkpointing, autocast."""
import inspect
import json

import pytest
import torch as th

import redraw
from conftest import FIXTURES
from improved_diffusion import script_util
from improved_diffusion.nn import GroupNorm32, timestep_embedding
from improved_diffusion.script_util import (
    create_model,
    model_and_diffusion_defaults,
    sr_create_model,
)
from improved_diffusion.unet import AttentionBlock, SuperResModel, UNetModel

# Flags in the fixtures that are not model/diffusion flags (guided's trainer flag; no effect on
# the state dict: upstream converts weights to fp16 after building).
NON_MODEL_FIXTURE_FLAGS = {"use_fp16"}
CREATE_MODEL_ARGS = set(inspect.getfullargspec(create_model).args)


def _fixture_configs():
    configs = []
    for filename in ("upstream_unet_state_dict_keys.json", "guided_unet_state_dict_keys.json"):
        with open(FIXTURES / filename) as f:
            for name, entry in json.load(f).items():
                configs.append(pytest.param(entry, id=name))
    return configs


def _model_from_flags(flags):
    args = model_and_diffusion_defaults()
    args.update({k: v for k, v in flags.items() if k not in NON_MODEL_FIXTURE_FLAGS})
    unknown = set(args) - set(model_and_diffusion_defaults())
    assert not unknown, f"fixture flags we do not have: {unknown}"
    return create_model(**{k: v for k, v in args.items() if k in CREATE_MODEL_ARGS})


@pytest.mark.parametrize("entry", _fixture_configs())
def test_state_dict_keys_shapes_and_parameter_count_match_upstream(entry):
    with th.device("meta"):
        model = _model_from_flags(entry["flags"])
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert sorted(ours) == sorted(entry["state_dict"])
    assert ours == entry["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == entry["num_params"]


@pytest.fixture(scope="module")
def reference():
    return th.load(FIXTURES / "upstream_small_reference.pt", weights_only=True)


def test_upstream_small_model_loads_strictly_and_reproduces_its_output(reference):
    model = _model_from_flags(reference["flags"])
    state = redraw.upstream_weights("upstream_small_model")
    model.load_state_dict(state, strict=True)
    model.eval()
    # The reference diffusion is a SpacedDiffusion whose _scale_timesteps is the identity (the
    # wrapped model rescales), so model_out is the bare model on x0 and the raw t.
    with th.no_grad():
        out = model(reference["x0"], reference["t"], y=reference["y"])
    th.testing.assert_close(out, reference["model_out"], rtol=1e-5, atol=1e-5)


def _tiny(image_size, **kw):
    args = dict(
        num_channels=32,
        num_res_blocks=1,
        attention_resolutions="4",
        num_heads=2,
        use_scale_shift_norm=True,
    )
    args.update(kw)
    return create_model(image_size, **args)


@pytest.mark.parametrize("image_size", [8, 16, 28, 32])
@pytest.mark.parametrize("class_cond", [False, True])
def test_forward_keeps_the_image_shape_for_any_image_size(image_size, class_cond):
    model = _tiny(image_size, class_cond=class_cond, num_classes=10)
    x = th.randn(2, 3, image_size, image_size)
    kwargs = {"y": th.tensor([0, 9])} if class_cond else {}
    with th.no_grad():
        out = model(x, th.tensor([0.0, 999.0]), **kwargs)
    assert out.shape == (2, 3, image_size, image_size)


def test_learned_sigma_doubles_the_output_channels():
    model = _tiny(8, learn_sigma=True)
    with th.no_grad():
        out = model(th.randn(1, 3, 8, 8), th.tensor([3]))
    assert out.shape == (1, 6, 8, 8)


def test_class_conditional_model_insists_on_labels_and_unconditional_refuses_them():
    cond = _tiny(8, class_cond=True, num_classes=3)
    assert cond.label_emb.num_embeddings == 3
    with pytest.raises(ValueError, match="class-conditional: pass y"):
        cond(th.randn(1, 3, 8, 8), th.tensor([1]))
    with pytest.raises(ValueError, match="not class-conditional"):
        _tiny(8)(th.randn(1, 3, 8, 8), th.tensor([1]), y=th.tensor([0]))


def test_super_res_model_upsamples_low_res_and_returns_the_large_shape():
    model = sr_create_model(16, 8, 32, 1, learn_sigma=True, attention_resolutions="8")
    assert isinstance(model, SuperResModel) and model.in_channels == 6
    with th.no_grad():
        out = model(th.randn(2, 3, 16, 16), th.tensor([1, 2]), low_res=th.randn(2, 3, 8, 8))
    assert out.shape == (2, 6, 16, 16)


def _randomise(model, seed=0):
    """Re-draw all weights (upstream zero-initialises output layers, which hides bugs)."""
    gen = th.Generator().manual_seed(seed)
    with th.no_grad():
        for p in model.parameters():
            p.copy_(th.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.mark.parametrize("new_order", [False, True])
def test_gradient_checkpointing_gives_the_same_outputs_and_gradients(new_order):
    flags = dict(resblock_updown=True, use_new_attention_order=new_order, dropout=0.0)
    plain = _randomise(_tiny(8, class_cond=True, num_classes=4, **flags))
    ckpt = _tiny(8, class_cond=True, num_classes=4, use_checkpoint=True, **flags)
    ckpt.load_state_dict(plain.state_dict())
    x, t, y = th.randn(2, 3, 8, 8), th.tensor([5.0, 700.0]), th.tensor([1, 3])
    results = []
    for model in (plain, ckpt):
        out = model(x, t, y=y)
        out.pow(2).mean().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()]))
    th.testing.assert_close(results[0][0], results[1][0])
    for g_plain, g_ckpt in zip(results[0][1], results[1][1]):
        th.testing.assert_close(g_plain, g_ckpt)


def test_new_attention_order_equals_legacy_order_with_permuted_qkv_weights():
    heads, ch = 2, 64
    legacy = _randomise(AttentionBlock(ch, num_heads=heads))
    new = AttentionBlock(ch, num_heads=heads, use_new_attention_order=True)
    state = legacy.state_dict()
    # Legacy qkv channels are laid out [head, q/k/v, c]; the new order is [q/k/v, head, c].
    for key in ("qkv.weight", "qkv.bias"):
        w = state[key]
        state[key] = w.reshape(heads, 3, ch // heads, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    new.load_state_dict(state)
    x = th.randn(2, ch, 4, 4)
    th.testing.assert_close(new(x), legacy(x))


def test_num_head_channels_sets_the_number_of_heads():
    assert AttentionBlock(128, num_heads=1, num_head_channels=32).num_heads == 4
    with pytest.raises(ValueError, match="num_head_channels"):
        AttentionBlock(96, num_head_channels=64)


def test_forward_and_backward_work_under_bfloat16_autocast():
    model = _randomise(_tiny(8, class_cond=True, num_classes=4, learn_sigma=True))
    x = th.randn(2, 3, 8, 8)
    with th.autocast("cpu", dtype=th.bfloat16):
        out = model(x, th.tensor([1, 2]), y=th.tensor([0, 1]))
    assert out.shape == (2, 6, 8, 8)
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == th.float32 and th.isfinite(g).all() for g in grads)


def test_group_norm_computes_in_float32_and_returns_the_input_dtype():
    norm = GroupNorm32(32, 64)
    x = th.randn(2, 64, 4, 4)
    out = norm(x.to(th.bfloat16))
    assert out.dtype == th.bfloat16
    th.testing.assert_close(out.float(), norm(x), rtol=0.02, atol=0.05)


def test_timestep_embedding_is_cos_then_sin_and_pads_odd_dims():
    t = th.tensor([0.0, 10.0])
    emb = timestep_embedding(t, 7)
    assert emb.shape == (2, 7)
    th.testing.assert_close(emb[0], th.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert emb[1, 0] == th.cos(th.tensor(10.0)) and emb[1, 3] == th.sin(th.tensor(10.0))


def test_unet_model_signature_keeps_the_shared_contract():
    params = list(inspect.signature(UNetModel.__init__).parameters)[1:]
    assert params == [
        "in_channels", "model_channels", "out_channels", "num_res_blocks",
        "attention_resolutions", "dropout", "channel_mult", "conv_resample", "dims",
        "num_classes", "use_checkpoint", "num_heads", "num_head_channels", "num_heads_upsample",
        "use_scale_shift_norm", "resblock_updown", "use_new_attention_order", "use_fp16",
        "use_null_label",  # ours, last (classifier-free guidance)
    ]
    assert script_util.NUM_CLASSES == 1000


@pytest.mark.parametrize("filename", ["model000010.pt", "ema_0.9999_000010.pt"])
def test_upstream_run_directory_weights_load_strictly(filename):
    # Flags of the upstream run that wrote tests/fixtures/upstream_run_small (see its README).
    model = _model_from_flags(dict(
        image_size=32, num_channels=32, num_res_blocks=1, attention_resolutions="16",
        learn_sigma=True, diffusion_steps=100, noise_schedule="cosine",
    ))
    state = th.load(FIXTURES / "upstream_run_small" / filename, weights_only=True)
    model.load_state_dict(state, strict=True)


def _flash_available_here():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = th.randn(1, 1, 4, 8)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            th.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("new_order", [False, True])
def test_attention_hands_sdpa_4d_inputs_with_contiguous_channels(new_order, monkeypatch):
    """The fused kernels (flash, memory-efficient) take only [N, heads, T, C] inputs whose last
    dimension has stride 1; anything else falls back to the T x T math kernel on a GPU."""
    from improved_diffusion import unet

    seen = []
    real = unet.F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append([(t.dim(), t.stride(-1), tuple(t.shape)) for t in (q, k, v)])
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(unet.F, "scaled_dot_product_attention", recording)
    block = AttentionBlock(64, num_heads=4, use_new_attention_order=new_order)
    block(th.randn(2, 64, 4, 4))
    assert seen == [[(4, 1, (2, 4, 16, 16))] * 3]


@pytest.mark.skipif(not _flash_available_here(), reason="this torch has no CPU flash kernel")
@pytest.mark.parametrize("new_order", [False, True])
def test_attention_runs_with_only_the_flash_kernel_allowed(new_order):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    block = _randomise(AttentionBlock(64, num_heads=2, use_new_attention_order=new_order))
    x = th.randn(2, 64, 4, 4, requires_grad=True)
    reference = block(x)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # "No available kernel" on 3-D inputs
        out = block(x)
        out.sum().backward()
    th.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
