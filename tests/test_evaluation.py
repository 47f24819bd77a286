"""ADM's evaluator in PyTorch (issue 30): the numbers of guided-diffusion's evaluations/evaluator.py
on its reference activations, the FID Inception network against torch-fidelity's port, and
scripts/evaluate.py end to end with a random-weights Inception on tiny images."""
import json
import os
import time

import numpy as np
import pytest
import torch

import redraw
from conftest import FIXTURES, PY, REPO, _run, run_mpi, write_images

from improved_diffusion import evaluation, inception

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # far faster on 2 loaded cores

ADM = FIXTURES / "adm_evaluator_reference.npz"
NET = FIXTURES / "fid_inception_reference.pt"


@pytest.fixture(scope="module")
def adm():
    """ADM's outputs (the fixture) and its inputs, drawn again from their seeded recipe (float16:
    cast to float32, the exact values ADM's code got)."""
    with np.load(ADM) as z:
        out = {k: z[k] for k in z.files}
    out.update((k, v.astype(np.float32)) for k, v in redraw.adm_inputs().items())
    return out


def rel(a, b):
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------- the metrics


def test_fid_of_the_far_pair_is_adms_to_1e6(adm):
    ref = evaluation.compute_statistics(adm["ref_pool"])
    sample = evaluation.compute_statistics(adm["sample_pool"])
    assert ref.rows is None  # more samples than features
    # "eigh" here: ADM's own sqrtm path (the default) takes up to a minute on 2 loaded cores
    fid = sample.frechet_distance(ref, method="eigh")
    assert rel(fid, float(adm["fid"])) < 1e-6, fid


@pytest.mark.slow
def test_fid_of_the_far_pair_by_adms_sqrtm_path(adm):
    ref = evaluation.compute_statistics(adm["ref_pool"])
    sample = evaluation.compute_statistics(adm["sample_pool"])
    assert rel(sample.frechet_distance(ref), float(adm["fid"])) < 1e-6


def test_sfid_is_adms_to_1e6(adm):
    ref = evaluation.compute_statistics(adm["ref_spatial"])
    sample = evaluation.compute_statistics(adm["sample_spatial"])
    assert rel(sample.frechet_distance(ref, method="eigh"), float(adm["sfid"])) < 1e-6


@pytest.mark.parametrize("method", ["sqrtm", "eigh", "auto"])
def test_fid_of_the_near_pair_survives_the_cancellation(adm, method):
    ref = evaluation.compute_statistics(adm["near_ref"])
    sample = evaluation.compute_statistics(adm["near_sample"])
    fid = sample.frechet_distance(ref, method=method)
    assert rel(fid, float(adm["fid_near"])) < 1e-6, fid
    assert abs(fid - 0.248330) < 1e-6


def test_fid_with_fewer_samples_than_features_is_exact_from_the_rows():
    rng = np.random.default_rng(0)
    a = rng.random((40, 64)).astype(np.float32)
    b = (rng.random((30, 64)) ** 2).astype(np.float32)
    sa, sb = evaluation.compute_statistics(a), evaluation.compute_statistics(b)
    assert sa.rows is not None and sb.rows is not None
    exact = sb.frechet_distance(sa, method="auto")  # singular values of rows_b @ rows_a.T
    # one side as published statistics only (ADM's reference batches carry mu and sigma): the
    # eigenvalues of rows_b @ sigma_a @ rows_b.T, the same trace by another formula
    bare = evaluation.FIDStatistics(sa.mu, sa.sigma)
    assert rel(sb.frechet_distance(bare, method="auto"), exact) < 1e-9
    # the roots of a singular product carry sqrt(eps) noise
    assert rel(sb.frechet_distance(sa, method="eigh"), exact) < 1e-6


def test_fid_refuses_gaussians_of_different_widths():
    a = evaluation.FIDStatistics(np.zeros(3), np.eye(3))
    b = evaluation.FIDStatistics(np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match="different widths"):
        a.frechet_distance(b)


def test_inception_score_is_adms_softmax_without_bias(adm):
    logits = adm["sample_pool"] @ adm["logits_w"]
    assert rel(evaluation.compute_inception_score(logits), float(adm["inception_score"])) < 1e-6
    assert rel(evaluation.compute_inception_score(logits, split_size=500),
               float(adm["inception_score_split_500"])) < 1e-6


def test_inception_score_of_a_probability_that_underflows_is_finite():
    logits = np.array([[0.0, -200.0], [-200.0, 0.0]], dtype=np.float32)
    assert abs(evaluation.compute_inception_score(logits) - 2.0) < 1e-6


def test_precision_recall_of_the_far_pair_within_0005(adm):
    est = evaluation.ManifoldEstimator()
    radii = est.manifold_radii(adm["ref_pool"])[:, 0]
    # float16 distances: ADM's radii to within a float16 rounding
    assert np.max(np.abs(radii - adm["radii_ref_k3"]) / adm["radii_ref_k3"]) < 4e-3
    p, r = evaluation.compute_prec_recall(adm["ref_pool"], adm["sample_pool"])
    assert abs(p - float(adm["precision"])) < 0.005 and abs(r - float(adm["recall"])) < 0.005


def test_precision_recall_do_not_depend_on_the_block_sizes(adm):
    ref, sample = adm["near_ref"], adm["near_sample"]
    whole = evaluation.compute_prec_recall(ref, sample)
    assert abs(whole[0] - float(adm["precision_near"])) < 0.005
    assert abs(whole[1] - float(adm["recall_near"])) < 0.005
    assert evaluation.compute_prec_recall(ref, sample, row_batch_size=1500,
                                          col_batch_size=1100) == whole


# ---------------------------------------------------------------- the network


@pytest.fixture(scope="module")
def net_ref():
    """torch-fidelity's outputs (the fixture), and the weights and images they are of, drawn
    again from their seeded recipes."""
    ref = torch.load(NET, weights_only=True)
    ref["state_dict"] = redraw.inception_state_dict()
    ref.update((f"images_{size}", redraw.inception_images(size)) for size in (32, 64, 256))
    return ref


@pytest.fixture(scope="module")
def weights_file(net_ref, tmp_path_factory):
    """A random-weights Inception file in the published layout (the fixture's weights)."""
    path = tmp_path_factory.mktemp("weights") / "inception_random.pt"
    torch.save(net_ref["state_dict"], path)
    return path


def test_network_matches_torch_fidelitys_port_at_three_sizes(net_ref, weights_file):
    lines = []
    net = inception.load_inception(weights_file, log=lines.append)
    assert net.sha256 in lines[0] and str(weights_file) in lines[0]
    for size in (32, 64, 256):
        images = net_ref[f"images_{size}"].permute(0, 2, 3, 1).numpy()  # NCHW -> NHWC
        pool, spatial, logits = net(images)
        assert pool.shape == (3, 2048) and spatial.shape == (3, 2023) and logits.shape == (3, 1008)
        for ours, name in ((pool, "pool_2048"), (spatial, "spatial_2023"),
                           (logits, "logits_unbiased")):
            ref = net_ref[f"{name}_{size}"]
            err = ((ours - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (size, name, err)


def test_pytorch_fid_layout_without_num_batches_tracked_loads(net_ref, tmp_path):
    sd = {k: v.float() for k, v in net_ref["state_dict"].items()
          if not k.endswith("num_batches_tracked")}
    path = tmp_path / "pt_inception-2015-12-05-6726825d.pth"
    torch.save(sd, path)
    net = inception.load_inception(path)
    assert torch.equal(net.fc.weight, sd["fc.weight"])


def test_weights_of_another_layout_are_one_line_naming_the_file(net_ref, tmp_path):
    sd = dict(net_ref["state_dict"])
    sd["fc.weight"] = sd["fc.weight"][:1000]
    path = tmp_path / "wrong.pt"
    torch.save(sd, path)
    with pytest.raises(inception.InceptionWeightsError, match=r"wrong\.pt.*fc\.weight has shape"):
        inception.load_inception(path)
    torch.save({"model": sd}, path)
    with pytest.raises(inception.InceptionWeightsError, match=r"wrong\.pt.*unexpected keys"):
        inception.load_inception(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(inception.InceptionWeightsError, match=r"wrong\.pt: not a loadable"):
        inception.load_inception(path)


def test_no_weights_says_where_to_get_them(monkeypatch):
    monkeypatch.delenv(inception.WEIGHTS_ENV, raising=False)
    with pytest.raises(inception.InceptionWeightsError) as e:
        inception.load_inception(None)
    msg = str(e.value)
    assert "--inception_weights PATH" in msg and "$ID_INCEPTION_WEIGHTS" in msg
    assert inception.WEIGHTS_URL in msg


# ---------------------------------------------------------------- scripts/evaluate.py


def _load_script(name="evaluate.py"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name[:-3] + "_script", REPO / "scripts" /
                                                  name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def evaluate_script():
    return _load_script()


def run_inproc(script, capsys, *args):
    """scripts/evaluate.py in this process (one rank): (exit code, stdout, stderr)."""
    from improved_diffusion.infra import cli

    capsys.readouterr()
    code = cli.run_main(script.main, [str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def digits():
    """datasets/digits.py (the bundled real digits)."""
    import sys

    sys.path.insert(0, str(REPO / "datasets"))
    import digits

    return digits


@pytest.fixture(scope="module")
def digits_folder(digits, tmp_path_factory):
    """40 real digits as a training folder of 8x8 PNGs (digits.py's names and images)."""
    d = tmp_path_factory.mktemp("digits") / "data"
    d.mkdir()
    x, y = digits.load_real_digits()
    for i in range(40):
        digits.digit_to_image(x[i], size=8).save(d / digits.digit_filename(y[i], i))
    return d


def real_digits(digits, n, start=0, size=8):
    """``n`` of the real digits from ``start`` on, as uint8 [n, size, size, 3]."""
    x, _ = digits.load_real_digits()
    return np.stack([np.asarray(digits.digit_to_image(v, size=size).convert("RGB"))
                     for v in x[start:start + n]])


def write_batch(path, n, size=12, seed=0, **extra):
    rng = np.random.default_rng(seed)
    np.savez(path, arr_0=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), **extra)
    return path


def listing(d):
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir())


FIGURES = ("inception_score", "fid", "sfid", "precision", "recall")
# a tiny train.py run (test_train_eval.py's)
TINY_TRAIN = ["--image_size", "8", "--num_channels", "32", "--num_res_blocks", "1",
              "--attention_resolutions", "", "--diffusion_steps", "10", "--noise_schedule",
              "cosine", "--batch_size", "2", "--log_interval", "2", "--sample_steps", "3",
              "--max_steps", "2"]


def test_evaluate_one_rank_and_two_ranks_agree_and_the_cache_is_reused(
        tmp_path, weights_file, evaluate_script, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        write_batch(d / "ref.npz", 4, size=12, seed=1)
        write_batch(d / "samples_4x16x16x3.npz", 4, size=16, seed=2, arr_1=np.arange(4))
    code, out, err = run_inproc(evaluate_script, capsys, one / "ref.npz",
                                one / "samples_4x16x16x3.npz", "--inception_weights",
                                weights_file, "--json", "--batch_size", 3)
    assert code == 0, err
    first = json.loads(out)
    assert "images/s" in err and "ETA" in err and weights_file.name in err
    assert first["weights_sha256"] in err  # the weights' sha256 is logged
    assert (one / "ref.acts.npz").exists() and (one / "samples_4x16x16x3.acts.npz").exists()
    for k in FIGURES:
        assert np.isfinite(first[k]), first

    proc = run_mpi(2, "evaluate.py", two / "ref.npz", two / "samples_4x16x16x3.npz",
                   "--inception_weights", weights_file, "--json", timeout=240)
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    for k in FIGURES:
        assert abs(second[k] - first[k]) <= 1e-6 * abs(first[k]) + 1e-12, (k, first, second)
    assert proc.stdout.count("note: Inception weights") == 1  # rank 0 alone prints

    # a rerun reads both caches (written by rank 0 of the 2-rank job): nothing recomputed
    before = listing(two)
    code, out, err = run_inproc(evaluate_script, capsys, two / "ref.npz",
                                two / "samples_4x16x16x3.npz", "--inception_weights",
                                weights_file)
    assert code == 0, err
    assert "images/s" not in err and err.count("from ") == 2, err
    assert listing(two) == before
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["Inception Score", "FID", "sFID",
                                                       "Precision", "Recall"]
    assert float(lines[1].split()[-1]) == second["fid"]



class _FakeFeatures:
    name = "fake"
    dims = (3, 2, 1)
    identity = {"features": "fake", "weights_sha256": "abc"}


def test_the_cache_is_keyed_by_size_mtime_content_and_weights(tmp_path):
    path = write_batch(tmp_path / "b.npz", 3)
    batch = evaluation.open_batch(path)
    acts = tuple(np.full((3, d), i, np.float32) for i, d in enumerate(_FakeFeatures.dims))
    feats = _FakeFeatures()
    assert evaluation.write_cache(batch, feats, acts) == str(tmp_path / "b.fake.acts.npz")
    assert all(np.array_equal(a, b) for a, b in zip(evaluation.read_cache(batch, feats), acts))
    other = _FakeFeatures()
    other.identity = {"features": "fake", "weights_sha256": "def"}
    assert evaluation.read_cache(batch, other) is None  # other weights
    os.utime(path, ns=(batch.stat[1] + 10**9, batch.stat[1] + 10**9))
    assert evaluation.read_cache(evaluation.open_batch(path), feats) is None  # touched since
    write_batch(path, 3, seed=9)
    assert evaluation.read_cache(evaluation.open_batch(path), feats) is None  # rewritten
    # other images of the same size, the mtime put back: the zip's CRC-32 tells them apart
    os.utime(path, ns=batch.stat[1:] * 2)
    again = evaluation.open_batch(path)
    assert again.stat == batch.stat and again.members != batch.members
    assert evaluation.read_cache(again, feats) is None


def test_a_compressed_batch_streams_from_the_zip_member(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (7, 5, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "plain.npz", arr_0=images)
    np.savez_compressed(tmp_path / "packed.npz", arr_0=images)
    for name in ("plain.npz", "packed.npz"):
        batch = evaluation.open_batch(tmp_path / name)
        assert (batch._offset is None) == (name == "packed.npz")
        got = np.concatenate([batch.read(i, i + 3) for i in range(0, 7, 3)])
        assert np.array_equal(got, images) and np.array_equal(batch.read(2, 4), images[2:4])
        batch.close()


def test_digits_features_give_the_five_figures(tmp_path, digits_folder, evaluate_script,
                                               capsys):
    # the newcomer's path: a reference batch of the training folder, then the samples scored
    code, out, err = run_inproc(evaluate_script, capsys, "--data_dir", digits_folder,
                                "--image_size", 16, "--num_images", 30, tmp_path / "ref.npz")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'ref.npz'}: 30 images"), err
    write_batch(tmp_path / "samples.npz", 5, size=16, seed=5)
    code, out, err = run_inproc(evaluate_script, capsys, tmp_path / "ref.npz",
                                tmp_path / "samples.npz", "--features", "digits", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert all(np.isfinite(r[k]) for k in FIGURES) and 1.0 <= r["inception_score"] <= 10.0
    assert (tmp_path / "samples.digits.acts.npz").exists()


def test_no_weights_is_one_line_saying_where_to_get_them(tmp_path, evaluate_script, capsys,
                                                          monkeypatch):
    monkeypatch.delenv("ID_INCEPTION_WEIGHTS", raising=False)
    write_batch(tmp_path / "ref.npz", 4)
    write_batch(tmp_path / "samples.npz", 4)
    before = listing(tmp_path)
    code, out, err = run_inproc(evaluate_script, capsys, tmp_path / "ref.npz",
                                tmp_path / "samples.npz")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: no Inception weights")
    assert "--inception_weights PATH" in err and "$ID_INCEPTION_WEIGHTS" in err
    assert inception.WEIGHTS_URL in err
    assert listing(tmp_path) == before


def _bad_ref(kind, d):
    """(ref path, sample path, words the error line must hold) for one kind of bad input."""
    ref, samples = d / "ref.npz", d / "samples.npz"
    write_batch(ref, 4)
    write_batch(samples, 4, seed=1)
    if kind == "latents":
        np.savez(samples, arr_0=np.zeros((4, 4, 8, 8), np.float32))
        return ref, samples, [str(samples), "float32 [4, 4, 8, 8]", "uint8 images [N, H, W, 3]"]
    if kind == "gray":
        np.savez(samples, arr_0=np.zeros((4, 8, 8, 1), np.uint8))
        return ref, samples, [str(samples), "uint8 [4, 8, 8, 1]", "3 channels"]
    if kind == "no_arr_0":
        np.savez(ref, images=np.zeros((4, 8, 8, 3), np.uint8))
        return ref, samples, [str(ref), "no arr_0", "has images"]
    if kind == "stats_width":
        write_batch(ref, 4, mu=np.zeros(16), sigma=np.eye(16))
        return ref, samples, [str(ref), "mu [16]", "another width", "2048"]
    if kind == "one_sample":
        write_batch(samples, 1)
        return ref, samples, [str(samples), "holds 1 image", "at least 2"]
    if kind == "not_npz":
        samples.write_text("hello")
        return ref, samples, [str(samples), "not a readable .npz"]
    if kind == "missing":
        samples.unlink()
        return ref, samples, [str(samples), "no such file"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["latents", "gray", "no_arr_0", "stats_width", "one_sample",
                                  "not_npz", "missing"])
def test_a_bad_batch_is_one_line_naming_the_file_and_nothing_is_written(
        kind, tmp_path, weights_file, evaluate_script, capsys):
    ref, samples, words = _bad_ref(kind, tmp_path)
    before = listing(tmp_path)
    code, out, err = run_inproc(evaluate_script, capsys, ref, samples, "--inception_weights",
                                weights_file)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)
    assert listing(tmp_path) == before


def test_bad_weights_and_nan_activations_are_one_line_and_nothing_is_written(
        tmp_path, net_ref, evaluate_script, capsys):
    write_batch(tmp_path / "ref.npz", 2)
    write_batch(tmp_path / "samples.npz", 2, seed=1)
    sd = dict(net_ref["state_dict"])
    wrong = tmp_path / "wrong_weights.pt"
    torch.save({k: v for k, v in sd.items() if not k.startswith("fc.")}, wrong)
    nan = tmp_path / "nan_weights.pt"
    sd["Conv2d_1a_3x3.bn.running_mean"] = torch.full_like(sd["Conv2d_1a_3x3.bn.running_mean"],
                                                          float("nan"))
    torch.save(sd, nan)
    before = listing(tmp_path)
    for weights, words in ((wrong, ["wrong_weights.pt", "missing keys", "fc.bias"]),
                           (nan, ["ref.npz", "not finite", "nan_weights.pt"])):
        code, out, err = run_inproc(evaluate_script, capsys, tmp_path / "ref.npz",
                                    tmp_path / "samples.npz", "--inception_weights", weights)
        assert code == 1 and out == ""
        error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(error_lines) == 1 and all(w in error_lines[0] for w in words), err
        assert listing(tmp_path) == before


def test_usage_errors_exit_2(tmp_path, evaluate_script, capsys):
    code, _, err = run_inproc(evaluate_script, capsys, "a.npz", "b.npz", "--batch_size", 0)
    assert code == 2 and err.count("\n") == 1 and "--batch_size" in err
    code, _, err = run_inproc(evaluate_script, capsys, "a.npz", "b.npz", "--batch_sise", 4)
    assert code == 2 and "--batch_size" in err


# ---------------------------------------------------------------- issue 37: hostile batches


def _lying_npz(path, compression, claimed=10, held=4, size=8):
    """An npz whose arr_0 header claims ``claimed`` images while its member holds ``held``."""
    import io
    import zipfile

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "|u1", "fortran_order": False, "shape": (claimed, size, size, 3)})
    buf.write(np.zeros((held, size, size, 3), np.uint8).tobytes())
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr("arr_0.npy", buf.getvalue())


HOSTILE = ["claims_more_stored", "claims_more_deflated", "object_statistics", "zero_pixels",
           "nan_statistics"]


def _hostile(kind, d, digits):
    """(the bad batch, words its error line must hold) in ``d``, beside a good ref.npz and
    samples.npz of real digits: the bad one replaces the reference for its statistics, the
    samples otherwise."""
    import zipfile

    d.mkdir(exist_ok=True)
    ref, samples = d / "ref.npz", d / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    np.savez(samples, arr_0=real_digits(digits, 6, start=100))
    if kind.startswith("claims_more"):
        _lying_npz(samples, zipfile.ZIP_STORED if kind.endswith("stored")
                   else zipfile.ZIP_DEFLATED)
        return samples, ["header says uint8 [10, 8, 8, 3]", "only 4 images", "write it again"]
    if kind == "object_statistics":
        np.savez(ref, arr_0=real_digits(digits, 40),
                 mu=np.array([np.zeros(45), None], dtype=object), sigma=np.eye(45))
        return ref, ["mu is stored as an object array", "float arrays"]
    if kind == "zero_pixels":
        np.savez(samples, arr_0=np.zeros((4, 0, 0, 3), np.uint8))
        return samples, ["uint8 [4, 0, 0, 3]", "0x0 pixels"]
    if kind == "nan_statistics":
        np.savez(ref, arr_0=real_digits(digits, 40), mu=np.full(45, np.nan), sigma=np.eye(45))
        return ref, ["mu holds 45 values that are not finite"]
    raise AssertionError(kind)


def _train_with_digits_eval(tmp_path, log, ref, capsys):
    """train.py in this process, evaluating with the digits features against ``ref`` every 2
    steps; returns (exit code, stderr)."""
    capsys.readouterr()
    code = _load_script("train.py").main([str(a) for a in [
        "--data_dir", write_images(tmp_path / "data", n=4), "--log_dir", log, *TINY_TRAIN,
        "--eval_interval", 2, "--eval_ref_batch", ref, "--eval_num_samples", 4,
        "--eval_features", "digits"]])
    return code, capsys.readouterr().err


def _one_error_line(err, words, path):
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in [str(path), *words]:
        assert w in lines[0], (w, lines[0])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_batch_is_one_line_exit_1_in_every_entry_point_and_nothing_is_cached(
        kind, tmp_path, digits, evaluate_script, capsys):
    """Issue 37, item 8: a header that claims more images than stored (a traceback), statistics
    stored as object arrays (a traceback), 0x0 images (figures, exit 0), NaN statistics (`FID:
    nan`, exit 0; phema's `best:` line lost): evaluate.py, train.py --eval_ref_batch and
    `ckpt.py phema --evaluate` each say it in one line, exit 1, and cache nothing."""
    from improved_diffusion.apps import ckpt_tool

    d = tmp_path / "batches"
    bad, words = _hostile(kind, d, digits)
    before = listing(d)
    code, out, err = run_inproc(evaluate_script, capsys, d / "ref.npz", d / "samples.npz",
                                "--features", "digits")
    assert code == 1 and out == "", (out, err)
    _one_error_line(err, words, bad)
    assert listing(d) == before

    # the reference of the other entry points (a bad batch is a bad reference there too)
    if bad.name == "samples.npz":
        os.replace(bad, d / "ref.npz")
        before = listing(d)
    capsys.readouterr()
    code = ckpt_tool.main(["phema", str(tmp_path), "--std", "0.05", "--evaluate",
                           str(d / "ref.npz"), "--features", "digits", "--num_samples", "4"])
    err = capsys.readouterr().err
    assert code == 1, err
    _one_error_line(err, words, d / "ref.npz")
    assert listing(d) == before

    log = tmp_path / "log"
    code, err = _train_with_digits_eval(tmp_path, log, d / "ref.npz", capsys)
    assert code == 1, err
    _one_error_line(err, words, d / "ref.npz")
    assert listing(d) == before and not log.exists()


@pytest.mark.timeout(200)
def test_a_zip_directory_that_claims_more_bytes_than_the_member_holds_is_one_line(
        tmp_path, digits, evaluate_script, capsys):
    """The header and the zip's sizes agree, but the compressed member ends early: the images
    that are not there are found missing while reading, on whichever rank reads them."""
    import struct
    import zipfile

    ref, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    _lying_npz(samples, zipfile.ZIP_DEFLATED)
    data = bytearray(samples.read_bytes())
    claimed = 128 + 10 * 8 * 8 * 3  # the npy header (128 bytes) and 10 images
    for sig, at in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):  # central, local header
        i = data.index(sig) + at
        data[i:i + 4] = struct.pack("<I", claimed)
    samples.write_bytes(bytes(data))
    before = listing(tmp_path)
    code, out, err = run_inproc(evaluate_script, capsys, ref, samples, "--features", "digits")
    assert code == 1 and out == ""
    _one_error_line(err, ["arr_0 ends after 4 of its 10 images"], samples)
    assert listing(tmp_path) == before
    # on 2 ranks rank 0 finds it (images 0-4 of 10), and rank 1 does not wait for it in vain
    proc = run_mpi(2, "evaluate.py", ref, samples, "--features", "digits", "--dist_timeout", 60,
                   timeout=150, check=False)
    assert proc.returncode == 1, proc.stdout
    _one_error_line(proc.stdout, ["arr_0 ends after 4 of its 10 images"], samples)
    assert listing(tmp_path) == before


def test_the_phema_sweep_refuses_a_fid_that_is_not_a_number():
    """The sweep's `best:` line was lost without a word when FIDs were NaN: a width's activations
    or FID that are not finite are one line (EvaluationError) naming the width."""
    from improved_diffusion import phema

    class Features:
        name, dims = "fake", (3, 2, 4)

        def __init__(self, fill):
            self.fill = fill

        def __call__(self, images):
            n = len(images)
            return (np.full((n, 3), self.fill) + np.arange(3 * n).reshape(n, 3) ** 2,
                    np.zeros((n, 2)), np.zeros((n, 4)))

    images = np.zeros((5, 4, 4, 3), np.uint8)
    ref = evaluation.FIDStatistics(np.zeros(3), np.eye(3))
    fid, score = phema.fid_and_is(images, Features(0.0), ref)
    assert np.isfinite(fid) and score == pytest.approx(1.0)
    with pytest.raises(evaluation.EvaluationError, match=r"std 0\.05's samples: the fake "
                                                         r"activations are not finite"):
        phema.fid_and_is(images, Features(np.nan), ref, what="std 0.05's samples")
    with pytest.raises(evaluation.EvaluationError, match=r"the FID is nan, not a number"):
        phema.fid_and_is(images, Features(0.0), evaluation.FIDStatistics(np.full(3, np.nan),
                                                                         np.eye(3)))


def _score(script, capsys, ref, samples, *extra):
    code, out, err = run_inproc(script, capsys, ref, samples, "--features", "digits", "--json",
                                *extra)
    assert code == 0, err
    return json.loads(out), err


def test_a_batch_rewritten_with_the_same_size_and_mtime_is_scored_afresh(
        tmp_path, digits, evaluate_script, capsys):
    """Issue 37, item 12: the cache was keyed by the batch's size and mtime only, so other
    images of the same shape written under the same mtime got the old batch's figures."""
    ref, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    np.savez(samples, arr_0=real_digits(digits, 8, start=100))
    first, _ = _score(evaluate_script, capsys, ref, samples)
    st = samples.stat()
    np.savez(samples, arr_0=real_digits(digits, 8, start=300))  # other digits, the same size
    os.utime(samples, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (samples.stat().st_size, samples.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second, err = _score(evaluate_script, capsys, ref, samples)
    assert f"activations of {samples}: 8 images in" in err  # computed, not read from the cache
    fresh = tmp_path / "fresh"  # the same batches without any cache
    fresh.mkdir()
    for p in (ref, samples):
        (fresh / p.name).write_bytes(p.read_bytes())
    third, _ = _score(evaluate_script, capsys, fresh / "ref.npz", fresh / "samples.npz")
    assert second["fid"] != first["fid"]
    assert all(second[k] == third[k] for k in FIGURES), (second, third)


@pytest.mark.timeout(120)
def test_a_cache_write_killed_midway_leaves_no_file_under_the_caches_name(
        tmp_path, digits, evaluate_script, capsys):
    """Issue 37, item 18 (a promise): the activations cache is written under a temporary name
    and renamed, so a job killed while writing it leaves no half-written NAME.acts.npz (which
    the next run would have to recognise as damaged)."""
    ref, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    np.savez(samples, arr_0=real_digits(digits, 8, start=100))
    kill_midway = f"""
import io, os, runpy, signal, sys
import numpy as np
savez = np.savez
def half_then_killed(file, *args, **kwargs):  # the cache's write: half its bytes, then SIGKILL
    buf = io.BytesIO()
    savez(buf, *args, **kwargs)
    file.write(buf.getvalue()[:len(buf.getvalue()) // 2])
    file.flush()
    os.fsync(file.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
np.savez = half_then_killed
sys.argv = ["evaluate.py", {str(ref)!r}, {str(samples)!r}, "--features", "digits"]
runpy.run_path({str(REPO / "scripts" / "evaluate.py")!r}, run_name="__main__")
"""
    proc = _run([PY, "-c", kill_midway], 90, check=False)
    assert proc.returncode == -9, proc.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.endswith(".acts.npz")], names
    leftovers = [tmp_path / n for n in names if ".acts.npz.tmp" in n]
    assert leftovers, names  # it was killed while writing
    old = time.time() - evaluation.ABANDONED_AFTER_S - 60
    for p in leftovers:  # as a killed write found by a later run
        os.utime(p, (old, old))
    # the next run computes the activations again, caches them whole, and removes what the
    # killed write left (its process is gone)
    first, err = _score(evaluate_script, capsys, ref, samples)
    assert "images in" in err and (tmp_path / "ref.digits.acts.npz").exists()
    assert not [p for p in leftovers if p.exists()], sorted(os.listdir(tmp_path))
    again, err = _score(evaluate_script, capsys, ref, samples)
    assert "images in" not in err and again == first


def test_the_inception_score_of_evaluate_py_is_the_mean_over_adms_splits_of_5000(
        tmp_path, digits, evaluate_script, capsys):
    """Issue 37, item 16 (a promise): ADM's IS is exp(mean KL) per split of 5000 samples,
    averaged; 5003 samples whose last 3 are one image give a second split of IS 1, so the mean
    over splits (about 4.7) is far from the IS of the whole batch (about 8.4)."""
    ref, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    real = real_digits(digits, 1797)
    images = np.concatenate([np.resize(real, (5000,) + real.shape[1:]),
                             np.repeat(real[:1], 3, axis=0)])
    np.savez(samples, arr_0=images)
    r, _ = _score(evaluate_script, capsys, ref, samples, "--batch_size", 1024)
    logits = evaluation.digits_features()(images)[2]
    adm = evaluation.compute_inception_score(logits, split_size=5000)
    assert abs(r["inception_score"] - adm) <= 1e-6 * adm, (r["inception_score"], adm)
    whole = evaluation.compute_inception_score(logits, split_size=len(images))
    assert abs(whole - adm) > 2, (whole, adm)


def test_a_reference_batchs_own_statistics_are_used_as_they_are(tmp_path, digits,
                                                                evaluate_script, capsys):
    """Issue 37, item 17 (a promise): ADM's reference batches carry mu/sigma and mu_s/sigma_s,
    its published statistics; FID and sFID use them, not those of the batch's images."""
    features = evaluation.digits_features()
    other = features(real_digits(digits, 300, start=1000))  # statistics of other digits
    pool, spatial = (evaluation.compute_statistics(a) for a in other[:2])
    ref, samples = tmp_path / "ref.npz", tmp_path / "samples.npz"
    ref_images, sample_images = real_digits(digits, 60), real_digits(digits, 60, start=300)
    np.savez(ref, arr_0=ref_images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu,
             sigma_s=spatial.sigma)
    np.savez(samples, arr_0=sample_images)
    r, _ = _score(evaluate_script, capsys, ref, samples)
    mine, theirs = features(sample_images), features(ref_images)
    for key, i, published in (("fid", 0, pool), ("sfid", 1, spatial)):
        ours = evaluation.compute_statistics(mine[i])
        expected = ours.frechet_distance(evaluation.FIDStatistics(published.mu, published.sigma),
                                         method="auto")
        recomputed = ours.frechet_distance(evaluation.compute_statistics(theirs[i]),
                                           method="auto")
        assert abs(r[key] - expected) <= 1e-6 * expected, (key, r[key], expected)
        assert abs(recomputed - expected) > 0.05 * expected, (key, recomputed, expected)


def _shapes(n, size=16, seed=0):
    """``n`` images of a filled ellipse or rectangle on a flat background: not digits."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        im = Image.new("RGB", (size, size), tuple(int(c) for c in rng.integers(0, 256, 3)))
        x0, y0 = (int(v) for v in rng.integers(0, size // 2, 2))
        box = [x0, y0, x0 + int(rng.integers(3, size // 2)), y0 + int(rng.integers(3, size // 2))]
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (ImageDraw.Draw(im).ellipse if i % 2 else ImageDraw.Draw(im).rectangle)(box, fill=fill)
        out.append(np.asarray(im))
    return np.stack(out)


@pytest.mark.timeout(120)
def test_the_digits_features_refuse_a_reference_that_is_not_digits(tmp_path, evaluate_script,
                                                                  capsys):
    """Issue 37, item 13: `--features digits` on shapes gave FID 1.51 and precision 1.0 without
    a word. The digits classifier's mean confidence on the reference tells: about 0.96 on the
    bundled digits, about 0.2 on shapes; below 0.5 it is one line, exit 1, nothing cached,
    in evaluate.py and in train.py --eval_features digits."""
    d = tmp_path / "batches"
    d.mkdir()
    np.savez(d / "ref.npz", arr_0=_shapes(30))
    np.savez(d / "samples.npz", arr_0=_shapes(20, seed=1))
    code, out, err = run_inproc(evaluate_script, capsys, d / "ref.npz", d / "samples.npz",
                                "--features", "digits")
    assert code == 1 and out == "", out
    words = ["not digits", "0.2", "--features inception"]
    _one_error_line(err, words, d / "ref.npz")
    assert sorted(p.name for p in d.iterdir()) == ["ref.npz", "samples.npz"]

    log = tmp_path / "log"
    code, err = _train_with_digits_eval(tmp_path, log, d / "ref.npz", capsys)
    assert code == 1, err
    _one_error_line(err, words, d / "ref.npz")
    assert sorted(p.name for p in d.iterdir()) == ["ref.npz", "samples.npz"]
    assert not (log / "eval").exists() and not list(log.glob("*.pt"))


# ---------------------------------------------------------------- a reference batch of one's data


def _mixed_folder(d):
    """Images as a user's folder holds them: RGB of another aspect (box-halved, then cropped),
    gray, RGBA, a palette image and a JPEG in a subfolder."""
    from PIL import Image

    rng = np.random.default_rng(3)
    d.mkdir(parents=True)
    (d / "sub").mkdir()
    Image.fromarray(rng.integers(0, 256, (24, 40, 3), np.uint8)).save(d / "a_wide.png")
    Image.fromarray(rng.integers(0, 256, (9, 9), np.uint8), mode="L").save(d / "b_gray.png")
    Image.fromarray(rng.integers(0, 256, (10, 12, 4), np.uint8), mode="RGBA").save(
        d / "c_rgba.png")
    Image.fromarray(rng.integers(0, 256, (30, 17, 3), np.uint8)).convert("P").save(
        d / "d_palette.gif")
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), np.uint8)).save(d / "sub" / "e.jpg")
    return d


@pytest.mark.timeout(120)
def test_a_reference_batch_of_ones_own_folder_holds_the_images_the_training_sees(
        tmp_path, evaluate_script, capsys):
    """Issue 37, item 14: `evaluate.py --data_dir DIR --image_size N REF.npz` writes ADM's
    reference batch (arr_0 uint8 NHWC) of the training folder, each image as train.py's loader
    gives it (image_datasets' own loading and resizing), to the bit."""
    from improved_diffusion import image_datasets

    data, ref = _mixed_folder(tmp_path / "data"), tmp_path / "ref.npz"
    code, out, err = run_inproc(evaluate_script, capsys, "--data_dir", data, "--image_size", 8,
                                ref)
    assert code == 0 and out.strip() == (f"wrote {ref}: 5 images of 8x8 from {data}, as "
                                         "train.py --image_size 8 sees them"), err
    with np.load(ref) as z:
        assert z.files == ["arr_0"]
        images = z["arr_0"]
    assert images.dtype == np.uint8 and images.shape == (5, 8, 8, 3)
    loader = image_datasets.load_data(data_dir=str(data), batch_size=5, image_size=8,
                                      deterministic=True, rank=0, world_size=1, num_workers=0)
    trained, _ = next(iter(loader))  # what train.py --data_dir DATA --image_size 8 trains on
    loader.close()
    as_trained = np.transpose(images.astype(np.float32) / 127.5 - 1, [0, 3, 1, 2])
    assert np.array_equal(as_trained, trained.numpy())
    batch = evaluation.open_batch(ref)
    assert batch._offset is not None and np.array_equal(batch.read(0, 5), images)  # mmap
    batch.close()

    # a seeded subset, in file order
    sub = tmp_path / "sub.npz"
    code, _, err = run_inproc(evaluate_script, capsys, "--data_dir", data, "--image_size", 8,
                              "--num_images", 3, "--seed", 1, sub)
    assert code == 0, err
    with np.load(sub) as z:
        picked = z["arr_0"]
    rows = [i for i in range(5) for j in range(3) if np.array_equal(images[i], picked[j])]
    assert len(rows) == 3 and rows == sorted(rows)

    # refusals: one line, nothing written, nothing overwritten
    latents = tmp_path / "latents"
    latents.mkdir()
    np.save(latents / "x.npy", np.zeros((4, 8, 8), np.float32))
    before = listing(tmp_path)
    for argv, code_, words in [
        (["--data_dir", data, "--image_size", 8, ref], 1, f"{ref}: already exists"),
        (["--data_dir", latents, "--image_size", 8, tmp_path / "l.npz"], 1, "holds latents"),
        (["--data_dir", data, tmp_path / "n.npz"], 2, "--image_size"),
        (["--data_dir", data, "--image_size", 8, "--num_images", 9, tmp_path / "n.npz"], 2,
         "holds only 5 images"),
        (["--data_dir", data, "--image_size", 8, ref, tmp_path / "n.npz"], 2, "one batch"),
        (["--data_dir", data, "--image_size", 8, data / "sub" / "n.npz"], 2, "inside --data_dir"),
        (["--image_size", 8, ref, ref], 2, "--data_dir"),
        ([ref], 2, "REF_BATCH SAMPLE_BATCH"),
    ]:
        got, out, err = run_inproc(evaluate_script, capsys, *argv)
        assert got == code_ and out == "", (argv, err)
        assert err.count("\n") == 1 and words in err, (argv, err)
    assert listing(tmp_path) == before


# ------------------------------------------------- issue 43: batches that must be refused, ranks


def _refused(kind, d, digits):
    """(the bad batch, words its error line must hold) in ``d``, beside a good ref.npz and
    samples.npz of real digits (the digits features: 45 wide)."""
    import struct
    import zipfile

    ref, samples = d / "ref.npz", d / "samples.npz"
    np.savez(ref, arr_0=real_digits(digits, 40))
    np.savez(samples, arr_0=real_digits(digits, 6, start=100))
    if kind == "fortran_order":  # its bytes, read in C order, would be other images
        np.savez(samples, arr_0=np.asfortranarray(real_digits(digits, 6, start=100)))
        return samples, ["uint8 [6, 8, 8, 3] (Fortran order)", "expected uint8 images"]
    if kind == "stored_member_claims_more":  # the zip's sizes agree with the header's 10 images
        _lying_npz(samples, zipfile.ZIP_STORED)
        data = bytearray(samples.read_bytes())
        claimed = 128 + 10 * 8 * 8 * 3
        for sig, at in ((b"PK\x01\x02", 20), (b"PK\x03\x04", 18)):  # compressed, then plain size
            i = data.index(sig) + at
            data[i:i + 8] = struct.pack("<II", claimed, claimed)
        samples.write_bytes(bytes(data))
        return samples, ["header says uint8 [10, 8, 8, 3]", "only 4 images"]
    sigma = np.eye(45)
    if kind == "mu_without_sigma":
        np.savez(ref, arr_0=real_digits(digits, 40), mu=np.zeros(45))
        return ref, ["holds mu but no sigma"]
    if kind == "sigma_s_without_mu_s":
        np.savez(ref, arr_0=real_digits(digits, 40), mu=np.zeros(45), sigma=sigma,
                 sigma_s=sigma)
        return ref, ["holds sigma_s but no mu_s"]
    if kind == "sigma_not_psd":  # FID's sqrtm: "ValueError: Imaginary component"
        sigma[3, 3] = -1.0
        np.savez(ref, arr_0=real_digits(digits, 40), mu=np.zeros(45), sigma=sigma)
        return ref, ["sigma is not positive semi-definite", "-1", "not a covariance matrix"]
    if kind == "sigma_not_symmetric":  # was accepted, and FID computed from it
        sigma[0, 1] = 0.5
        np.savez(ref, arr_0=real_digits(digits, 40), mu=np.zeros(45), sigma=sigma)
        return ref, ["sigma is not symmetric", "not a covariance matrix"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["fortran_order", "stored_member_claims_more",
                                  "mu_without_sigma", "sigma_s_without_mu_s", "sigma_not_psd",
                                  "sigma_not_symmetric"])
def test_a_batch_evaluate_py_cannot_use_is_one_line_naming_it_and_nothing_is_cached(
        kind, tmp_path, digits, evaluate_script, capsys):
    """Issue 43, items 16 and 23: a Fortran-ordered arr_0, a stored member whose zip sizes claim
    more bytes than the file holds, half of a (mu, sigma) pair, a sigma that is not symmetric
    or not positive semi-definite: one line naming the file, exit 1, nothing written."""
    bad, words = _refused(kind, tmp_path, digits)
    before = listing(tmp_path)
    code, out, err = run_inproc(evaluate_script, capsys, tmp_path / "ref.npz",
                                tmp_path / "samples.npz", "--features", "digits")
    assert code == 1 and out == "", (out, err)
    _one_error_line(err, words, bad)
    assert listing(tmp_path) == before


@pytest.mark.timeout(150)
def test_one_file_as_reference_and_samples_on_2_ranks_after_1_rank_cached_it(
        tmp_path, digits, evaluate_script, capsys):
    """Issue 43, item 16: rank 1 took the samples' activations from the reference's, which only
    rank 0 had read from the cache (KeyError: 'ref')."""
    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=real_digits(digits, 12))
    one, _ = _score(evaluate_script, capsys, ref, ref)
    assert (tmp_path / "ref.digits.acts.npz").is_file()  # the cache the 2-rank run reads
    proc = run_mpi(2, "evaluate.py", ref, ref, "--features", "digits", "--json", timeout=120,
                   check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"activations of {ref} from" in proc.stdout
    two = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert two["fid"] == pytest.approx(one["fid"], abs=1e-6) and two["num_samples"] == 12
