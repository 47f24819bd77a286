"""checkpoint.py: tagged files, the bad-file corpus, legacy files, save/discover/prune, crashes."""
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import textwrap
import time
import zipfile
import zlib
from collections import OrderedDict

import pytest
import torch as th

from conftest import FIXTURES, run_module_mpi
from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion.ckpt import file_writer as W
from improved_diffusion.ckpt import run_dir as R

UPSTREAM = FIXTURES / "upstream_run_small"


def _sd(seed=0):
    g = th.Generator().manual_seed(seed)
    return OrderedDict([("a.weight", th.randn(4, 3, generator=g)),
                        ("a.bias", th.randn(4, generator=g))])


def _step_files(step, rates=("0.9999",)):
    files = {
        C.model_filename(step): C.model_payload(step, _sd(step), {"image_size": 8}),
        C.opt_filename(step): C.opt_payload(
            step, {"format": "named-v1", "state": {}, "param_groups": []}, {"step": step}),
    }
    for r in rates:
        files[C.ema_filename(r, step)] = C.ema_payload(step, r, _sd(step + 100), {"image_size": 8})
    return files


def _save_steps(d, steps, rates=("0.9999",)):
    for s in steps:
        R.save_step(d, s, _step_files(s, rates))


def _snapshot(d):
    return {p.name: (p.stat().st_size, p.read_bytes() if p.is_file() else None)
            for p in sorted(d.iterdir())}


# ------------------------------------------------------------------------------------------
# names


def test_file_names_follow_upstream_and_parse_step_reads_them_back():
    assert C.model_filename(10) == "model000010.pt"
    assert C.ema_filename("0.9999", 10) == "ema_0.9999_000010.pt"
    assert C.opt_filename(1234567) == "opt1234567.pt"
    assert C.manifest_filename(10) == "manifest000010.json"
    for name in ("model000010.pt", "ema_0.9999_000010.pt", "opt000010.pt", "manifest000010.json"):
        assert C.parse_step(f"/some/dir/{name}") == 10


def test_parse_step_refuses_a_name_without_a_step_instead_of_returning_zero():
    with pytest.raises(C.CheckpointError, match="mymodel.pt: cannot read a step number"):
        C.parse_step("/x/mymodel.pt")


def test_name_info_reads_kind_step_and_rate_from_every_checkpoint_name():
    assert C.name_info("/r/ema_0.9999_000020.pt") == C.NameInfo("ema", 20, "0.9999")
    assert C.name_info("model000020.pt") == C.NameInfo("model", 20)
    assert C.name_info("opt000020.pt").kind == "opt"
    assert C.name_info("manifest000020.json").kind == "manifest"
    assert C.name_info("model000020.pt.tmp-0123456789abcdef") == C.NameInfo("temp", 20)
    assert C.name_info("progress.csv") is None and C.name_info("model.pt") is None


def test_a_step_lists_every_ema_rate_of_that_step_only(tmp_path):
    for name in ("model000020.pt", "ema_0.999_000020.pt", "ema_0.9999_000020.pt",
                 "ema_0.9999_000010.pt"):
        (tmp_path / name).write_bytes(b"x")
    st = next(s for s in R.list_steps(tmp_path) if s.step == 20)
    assert st.ema_paths == {
        "0.999": str(tmp_path / "ema_0.999_000020.pt"),
        "0.9999": str(tmp_path / "ema_0.9999_000020.pt"),
    }


# ------------------------------------------------------------------------------------------
# tagged round trip


def test_tagged_files_round_trip_with_their_step_flags_and_rate(tmp_path):
    _save_steps(tmp_path, [7])
    m = C.load_file(tmp_path / "model000007.pt")
    assert (m.kind, m.tagged, m.step, m.flags) == ("model", True, 7, {"image_size": 8})
    assert all(th.equal(m.state_dict[k], _sd(7)[k]) for k in _sd(7))
    e = C.load_file(tmp_path / "ema_0.9999_000007.pt")
    assert (e.kind, e.rate_str, e.raw["rate"]) == ("ema", "0.9999", 0.9999)
    o = C.load_file(tmp_path / "opt000007.pt")
    assert (o.kind, o.trainer, o.optimizer["format"]) == ("opt", {"step": 7}, "named-v1")
    assert o.nbytes == (tmp_path / "opt000007.pt").stat().st_size


def test_a_file_from_a_newer_format_version_is_refused(tmp_path):
    obj = C.model_payload(1, _sd(), {})
    obj["version"] = C.VERSION + 1
    th.save(obj, tmp_path / "model000001.pt")
    with pytest.raises(C.CheckpointError, match="model000001.pt: checkpoint format version 2"):
        C.load_file(tmp_path / "model000001.pt")


# ------------------------------------------------------------------------------------------
# the bad-file corpus


class _WritesMarker:
    """Unpickling this calls open(marker, "w"): loading it must never create the marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _good_bytes():
    buf = io.BytesIO()
    th.save(C.model_payload(5, _sd(), {"image_size": 8}), buf)
    return buf.getvalue()


def _corrupt_zip_record(data):
    """Overwrite the local header of the tensor data record."""
    info = [i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()
            if i.filename.endswith("data/0")][0]
    bad = bytearray(data)
    bad[info.header_offset:info.header_offset + 4] = b"XXXX"
    return bytes(bad)


def _corrupt_pickle_record(data):
    info = [i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()
            if i.filename.endswith("data.pkl")][0]
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    bad = bytearray(data)
    bad[start + 20:start + 40] = b"\xff" * 20
    return bytes(bad)


def _marker_pickle(marker, legacy):
    buf = io.BytesIO()
    th.save({"state_dict": _WritesMarker(str(marker))}, buf,
            _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


GOOD = _good_bytes()
_REFUSED = r"holds pickled code/objects \(io.open\) .* nothing in it was executed"
BAD_FILES = {
    "empty": (lambda m: b"", "empty file"),
    "truncated_at_1": (lambda m: GOOD[:1], "not a torch checkpoint"),
    "truncated_at_64": (lambda m: GOOD[:64], "truncated or corrupt"),
    "truncated_at_half": (lambda m: GOOD[:len(GOOD) // 2], "truncated or corrupt"),
    "truncated_at_end_minus_1": (lambda m: GOOD[:-1], "truncated or corrupt"),
    "random_bytes": (lambda m: random.Random(0).randbytes(4096), "not a torch checkpoint"),
    "corrupt_zip_record": (lambda m: _corrupt_zip_record(GOOD), "truncated or corrupt"),
    "corrupt_pickle_record": (lambda m: _corrupt_pickle_record(GOOD), "not a torch checkpoint"),
    "pickle_with_code_zip": (lambda m: _marker_pickle(m, legacy=False), _REFUSED),
    "pickle_with_code_legacy": (lambda m: _marker_pickle(m, legacy=True), _REFUSED),
    "raw_pickle_with_code": (lambda m: pickle.dumps(_WritesMarker(str(m)), protocol=2), _REFUSED),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_a_one_line_checkpoint_error_and_changes_nothing(tmp_path, case):
    make, match = BAD_FILES[case]
    marker = tmp_path / "MARKER"
    d = tmp_path / "run"
    d.mkdir()
    f = d / "model000005.pt"
    f.write_bytes(make(marker))
    before = _snapshot(d)
    for load in (lambda: C.load_file(f), lambda: C.load_file(f.read_bytes(), name=str(f)),
                 lambda: C.load_file_collective(f)):
        with pytest.raises(C.CheckpointError, match=match) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and str(f) in msg
        assert "weights_only=False" not in msg
    assert not marker.exists(), "loading a checkpoint ran code from it"
    assert _snapshot(d) == before


def test_the_marker_payload_really_would_run_code_when_unpickled_unsafely(tmp_path):
    marker = tmp_path / "proof"
    pickle.loads(pickle.dumps(_WritesMarker(str(marker)))).close()
    assert marker.exists()


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_missing_path_or_a_directory_is_a_one_line_checkpoint_error(tmp_path, what):
    p = tmp_path / "model000005.pt"
    if what == "directory":
        p.mkdir()
    match = "no such file" if what == "missing" else "is a directory"
    for load in (C.load_file, C.load_file_collective):
        with pytest.raises(C.CheckpointError, match=f"model000005.pt: {match}") as e:
            load(p)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------
# legacy (upstream) files


def test_upstream_run_files_classify_as_model_ema_and_opt():
    m = C.load_file(UPSTREAM / "model000010.pt")
    assert (m.kind, m.tagged, m.step) == ("model", False, 10)
    assert len(m.state_dict) == 204 and "time_embed.0.weight" in m.state_dict
    e = C.load_file(UPSTREAM / "ema_0.9999_000010.pt")
    assert (e.kind, e.tagged, e.step, e.rate_str) == ("ema", False, 10, "0.9999")
    o = C.load_file(UPSTREAM / "opt000010.pt")
    assert (o.kind, o.tagged, o.step) == ("opt", False, 10)
    assert len(o.optimizer["param_groups"]) == 1 and len(o.optimizer["state"]) == 204
    assert not any("flattened" in n for n in o.notes)


def test_a_model_state_dict_in_the_opt_slot_is_classified_as_a_model():
    raw = th.load(UPSTREAM / "model000010.pt", weights_only=True)
    kind, _ = C.classify(raw)
    assert kind == "model"
    ck = C.load_file(UPSTREAM / "model000010.pt", name="opt000010.pt")
    assert ck.kind == "model" and C.describe(ck) == "a model state dict"


@pytest.mark.parametrize("prefix, note", [("module.", "DDP `module.` prefix"),
                                          ("_orig_mod.", "torch.compile `_orig_mod.` prefix")])
def test_prefixed_state_dicts_are_stripped_and_noted(prefix, note):
    sd = OrderedDict((prefix + k, v) for k, v in _sd().items())
    kind, notes = C.classify(sd)
    assert kind == "model" and any(note in n for n in notes)
    stripped, notes = C.strip_prefixes(sd)
    assert list(stripped) == list(_sd()) and len(notes) == 1


def test_both_prefixes_are_stripped_together():
    sd = OrderedDict(("module._orig_mod." + k, v) for k, v in _sd().items())
    stripped, notes = C.strip_prefixes(sd)
    assert list(stripped) == list(_sd()) and len(notes) == 2


def test_combined_dicts_give_model_and_ema_weights(tmp_path):
    obj = {"model": {"module." + k: v for k, v in _sd(1).items()}, "ema": _sd(2),
           "opt": {"state": {}, "param_groups": [{"params": [0, 1]}]}, "args": {"lr": 1.0}}
    th.save(obj, tmp_path / "0001000.pt")
    ck = C.load_file(tmp_path / "0001000.pt")
    assert ck.kind == "combined" and any("model, ema, opt" in n for n in ck.notes)
    assert th.equal(C.model_state_from(ck)["a.weight"], _sd(1)["a.weight"])
    assert th.equal(C.model_state_from(ck, "ema")["a.weight"], _sd(2)["a.weight"])
    assert ck.optimizer is obj["opt"] or ck.optimizer["param_groups"] == obj["opt"]["param_groups"]


def test_model_state_from_an_optimizer_file_is_a_clear_error():
    ck = C.load_file(UPSTREAM / "opt000010.pt")
    with pytest.raises(C.CheckpointError, match="opt000010.pt: holds optimizer state, not model"):
        C.model_state_from(ck)


def _adam_entry(*shape):
    return {"step": th.tensor(3.0), "exp_avg": th.zeros(*shape), "exp_avg_sq": th.zeros(*shape)}


@pytest.mark.parametrize("layout,shapes", [
    (C.LAYOUT_FLAT1, [(1000,)]),           # improved-diffusion: one flat master param
    (C.LAYOUT_FLAT2, [(400,), (1, 600)]),  # guided-diffusion: [N1] (ndim <= 1), then [1, N2]
    (C.LAYOUT_INDEXED, [(5, 3), (5,)]),    # a plain model of two parameters
])
def test_optimizer_layouts_are_detected_once_and_named_by_one_phrase(layout, shapes):
    opt = {"state": {i: _adam_entry(*s) for i, s in enumerate(shapes)},
           "param_groups": [{"lr": 1e-4, "params": list(range(len(shapes)))}]}
    assert C.opt_layout(opt) == layout
    kind, notes = C.classify(opt)
    assert kind == "opt"
    flat = [n for n in notes if "flattened fp16" in n]
    assert flat == ([] if layout == C.LAYOUT_INDEXED else
                    [f"optimizer layout: {C.LAYOUT_PHRASES[layout]}"])
    # knowing the model has as many parameters, even a flat-looking payload is index-keyed
    assert C.opt_layout(opt, n_params=len(shapes)) == C.LAYOUT_INDEXED


def test_unknown_objects_classify_as_unknown():
    assert C.classify([1, 2])[0] == "unknown"
    assert C.classify({})[0] == "unknown"
    assert C.classify({"foo": 1, "bar": "x"})[0] == "unknown"


# ------------------------------------------------------------------------------------------
# DiT's train.py files: {step:07d}.pt = {"model", "ema", "opt", "args": argparse.Namespace}


def _dit_args(**extra):
    import argparse

    return argparse.Namespace(data_path="/data", results_dir="results", model="DiT-XL/2",
                              image_size=256, num_classes=1000, epochs=1400, **extra)


def _dit_file(path, args, model=None):
    th.save({"model": _sd(1) if model is None else model, "ema": _sd(2),
             "opt": {"state": {}, "param_groups": [{"params": [0, 1], "lr": 1e-4}]},
             "args": args}, path)
    return path


def test_dits_names_carry_the_step_and_a_dit_dir_lists_its_steps(tmp_path):
    assert C.name_info("results/000-DiT-XL-2/checkpoints/0400000.pt") == C.NameInfo(
        "combined", 400000)
    assert C.parse_step("checkpoints/0400000.pt") == 400000
    assert C.name_info("400.pt") is None  # DiT writes 7 digits at least
    for step in (50, 100):
        _dit_file(tmp_path / f"{step:07d}.pt", _dit_args())
    (tmp_path / "0000150.pt").write_bytes(b"")  # an interrupted torch.save
    steps = R.list_steps(tmp_path)
    assert [(st.step, st.complete, st.legacy) for st in steps] == [
        (150, False, True), (100, True, True), (50, True, True)]
    plan = R.plan_resume(tmp_path / "log", tmp_path)
    assert (plan.step, os.path.basename(plan.model)) == (100, "0000100.pt")


def test_dits_args_namespace_is_read_as_data_without_constructing_it(tmp_path, monkeypatch):
    import argparse

    path = _dit_file(tmp_path / "0400000.pt", _dit_args())
    made = []  # a real Namespace would be built through this (unpickling's BUILD): never
    monkeypatch.setattr(argparse.Namespace, "__setstate__", made.append, raising=False)
    for ck in (C.load_file(path), C.load_file(path.read_bytes(), name=str(path)),
               C.load_file_collective(path)):
        assert (ck.kind, ck.step) == ("combined", 400000)
        assert type(ck.raw["args"]) is dict
        assert ck.raw["args"] == {"data_path": "/data", "results_dir": "results",
                                  "model": "DiT-XL/2", "image_size": 256, "num_classes": 1000,
                                  "epochs": 1400}
        assert any("args: a pickled argparse.Namespace, read as its 6 fields" in n
                   for n in ck.notes)
        assert th.equal(C.model_state_from(ck, "ema")["a.weight"], _sd(2)["a.weight"])
        assert ck.optimizer["param_groups"][0]["params"] == [0, 1]
        assert (ck.flags["arch"], ck.flags["image_size"], ck.flags["in_channels"]) == (
            "DiT-XL/2", 32, 4)  # DiT trains on 8x smaller VAE latents
    assert made == []


def test_code_pickled_in_dits_args_is_skipped_and_named_never_run(tmp_path):
    marker = tmp_path / "MARKER"
    path = _dit_file(tmp_path / "0000010.pt", _dit_args(hook=_WritesMarker(str(marker))))
    ck = C.load_file(path)
    assert not marker.exists(), "loading a checkpoint ran code from it"
    assert ck.raw["args"]["hook"] is None and ck.raw["args"]["model"] == "DiT-XL/2"
    assert "args.hook: a pickled io.open object, skipped (safe loading constructs no objects)" \
        in ck.notes


@pytest.mark.parametrize("where", ["model", "opt", "top"])
def test_pickled_objects_in_the_weights_or_outside_a_combined_dict_are_refused(tmp_path, where):
    marker = tmp_path / "MARKER"
    hook = _WritesMarker(str(marker))
    path = tmp_path / "0000010.pt"
    if where == "model":
        _dit_file(path, _dit_args(), model={"a.weight": th.zeros(1), "b": hook})
    elif where == "opt":
        th.save({"model": _sd(1), "opt": {"state": {0: {"x": hook}}, "param_groups": []}}, path)
    else:
        th.save(_dit_args(), path)
    with pytest.raises(C.CheckpointError, match=r"0000010.pt: holds pickled code/objects \("
                                                r"(io.open|argparse.Namespace)\) .*nothing in it "
                                                r"was executed"):
        C.load_file(path)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------
# save, discover


def _recording(real, placed):
    """os.link/os.replace/os.rename that also appends (source name, target name) to ``placed``."""
    def op(src, dst, *args, **kwargs):
        result = real(src, dst, *args, **kwargs)
        placed.append((os.path.basename(src), os.path.basename(dst)))
        return result
    return op


def test_save_step_writes_files_then_a_manifest_with_sizes_and_checksums(tmp_path, monkeypatch):
    placed = []  # what each file was renamed (or hard-linked) from and to, in order
    for name in ("link", "replace", "rename"):
        monkeypatch.setattr(os, name, _recording(getattr(os, name), placed))
    _save_steps(tmp_path, [1, 2])
    assert [dst for _, dst in placed] == [*_step_files(1), "manifest000001.json",
                                          *_step_files(2), "manifest000002.json"]
    assert all(src.startswith(dst + ".tmp-") for src, dst in placed)  # never written in place
    man = json.loads((tmp_path / "manifest000002.json").read_text())
    assert man["step"] == 2 and man["version"] == W.MANIFEST_VERSION == 2
    assert set(man["files"]) == {"model000002.pt", "opt000002.pt", "ema_0.9999_000002.pt"}
    for name, info in man["files"].items():
        data = (tmp_path / name).read_bytes()
        assert info == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    steps = R.list_steps(tmp_path)
    assert [s.step for s in steps] == [2, 1] and all(s.complete and not s.legacy for s in steps)
    latest = R.latest_complete_step(tmp_path, warn=pytest.fail)
    assert latest.step == 2 and latest.model_path == str(tmp_path / "model000002.pt")
    assert latest.ema_paths == {"0.9999": str(tmp_path / "ema_0.9999_000002.pt")}
    assert latest.opt_path == str(tmp_path / "opt000002.pt")
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_save_step_never_overwrites_an_existing_file(tmp_path):
    _save_steps(tmp_path, [3])
    before = _snapshot(tmp_path)
    with pytest.raises(C.CheckpointError, match="model000003.pt: already exists"):
        _save_steps(tmp_path, [3])
    assert _snapshot(tmp_path) == before
    with pytest.raises(C.CheckpointError, match="already exists"):
        W.atomic_write(tmp_path / "opt000003.pt", {"x": 1})


def test_an_empty_or_missing_dir_has_no_steps(tmp_path):
    assert R.list_steps(tmp_path / "nope") == []
    assert R.latest_complete_step(tmp_path, warn=pytest.fail) is None


def test_the_upstream_run_dir_is_a_complete_legacy_step():
    st = R.latest_complete_step(UPSTREAM, warn=pytest.fail)
    assert (st.step, st.complete, st.legacy) == (10, True, True)
    assert st.ema_paths == {"0.9999": str(UPSTREAM / "ema_0.9999_000010.pt")}


def test_a_legacy_step_without_opt_file_is_not_resumable(tmp_path):
    shutil.copy(UPSTREAM / "model000010.pt", tmp_path)
    (st,) = R.list_steps(tmp_path)
    assert not st.complete and st.legacy and "opt" in st.problem


def _crash(d, how):
    if how == "missing_file":
        os.unlink(d / "ema_0.9999_000003.pt")
    elif how == "truncated_file":
        with open(d / "opt000003.pt", "r+b") as f:
            f.truncate(100)
    elif how == "no_manifest":
        os.unlink(d / "manifest000003.json")
    elif how == "garbled_manifest":
        (d / "manifest000003.json").write_text("{not json")
    elif how == "only_temp_file":
        for p in d.glob("*000003*"):
            p.unlink()
        (d / "model000003.pt.tmp-0123456789abcdef").write_bytes(GOOD[:100])
        return None
    return 3


@pytest.mark.parametrize("how", ["missing_file", "truncated_file", "no_manifest",
                                 "garbled_manifest", "only_temp_file"])
def test_after_a_crash_the_previous_complete_step_is_chosen_with_a_warning(tmp_path, how):
    _save_steps(tmp_path, [1, 2, 3])
    skipped = _crash(tmp_path, how)
    warnings = []
    st = R.latest_complete_step(tmp_path, warn=warnings.append)
    assert st.step == 2 and st.complete
    if skipped is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "\n" not in warnings[0]
        assert warnings[0].startswith("warning: skipping step 3 in ")


def test_checksum_verification_catches_same_size_corruption(tmp_path):
    _save_steps(tmp_path, [1, 2])
    p = tmp_path / "model000002.pt"
    data = bytearray(p.read_bytes())
    data[-100] ^= 0xFF
    p.write_bytes(bytes(data))
    assert R.latest_complete_step(tmp_path, warn=None).step == 2
    warnings = []
    assert R.latest_complete_step(tmp_path, warn=warnings.append, verify_checksums=True).step == 1
    assert "does not match its crc32 in the manifest (corrupt)" in warnings[0]


def test_a_version_1_manifest_with_sha256s_is_still_read_and_verified(tmp_path):
    _save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        path = tmp_path / f"manifest{step:06d}.json"
        doc = json.loads(path.read_text())
        doc["version"] = 1
        doc["files"] = {n: {"size": (tmp_path / n).stat().st_size,
                            "sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}
                        for n in doc["files"]}
        path.write_text(json.dumps(doc))
    assert R.latest_complete_step(tmp_path, warn=pytest.fail, verify_checksums=True).step == 2
    p = tmp_path / "opt000002.pt"
    data = bytearray(p.read_bytes())
    data[-100] ^= 0xFF
    p.write_bytes(bytes(data))
    warnings = []
    assert R.latest_complete_step(tmp_path, warn=warnings.append, verify_checksums=True).step == 1
    assert "does not match its sha256 in the manifest (corrupt)" in warnings[0]


def test_crc32_combine_is_zlibs_crc_of_the_concatenation():
    rng = random.Random(0)
    for len_a, len_b in [(0, 0), (1, 0), (0, 7), (100, 1), (4096, 65536), (3, 1 << 20)]:
        a, b = rng.randbytes(len_a), rng.randbytes(len_b)
        assert W.crc32_combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)


HEADER = b"PK\x03\x04" + bytes(22) + (4).to_bytes(2, "little") + bytes(2)  # a 4-byte name
DATA = bytes(range(256)) * 512  # 128 KiB


@pytest.mark.parametrize("pieces", [
    [HEADER, b"name", DATA, b"tail"],  # the record's data, then no descriptor
    [HEADER, b"name", DATA, DATA],  # the data in two pieces
    [HEADER, b"name", DATA, b"PK\x07\x08" + bytes(12)],  # a descriptor of another size
    [HEADER, b"name", DATA],  # the data last
    [b"x" * 10, DATA, DATA],  # large writes that are no record's data
])
def test_the_writers_crc_is_the_files_whatever_the_write_pattern(tmp_path, pieces):
    """A record's large data is left to the CRC torch writes after it; any other pattern is
    read back from the file or CRC'd as it passes: the file's CRC-32 either way."""
    path = tmp_path / "f.bin"
    with open(path, "wb") as f, open(path, "rb") as back:
        out = W.ChecksumWriter(f, reread=lambda o, n: os.pread(back.fileno(), n, o))
        for piece in pieces:
            out.write(piece)
        f.flush()
        digest = out.digest()
    data = path.read_bytes()
    assert digest == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_a_torch_file_gets_its_crc_from_the_records_crcs_without_reading_them_back(
        tmp_path, monkeypatch):
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, o: reads.append(n) or real(fd, n, o))
    sd = {f"w{i}": th.randn(20000 + i) for i in range(5)}  # records of 80 KB and more
    sd.update({f"b{i}": th.ones(1) for i in range(1200)})  # a central directory of > 64 KB
    info = W.write_file(str(tmp_path / "model000001.pt"), C.model_payload(1, sd, None))
    data = (tmp_path / "model000001.pt").read_bytes()
    assert info == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"} and reads == []
    assert th.equal(th.load(tmp_path / "model000001.pt", weights_only=True)["state_dict"]["w4"],
                    sd["w4"])


def test_a_large_file_is_handed_to_the_disk_while_it_is_written(tmp_path, monkeypatch):
    """The writer starts the kernel's writeback every WRITEBACK_BYTES (sync_file_range), so that
    the final fsync does not find the whole file still in memory."""
    started = []
    monkeypatch.setattr(W, "sync_file_range",
                        lambda: lambda fd, offset, n, flags: started.append((offset, n, flags)))
    monkeypatch.setattr(W.ChecksumWriter, "WRITEBACK_BYTES", 1 << 20)
    sd = {f"w{i}": th.randn(300000) for i in range(4)}  # 4.8 MB
    W.write_file(str(tmp_path / "model000001.pt"), C.model_payload(1, sd, None))
    assert len(started) >= 4 and all(flags == 2 for _, _, flags in started)
    assert [o for o, _, _ in started] == [0] + [o + n for o, n, _ in started[:-1]]  # contiguous


# ------------------------------------------------------------------------------------------
# prune


def test_prune_keeps_the_newest_k_complete_steps(tmp_path):
    _save_steps(tmp_path, [1, 2, 3, 4])
    deleted = R.prune(tmp_path, keep=2)
    assert [s.step for s in R.list_steps(tmp_path)] == [4, 3]
    assert len(deleted) == 8
    # the manifest of each pruned step goes first
    assert os.path.basename(deleted[0]).startswith("manifest")


def test_prune_never_leaves_fewer_than_one_complete_step(tmp_path):
    _save_steps(tmp_path, [1, 2, 3])
    _crash(tmp_path, "no_manifest")  # step 3 looks like an interrupted (or ongoing) save
    R.prune(tmp_path, keep=1)
    steps = {s.step: s for s in R.list_steps(tmp_path)}
    assert sorted(steps) == [2, 3] and steps[2].complete and not steps[3].complete
    # keep=0 deletes no step
    assert R.prune(tmp_path, keep=0) == []
    assert R.latest_complete_step(tmp_path, warn=None).step == 2


def test_prune_removes_stale_temp_files_only(tmp_path):
    _save_steps(tmp_path, [1])
    stale = tmp_path / "opt000002.pt.tmp-00112233445566778899aabbccddeeff"
    fresh = tmp_path / "model000002.pt.tmp-ffeeddccbbaa99887766554433221100"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert R.prune(tmp_path, keep=1) == [str(stale)]
    assert fresh.exists() and R.latest_complete_step(tmp_path, warn=None).step == 1


def test_prune_of_an_upstream_dir_keeps_its_only_step(tmp_path):
    for p in UPSTREAM.iterdir():
        shutil.copy(p, tmp_path)
    _save_steps(tmp_path, [20])
    assert R.prune(tmp_path, keep=2) == []
    R.prune(tmp_path, keep=1)
    assert [s.step for s in R.list_steps(tmp_path)] == [20]
    assert (tmp_path / "progress.csv").exists()


# ------------------------------------------------------------------------------------------
# multi-rank


@pytest.mark.timeout(60)
def test_save_step_on_two_ranks_writes_once_and_errors_reach_every_rank(tmp_path):
    code = textwrap.dedent(f"""
        import json, os, sys, torch as th
        from improved_diffusion import dist_util
        from improved_diffusion.ckpt import checkpoint as C, run_dir as R
        dist_util.setup_dist()
        rank = dist_util.get_rank()
        d = {str(tmp_path)!r}
        w = th.full((3,), float(rank))
        files = {{C.model_filename(5): C.model_payload(5, {{"w": w}}, {{}}),
                 C.opt_filename(5): C.opt_payload(5, {{"state": {{}}, "param_groups": []}}, {{}})}}
        R.save_step(d, 5, files)
        ck = C.load_file_collective(os.path.join(d, C.model_filename(5)))
        try:
            R.save_step(d, 5, files)
            err = None
        except C.CheckpointError as e:
            err = str(e)
        try:
            C.load_file_collective(os.path.join(d, "model000005.pt" if rank else "opt000005.pt"))
            err2 = None
        except C.CheckpointError as e:
            err2 = str(e)
        # one write per line, so the two ranks' lines never run together on mpiexec's stdout
        sys.stdout.write("RESULT " + json.dumps(dict(
            rank=rank, w=ck.state_dict["w"].tolist(), err=err, err2=err2,
            step=R.latest_complete_step(d, warn=None).step)) + "\\n")
        sys.stdout.flush()
    """)
    proc = run_module_mpi(2, code, timeout=50)
    res = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            res[r["rank"]] = r
    assert sorted(res) == [0, 1]
    for r in res.values():
        assert r["w"] == [0.0, 0.0, 0.0]  # rank 0's payload, read back by every rank
        assert r["step"] == 5
        assert r["err"] == res[0]["err"] and "model000005.pt: already exists" in r["err"]
        assert r["err2"] == res[0]["err2"] and "different files" in r["err2"]
    assert sorted(os.listdir(tmp_path)) == ["manifest000005.json", "model000005.pt",
                                            "opt000005.pt"]


def test_a_flipped_byte_inside_a_tensor_record_is_caught_by_the_zip_crc(tmp_path):
    """torch.load does not check CRCs: without our check the damaged weights would load."""
    buf = io.BytesIO()
    th.save({"w": th.zeros(256)}, buf)
    data = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        rec = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    h = rec.header_offset  # the local header gives the lengths before the record's data
    name_len = int.from_bytes(data[h + 26:h + 28], "little")
    extra_len = int.from_bytes(data[h + 28:h + 30], "little")
    data[h + 30 + name_len + extra_len + 8] ^= 0xFF
    damaged = tmp_path / "model000001.pt"
    damaged.write_bytes(bytes(data))
    assert th.load(damaged, weights_only=True)["w"].abs().sum() > 0  # loads silently, damaged
    with pytest.raises(C.CheckpointError, match="CRC mismatch"):
        C.load_file(damaged)


def test_a_save_written_in_two_large_pieces_gets_the_files_crc(tmp_path, monkeypatch):
    """A torch.save that hands the file over in two halves (as tests/slow_save_train.py does):
    the checksum is still the file's (it once failed: 'flush of closed file')."""
    def two_halves(obj, f, *args):
        buf = io.BytesIO()
        th.save(obj, buf)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])
        f.write(data[len(data) // 2:])

    monkeypatch.setattr(W.torch_zip, "save", two_halves)  # what writes a .pt file's bytes
    sd = {"w": th.randn(100000)}
    info = W.write_file(str(tmp_path / "model000001.pt"), C.model_payload(1, sd, None))
    data = (tmp_path / "model000001.pt").read_bytes()
    assert info == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
