"""
ADM's evaluator (guided-diffusion ``evaluations/evaluator.py``) in PyTorch and NumPy: FID, sFID,
Inception Score, precision and recall, under ADM's names, with ADM's numbers.

The math (no files, no ranks):

* ``FIDStatistics(mu, sigma).frechet_distance(other)``: ``|mu1 - mu2|^2 + tr(S1) + tr(S2)
  - 2 tr(sqrtm(S1 S2))``, ADM's (TTUR's) code path: ``scipy.linalg.sqrtm`` of the product; when
  that is not finite, ``eps`` (1e-6) added to both diagonals and the root taken again; a complex
  root is accepted when its diagonal's imaginary part is within 1e-3 of 0 (its real part is
  used), else an error. ``method="eigh"`` computes the same trace from the eigenvalues of
  ``sqrt(S1) S2 sqrt(S1)`` (symmetric, so two ``eigh`` instead of a complex Schur form): the
  same figures to ~1e-9 relative on the reference data, 10-40x faster at 2048 features.
* ``compute_statistics(acts)``: ``mu`` the mean in the activations' dtype (float32, as ADM's
  ``np.mean``), ``sigma = np.cov(acts, rowvar=False)`` (float64).
* ``compute_inception_score(logits, split_size=5000)``: ADM's softmax of the logits *without*
  the fc bias (``_create_softmax_graph`` takes only the MatMul weight), in float32, then
  improved-gan's ``exp(mean KL(p(y|x) || p(y)))`` per split of ``split_size``, averaged.
* ``compute_prec_recall(ref_acts, sample_acts)``: ADM's ``ManifoldEstimator`` (k=3, improved
  precision and recall of Kynkaanniemi et al.): the radius of each point is the squared distance
  to its 3rd neighbour within its own set (itself counted at index 0); precision is the share
  of samples inside some reference ball, recall the share of references inside some sample
  ball. Distances as ADM's ``DistanceBlock``: the features cast to float16, squared distances
  ``max(|u|^2 - 2 u.v + |v|^2, 0)`` rounded to float16 when the block is finite in float16, else
  in float32. Rows and columns go in blocks (``row_batch_size`` x ``col_batch_size``) and the
  radii keep a running k+1 smallest per row, so memory is one block whatever the set sizes
  (ADM holds a ``row_batch_size`` x N row of distances: 2 GB for 50k).

Batches and activations (what ``scripts/evaluate.py`` runs; see docs/evaluation.md):
``open_batch`` reads ``arr_0`` of an npz without loading it (memory-mapped when stored, as
``np.savez`` and ADM's reference batches store it; streamed otherwise), ``batch_activations``
splits a batch's images across ranks and gathers the features, cached beside the batch in
``NAME.acts.npz`` (keyed by the batch's size and mtime and the feature network's identity), and
``evaluate`` gives the five figures.
"""
import os
import sys
import time
import warnings
import zipfile

import numpy as np

from .errors import UsageError, UserError

__all__ = [
    "FIDStatistics", "compute_statistics", "compute_inception_score", "compute_prec_recall",
    "ManifoldEstimator", "EvaluationError", "open_batch", "read_statistics",
    "batch_activations", "evaluate",
]


class EvaluationError(UserError):
    """A batch, a weights file or activations that cannot be evaluated (exit 1); the message
    names the file."""


class InvalidFIDException(Exception):
    """ADM's name; kept for code that catches it (never raised: a bad root is an error below)."""


# ----------------------------------------------------------------------------------------------
# FID


def _sqrtm(m):
    """scipy's matrix square root (ADM calls it with disp=False; the root is the same)."""
    from scipy import linalg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # scipy 1.17 deprecates disp
        out = linalg.sqrtm(m, disp=False)
    return out[0] if isinstance(out, tuple) else out


class FIDStatistics:
    """A Gaussian fitted to features: ``mu`` [D], ``sigma`` [D, D]. ``rows``: optional [N, D]
    float64 with ``sigma == rows.T @ rows`` (the centred activations over sqrt(N - 1)), kept by
    compute_statistics when N <= D (a singular covariance) for ``method="auto"``."""

    def __init__(self, mu, sigma, rows=None):
        self.mu = mu
        self.sigma = sigma
        self.rows = rows

    def frechet_distance(self, other, eps=1e-6, method="sqrtm"):
        """
        The Frechet distance between this Gaussian and ``other`` (a float).

        ``method``: "sqrtm", ADM's computation exactly (see the module docstring); "eigh", the
        same trace by symmetric eigendecompositions (faster; negative eigenvalues, the
        numerical noise of a singular product, count 0, as in the real part of ADM's root);
        "auto", "sqrtm" unless a side holds ``rows`` (fewer samples than features): then the
        trace exactly from them (the singular values of ``rows1 @ rows2.T``, or the eigenvalues
        of ``rows @ sigma_other @ rows.T``), where sqrtm of a singular product is noise.
        """
        mu1, mu2 = np.atleast_1d(self.mu), np.atleast_1d(other.mu)
        sigma1, sigma2 = np.atleast_2d(self.sigma), np.atleast_2d(other.sigma)
        if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
            raise ValueError(
                f"the two Gaussians have different widths: mean {mu1.shape} vs {mu2.shape}, "
                f"covariance {sigma1.shape} vs {sigma2.shape}")
        diff = mu1 - mu2
        if method == "auto":
            method = "sqrtm" if self.rows is None and other.rows is None else "rows"
        if method == "sqrtm":
            tr_covmean = _trace_sqrtm_adm(sigma1, sigma2, eps)
        elif method == "eigh":
            tr_covmean = _trace_sqrt_product_eigh(sigma1, sigma2)
        elif method == "rows":
            tr_covmean = _trace_sqrt_product_rows(self, other)
        else:
            raise ValueError(f"method must be 'sqrtm', 'eigh' or 'auto', got {method!r}")
        return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * tr_covmean)


def _trace_sqrtm_adm(sigma1, sigma2, eps):
    covmean = _sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        warnings.warn("fid calculation produces singular product; adding %s to diagonal of cov "
                      "estimates" % eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = _sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            m = np.max(np.abs(covmean.imag))
            raise ValueError("Imaginary component {}".format(m))
        covmean = covmean.real
    return np.trace(covmean)


def _trace_sqrt_product_eigh(sigma1, sigma2):
    """tr(sqrtm(S1 S2)) for symmetric PSD S1, S2: the sum of the roots of the eigenvalues of
    L^T S2 L, S1 = L L^T (Cholesky; for a singular S1, L = V sqrt(w) from its eigh)."""
    from scipy import linalg

    s1 = (sigma1 + sigma1.T) / 2
    try:
        root = linalg.cholesky(s1, lower=True)
    except linalg.LinAlgError:  # not positive definite: a singular covariance
        w, v = linalg.eigh(s1)
        root = v * np.sqrt(np.clip(w, 0, None))
    m = root.T @ sigma2 @ root
    lam = linalg.eigvalsh((m + m.T) / 2, driver="ev")
    return float(np.sqrt(np.clip(lam, 0, None)).sum())


def _trace_sqrt_product_rows(a, b):
    """tr(sqrtm(S1 S2)) where a side has ``rows`` R (S = R^T R): the eigenvalues of S1 S2 that
    are not 0 are those of R1 S2 R1^T, or the squared singular values of R1 R2^T."""
    from scipy import linalg

    if a.rows is not None and b.rows is not None:
        return float(linalg.svdvals(a.rows @ b.rows.T).sum())
    rows, sigma = (a.rows, b.sigma) if a.rows is not None else (b.rows, a.sigma)
    m = rows @ np.atleast_2d(sigma) @ rows.T
    lam = linalg.eigvalsh((m + m.T) / 2)
    return float(np.sqrt(np.clip(lam, 0, None)).sum())


def compute_statistics(activations):
    """ADM's ``Evaluator.compute_statistics``: activations [N, D] -> FIDStatistics (``rows``
    kept when N <= D)."""
    mu = np.mean(activations, axis=0)
    sigma = np.cov(activations, rowvar=False)
    rows = None
    n, d = np.shape(activations)[0], np.shape(activations)[-1]
    if 1 < n <= d:
        x = np.asarray(activations, dtype=np.float64)
        rows = (x - x.mean(axis=0)) / np.sqrt(n - 1)
    return FIDStatistics(mu, sigma, rows)


# ----------------------------------------------------------------------------------------------
# Inception Score


def _softmax32(logits):
    x = np.asarray(logits, dtype=np.float32)
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def compute_inception_score(logits, split_size=5000, batch_size=512):
    """
    ADM's ``compute_inception_score``, from the unbiased logits [N, C] (``pool @ W``, the fc
    weight without its bias): float32 softmax, ``exp(mean_x KL(p(y|x) || p(y)))`` per split of
    ``split_size`` rows, the mean over splits (a float). A probability that underflows to 0
    contributes 0 (its limit), where ADM's ``0 * log 0`` gives NaN.
    """
    logits = np.asarray(logits)
    preds = np.concatenate([_softmax32(logits[i:i + batch_size])
                            for i in range(0, len(logits), batch_size)], axis=0)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i:i + split_size]
        marginal = np.expand_dims(np.mean(part, 0), 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = part * (np.log(part) - np.log(marginal))
        kl = np.where(part > 0, kl, np.float32(0))
        kl = np.mean(np.sum(kl, 1))
        scores.append(np.exp(kl))
    return float(np.mean(scores))


# ----------------------------------------------------------------------------------------------
# Precision and recall


class ManifoldEstimator:
    """
    ADM's ManifoldEstimator (k-NN manifolds of feature vectors), in bounded memory: one
    ``row_batch_size`` x ``col_batch_size`` block of distances at a time. ``fp16``: distances
    rounded to float16 when finite, as ADM's DistanceBlock (False: float32 throughout).
    """

    def __init__(self, row_batch_size=5000, col_batch_size=5000, nhood_sizes=(3,),
                 clamp_to_percentile=None, eps=1e-5, fp16=True):
        self.row_batch_size = row_batch_size
        self.col_batch_size = col_batch_size
        self.nhood_sizes = tuple(nhood_sizes)
        self.num_nhoods = len(self.nhood_sizes)
        self.clamp_to_percentile = clamp_to_percentile
        self.eps = eps
        self.fp16 = fp16

    def _prepare(self, features):
        """(float32 features, their squared norms, the float16-rounded features and norms or
        None when float16 cannot hold them)."""
        import torch as th

        x = th.as_tensor(np.asarray(features, dtype=np.float32))
        n = (x.double() ** 2).sum(1).float()
        if not self.fp16:
            return x, n, None, None
        x16 = x.half()
        if not bool(th.isfinite(x16).all()):
            return x, n, None, None
        x16 = x16.float()
        n16 = (x16.double() ** 2).sum(1).float()
        if not bool(th.isfinite(n16.half()).all()):
            return x, n, None, None
        return x, n, x16, n16

    def _distances(self, a, b, ia, ib):
        """Squared distances [len(ia), len(ib)] between rows ``ia`` of prepared set ``a`` and
        rows ``ib`` of ``b``, as ADM's DistanceBlock: float16 when finite, else float32."""
        import torch as th

        if a[2] is not None and b[2] is not None:
            d = th.clamp(a[3][ia, None] - 2 * (a[2][ia] @ b[2][ib].T) + b[3][None, ib], min=0.0)
            d16 = d.half()
            if bool(th.isfinite(d16).all()):
                return d16.float()
        return th.clamp(a[1][ia, None] - 2 * (a[0][ia] @ b[0][ib].T) + b[1][None, ib], min=0.0)

    def manifold_radii(self, features):
        """[N, K] float32: each row's squared distance to its k-th neighbour (k per nhood)."""
        import torch as th

        x = self._prepare(features)
        num = len(x[0])
        kmax = max(self.nhood_sizes) + 1
        if num < kmax:
            raise ValueError(f"precision/recall with k={kmax - 1} needs at least {kmax} "
                             f"feature vectors, got {num}")
        radii = np.zeros([num, self.num_nhoods], dtype=np.float32)
        for b1 in range(0, num, self.row_batch_size):
            e1 = min(b1 + self.row_batch_size, num)
            best = None
            for b2 in range(0, num, self.col_batch_size):
                e2 = min(b2 + self.col_batch_size, num)
                d = self._distances(x, x, slice(b1, e1), slice(b2, e2))
                if best is not None:
                    d = th.cat([best, d], dim=1)
                best = th.topk(d, min(kmax, d.shape[1]), dim=1, largest=False, sorted=True).values
            radii[b1:e1] = best[:, list(self.nhood_sizes)].numpy()
        if self.clamp_to_percentile is not None:
            max_distances = np.percentile(radii, self.clamp_to_percentile, axis=0)
            radii[radii > max_distances] = 0
        return radii

    def evaluate_pr(self, features_1, radii_1, features_2, radii_2):
        """
        (precision [K1], recall [K2]) as float64 arrays: the share of ``features_2`` inside the
        manifold of ``features_1`` (radii_1) and the share of ``features_1`` inside that of
        ``features_2``.
        """
        import torch as th

        x1, x2 = self._prepare(features_1), self._prepare(features_2)
        len_1, len_2 = len(x1[0]), len(x2[0])
        r1, r2 = th.as_tensor(radii_1), th.as_tensor(radii_2)
        status_1 = th.zeros([len_1, r2.shape[1]], dtype=th.bool)
        status_2 = th.zeros([len_2, r1.shape[1]], dtype=th.bool)
        for b1 in range(0, len_1, self.row_batch_size):
            e1 = min(b1 + self.row_batch_size, len_1)
            for b2 in range(0, len_2, self.col_batch_size):
                e2 = min(b2 + self.col_batch_size, len_2)
                d = self._distances(x1, x2, slice(b1, e1), slice(b2, e2))
                for k in range(r2.shape[1]):  # batch_1_in: row inside some ball of set 2
                    status_1[b1:e1, k] |= (d <= r2[b2:e2, k][None, :]).any(dim=1)
                for k in range(r1.shape[1]):  # batch_2_in: column inside some ball of set 1
                    status_2[b2:e2, k] |= (d <= r1[b1:e1, k][:, None]).any(dim=0)
        return (status_2.double().mean(0).numpy(), status_1.double().mean(0).numpy())


def compute_prec_recall(ref_acts, sample_acts, **kwargs):
    """ADM's ``compute_prec_recall``: (precision, recall) floats for [N1, D] and [N2, D] features
    (``kwargs`` go to ManifoldEstimator: block sizes, fp16)."""
    est = ManifoldEstimator(**kwargs)
    radii_1 = est.manifold_radii(ref_acts)
    radii_2 = est.manifold_radii(sample_acts)
    pr = est.evaluate_pr(ref_acts, radii_1, sample_acts, radii_2)
    return float(pr[0][0]), float(pr[1][0])
