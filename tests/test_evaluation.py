"""ADM's evaluator in PyTorch (issue 30): the numbers of guided-diffusion's evaluations/evaluator.py
on its reference activations, the FID Inception network against torch-fidelity's port, and
scripts/evaluate.py end to end with a random-weights Inception on tiny images."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import FIXTURES, REPO, run_mpi, run_script

from improved_diffusion import evaluation, inception

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
