"""DiT: DiT's state-dict keys and shapes, its initial weights, and its numbers (dit.py).

The references (tests/fixtures/dit_*) were made with facebookresearch/DiT's models.py (commit
ed81ce2, timm 1.0.31) on one thread; see tests/fixtures/README.md.
"""
import json

import pytest
import torch as th

from conftest import FIXTURES
from improved_diffusion import dit as dit_module
from improved_diffusion.dit import DIT_CONFIGS, DiT, DiT_models, TimestepEmbedder
from improved_diffusion.script_util import (
    FlagError,
    create_model_and_diffusion,
    model_and_diffusion_defaults,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = json.loads((FIXTURES / "dit_state_dict_keys.json").read_text())


@pytest.fixture(scope="module")
def reference():
    return th.load(FIXTURES / "dit_small_reference.pt", weights_only=True)


@pytest.fixture(scope="module")
def weights():
    return th.load(FIXTURES / "dit_small_model.pt", weights_only=True)


def dit_from_reference(reference, weights, name):
    model = DiT(**reference["models"][name]["flags"])
    model.load_state_dict(weights[name], strict=True)
    return model.eval()


def shapes(model):
    return [(k, list(v.shape)) for k, v in model.state_dict().items()]


# ------------------------------------------------------------------------------------ keys


@pytest.mark.parametrize("config", sorted(KEYS))
def test_state_dict_keys_shapes_order_and_parameter_counts_are_dits(config):
    entry = KEYS[config]
    f = entry["flags"]
    with th.device("meta"):  # XL/2 has 675M parameters: shapes only
        theirs = DiT_models[f["model"]](input_size=f["input_size"], num_classes=f["num_classes"])
        ours, _ = create_model_and_diffusion(**dict(
            model_and_diffusion_defaults(), arch=f["model"], image_size=f["input_size"],
            in_channels=f["in_channels"], learn_sigma=f["learn_sigma"], class_cond=True,
            num_classes=f["num_classes"], class_dropout_prob=f["class_dropout_prob"]))
    want = [(k, list(v)) for k, v in entry["state_dict"].items()]
    for model in (theirs, ours):
        assert shapes(model) == want  # names, shapes and order: model.parameters() order is DiT's
        params = list(model.named_parameters())
        assert sum(p.numel() for _, p in params) == entry["num_params"]
        assert sum(p.numel() for _, p in params if p.requires_grad) == \
            entry["num_trainable_params"]
        assert [n for n, p in params if not p.requires_grad] == entry["non_trainable"]
        assert [n for n, _ in model.named_buffers()] == entry["buffers"]


def test_the_model_table_is_dits_twelve_models():
    assert sorted(DiT_models) == sorted(f"DiT-{s}/{p}" for s in ("S", "B", "L", "XL")
                                        for p in (2, 4, 8))
    assert DIT_CONFIGS["DiT-XL/2"] == (28, 1152, 2, 16)  # depth, hidden, patch, heads
    assert DIT_CONFIGS["DiT-S/8"] == (12, 384, 8, 6)
    with th.device("meta"):
        model = dit_module.DiT_B_4(input_size=32)  # DiT's function names exist too
    assert (len(model.blocks), model.patch_size, model.num_heads) == (12, 4, 12)


def test_a_fresh_dit_has_dits_initial_weights_for_the_same_seed(reference, weights):
    """The reference weights are DiT's init from seed 0 with its all-zero tensors redrawn: every
    tensor our init does not leave at zero is bit for bit DiT's (the sin-cos pos_embed too)."""
    for name in ("small", "latent4"):
        th.manual_seed(0)
        fresh = DiT(**reference["models"][name]["flags"]).state_dict()
        nonzero = [k for k, v in fresh.items() if v.abs().sum() > 0]
        assert "pos_embed" in nonzero and "blocks.0.attn.qkv.weight" in nonzero
        assert [k for k in nonzero if not th.equal(fresh[k], weights[name][k])] == []
        zero = set(fresh) - set(nonzero)  # adaLN-Zero, the final layer, every bias
        assert "final_layer.linear.weight" in zero and "blocks.1.adaLN_modulation.1.bias" in zero


def test_pos_embed_is_a_frozen_parameter_and_gets_no_gradient(reference, weights):
    model = dit_from_reference(reference, weights, "small").train()
    r = reference["models"]["small"]
    model(r["x"], reference["t"], reference["y"]).square().mean().backward()
    assert model.pos_embed.grad is None and not model.pos_embed.requires_grad
    assert model.blocks[0].attn.qkv.weight.grad is not None


# ------------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("name", ["small", "latent4"])
def test_the_eval_forward_equals_dits_fused_and_explicit_attention(reference, weights, name):
    model, r = dit_from_reference(reference, weights, name), reference["models"][name]
    with th.no_grad():
        out = model(r["x"], reference["t"], reference["y"])
    assert out.shape == r["forward_fused"].shape  # [N, 2C, H, W] with learn_sigma
    for key in ("forward_fused", "forward_unfused"):
        th.testing.assert_close(out, r[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["small", "latent4"])
def test_forward_with_cfg_at_scale_4_equals_dits_and_guides_channels_0_to_2_only(
        reference, weights, name):
    model, r = dit_from_reference(reference, weights, name), reference["models"][name]
    with th.no_grad():
        guided = model.forward_with_cfg(r["x2"], r["t2"], r["y2"], r["cfg_scale"])
        plain = model(r["x2"], r["t2"], r["y2"])
    for key in ("forward_with_cfg_fused", "forward_with_cfg_unfused"):
        th.testing.assert_close(guided, r[key], rtol=1e-5, atol=2e-6)
    half = len(guided) // 2
    assert th.equal(guided[:half, :3], guided[half:, :3])  # both halves get the guided eps
    assert not th.allclose(guided[:half, :3], plain[:half, :3])
    # DiT's quirk: channels from 3 on pass through unguided (for the 4-channel latent model
    # that includes eps channel 3; for the 3-channel model it is the variance only).
    th.testing.assert_close(guided[:, 3:], plain[:, 3:], rtol=0, atol=1e-6)


def test_the_timestep_and_label_embeddings_equal_dits(reference, weights):
    model = dit_from_reference(reference, weights, "small")
    t, y = reference["t"], reference["y"]
    with th.no_grad():
        th.testing.assert_close(model.t_embedder(t), reference["models"]["small"]["t_embedder_out"],
                                rtol=1e-5, atol=1e-6)
        assert th.equal(model.y_embedder(y, False),
                        reference["models"]["small"]["y_embedder_out_eval"])
    # float32 sin/cos of t * f: one ulp of a frequency moves the value by about t * 6e-8 (the
    # libm of the machine that made the reference rounds some frequencies the other way).
    for tt, key, dim in ((t, "timestep_embedding_256", 256),
                         (reference["t_frac"], "timestep_embedding_256_frac", 256),
                         (t, "timestep_embedding_7_odd", 7)):
        got = TimestepEmbedder.timestep_embedding(tt, dim)
        bound = 1e-7 + 6e-8 * tt.abs().float()[:, None]
        assert got.shape == reference[key].shape
        assert ((got - reference[key]).abs() <= bound).all(), key
    assert th.equal(TimestepEmbedder.timestep_embedding(t, 7)[:, -1], th.zeros(4))


def test_the_null_label_rule_is_dits(reference, weights):
    embedder = dit_from_reference(reference, weights, "small").y_embedder
    assert embedder.embedding_table.num_embeddings == 11  # 10 classes + the null label 10
    forced = embedder.token_drop(th.tensor([0, 3, 9, 5]), th.tensor([1, 0, 1, 0]))
    assert th.equal(forced, reference["token_drop_forced"])
    th.manual_seed(0)
    dropped = embedder.token_drop(reference["token_drop_seed0_labels"])
    assert th.equal(dropped, reference["token_drop_seed0"])
    # eval mode never drops; the null label given in y is used as given
    y = th.tensor([10, 10, 2, 2])
    th.manual_seed(0)
    before = th.get_rng_state()
    assert th.equal(embedder(y, train=False), embedder.embedding_table.weight[y])
    assert th.equal(th.get_rng_state(), before)


def test_without_dropout_the_table_has_no_null_row_as_dits():
    model = DiT(input_size=8, patch_size=4, in_channels=3, hidden_size=32, depth=1, num_heads=2,
                class_dropout_prob=0.0, num_classes=10, learn_sigma=False)
    assert model.y_embedder.embedding_table.num_embeddings == 10
    with pytest.raises(ValueError, match="y is required"):
        model(th.zeros(1, 3, 8, 8), th.zeros(1))


def test_an_unconditional_dit_is_called_without_y_and_uses_its_one_null_row():
    th.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=2,
                class_dropout_prob=0.0, num_classes=0, learn_sigma=True).eval()
    th.nn.init.normal_(model.final_layer.linear.weight)
    th.nn.init.normal_(model.blocks[0].adaLN_modulation[1].weight)
    assert model.y_embedder.embedding_table.num_embeddings == 1
    x, t = th.randn(2, 3, 8, 8), th.tensor([3, 700])
    with th.no_grad():
        out = model(x, t)
        assert out.shape == (2, 6, 8, 8)
        assert th.equal(out, model(x, t, th.zeros(2, dtype=th.long)))  # index 0 = num_classes


def test_attention_runs_scaled_dot_product_attention_on_4d_head_tensors(monkeypatch):
    seen = []
    real = dit_module.F.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(dit_module.F, "scaled_dot_product_attention", record)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4,
                num_classes=3)
    model(th.randn(5, 4, 8, 8), th.zeros(5), th.zeros(5, dtype=th.long))
    assert seen == [((5, 4, 16, 8),) * 3] * 2  # [N, heads, T, D / heads], once per block


@pytest.mark.parametrize("flags, match", [
    (dict(arch="DiT-M/2"), r"--arch 'DiT-M/2' is unknown; use one of unet, DiT-XL/2"),
    (dict(arch="DiT-S/8", image_size=12), r"--image_size 12 is not a multiple of DiT-S/8's patch"),
    (dict(dit_num_heads=5), r"--dit_hidden_size 64 must be a multiple of 4 and of the 5 heads"),
    (dict(dit_depth=-1), r"--dit_depth must be a positive integer, or 0 for DiT-S/2's 12"),
    (dict(in_channels=0), r"--in_channels must be a positive integer"),
])
def test_bad_dit_flags_are_one_line_flag_errors(flags, match):
    base = dict(model_and_diffusion_defaults(), arch="DiT-S/2", image_size=16, dit_depth=1,
                dit_hidden_size=64, dit_num_heads=4)
    with pytest.raises(FlagError, match=match):
        create_model_and_diffusion(**dict(base, **flags))


# ------------------------------------------------------------------------ guidance with DiT


@pytest.mark.parametrize("name", ["small", "latent4"])
def test_sample_pys_guided_forward_of_a_dit_gives_dits_forward_with_cfg(reference, weights, name):
    """sample.py --guidance_scale S on a DiT: the first half of DiT's forward_with_cfg (DiT
    guides channels 0..2, also of a 4-channel latent model)."""
    from improved_diffusion import sampling

    model, r = dit_from_reference(reference, weights, name), reference["models"][name]
    flags = dict(arch="DiT-S/2", class_cond=True, class_dropout_prob=0.1,
                 num_classes=model.num_classes)
    half = len(r["x2"]) // 2
    forward = sampling.sampling_forward(model, flags, r["cfg_scale"])
    with th.no_grad():
        ours = forward(r["x2"][:half], r["t2"][:half], y=r["y2"][:half])
        theirs = model.forward_with_cfg(r["x2"], r["t2"], r["y2"], r["cfg_scale"])[:half]
    th.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)


def test_a_dit_of_the_trainer_leaves_label_dropout_to_the_trainer_a_bare_dit_drops_itself():
    """train.py drops labels once, for every model (guidance.drop_labels_in); DiT's own forward
    drops them again in training mode only when built directly, as DiT's code is."""
    flags = dict(model_and_diffusion_defaults(), arch="DiT-S/2", image_size=8, dit_depth=1,
                 dit_hidden_size=32, dit_num_heads=2, class_cond=True, num_classes=4,
                 class_dropout_prob=0.9)
    ours, _ = create_model_and_diffusion(**flags)
    bare = DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=2,
               class_dropout_prob=0.9, num_classes=4, learn_sigma=False)
    x, t, y = th.randn(16, 3, 8, 8), th.randint(0, 1000, (16,)), th.randint(0, 4, (16,))
    for model, drops in ((ours, False), (bare, True)):
        with th.no_grad():  # DiT zeroes its output layers at init: make the labels matter
            for p in model.parameters():
                p.copy_(th.randn_like(p) * 0.02)
        with th.no_grad():
            th.manual_seed(0)
            trained = model.train()(x, t, y)
            evaluated = model.eval()(x, t, y)
        assert th.equal(trained, evaluated) is not drops
