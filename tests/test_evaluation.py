"""ADM's evaluator in PyTorch (issue 30): the numbers of guided-diffusion's evaluations/evaluator.py
on its reference activations, the FID Inception network against torch-fidelity's port, and
scripts/evaluate.py end to end with a random-weights Inception on tiny images."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import FIXTURES, REPO, run_mpi

from improved_diffusion import evaluation, inception

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # far faster on 2 loaded cores

ADM = FIXTURES / "adm_evaluator_reference.npz"
NET = FIXTURES / "fid_inception_reference.pt"


@pytest.fixture(scope="module")
def adm():
    with np.load(ADM) as z:
        # the inputs are stored as float16: cast to float32, the exact values ADM's code got
        return {k: (z[k].astype(np.float32) if z[k].dtype == np.float16 else z[k])
                for k in z.files}


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
    return torch.load(NET, weights_only=True)


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


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" /
                                                  "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def evaluate_script():
    return _load_script()


def run_inproc(script, capsys, *args):
    """scripts/evaluate.py in this process (one rank): (exit code, stdout, stderr)."""
    from improved_diffusion import cli

    capsys.readouterr()
    code = cli.run_main(script.main, [str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def write_batch(path, n, size=12, seed=0, **extra):
    rng = np.random.default_rng(seed)
    np.savez(path, arr_0=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), **extra)
    return path


def listing(d):
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir())


FIGURES = ("inception_score", "fid", "sfid", "precision", "recall")


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


def test_the_cache_is_keyed_by_size_mtime_and_weights(tmp_path):
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


def test_digits_features_give_the_five_figures(tmp_path, evaluate_script, capsys):
    write_batch(tmp_path / "ref.npz", 6, size=16, seed=4)
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
