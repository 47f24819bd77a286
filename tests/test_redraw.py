"""tests/redraw.py: the inputs and weights the fixtures' outputs were computed from, drawn again
from their seeded recipes, fail by name when a generator no longer draws what the recipe's
SHA-256 names (a numerical mismatch further on would not say why)."""
import copy

import pytest
import torch

import redraw

CACHED = (redraw.adm_inputs, redraw._inception_state_dict, redraw._inception_images,
          redraw._upstream_init, redraw.init_layouts)


@pytest.fixture
def fresh_draws():
    for f in CACHED:
        f.cache_clear()
    yield
    for f in CACHED:  # the draws of the changed recipes must not stay for the next test
        f.cache_clear()


def test_a_changed_numpy_stream_fails_naming_the_fixture_and_the_array(fresh_draws, monkeypatch):
    monkeypatch.setattr(redraw, "ADM_SEED", redraw.ADM_SEED + 1)
    with pytest.raises(redraw.RedrawError, match=r"^adm_evaluator_reference: the drawn ref_pool's "
                       r"sha256 is [0-9a-f]{64}, the recipe says b4aaf3d7.*changed its stream"):
        redraw.adm_inputs()


def test_a_changed_torch_stream_fails_naming_the_inception_state_dict(fresh_draws, monkeypatch):
    monkeypatch.setattr(redraw, "INCEPTION_SEED", 7)
    with pytest.raises(redraw.RedrawError, match=r"^fid_inception_reference: the drawn "
                       r"state_dict's sha256 is [0-9a-f]{64}, the recipe says 4bf1ecd6"):
        redraw.inception_state_dict()


def test_a_changed_image_draw_fails_naming_its_size(fresh_draws, monkeypatch):
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda lo, hi, *a, **k: real(lo, hi - 1, *a, **k))
    with pytest.raises(redraw.RedrawError, match=r"^fid_inception_reference: the drawn images_32"):
        redraw.inception_images(32)


def test_a_changed_init_fails_naming_the_fixture_and_the_model(fresh_draws, monkeypatch):
    layouts = copy.deepcopy(redraw.init_layouts())
    entries = layouts["guided_small_models"]["legacy_heads_updown_uncond"]["entries"]
    name, shape, kind = entries[0]
    assert kind == ["kaiming_uniform"]
    entries[0] = [name, shape, ["fan_in_uniform", 2]]  # another draw than upstream made
    redraw.init_layouts.cache_clear()
    monkeypatch.setattr(redraw, "init_layouts", lambda: layouts)
    assert redraw.upstream_init("guided_small_models", "updown_headch_neworder_cond")  # unchanged
    with pytest.raises(redraw.RedrawError, match=r"^guided_small_models\['legacy_heads_updown_"
                       r"uncond'\]: the drawn state_dict's sha256 is [0-9a-f]{64}, the recipe"):
        redraw.upstream_init("guided_small_models", "legacy_heads_updown_uncond")


def test_every_recipe_draws_what_its_digest_names_and_callers_get_their_own_copies():
    inputs = redraw.adm_inputs()
    assert sorted(inputs) == sorted(redraw.ADM_SHA256)
    assert not inputs["ref_pool"].flags.writeable  # shared by the tests of a process
    sd = redraw.inception_state_dict()
    assert len(sd) == 566 and sd["fc.weight"].dtype == torch.float16
    sd.pop("fc.weight")
    assert "fc.weight" in redraw.inception_state_dict()
    for fixture, models in redraw.init_layouts().items():
        weights = redraw.upstream_weights(fixture)
        first = weights if list(models) == [""] else weights[next(iter(models))]
        next(iter(first.values())).add_(1.0)
        again = redraw.upstream_weights(fixture)
        again = again if list(models) == [""] else again[next(iter(models))]
        assert not torch.equal(next(iter(first.values())), next(iter(again.values())))
