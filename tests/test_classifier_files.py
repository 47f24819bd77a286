"""The checkpoint vocabulary knows a noised classifier (issue 21): guided-diffusion's raw classifier
files classify as "classifier", our tagged ones carry kind "classifier" in the model slot of their
own log dir, and ckpt.py inspect / verify / diff / convert understand a classifier step."""
import functools
import json

import pytest
import torch as th

import redraw
from conftest import FIXTURES
from improved_diffusion.ckpt import checkpoint as ckpt
from improved_diffusion.ckpt import file_writer
from improved_diffusion.ckpt import run_dir
from improved_diffusion import script_util as su
from improved_diffusion.ckpt.optim_state import named_optimizer_state
from test_ckpt_tool import cli

FLAGS = dict(su.classifier_and_diffusion_defaults(), image_size=8, classifier_width=32,
             classifier_depth=1, classifier_attention_resolutions="4", classifier_num_classes=3)
FLAGS_ARGV = ("--image_size 8 --classifier_width 32 --classifier_depth 1 "
              "--classifier_attention_resolutions 4 --classifier_num_classes 3")


def classifier():
    th.manual_seed(0)
    return su.create_classifier(**{k: FLAGS[k] for k in su.CLASSIFIER_FLAG_KEYS})


@functools.lru_cache(maxsize=None)
def upstream_classifiers():
    weights = redraw.upstream_weights("guided_classifier_small")
    weights.update(redraw.upstream_weights("guided_classifier_spatial"))
    return weights


def classifier_step(d, step=3, opt_holds_weights=False):
    """A complete step of a classifier run: model{step}.pt (kind classifier), opt{step}.pt, the
    manifest; with ``opt_holds_weights`` the opt file holds the classifier's weights (the
    upstream multi-rank mix-up)."""
    model = classifier()
    opt = th.optim.AdamW(model.parameters(), lr=1e-3)
    model(th.randn(2, 3, 8, 8), th.tensor([0, 5])).sum().backward()
    opt.step()
    d.mkdir(exist_ok=True)
    named = named_optimizer_state(opt, list(model.named_parameters()))
    opt_payload = (model.state_dict() if opt_holds_weights else
                   ckpt.opt_payload(step, named, {"step": step}))
    run_dir.save_step(d, step, {
        ckpt.model_filename(step): ckpt.classifier_payload(step, model.state_dict(), FLAGS),
        ckpt.opt_filename(step): opt_payload,
    })
    return d


@pytest.mark.parametrize("name", ["classifier_attention", "classifier_adaptive",
                                  "classifier_spatial", "classifier_spatial_v2"])
def test_upstreams_raw_classifier_state_dicts_classify_as_classifiers(name):
    sd = upstream_classifiers()[name]
    kind, notes = ckpt.classify(sd)
    assert kind == "classifier"
    assert notes == ["guided-diffusion's noised classifier layout (no output_blocks)"]
    ddp = {"module." + k: v for k, v in sd.items()}
    assert ckpt.classify(ddp) == ("classifier", notes + ["keys carry a DDP `module.` prefix "
                                                         "(stripped)"])


def test_a_unet_state_dict_is_still_a_model():
    sd = redraw.upstream_weights("guided_classifier_small")["diffusion_unet"]
    assert ckpt.classify(sd)[0] == "model"
    assert not ckpt.is_classifier_state(sd)


def test_a_tagged_classifier_file_loads_with_its_flags(tmp_path):
    path = tmp_path / "model000007.pt"
    file_writer.atomic_write(str(path), ckpt.classifier_payload(7, classifier().state_dict(), FLAGS))
    c = ckpt.load_file(str(path))
    assert (c.kind, c.tagged, c.step, c.flags) == ("classifier", True, 7, FLAGS)
    assert ckpt.model_state_from(c).keys() == classifier().state_dict().keys()
    assert ckpt.describe(c) == "noised-classifier weights"
    assert ckpt.slot_of(path) == "model"


def test_inspect_says_what_a_classifier_file_is(tmp_path):
    classifier_step(tmp_path / "run")
    code, out, _ = cli("inspect", tmp_path / "run" / "model000003.pt")
    assert code == 0, out
    assert "kind        classifier, tagged" in out
    assert "flags       --image_size 8" in out and "--classifier_width 32" in out
    raw = tmp_path / "64x64_classifier.pt"
    th.save(upstream_classifiers()["classifier_attention"], raw)
    code, out, _ = cli("inspect", raw)
    assert code == 0, out
    assert "kind        classifier, untagged (legacy/upstream)" in out
    assert "none stored (give the classifier flags" in out


def test_verify_resumes_a_classifier_step_and_explains_an_opt_file_holding_its_weights(tmp_path):
    code, out, _ = cli("verify", classifier_step(tmp_path / "good"))
    assert code == 0, out
    assert "resume: step 3" in out
    code, out, _ = cli("verify", classifier_step(tmp_path / "bad", opt_holds_weights=True))
    assert code == 1
    assert "optimizer slot holds noised-classifier weights (opt000003.pt" in out
    assert "resumable with a fresh optimizer" in out and "resume: step 3" in out


def test_diff_builds_the_classifier_of_the_flags(tmp_path):
    path = classifier_step(tmp_path / "run") / "model000003.pt"
    code, out, _ = cli("diff", path, "--flags", FLAGS_ARGV)
    assert code == 0 and "status      same" in out, out
    code, out, _ = cli("diff", path, "--flags", FLAGS_ARGV.replace("width 32", "width 64"))
    assert code == 1 and "status      DIFFERENT" in out, out


def test_convert_tags_an_upstream_classifier_with_its_flags_and_back_to_raw(tmp_path):
    raw = tmp_path / "src" / "model000010.pt"
    raw.parent.mkdir()
    sd = upstream_classifiers()["classifier_attention"]
    th.save(sd, raw)
    flags = ("--image_size 64 --classifier_width 32 --classifier_depth 1 "
             "--classifier_channel_mult 1,2")
    code, out, err = cli("convert", raw, "--to", "tagged", "--out", tmp_path / "tagged",
                         "--flags", flags)
    assert code == 0, err
    tagged = ckpt.load_file(str(tmp_path / "tagged" / "model000010.pt"))
    assert (tagged.kind, tagged.step) == ("classifier", 10)
    assert tagged.flags["classifier_channel_mult"] == "1,2"
    assert tagged.flags["classifier_num_classes"] == 1000
    code, _, err = cli("convert", tmp_path / "tagged" / "model000010.pt", "--to", "raw",
                       "--out", tmp_path / "raw")
    assert code == 0, err
    back = th.load(tmp_path / "raw" / "model000010.pt", weights_only=True)
    assert back.keys() == sd.keys() and all(th.equal(back[k], sd[k]) for k in sd)
    code, _, err = cli("convert", raw, "--to", "tagged", "--out", tmp_path / "wrong",
                       "--flags", flags.replace("depth 1", "depth 2"))
    assert code == 1 and "does not fit the model of --flags" in err


def test_a_classifier_runs_index_keyed_optimizer_converts_with_the_classifiers_names(tmp_path):
    model = classifier()
    opt = th.optim.AdamW(model.parameters(), lr=1e-3)
    model(th.randn(2, 3, 8, 8), th.tensor([0, 5])).sum().backward()
    opt.step()
    src = tmp_path / "src"
    src.mkdir()
    th.save(model.state_dict(), src / "model000002.pt")
    th.save(opt.state_dict(), src / "opt000002.pt")  # upstream's: keyed by index
    code, _, err = cli("convert", src, "--to", "tagged", "--out", tmp_path / "out",
                       "--flags", FLAGS_ARGV)
    assert code == 0, err
    named = ckpt.load_file(str(tmp_path / "out" / "opt000002.pt")).optimizer
    assert list(named["shapes"]) == [n for n, _ in model.named_parameters()]
    manifest = json.loads((tmp_path / "out" / "manifest000002.json").read_text())
    assert set(manifest["files"]) == {"model000002.pt", "opt000002.pt"}


@pytest.mark.timeout(120)
def test_train_py_on_a_classifier_run_dir_names_the_log_dir_not_resume_checkpoint(tmp_path):
    """Issue 29, item 13: ``train.py --log_dir <a classifier run>`` blamed --resume_checkpoint,
    which was not given."""
    from conftest import run_script, write_images

    run = tmp_path / "clf"
    classifier_step(run)
    proc = run_script("train.py", "--data_dir", write_images(tmp_path / "imgs", n=4),
                      "--log_dir", run, "--image_size", "8", "--num_channels", "32",
                      "--num_res_blocks", "1", "--max_steps", 4, check=False, timeout=100)
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-2000:]
    assert errors[0].startswith(f"error: --log_dir {run}: its newest step (model000003.pt)")
    assert "noised classifier's run (classifier_train.py's)" in errors[0]
    assert "--resume_checkpoint" not in errors[0]
