"""Flags: defaults, parsing helpers, channel_mult rules and the errors users see."""
import argparse

import pytest

from improved_diffusion.script_util import (
    MODEL_FLAG_KEYS,
    FlagError,
    add_dict_to_argparser,
    args_to_dict,
    create_model,
    create_model_and_diffusion,
    model_and_diffusion_defaults,
    model_flag_keys,
    parse_attention_resolutions,
    parse_channel_mult,
    sr_create_model_and_diffusion,
    sr_model_and_diffusion_defaults,
    str2bool,
)

UPSTREAM_DEFAULTS = dict(
    image_size=64, num_channels=128, num_res_blocks=2, num_heads=4, num_heads_upsample=-1,
    attention_resolutions="16,8", dropout=0.0, learn_sigma=False, sigma_small=False,
    class_cond=False, diffusion_steps=1000, noise_schedule="linear", timestep_respacing="",
    use_kl=False, predict_xstart=False, rescale_timesteps=True, rescale_learned_sigmas=True,
    use_checkpoint=False, use_scale_shift_norm=True,
)
NEW_DEFAULTS = dict(
    num_head_channels=-1, resblock_updown=False, use_new_attention_order=False, channel_mult="",
    num_classes=1000, class_dropout_prob=0.0, arch="unet", in_channels=3, dit_depth=0,
    dit_hidden_size=0, dit_num_heads=0,
)
TINY = dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="4",
            diffusion_steps=100)


def test_defaults_are_upstreams_plus_the_additive_new_flags():
    assert model_and_diffusion_defaults() == {**UPSTREAM_DEFAULTS, **NEW_DEFAULTS}


def test_model_flag_keys_are_the_default_keys():
    assert model_flag_keys() == list(model_and_diffusion_defaults())
    assert MODEL_FLAG_KEYS == tuple(model_flag_keys())


@pytest.mark.parametrize("text", ["yes", "True", "T", "y", "1", " TRUE "])
def test_str2bool_reads_true_spellings(text):
    assert str2bool(text) is True


@pytest.mark.parametrize("text", ["no", "False", "f", "N", "0"])
def test_str2bool_reads_false_spellings(text):
    assert str2bool(text) is False
    assert str2bool(False) is False


def test_str2bool_rejects_anything_else_with_a_clear_message():
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a boolean .* got 'maybe'"):
        str2bool("maybe")


def test_argparser_round_trips_the_defaults_and_types_overrides():
    parser = argparse.ArgumentParser()
    add_dict_to_argparser(parser, model_and_diffusion_defaults())
    args = parser.parse_args([])
    assert args_to_dict(args, model_flag_keys()) == model_and_diffusion_defaults()
    args = parser.parse_args(
        ["--learn_sigma", "True", "--num_channels", "64", "--channel_mult", "1,2",
         "--dropout", "0.1", "--use_checkpoint", "no"]
    )
    picked = args_to_dict(args, ["learn_sigma", "num_channels", "channel_mult", "dropout",
                                 "use_checkpoint"])
    assert picked == dict(learn_sigma=True, num_channels=64, channel_mult="1,2", dropout=0.1,
                          use_checkpoint=False)


def test_argparser_names_the_flag_when_a_boolean_is_malformed(capsys):
    parser = argparse.ArgumentParser()
    add_dict_to_argparser(parser, {"learn_sigma": False, "resume": None})
    assert parser.parse_args(["--resume", "x"]).resume == "x"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--learn_sigma", "perhaps"])
    assert exc.value.code == 2
    assert "--learn_sigma: expected a boolean" in capsys.readouterr().err


@pytest.mark.parametrize(
    "image_size, expected",
    [
        (32, (1, 2, 2, 2)),
        (64, (1, 2, 3, 4)),
        (128, (1, 1, 2, 3, 4)),
        (256, (1, 1, 2, 2, 4, 4)),
        (512, (0.5, 1, 1, 2, 2, 4, 4)),
        (8, (1, 2)),
        (16, (1, 2, 2)),
        (28, (1, 2, 2)),
        (48, (1, 2, 2, 2)),
        (96, (1, 2, 2, 2, 4)),
        (7, (1,)),
    ],
)
def test_empty_channel_mult_picks_upstreams_choice_or_a_halving_rule(image_size, expected):
    assert parse_channel_mult("", image_size) == expected


def test_explicit_channel_mult_is_parsed():
    assert parse_channel_mult("1,2,2", 28) == (1, 2, 2)
    assert parse_channel_mult(" 0.5,1,2 ", 16) == (0.5, 1, 2)
    assert parse_channel_mult((1, 2), 8) == (1, 2)


@pytest.mark.parametrize("bad", ["1,x", "1,,2", "0,1", "-1", "1,nan"])
def test_malformed_channel_mult_raises_a_flag_error(bad):
    with pytest.raises(FlagError, match=r"--channel_mult .* comma-separated list"):
        parse_channel_mult(bad, 32)


def test_channel_mult_that_cannot_halve_the_image_size_names_both_flags():
    match = r"--channel_mult 1,2,2,2 .*--image_size 28 .*not divisible by 8"
    with pytest.raises(FlagError, match=match):
        parse_channel_mult("1,2,2,2", 28)


@pytest.mark.parametrize("bad", [0, -8, 8.0])
def test_bad_image_size_raises_a_flag_error(bad):
    with pytest.raises(FlagError, match="--image_size must be a positive integer"):
        parse_channel_mult("", bad)


def test_flag_error_is_a_usage_error_that_exits_2():
    from improved_diffusion.infra.errors import UsageError, UserError

    assert issubclass(FlagError, UsageError) and issubclass(FlagError, UserError)
    assert FlagError("x").exit_code == 2 and not issubclass(FlagError, ValueError)


def test_attention_resolutions_become_downsample_rates_as_upstream():
    assert parse_attention_resolutions("16,8", 64) == (4, 8)
    assert parse_attention_resolutions("", 64) == ()
    with pytest.raises(FlagError, match="--attention_resolutions '16,a'"):
        parse_attention_resolutions("16,a", 64)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_channels=48), "--num_channels 48 .*multiple of 32"),
        (dict(channel_mult="0.5,1"), "--channel_mult entry 0.5"),
        (dict(num_heads=3), "--num_heads 3 does not divide"),
        (dict(num_heads_upsample=5), "--num_heads_upsample 5 does not divide"),
        (dict(num_head_channels=48), "--num_head_channels 48 does not divide"),
        (dict(class_cond=True, num_classes=0), "--num_classes must be a positive integer"),
        (dict(channel_mult="1,2,2,2,2"), "--image_size 8 is not divisible"),
    ],
)
def test_impossible_model_flags_raise_flag_errors_naming_the_flag(overrides, match):
    flags = dict(num_channels=32, num_res_blocks=1, attention_resolutions="4", num_heads=1)
    flags.update(overrides)
    with pytest.raises(FlagError, match=match):
        create_model(8, **flags)


def test_create_model_and_diffusion_accepts_every_default_flag():
    flags = model_and_diffusion_defaults()
    flags.update(TINY, learn_sigma=True, class_cond=True, num_classes=5, timestep_respacing="5")
    model, diffusion = create_model_and_diffusion(**flags)
    assert model.out_channels == 6 and model.label_emb.num_embeddings == 5
    assert diffusion.num_timesteps == 5


def test_super_res_defaults_and_builder_fit_together():
    defaults = sr_model_and_diffusion_defaults()
    assert defaults["large_size"] == 256 and defaults["small_size"] == 64
    assert "image_size" not in defaults and "sigma_small" not in defaults
    assert {"channel_mult", "num_classes", "num_head_channels"} <= set(defaults)
    defaults.update(large_size=16, small_size=8, num_channels=32, num_res_blocks=1,
                    attention_resolutions="8", diffusion_steps=100)
    model, diffusion = sr_create_model_and_diffusion(**defaults)
    assert model.in_channels == 6 and model.image_size == 16
    assert diffusion.num_timesteps == 100


def test_super_res_size_errors_name_the_large_size_flag():
    defaults = sr_model_and_diffusion_defaults()
    defaults.update(large_size=12, small_size=6, channel_mult="1,2,2,2")
    with pytest.raises(FlagError, match="--large_size 12"):
        sr_create_model_and_diffusion(**defaults)


def test_a_linear_schedule_too_short_for_its_betas_is_one_line_naming_the_flags():
    """--diffusion_steps 4 with the linear schedule: betas up to 5 (0.02 * 1000 / 4); before, a
    ValueError traceback ("betas must lie in (0, 1]") from inside the diffusion."""
    import pytest as _pytest

    from improved_diffusion.infra.errors import UsageError
    from improved_diffusion.script_util import create_gaussian_diffusion

    with _pytest.raises(UsageError, match=r"--diffusion_steps 4 with --noise_schedule linear.*"
                                          r"--diffusion_steps 20 or more"):
        create_gaussian_diffusion(steps=4, noise_schedule="linear")
    assert create_gaussian_diffusion(steps=4, noise_schedule="cosine").num_timesteps == 4
    assert create_gaussian_diffusion(steps=20, noise_schedule="linear").num_timesteps == 20


@pytest.mark.timeout(120)
def test_the_shortest_linear_schedule_samples_finite_images_without_a_warning(tmp_path):
    """Issue 37, item 15: 20 linear steps end at beta 1 (alpha_bar 0), whose 1/alpha_bar was
    two divide-by-zero RuntimeWarnings and made every ancestral sample nan (pixel value 0)."""
    import warnings

    import numpy as np

    from conftest import run_script
    from improved_diffusion.ckpt import checkpoint, file_writer
    from improved_diffusion.script_util import create_gaussian_diffusion

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = create_gaussian_diffusion(steps=20, noise_schedule="linear")
    assert d.betas.max() < 1 and np.isfinite(d.sqrt_recip_alphas_cumprod).all()
    assert np.isfinite(d.sqrt_recipm1_alphas_cumprod).all()
    flags = dict(model_and_diffusion_defaults(), **dict(TINY, diffusion_steps=20))
    model, _ = create_model_and_diffusion(**flags)
    path = tmp_path / "model000001.pt"
    file_writer.atomic_write(str(path), checkpoint.model_payload(1, model.state_dict(), flags))
    run_script("sample.py", "--model_path", path, "--num_samples", "2", "--log_dir",
               tmp_path / "s", "--progress", "False")
    with np.load(tmp_path / "s" / "samples_2x8x8x3.npz") as z:
        assert len(np.unique(z["arr_0"])) > 2  # not one value (nan: 0 everywhere)
