"""One answer to "does this state dict fit the model, and which flag is likely wrong"."""
import io
import json

import pytest
import torch as th

from improved_diffusion.ckpt import checkpoint as ckpt
from improved_diffusion.apps import ckpt_tool
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults
from improved_diffusion.ckpt.state_fit import SHAPE_FLAGS, fit_state_dict, shapes_of

BASE = dict(model_and_diffusion_defaults(), image_size=32, num_channels=32, num_res_blocks=1,
            attention_resolutions="16")
OTHER_VALUE = dict(
    image_size=64, num_channels=64, num_res_blocks=2, num_heads=2, num_heads_upsample=2,
    attention_resolutions="16,8", dropout=0.1, learn_sigma=True, sigma_small=True,
    class_cond=True, diffusion_steps=50, noise_schedule="cosine", timestep_respacing="10",
    use_kl=True, predict_xstart=True, rescale_timesteps=False, rescale_learned_sigmas=False,
    use_checkpoint=True, use_scale_shift_norm=False, num_head_channels=16, resblock_updown=True,
    use_new_attention_order=True, channel_mult="1,2,2", num_classes=5, class_dropout_prob=0.1,
    arch="DiT-S/8", in_channels=4, dit_depth=2, dit_hidden_size=64, dit_num_heads=2,
)
# A tiny DiT, and a value of each flag that matters to it.
DIT_BASE = dict(arch="DiT-S/2", image_size=8, dit_depth=1, dit_hidden_size=32, dit_num_heads=2)
DIT_OTHER_VALUE = dict(arch="DiT-S/4", image_size=16, in_channels=4, dit_depth=2,
                       dit_hidden_size=64, dit_num_heads=4, learn_sigma=True, class_cond=True,
                       num_classes=5)


def flags(**kw):
    return dict(BASE, **kw)


def shapes(**kw):
    th.manual_seed(0)
    model, _ = create_model_and_diffusion(**flags(**kw))
    return shapes_of(model.state_dict())


@pytest.mark.timeout(120)
def test_shape_flags_are_exactly_the_flags_that_change_names_or_shapes():
    assert set(OTHER_VALUE) == set(model_and_diffusion_defaults())
    changes = set()
    for k, v in [*OTHER_VALUE.items(), *(("dit", kv) for kv in DIT_OTHER_VALUE.items())]:
        extra = {"class_cond": True} if k in ("num_classes", "class_dropout_prob", "dit") else {}
        if k == "dit":  # the same flag on the DiT
            (k, v), extra = v, dict(DIT_BASE, **extra)
        if shapes(**{**extra, k: v}) != shapes(**extra):
            changes.add(k)
    assert changes == set(SHAPE_FLAGS)


def test_a_reshape_only_learn_sigma_explains_never_names_flags_that_cannot_change_shapes():
    file_flags = flags(learn_sigma=True, dropout=0.1, diffusion_steps=50, noise_schedule="cosine")
    fit = fit_state_dict(shapes(), shapes(learn_sigma=True), file_flags, flags())
    assert not fit.ok and set(fit.reshaped) == {"out.2.weight", "out.2.bias"}
    assert fit.likely_flags == ["--learn_sigma (file: True, model: False)"]
    line = fit.summary()
    assert "\n" not in line and line.startswith("2 reshaped (out.2.weight: [6, 32, 3, 3] in the "
                                                "file, [3, 32, 3, 3] in the model")


@pytest.mark.parametrize("kw,hint", [
    (dict(learn_sigma=True), "--learn_sigma (file has 6 output channels, model 3)"),
    (dict(num_channels=64), "--num_channels (file: 64, model: 32)"),
    (dict(class_cond=True), "--class_cond (file: True, model: False)"),
    (dict(attention_resolutions="16,8"), "--attention_resolutions"),
    (dict(num_res_blocks=2), "--num_res_blocks"),
    (dict(use_scale_shift_norm=False), "--use_scale_shift_norm (file: False, model: True)"),
    (DIT_BASE, "--arch (file: a DiT, model: the UNet)"),
])
def test_without_stored_flags_the_key_layout_names_the_flag(kw, hint):
    fit = fit_state_dict(shapes(), shapes(**kw))
    assert fit.likely_flags and fit.likely_flags[0].startswith(hint), fit.likely_flags


@pytest.mark.parametrize("kw,hint", [
    (dict(in_channels=4), "--in_channels (file: 4, model: 3)"),
    (dict(arch="DiT-S/4"), "--arch (file: patch size 4, model: 2)"),
    (dict(dit_hidden_size=64), "--arch / --dit_hidden_size (file: width 64, model: 32)"),
    (dict(learn_sigma=True), "--learn_sigma (file has 6 output channels, model 3)"),
    (dict(class_cond=True, num_classes=5), "--class_cond / --num_classes / --class_dropout_prob "
                                           "(file: 5 label rows, model: 1"),
    (dict(image_size=16), "--image_size (file: 64 patches, model: 16)"),
    (dict(dit_depth=3), "--arch / --dit_depth (file: 3 blocks, model: 1)"),
])
def test_without_stored_flags_dits_key_layout_names_the_flag(kw, hint):
    fit = fit_state_dict(shapes(**DIT_BASE), shapes(**dict(DIT_BASE, **kw)))
    assert fit.likely_flags and fit.likely_flags[0].startswith(hint), fit.likely_flags


def test_a_fitting_state_dict_has_no_hints():
    fit = fit_state_dict(shapes(), shapes(dropout=0.3), flags(dropout=0.3), flags())
    assert fit.ok and not fit.likely_flags and fit.summary() == "all keys and shapes match"


def test_ckpt_diff_against_names_only_learn_sigma_for_a_learn_sigma_reshape(tmp_path):
    for name, kw in (("a", dict(learn_sigma=True, dropout=0.1, diffusion_steps=50,
                                noise_schedule="cosine")), ("b", {})):
        th.manual_seed(0)
        model, _ = create_model_and_diffusion(**flags(**kw))
        th.save(ckpt.model_payload(1, model.state_dict(), flags(**kw)), tmp_path / f"{name}.pt")
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_tool.main(["diff", str(tmp_path / "a.pt"), "--against", str(tmp_path / "b.pt"),
                           "--json"], out=out, err=err)
    rep = json.loads(out.getvalue())
    assert code == 1 and rep["likely_flags"] == ["--learn_sigma (file: True, other: False)"]
