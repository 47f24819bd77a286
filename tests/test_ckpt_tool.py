"""The checkpoint doctor CLI: inspect, verify, diff, convert, prune; bad files never crash it."""
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import zipfile

import pytest
import torch as th

from improved_diffusion.ckpt import checkpoint as ckpt
from improved_diffusion.ckpt import run_dir
from improved_diffusion.apps.ckpt_tool import main
from improved_diffusion.ckpt.optim_state import named_optimizer_state

from conftest import FIXTURES, hang_s, run_script

RUN = FIXTURES / "upstream_run_small"
RUN_FLAGS = ("--image_size 32 --num_channels 32 --num_res_blocks 1 --attention_resolutions 16 "
             "--learn_sigma True --diffusion_steps 100 --noise_schedule cosine")


def cli(*argv):
    """Run ckpt_tool.main in-process; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def tree_hash(root):
    """A hash of every name and byte under root (to prove nothing on disk changed)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, root).encode())
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def tiny_model():
    th.manual_seed(0)
    return th.nn.Sequential(th.nn.Linear(4, 8), th.nn.GroupNorm(2, 8), th.nn.Linear(8, 3))


def tiny_opt_state(model):
    opt = th.optim.AdamW(model.parameters(), lr=1e-3)
    model(th.randn(2, 4)).sum().backward()
    opt.step()
    return opt


class MarkerPayload:
    """Unpickling this would create a file (it must never happen)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def bad_corpus(d, marker):
    """Files that are not usable checkpoints, each with the phrase its error must contain."""
    good = io.BytesIO()
    th.save({"w": th.randn(64, 64), "b": th.randn(16)}, good)
    data = good.getvalue()
    files = {}

    def put(name, blob, expect):
        p = d / name
        p.write_bytes(blob)
        files[p] = expect

    put("empty000001.pt", b"", "empty file")
    for cut in (10, 200, len(data) // 2, len(data) - 30):
        put(f"model{cut:06d}.pt", data[:cut], "corrupt|truncated|cannot be loaded")
    put("random000001.pt", os.urandom(4096), "not a torch checkpoint")
    put("pickle000001.pt", pickle.dumps({"x": MarkerPayload(str(marker))}),
        "refuses|not a torch checkpoint")
    zbuf = io.BytesIO()
    th.save({"x": MarkerPayload(str(marker))}, zbuf)
    put("zippickle000001.pt", zbuf.getvalue(), "refuses")
    z = zipfile.ZipFile(io.BytesIO(data))
    rec = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    corrupt = bytearray(data)
    start = rec.header_offset + 100
    corrupt[start:start + 64] = bytes(255 - b for b in corrupt[start:start + 64])
    put("crc000001.pt", bytes(corrupt), "CRC mismatch")
    header = bytearray(data)
    header[rec.header_offset:rec.header_offset + 4] = b"XXXX"
    put("ziphdr000001.pt", bytes(header), "corrupt")
    (d / "adir").mkdir()
    files[d / "adir"] = "is a directory"
    files[d / "missing000001.pt"] = "no such file"
    return files


def test_inspect_on_the_bad_file_corpus_gives_one_line_errors_and_changes_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    marker = tmp_path / "MARKER"
    files = bad_corpus(corpus, marker)
    before = tree_hash(corpus)
    for path, expect in files.items():
        code, out, err = cli("inspect", path)
        assert code == 1, (path, out, err)
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (path, err)
        assert str(path) in lines[0] and re.search(expect, lines[0]), (path, lines[0])
        assert "Traceback" not in err
        code, out, _ = cli("inspect", path, "--json")
        assert code == 1 and json.loads(out)["error"]
    assert not marker.exists()
    assert tree_hash(corpus) == before


@pytest.mark.timeout(120)
def test_inspect_script_on_bad_files_exits_1_without_traceback_or_code_execution(tmp_path):
    marker = tmp_path / "MARKER"
    files = bad_corpus(tmp_path, marker)
    picked = [p for p in files if p.name.startswith(("pickle", "random", "crc", "adir"))]
    before = tree_hash(tmp_path)
    proc = run_script("ckpt.py", "inspect", *picked, check=False, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("error: ")]) == len(picked)
    assert not marker.exists()
    assert tree_hash(tmp_path) == before


def test_inspect_describes_each_upstream_fixture_file():
    code, out, err = cli("inspect", RUN / "opt000010.pt")
    assert code == 0, err
    assert "kind        opt, untagged" in out
    assert "step        10" in out
    assert "index-keyed" in out and "204 with state" in out
    assert "status      ok" in out
    code, out, _ = cli("inspect", RUN / "model000010.pt", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["kind"] == "model" and rep["tagged"] is False
    assert rep["step"] == 10 and rep["tensors"] == 204 and rep["dtypes"] == {"float32": 204}
    assert rep["parameters"] == sum(
        t.numel() for t in th.load(RUN / "model000010.pt", weights_only=True).values())
    assert rep["size"] == os.path.getsize(RUN / "model000010.pt")
    code, out, _ = cli("inspect", RUN / "ema_0.9999_000010.pt", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["kind"] == "ema" and rep["rate"] == "0.9999"


def test_each_kind_in_the_wrong_slot_is_diagnosed(tmp_path):
    model = tiny_model()
    opt = tiny_opt_state(model)
    named = named_optimizer_state(opt, list(model.named_parameters()))
    flags = {"image_size": 8}
    th.save(model.state_dict(), tmp_path / "opt000003.pt")
    th.save(opt.state_dict(), tmp_path / "model000003.pt")
    th.save(ckpt.opt_payload(3, named, {}), tmp_path / "ema_0.99_000003.pt")
    th.save(ckpt.ema_payload(3, "0.99", model.state_dict(), flags), tmp_path / "model000004.pt")
    th.save(ckpt.model_payload(5, model.state_dict(), flags), tmp_path / "model000006.pt")
    th.save({"hello": "world"}, tmp_path / "model000007.pt")
    expect = {
        "opt000003.pt": "optimizer slot holds a model state dict",
        "model000003.pt": "model slot holds optimizer state",
        "ema_0.99_000003.pt": "EMA slot holds optimizer state",
        "model000004.pt": "model slot holds a tagged ema file",
        "model000006.pt": "file name says step 6 but the file holds step 5",
        "model000007.pt": "not a checkpoint this trainer understands",
    }
    before = tree_hash(tmp_path)
    for name, phrase in expect.items():
        code, out, err = cli("inspect", tmp_path / name)
        assert code == 1, (name, out, err)
        problems = [ln for ln in out.splitlines() if ln.strip().startswith("problem")]
        assert problems and phrase in problems[0], (name, out)
        assert "status      PROBLEM" in out
    assert tree_hash(tmp_path) == before


def test_inspect_reports_prefixes_and_flat_fp16_layouts(tmp_path):
    model = tiny_model()
    sd = {"module._orig_mod." + k: v for k, v in model.state_dict().items()}
    th.save(sd, tmp_path / "model000001.pt")
    code, out, _ = cli("inspect", tmp_path / "model000001.pt")
    assert code == 0
    assert "DDP `module.` prefix" in out and "`_orig_mod.` prefix" in out
    n = sum(p.numel() for p in model.parameters())
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    flat = {"state": {0: {"step": th.tensor(3.0), "exp_avg": th.zeros(n),
                          "exp_avg_sq": th.zeros(n)}},
            "param_groups": [dict(group, params=[0])]}
    th.save(flat, tmp_path / "opt000001.pt")
    code, out, _ = cli("inspect", tmp_path / "opt000001.pt")
    assert code == 0
    assert ckpt.LAYOUT_PHRASES[ckpt.LAYOUT_FLAT1] in out
    assert f"parameters  {n:,}" in out


def test_verify_reports_the_upstream_dir_resumable_and_changes_nothing():
    before = tree_hash(RUN)
    code, out, err = cli("verify", RUN)
    assert code == 0, out + err
    assert "step       10  ok" in out and "resume: step 10" in out
    code, out, _ = cli("verify", RUN, "--json")
    rep = json.loads(out)
    assert rep["ok"] and rep["resume_step"] == 10 and rep["steps"][0]["legacy"]
    assert tree_hash(RUN) == before


def test_verify_reads_a_version_1_run_by_its_sha256s_and_a_new_step_beside_it_by_crc32(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "manifest_v1_run", run)  # manifests of format version 1
    for quick in ((), ("--quick",)):
        code, out, err = cli("verify", run, *quick)
        assert code == 0, out + err
        assert "step        2  ok" in out and "step        1  ok" in out
        assert "resume: step 2" in out
    model = tiny_model()
    write_tagged_step(run, 3, model, tiny_opt_state(model))
    manifest = json.loads((run / "manifest000003.json").read_text())
    assert manifest["version"] == 2 and "crc32" in manifest["files"]["opt000003.pt"]
    code, out, _ = cli("verify", run)
    assert code == 0 and out.count("  ok ") == 3 and "resume: step 3" in out

    opt = run / "opt000002.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    opt.write_bytes(bytes(data))
    (run / "manifest000003.json").unlink()
    code, out, _ = cli("verify", run, "--quick")
    assert code == 1 and "resume: step 2" in out  # sizes and manifests only
    code, out, _ = cli("verify", run)
    assert code == 1
    assert "opt000002.pt does not match its sha256 in the manifest (corrupt)" in out
    assert "resume: step 1" in out


def write_tagged_step(d, step, model, opt, save=True):
    files = {
        ckpt.model_filename(step): ckpt.model_payload(step, model.state_dict(), {"image_size": 8}),
        ckpt.opt_filename(step): ckpt.opt_payload(
            step, named_optimizer_state(opt, list(model.named_parameters())), {}),
    }
    if save:
        run_dir.save_step(d, step, files)
    else:
        for name, obj in files.items():
            th.save(obj, d / name)


def test_verify_flags_an_interrupted_save_and_a_model_in_the_opt_slot(tmp_path):
    model = tiny_model()
    opt = tiny_opt_state(model)
    write_tagged_step(tmp_path, 1, model, opt)
    write_tagged_step(tmp_path, 2, model, opt, save=False)  # no manifest: interrupted
    code, out, _ = cli("verify", tmp_path)
    assert code == 1
    assert "NOT resumable" in out and "no manifest" in out and "resume: step 1" in out

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    th.save(model.state_dict(), legacy / "model000005.pt")
    th.save(model.state_dict(), legacy / "opt000005.pt")
    code, out, _ = cli("verify", legacy, "--json")
    rep = json.loads(out)
    assert code == 1 and rep["resume_step"] == 5
    row = rep["steps"][0]
    assert "optimizer slot holds a model state dict" in row["problems"][0]
    assert row["notes"] == ["resumable with a fresh optimizer"]

    code, _, err = cli("verify", tmp_path / "nope")
    assert code == 1 and err.startswith("error: ") and "no such directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("verify", empty)[0] == 1


def test_diff_against_flags_finds_the_differing_flag():
    code, out, _ = cli("diff", RUN / "model000010.pt", "--flags", RUN_FLAGS + " --batch_size 4")
    assert code == 0 and "all 204 keys and shapes match" in out
    code, out, _ = cli("diff", RUN / "model000010.pt", "--flags",
                       RUN_FLAGS.replace("--learn_sigma True", "--learn_sigma False"), "--json")
    rep = json.loads(out)
    assert code == 1 and not rep["missing"] and not rep["unexpected"]
    assert list(rep["reshaped"]) == ["out.2.weight", "out.2.bias"]
    assert rep["likely_flags"][0].startswith("--learn_sigma")
    code, out, _ = cli("diff", RUN / "model000010.pt", "--flags",
                       RUN_FLAGS.replace("attention_resolutions 16", "attention_resolutions 16,8"))
    assert code == 1 and "missing" in out and "--attention_resolutions" in out


def test_diff_against_another_file_and_bad_usage():
    code, out, _ = cli("diff", RUN / "model000010.pt", "--against", RUN / "ema_0.9999_000010.pt")
    assert code == 0 and "match" in out
    code, _, err = cli("diff", RUN / "model000010.pt")
    assert code == 2 and err.count("\n") == 1 and "--flags" in err
    code, _, err = cli("diff", RUN / "model000010.pt", "--flags", "--num_channels many")
    assert code == 2 and "num_channels" in err
    code, _, err = cli("diff", RUN / "opt000010.pt", "--against", RUN / "model000010.pt")
    assert code == 1 and "model file of the same step" in err


def test_bad_usage_exits_2_with_one_line():
    for argv in ([], ["frobnicate"], ["prune", str(RUN), "--keep", "0"], ["inspect"],
                 ["convert", str(RUN), "--to", "tagged"], ["prune", str(RUN), "--keep", "x"]):
        code, out, err = cli(*argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and err.startswith("error: "), (argv, err)


@pytest.mark.timeout(180)
def test_convert_round_trip_upstream_to_tagged_to_raw_loads_in_plain_torch(tmp_path):
    from improved_diffusion.ckpt.optim_state import load_optimizer_state
    from improved_diffusion.script_util import (
        create_model_and_diffusion,
        model_and_diffusion_defaults,
    )

    src = tmp_path / "upstream"
    shutil.copytree(RUN, src)
    before = tree_hash(src)
    code, out, err = cli("convert", src, "--to", "tagged", "--out", tmp_path / "tagged",
                         "--flags", RUN_FLAGS)
    assert code == 0, err
    assert tree_hash(src) == before
    statuses = run_dir.list_steps(tmp_path / "tagged")
    assert statuses[0].step == 10 and statuses[0].complete and not statuses[0].legacy
    tagged_model = ckpt.load_file(tmp_path / "tagged" / "model000010.pt")
    assert tagged_model.tagged and tagged_model.flags["num_channels"] == 32
    tagged_opt = ckpt.load_file(tmp_path / "tagged" / "opt000010.pt")
    assert tagged_opt.optimizer["format"] == "named-v1"

    flags = model_and_diffusion_defaults()
    flags.update(image_size=32, num_channels=32, num_res_blocks=1, attention_resolutions="16",
                 learn_sigma=True, diffusion_steps=100, noise_schedule="cosine")
    model, _ = create_model_and_diffusion(**flags)
    opt = th.optim.AdamW(model.parameters())
    report = load_optimizer_state(opt, tagged_opt.raw, list(model.named_parameters()))
    assert report.complete

    code, _, err = cli("convert", tmp_path / "tagged", "--to", "raw", "--out", tmp_path / "raw")
    assert code == 0, err
    raw_model = th.load(tmp_path / "raw" / "model000010.pt")
    model.load_state_dict(raw_model)
    upstream_sd = th.load(RUN / "model000010.pt", weights_only=True)
    assert all(th.equal(model.state_dict()[k], upstream_sd[k]) for k in upstream_sd)
    model.load_state_dict(th.load(tmp_path / "raw" / "ema_0.9999_000010.pt"))
    opt = th.optim.AdamW(model.parameters())
    opt.load_state_dict(th.load(tmp_path / "raw" / "opt000010.pt"))
    upstream_opt = th.load(RUN / "opt000010.pt", weights_only=True)
    mine = opt.state_dict()
    assert mine["param_groups"] == upstream_opt["param_groups"]
    for i, entry in upstream_opt["state"].items():
        for k, v in entry.items():
            assert th.equal(mine["state"][i][k], v)

    # Converting again into the same place refuses to overwrite, and writes nothing.
    again = tree_hash(tmp_path / "raw")
    code, _, err = cli("convert", tmp_path / "tagged", "--to", "raw", "--out", tmp_path / "raw")
    assert code == 1 and "already exists" in err
    assert tree_hash(tmp_path / "raw") == again
    code, _, err = cli("convert", src, "--to", "raw", "--out", src)
    assert code == 2


def test_convert_with_wrong_flags_is_refused(tmp_path):
    code, _, err = cli("convert", RUN / "model000010.pt", "--to", "tagged", "--out", tmp_path,
                       "--flags", RUN_FLAGS.replace("--num_channels 32", "--num_channels 64"))
    assert code == 1 and "does not fit the model of --flags" in err and "--num_channels" in err
    assert not any(tmp_path.iterdir())


def test_convert_to_safetensors_writes_weights_or_says_how_to_install(tmp_path):
    model = tiny_model()
    th.save(ckpt.model_payload(2, model.state_dict(), {"image_size": 8}),
            tmp_path / "model000002.pt")
    code, out, err = cli("convert", tmp_path / "model000002.pt", "--to", "safetensors",
                         "--out", tmp_path / "st")
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert code == 1 and err.strip().endswith("pip install safetensors")
        assert err.count("\n") == 1
        return
    assert code == 0, err
    loaded = load_file(str(tmp_path / "st" / "model000002.safetensors"))
    assert all(th.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_prune_keeps_the_newest_complete_steps(tmp_path):
    model = tiny_model()
    opt = tiny_opt_state(model)
    for step in (1, 2, 3):
        write_tagged_step(tmp_path, step, model, opt)
    code, out, _ = cli("prune", tmp_path, "--keep", "2", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["remaining_steps"] == [3, 2]
    assert sorted(os.path.basename(p) for p in rep["deleted"]) == [
        "manifest000001.json", "model000001.pt", "opt000001.pt"]
    assert cli("verify", tmp_path)[0] == 0
    code, _, err = cli("prune", tmp_path / "nope", "--keep", "1")
    assert code == 1 and "no such directory" in err


@pytest.mark.timeout(120)
def test_module_entry_point_runs_the_tool():
    from conftest import PY, _run

    proc = _run([PY, "-m", "improved_diffusion.apps.ckpt_tool", "verify", RUN, "--json"], 60,
                check=False)
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["resume_step"] == 10


@pytest.mark.timeout(120)
def test_a_reader_that_left_the_pipe_ends_the_tool_quietly_without_a_traceback(tmp_path):
    """`ckpt.py inspect F | head -1`: once head has gone, a write to the pipe fails (EPIPE)."""
    import subprocess

    from conftest import PY, REPO, child_env

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the tool writes its first line
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.run([PY, REPO / "scripts" / "ckpt.py", "inspect", RUN / "model000010.pt"],
                              stdout=write_end, stderr=err, env=child_env(), timeout=hang_s(60))
    os.close(write_end)
    text = (tmp_path / "err").read_text()
    assert proc.returncode == 1 and "Traceback" not in text and "Error" not in text, text


def test_convert_skips_a_model_state_dict_in_the_opt_slot_and_writes_no_manifest(tmp_path):
    model = tiny_model()
    src = tmp_path / "run"
    src.mkdir()
    th.save(model.state_dict(), src / "model000004.pt")
    th.save(model.state_dict(), src / "opt000004.pt")
    code, out, err = cli("convert", src, "--to", "tagged", "--out", tmp_path / "out")
    assert code == 0, err
    assert "opt000004.pt: the optimizer slot holds a model state dict; not converted" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["model000004.pt"]
    assert not run_dir.list_steps(tmp_path / "out")[0].complete


@pytest.mark.parametrize("fault,expect", [
    ("betas", "param_groups[0]['betas'] is (0.9,), not two numbers"),
    ("shapes", "'shapes' is"),
    ("step", "['step'] is a float32 tensor nan"),
])
def test_inspect_names_what_is_malformed_in_an_optimizer_file(tmp_path, fault, expect):
    model = tiny_model()
    named = named_optimizer_state(tiny_opt_state(model), list(model.named_parameters()))
    if fault == "betas":
        named["param_groups"][0]["betas"] = (0.9,)
    elif fault == "shapes":
        named["shapes"] = list(named["shapes"])
    else:
        next(iter(named["state"].values()))["step"] = th.tensor(float("nan"))
    th.save(ckpt.opt_payload(1, named, {}), tmp_path / "opt000001.pt")
    code, out, err = cli("inspect", tmp_path / "opt000001.pt")
    assert code == 1 and not err, err
    assert f"problem     {tmp_path / 'opt000001.pt'} holds malformed optimizer state: " in out
    assert expect in out


@pytest.mark.timeout(120)
def test_the_flags_md_recipe_runs_in_bash_as_written(tmp_path):
    """Issue 37, item 11: docs/flags.md's recipe pasted inspect's flags as `sample.py ... $F`,
    which hands `--timestep_respacing ''` to the script as two quote characters (exit 2)."""
    import shlex
    import subprocess

    import numpy as np

    from conftest import REPO, child_env
    from test_cfg import tagged_file

    section = (REPO / "docs" / "flags.md").read_text().split("## Flags from a checkpoint")[1]
    recipe = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    path = tagged_file(tmp_path)
    assert "--timestep_respacing ''" in cli("inspect", path)[1]  # what the recipe must carry
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", recipe.replace("FILE", shlex.quote(str(path)))],
        cwd=REPO, env=child_env({"OPENAI_LOGDIR": str(tmp_path / "samples")}), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=hang_s(110),
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "status      same" in proc.stdout  # diff --flags "$F": the flags describe the file
    with np.load(tmp_path / "samples" / "samples_4x8x8x3.npz") as z:
        assert z["arr_0"].shape == (4, 8, 8, 3)
