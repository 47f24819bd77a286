"""guided-diffusion's noised classifier (issue 21): EncoderUNetModel's keys, shapes, logits and
initialisation are upstream's; create_classifier takes guided's keywords and works at any size."""
import functools
import inspect
import json

import pytest
import torch as th

import redraw
from conftest import FIXTURES
from improved_diffusion import script_util as su
from improved_diffusion.unet import EncoderUNetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# guided-diffusion's create_classifier(...) parameters (commit 22e0df8), in its order.
GUIDED_CREATE_CLASSIFIER_ARGS = [
    "image_size", "classifier_use_fp16", "classifier_width", "classifier_depth",
    "classifier_attention_resolutions", "classifier_use_scale_shift_norm",
    "classifier_resblock_updown", "classifier_pool",
]
POOLS = ["classifier_attention", "classifier_adaptive", "classifier_spatial",
         "classifier_spatial_v2"]


def _key_configs():
    with open(FIXTURES / "guided_classifier_keys.json") as f:
        return [pytest.param(entry, id=name) for name, entry in json.load(f).items()]


@functools.lru_cache(maxsize=None)
def reference():
    ref = th.load(FIXTURES / "guided_classifier_reference.pt", weights_only=True)
    weights = redraw.upstream_weights("guided_classifier_small")
    weights.update(redraw.upstream_weights("guided_classifier_spatial"))
    return ref, weights


def encoder(name):
    """EncoderUNetModel called with the kwargs guided's create_classifier passed (the fixture's)."""
    kwargs = dict(reference()[0]["classifiers"][name]["ctor_kwargs"])
    kwargs["attention_resolutions"] = tuple(kwargs["attention_resolutions"])
    kwargs["channel_mult"] = tuple(kwargs["channel_mult"])
    return EncoderUNetModel(**kwargs)


@pytest.mark.parametrize("entry", _key_configs())
def test_published_classifiers_have_upstreams_keys_shapes_and_parameter_count(entry):
    with th.device("meta"):
        model = su.create_classifier(**entry["flags"])  # exactly guided's keyword arguments
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert list(ours) == list(entry["state_dict"])  # same keys, same order
    assert ours == entry["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == entry["num_params"]
    assert [n for n, _ in model.named_buffers()] == entry["buffers"]


@pytest.mark.parametrize("name", POOLS)
def test_every_pool_loads_upstreams_weights_strictly_and_gives_its_logits(name):
    ref, weights = reference()
    model = encoder(name)
    model.load_state_dict(weights[name], strict=True)
    model.eval()
    with th.no_grad():
        logits = model(ref["x"], timesteps=ref["t"])
    assert sum(p.numel() for p in model.parameters()) == ref["classifiers"][name]["num_params"]
    th.testing.assert_close(logits, ref["classifiers"][name]["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool", ["attention", "adaptive"])
def test_create_classifier_builds_upstreams_classifier_from_the_flags(pool):
    # The fixture's classifiers are what guided's create_classifier passes for these flags, but
    # for channel_mult (1, 2): --classifier_channel_mult says it (fixtures' README).
    ref, weights = reference()
    name = f"classifier_{pool}"
    model = su.create_classifier(**dict(
        su.classifier_defaults(), classifier_width=32, classifier_depth=1,
        classifier_channel_mult="1,2", classifier_pool=pool))
    kwargs = ref["classifiers"][name]["ctor_kwargs"]
    assert (model.num_head_channels, model.attention_resolutions, model.out_channels) == (
        kwargs["num_head_channels"], tuple(kwargs["attention_resolutions"]),
        kwargs["out_channels"])
    model.load_state_dict(weights[name], strict=True)
    with th.no_grad():
        logits = model.eval()(ref["x"], ref["t"])
    th.testing.assert_close(logits, ref["classifiers"][name]["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", POOLS)
def test_built_after_the_same_seed_the_classifier_initialises_as_upstreams(name):
    # The fixture's weights are upstream's initialisation after th.manual_seed(0), with only the
    # all-zero parameters re-drawn: every parameter we initialise to nonzero values is upstream's.
    _, weights = reference()
    th.manual_seed(0)
    ours = encoder(name).state_dict()
    nonzero = [k for k, v in ours.items() if v.abs().sum() > 0]
    assert len(nonzero) > len(ours) / 2
    for k in nonzero:
        assert th.equal(ours[k], weights[name][k]), k


def test_create_classifier_takes_guideds_keywords_and_defaults():
    params = list(inspect.signature(su.create_classifier).parameters)
    assert params[:len(GUIDED_CREATE_CLASSIFIER_ARGS)] == GUIDED_CREATE_CLASSIFIER_ARGS
    defaults = su.classifier_defaults()
    with open(FIXTURES / "guided_classifier_keys.json") as f:
        guided_defaults = json.load(f)["classifier_defaults"]["flags"]
    assert {k: defaults[k] for k in guided_defaults} == guided_defaults
    assert set(defaults) - set(guided_defaults) == {"classifier_channel_mult",
                                                    "classifier_num_classes"}
    with th.device("meta"):
        classifier, diffusion = su.create_classifier_and_diffusion(
            **su.classifier_and_diffusion_defaults())
    assert classifier.out_channels == su.NUM_CLASSES == 1000
    assert diffusion.num_timesteps == 1000


@pytest.mark.parametrize("image_size,pool,mult", [
    (8, "attention", (1, 2)), (16, "adaptive", (1, 2, 2)), (32, "spatial", (1, 2, 2, 2)),
    (28, "spatial_v2", (1, 2, 2)),
])
def test_small_images_get_the_unets_channel_multipliers_and_classify(image_size, pool, mult):
    th.manual_seed(0)
    model = su.create_classifier(**dict(
        su.classifier_defaults(), image_size=image_size, classifier_width=64,
        classifier_depth=1, classifier_pool=pool, classifier_num_classes=10))
    assert model.channel_mult == mult
    logits = model(th.randn(2, 3, image_size, image_size), th.tensor([0, 99]))
    assert logits.shape == (2, 10)


def test_an_explicit_channel_mult_is_used():
    with th.device("meta"):
        model = su.create_classifier(**dict(
            su.classifier_defaults(), image_size=64, classifier_width=32, classifier_depth=1,
            classifier_channel_mult="1,2"))
    assert model.channel_mult == (1, 2)


@pytest.mark.parametrize("flags,message", [
    (dict(classifier_pool="max"), r"--classifier_pool 'max' is unknown; use one of adaptive"),
    (dict(classifier_width=48), r"--classifier_width 48 times --classifier_channel_mult entry"),
    (dict(image_size=8, classifier_width=32),
     r"--classifier_attention_resolutions has 8 .* drop 8 or use a larger --classifier_width"),
    (dict(image_size=8, classifier_width=32, classifier_attention_resolutions="4",
          classifier_channel_mult="1"), r"--classifier_width 32: the classifier's middle block"),
    (dict(classifier_channel_mult="1,x"), r"--classifier_channel_mult '1,x' must be"),
    (dict(image_size=12, classifier_channel_mult="1,2,2,2"),
     r"--classifier_channel_mult 1,2,2,2 has 4 levels .* --image_size 12"),
    (dict(classifier_num_classes=0), r"--classifier_num_classes must be a positive integer"),
])
def test_flags_the_classifier_cannot_be_built_with_are_one_line_errors_naming_the_flag(
        flags, message):
    with pytest.raises(su.FlagError, match=message) as info:
        with th.device("meta"):
            su.create_classifier(**dict(su.classifier_defaults(), **flags))
    assert "\n" not in str(info.value)


def test_a_float16_torso_gives_logits_close_to_float32_and_converts_back():
    ref, weights = reference()
    model = encoder("classifier_attention")
    model.load_state_dict(weights["classifier_attention"])
    model.eval()
    model.convert_to_fp16()
    assert model.dtype == th.float16
    assert model.out[2].qkv_proj.weight.dtype == th.float32  # the head stays float32
    with th.no_grad():
        logits = model(ref["x"], ref["t"])
    assert logits.dtype == th.float32
    th.testing.assert_close(logits, ref["classifiers"]["classifier_attention"]["logits"],
                            rtol=0, atol=1e-3)
    model.convert_to_fp32()
    assert all(p.dtype == th.float32 for p in model.parameters())
