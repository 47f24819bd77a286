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
  in float32. Rows and columns go in blocks (``row_batch_size`` x ``col_batch_size``, 5000 x
  5000; ADM's are 10000 x 10000, and its float16-or-float32 choice is made per block, so the
  two differ only where some blocks overflow float16) and the radii keep a running k+1
  smallest per row, so memory is one block whatever the set sizes (ADM holds a
  ``row_batch_size`` x N row of distances: 2 GB for 50k).

Batches and activations (what ``scripts/evaluate.py`` runs; see docs/evaluation.md):
``open_batch`` reads ``arr_0`` of an npz without loading it (memory-mapped when stored, as
``np.savez`` and ADM's reference batches store it; streamed otherwise), ``batch_activations``
splits a batch's images across ranks and gathers the features, cached beside the batch in
``NAME.acts.npz`` (keyed by the batch's size, mtime and content, its zip members' CRC-32s, and
the feature network's identity; written atomically), and ``evaluate`` gives the five figures.
A batch is checked when opened: arr_0's header against the bytes stored, images of at least
1x1 pixel, precomputed statistics that are finite real arrays (never object arrays).
A batch path may be an object-store URL (s3://, gs://, az://: ckpt/storage.py): it is read from
a local copy downloaded once per process (its activation cache is not kept across runs), and a
reference batch written to a URL is streamed up once complete.
"""
import hashlib
import os
import sys
import time
import warnings
import zipfile

import numpy as np

from .infra.errors import UsageError, UserError

__all__ = [
    "FIDStatistics", "compute_statistics", "compute_inception_score", "compute_prec_recall",
    "ManifoldEstimator", "EvaluationError", "open_batch", "read_statistics",
    "batch_activations", "evaluate", "write_reference_batch",
]


class EvaluationError(UserError):
    """A batch, a weights file or activations that cannot be evaluated (exit 1); the message
    names the file."""


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
        """(float32 features, their squared norms, the features rounded to float16 (kept as
        float16: half the memory) and their norms, or None when float16 cannot hold them)."""
        import torch as th

        x = th.as_tensor(np.asarray(features, dtype=np.float32))
        n = _squared_norms(x)
        if not self.fp16:
            return x, n, None, None
        x16 = x.half()
        if not bool(th.isfinite(x16).all()):
            return x, n, None, None
        n16 = _squared_norms(x16)
        if not bool(th.isfinite(n16.half()).all()):
            return x, n, None, None
        return x, n, x16, n16

    def _distances(self, a, b, ia, ib):
        """Squared distances [len(ia), len(ib)] between rows ``ia`` of prepared set ``a`` and
        rows ``ib`` of ``b``, as ADM's DistanceBlock: float16 when finite, else float32."""
        import torch as th

        def block(x, nx, y, ny):  # max(|u|^2 - 2 u.v + |v|^2, 0), in place: one block held
            d = x[ia].float() @ y[ib].float().T
            d.mul_(-2).add_(nx[ia, None]).add_(ny[None, ib])
            return d.clamp_(min=0.0)

        if a[2] is not None and b[2] is not None:
            d16 = block(a[2], a[3], b[2], b[3]).half()
            if bool(th.isfinite(d16).all()):
                return d16.float()
            del d16
        return block(a[0], a[1], b[0], b[1])

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
                d = th.topk(d, min(kmax, d.shape[1]), dim=1, largest=False).values
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


def _squared_norms(x, chunk=4096):
    """Row norms squared (float32 [N]), summed in float64 a chunk of rows at a time."""
    import torch as th

    return th.cat([(c.double() ** 2).sum(1).float() for c in th.split(x, chunk)]) if len(x) \
        else th.zeros(0)


def compute_prec_recall(ref_acts, sample_acts, **kwargs):
    """ADM's ``compute_prec_recall``: (precision, recall) floats for [N1, D] and [N2, D] features
    (``kwargs`` go to ManifoldEstimator: block sizes, fp16)."""
    est = ManifoldEstimator(**kwargs)
    radii_1 = est.manifold_radii(ref_acts)
    radii_2 = est.manifold_radii(sample_acts)
    pr = est.evaluate_pr(ref_acts, radii_1, sample_acts, radii_2)
    return float(pr[0][0]), float(pr[1][0])


# ----------------------------------------------------------------------------------------------
# Batches: arr_0 of an npz, read a slice at a time


class Batch:
    """``arr_0`` of an npz (uint8 [N, H, W, 3]) without loading it: memory-mapped when the member
    is stored (``np.savez``, ADM's reference batches), else read from the zip member (a
    ``savez_compressed`` file decompresses up to the slice asked for). ``read(start, stop)``."""

    def __init__(self, path, shape, dtype, offset, member_name, stat, members=()):
        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.num = self.shape[0]
        self.stat = stat  # (size, mtime_ns): part of the cache key (cache_key)
        self.members = tuple(members)  # ((name, CRC-32, size), ...) of the zip: the content key
        self._offset, self._member_name = offset, member_name
        self._map = self._member = self._zip = None
        self._next = 0

    def read(self, start, stop):
        """Images ``start:stop`` as a uint8 array of their own."""
        stop = min(stop, self.num)
        if self._offset is not None:
            if self._map is None:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._offset,
                                      shape=self.shape)
            return np.array(self._map[start:stop])
        per = int(np.prod(self.shape[1:]))
        if self._member is None or start != self._next:
            self.close()
            self._zip = zipfile.ZipFile(self.path)
            self._member = self._zip.open(self._member_name)
            _read_npy_header(self._member)
            self._member.seek(self._member.tell() + start * per)  # forward: decompresses
        data = self._member.read((stop - start) * per)
        self._next = stop
        if len(data) != (stop - start) * per:  # the zip's own sizes lied: a damaged file
            raise EvaluationError(f"{self.path}: arr_0 ends after {start + len(data) // per} of "
                                  f"its {self.num} images; the file is truncated or damaged: "
                                  "write the batch again")
        return np.frombuffer(data, dtype=np.uint8).reshape((stop - start,) + self.shape[1:])

    def close(self):
        if self._member is not None:
            self._member.close()
            self._zip.close()
        self._member = self._zip = None
        self._map = None


def _read_npy_header(f):
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"npy format version {version} is not supported")


def _local_header_size(path, zinfo):
    """Bytes from a zip member's local header to its data (name and extra field included)."""
    import struct

    with open(path, "rb") as f:
        f.seek(zinfo.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return 30 + name_len + extra_len


# ----------------------------------------------------------------------------------------------
# Batches in an object store (s3://, gs://, az://: ckpt/storage.py)

_LOCAL_COPIES = {}  # URL -> this process's local copy of it


def _local_copy(path):
    """``path`` itself when local; for an object-store URL a local copy, downloaded (streamed)
    once per process into a temporary folder removed at exit: memory maps and zip reads need a
    local file. The activation cache of such a batch lives beside the copy, so it is not kept
    across runs. EvaluationError (or the store's one-line StoreUnreachableError) naming the
    URL when it cannot be read. Not collective."""
    import atexit
    import shutil
    import tempfile

    from .infra import storage

    if not storage.is_remote(path):
        return path
    local = _LOCAL_COPIES.get(path)
    if local is not None and os.path.exists(local):
        return local
    storage.check_store(path, "batch")
    folder = tempfile.mkdtemp(prefix="improved-diffusion-batch-")
    atexit.register(shutil.rmtree, folder, True)
    local = os.path.join(folder, storage.basename(path) or "batch.npz")
    try:
        if storage.isdir(path):
            raise EvaluationError(f"{path}: is a directory, not an npz batch")
        with storage.open(path, "rb") as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except FileNotFoundError:
        raise EvaluationError(f"{path}: no such file") from None
    except OSError as e:
        raise EvaluationError(f"{path}: cannot be read from the store ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    _LOCAL_COPIES[path] = local
    return local


def _on_local_copy(fn, path, *args):
    """``fn(local path, *args)`` for the batch at ``path`` (_local_copy); its EvaluationError
    names ``path`` (the URL), not the copy."""
    path = os.fspath(path)
    local = _local_copy(path)
    if local == path:
        return fn(path, *args)
    try:
        return fn(local, *args)
    except EvaluationError as e:
        raise EvaluationError(str(e).replace(local, path)) from None


def open_batch(path, min_images=2):
    """
    The ``arr_0`` of the npz at ``path`` (a local file or an object-store URL: read from a
    local copy, _local_copy) as a Batch, checked: a readable npz holding ``arr_0``,
    uint8 NHWC with 3 channels, images of at least 1x1 pixel, at least ``min_images`` of them,
    as many bytes stored as its header says (stored or compressed), and precomputed statistics,
    if any, that can be used (``_statistics``: loaded, so a few tens of MB for ADM's). One
    line (EvaluationError naming the file) otherwise. Not collective.
    """
    return _on_local_copy(_open_batch, path, min_images)


def _open_batch(path, min_images):
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise EvaluationError(f"{path}: no such file" if not os.path.isdir(path)
                              else f"{path}: is a directory, not an npz batch")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise EvaluationError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") \
            from None
    with zf:
        names = zf.namelist()
        if "arr_0.npy" not in names:
            have = ", ".join(n[:-4] if n.endswith(".npy") else n for n in names) or "nothing"
            raise EvaluationError(f"{path}: holds no arr_0 (has {have}); expected the images "
                                  "as arr_0, uint8 [N, H, W, 3]")
        zinfo = zf.getinfo("arr_0.npy")
        try:
            with zf.open(zinfo) as f:
                shape, fortran, dtype = _read_npy_header(f)
                header_len = f.tell()
        except (ValueError, zipfile.BadZipFile, OSError, EOFError) as e:
            raise EvaluationError(f"{path}: arr_0 is not a readable array ({e})") from None
        members = tuple((i.filename, i.CRC, i.file_size) for i in zf.infolist())
    desc = f"{dtype} [{', '.join(map(str, shape))}]"
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or fortran:
        raise EvaluationError(f"{path}: arr_0 is {desc}{' (Fortran order)' if fortran else ''}; "
                              "expected uint8 images [N, H, W, 3] (NHWC, 3 channels)")
    if shape[1] < 1 or shape[2] < 1:
        raise EvaluationError(f"{path}: arr_0 is {desc}: images of {shape[1]}x{shape[2]} "
                              "pixels; expected uint8 images [N, H, W, 3] with H, W >= 1")
    if shape[0] < min_images:
        raise EvaluationError(f"{path}: holds {shape[0]} image{'s' if shape[0] != 1 else ''}; "
                              f"at least {min_images} are needed")
    st = os.stat(path)
    per = int(np.prod(shape[1:]))
    stored = zinfo.file_size - header_len  # the member's bytes after its npy header
    offset = None
    if zinfo.compress_type == zipfile.ZIP_STORED:
        local = _local_header_size(path, zinfo)
        if local is not None:
            offset = zinfo.header_offset + local + header_len
            stored = min(stored, st.st_size - offset)  # a zip directory that claims too much
    if stored != shape[0] * per:
        held = (f"only {stored // per} image{'s' if stored // per != 1 else ''}"
                if stored < shape[0] * per else f"{stored - shape[0] * per} bytes more")
        raise EvaluationError(f"{path}: arr_0's header says {desc} but the file holds {held}: "
                              "a truncated or damaged batch; write it again")
    _check_statistics(path)
    return Batch(path, shape, dtype, offset, "arr_0.npy", (st.st_size, st.st_mtime_ns), members)


STAT_KEYS = ("mu", "sigma", "mu_s", "sigma_s")


def _load_statistic(z, path, name):
    """The array ``name`` of the open npz ``z`` (of ``path``), a finite real one: EvaluationError
    naming the file otherwise (an object array, which would need pickle to load, included)."""
    try:
        a = z[name]
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise EvaluationError(f"{path}: {name} is not a readable array ({e})") from None
        raise EvaluationError(f"{path}: {name} is stored as an object array, which only "
                              "pickle loads (never done here: a file could run code); store the "
                              "statistics as float arrays (np.savez(..., mu=mu.astype("
                              "np.float64), ...))") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise EvaluationError(f"{path}: {name} is not a readable array ({e})") from None
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise EvaluationError(f"{path}: {name} is {a.dtype}; expected float statistics")
    if not np.isfinite(a).all():
        raise EvaluationError(f"{path}: {name} holds {int(np.size(a) - np.isfinite(a).sum())} "
                              "values that are not finite (NaN or inf): these precomputed "
                              "statistics give no FID; remove them from the batch (its "
                              "activations are then used) or compute them again")
    return a


def _statistics(path):
    """The precomputed statistics the batch at ``path`` holds: {"mu": (mu, sigma), "mu_s":
    (mu_s, sigma_s)} for each pair present, each a finite real array of a Gaussian's shape;
    EvaluationError naming the file otherwise (one of a pair, an object array, NaN, a
    sigma that is not symmetric positive semi-definite: _check_covariance). Not
    collective."""
    out = {}
    with np.load(path) as z:
        files = set(z.files)
        for m, s in (("mu", "sigma"), ("mu_s", "sigma_s")):
            if m not in files and s not in files:
                continue
            if m not in files or s not in files:
                have, lack = (m, s) if m in files else (s, m)
                raise EvaluationError(f"{path}: holds {have} but no {lack}")
            mu, sigma = _load_statistic(z, path, m), _load_statistic(z, path, s)
            d = mu.shape[0] if mu.ndim == 1 else None
            if d is None or sigma.shape != (d, d):
                raise EvaluationError(
                    f"{path}: precomputed statistics {m} {list(mu.shape)} / {s} "
                    f"{list(sigma.shape)} are not a mean [D] and a covariance [D, D]")
            _check_covariance(path, s, sigma)
            out[m] = (mu, sigma)
    return out


# How far a stored covariance may be from symmetric, and below zero its smallest eigenvalue,
# relative to its largest |entry| / |eigenvalue|: rounding (np.cov's, a float32 copy's) stays
# orders of magnitude inside; a matrix beyond is no covariance, and FID's sqrtm of it would be
# complex ("Imaginary component") or a number that means nothing.
COVARIANCE_RTOL = 1e-5
_GOOD_COVARIANCES = set()  # digests of those that passed: a batch's are checked several times


def _check_covariance(path, name, sigma):
    """EvaluationError naming the file unless ``sigma`` (the array ``name`` of ``path``) is
    symmetric and positive semi-definite, to COVARIANCE_RTOL. Not collective."""
    digest = (sigma.shape, str(sigma.dtype),
              hashlib.sha256(np.ascontiguousarray(sigma).tobytes()).digest())
    if digest in _GOOD_COVARIANCES:
        return
    sigma = np.asarray(sigma, np.float64)
    scale = float(np.abs(sigma).max()) if sigma.size else 0.0
    asym = float(np.abs(sigma - sigma.T).max()) if sigma.size else 0.0
    redo = ("not a covariance matrix; compute the statistics again (mu = acts.mean(0), sigma = "
            "np.cov(acts, rowvar=False)) or remove them from the batch (its activations are "
            "then used)")
    if asym > COVARIANCE_RTOL * scale:
        raise EvaluationError(f"{path}: {name} is not symmetric (|{name} - {name}.T| up to "
                              f"{asym:.3g}, |{name}| up to {scale:.3g}): {redo}")
    eig = np.linalg.eigvalsh((sigma + sigma.T) / 2)
    if eig.size and eig[0] < -COVARIANCE_RTOL * float(np.abs(eig).max()):
        raise EvaluationError(f"{path}: {name} is not positive semi-definite (eigenvalues from "
                              f"{eig[0]:.3g} to {eig[-1]:.3g}): {redo}")
    _GOOD_COVARIANCES.add(digest)


def _check_statistics(path):
    """EvaluationError naming the file unless the batch's precomputed statistics, if any, can
    be used (``_statistics``). Not collective."""
    _statistics(path)


def read_statistics(path, pool_dim, spatial_dim):
    """
    The precomputed statistics of a reference batch, as ADM's ``read_statistics`` uses them:
    ``(FIDStatistics(mu, sigma) or None, FIDStatistics(mu_s, sigma_s) or None)``, checked
    (finite real arrays, not object arrays, in pairs) and against the feature widths
    (EvaluationError naming the file otherwise). ``path``: local or an object-store URL. Not
    collective.
    """
    return _on_local_copy(_read_statistics, path, pool_dim, spatial_dim)


def _read_statistics(path, pool_dim, spatial_dim):
    found = _statistics(path)
    out = []
    for (m, s), dim in ((("mu", "sigma"), pool_dim), (("mu_s", "sigma_s"), spatial_dim)):
        if m not in found:
            out.append(None)
            continue
        mu, sigma = found[m]
        if mu.shape != (dim,) or sigma.shape != (dim, dim):
            raise EvaluationError(
                f"{path}: precomputed statistics {m} {list(mu.shape)} / {s} "
                f"{list(sigma.shape)} are of another width than the features ({dim}); "
                "they belong to another feature network")
        out.append(FIDStatistics(mu, sigma))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Feature networks and activations


class InceptionFeatures:
    """The FID Inception as a feature network: images -> (pool, spatial, logits) float32."""

    name = "inception"
    dims = (2048, 2023, 1008)

    def __init__(self, net):
        self.net = net
        self.identity = {"features": "inception", "weights_sha256": net.sha256}

    def __call__(self, images):
        return tuple(t.cpu().numpy() for t in self.net(images))


def digits_features():
    """The demo's digits classifier (datasets/digits.py of the source tree, beside this package)
    as a feature network (``--features digits``); UsageError when the file is not there (an
    installed package without the source tree)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "datasets", "digits.py")
    if not os.path.isfile(path):
        raise UsageError(f"--features digits needs datasets/digits.py of the source tree (not "
                         f"found at {path}); use the Inception features")
    module = sys.modules.get("digits")
    if module is None or os.path.abspath(getattr(module, "__file__", "")) != path:
        spec = importlib.util.spec_from_file_location("digits", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["digits"] = module
    return module.DigitFeatures()


def feature_network(name, inception_weights=None, flag="--features"):
    """The feature network ``name`` ("inception": the FID Inception of ``inception_weights``,
    else $ID_INCEPTION_WEIGHTS, on this rank's device; "digits": digits_features()).
    UsageError for another name; InceptionWeightsError for a missing or wrong weights file.

    Collective: call from all ranks with the same arguments (the weights are read by rank 0).
    """
    from . import dist_util, inception

    if name == "digits":
        return digits_features()
    if name != "inception":
        raise UsageError(f"{flag} {name}: must be one of {', '.join(FEATURES)}")
    net = inception.load_inception(inception_weights, device=dist_util.dev(), log=_note)
    features = InceptionFeatures(net)
    features.weights_path = inception.resolve_weights_path(inception_weights)
    return features


# the feature networks: the FID Inception, the demo's digits classifier
FEATURES = ("inception", "digits")


def cached_activations(path, features, batch_size=64):
    """
    The activations ``(pool, spatial, logits)`` of the reference batch at ``path`` on rank 0
    (None on the other ranks): from its cache (NAME.acts.npz) when that matches, else computed
    across the ranks (batch_activations) and the cache written by rank 0 once they passed
    check_reference. EvaluationError for a bad batch (its precomputed statistics included) or
    a reference ``features`` cannot score against; nothing is cached then.

    Collective: call from all ranks with the same arguments.
    """
    from . import dist_util

    path = os.fspath(path)

    def check():  # the same verdict on every rank
        open_batch(path).close()
        read_statistics(path, *features.dims[:2])

    dist_util.run_on_rank0(check)
    batch = open_batch(path)
    try:
        found = {}

        def probe():
            found["acts"] = read_cache(batch, features)
            return found["acts"] is not None

        if dist_util.run_on_rank0(probe):
            _note(f"activations of {path} from {cache_path(path, features)}")
            acts, fresh = found.get("acts"), False
        else:
            acts, fresh = batch_activations(batch, features, batch_size), True

        def accept():
            check_reference(path, features, acts)
            if fresh:
                write_cache(batch, features, acts)

        dist_util.run_on_rank0(accept)
        return acts
    finally:
        batch.close()


# The digits classifier's mean confidence (its largest class probability) on a reference batch
# below which its figures are refused: about 0.96 on the bundled digits at any size, 0.2-0.26 on
# noise, shapes, blobs, gradients, flat images and inverted digits (docs/evaluation.md).
DIGITS_MIN_CONFIDENCE = 0.5


def check_reference(path, features, acts):
    """
    EvaluationError naming the batch when ``features`` cannot give meaningful figures against
    the reference at ``path`` of activations ``acts``: the digits features (the demo's, a
    classifier of 8x8 digits) on images that are not digits, told by the classifier's mean
    confidence on the batch (below DIGITS_MIN_CONFIDENCE). The Inception takes any images. Not
    collective.
    """
    if features.name != "digits":
        return
    confidence = float(np.mean(np.exp(np.max(acts[2], axis=1))))  # logits: log probabilities
    if confidence < DIGITS_MIN_CONFIDENCE:
        raise EvaluationError(
            f"{path}: not digits: the digits features' classifier is {confidence:.2f} sure of "
            f"these images on average (about 0.96 on the bundled digits, 0.2 on other images; "
            f"{DIGITS_MIN_CONFIDENCE} needed), so their FID, precision and recall would mean "
            "nothing; use the Inception features (--features inception; train.py: "
            "--eval_features inception)")


def _note(message):
    from . import dist_util

    if dist_util.get_rank() == 0:
        sys.stderr.write(f"note: {message}\n")
        sys.stderr.flush()


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def batch_activations(batch, features, batch_size=64, progress_every=10.0, out=None):
    """
    The activations ``(pool, spatial, logits)`` of every image of ``batch`` (float32 [N, d] each,
    in the batch's order) on rank 0, None on the other ranks: each rank computes a contiguous
    share of the images, ``batch_size`` at a time, and rank 0 gathers them. Rank 0 writes a
    progress line (images/s, ETA) to ``out`` (stderr) after the first batch, then every
    ``progress_every`` seconds, and one when done. Non-finite activations, or images that
    cannot be read (a batch damaged after it was opened), on any rank: EvaluationError on every
    rank.

    Collective: call from all ranks with the same arguments.
    """
    import torch as th

    from . import dist_util

    out = out or sys.stderr
    rank, world = dist_util.get_rank(), dist_util.get_world_size()
    lo, hi = batch.num * rank // world, batch.num * (rank + 1) // world
    parts = [[] for _ in features.dims]
    t0 = last = time.time()
    first, problem = True, None
    for start in range(lo, hi, batch_size):
        try:
            images = batch.read(start, min(start + batch_size, hi))
        except EvaluationError as e:
            problem = str(e)
            break  # this rank's verdict is made: the others learn it below
        for p, a in zip(parts, features(images)):
            p.append(np.ascontiguousarray(a, dtype=np.float32))
            if problem is None and not np.isfinite(p[-1]).all():
                what = getattr(features, "weights_path", None)
                problem = (f"{batch.path}: the {features.name} activations are not finite (NaN "
                           "or inf)" + (f" with the weights {what}; check that file" if what
                                        else ""))
        if problem is not None:
            break
        now = time.time()
        if rank == 0 and (first or now - last >= progress_every):
            done = min(batch.num, (start + len(images) - lo) * world)
            rate = done / max(now - t0, 1e-9)
            out.write(f"activations of {batch.path}: {done}/{batch.num} images, "
                      f"{rate:.1f} images/s, ETA {_clock((batch.num - done) / rate)}\n")
            out.flush()
            first, last = False, now
    problems = [p for p in dist_util.all_gather_object(problem) if p is not None]
    if problems:
        raise EvaluationError(problems[0])
    local = [np.concatenate(p, axis=0) if p else np.zeros((0, d), np.float32)
             for p, d in zip(parts, features.dims)]
    gathered = []
    for a, d in zip(local, features.dims):
        pieces = dist_util.all_gather_varlen(th.from_numpy(a.reshape(-1)))
        gathered.append(th.cat(pieces).numpy().reshape(-1, d) if rank == 0 else None)
    if rank != 0:
        return None
    took = time.time() - t0
    out.write(f"activations of {batch.path}: {batch.num} images in {took:.1f} s "
              f"({batch.num / max(took, 1e-9):.1f} images/s)\n")
    out.flush()
    return tuple(gathered)


# ----------------------------------------------------------------------------------------------
# The activation cache: NAME.acts.npz beside NAME.npz

CACHE_VERSION = 2  # 2: the key holds the zip members' CRC-32s (1: size and mtime only)
_ACT_NAMES = ("pool", "spatial", "logits")


def cache_path(batch_path, features):
    base = batch_path[:-4] if batch_path.endswith(".npz") else batch_path
    kind = "" if features.name == "inception" else f".{features.name}"
    return f"{base}{kind}.acts.npz"


def cache_key(batch, features):
    """What the cached activations of ``batch`` depend on, as a string: the feature network's
    identity, the file's size and mtime, and its content: the CRC-32 and size of each zip
    member (arr_0 and any statistics), which the zip's central directory holds (np.savez
    computed them over every byte), so a batch written again with other images of the same
    size and mtime has another key, and nothing is read to know it."""
    import json

    size, mtime_ns = batch.stat
    return json.dumps({"version": CACHE_VERSION, "size": size, "mtime_ns": mtime_ns,
                       "num": batch.num, "members": [list(m) for m in batch.members],
                       **features.identity}, sort_keys=True)


def read_cache(batch, features):
    """The cached activations of ``batch`` when the cache beside it matches the batch (its size,
    mtime and content: cache_key) and the feature network (else None: it is recomputed). Not
    collective."""
    path = cache_path(batch.path, features)
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as z:
            if "key" not in z.files or str(z["key"]) != cache_key(batch, features):
                return None
            acts = tuple(z[n] for n in _ACT_NAMES)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError):
        return None  # a damaged or foreign cache is recomputed, never trusted
    if any(a.shape != (batch.num, d) for a, d in zip(acts, features.dims)):
        return None
    return acts


# A temporary cache file of a process gone from this host and untouched this long was left by a
# killed write (it can be as large as the cache: ~1 GB for 50k Inception activations).
ABANDONED_AFTER_S = 600.0


def _remove_abandoned(path):
    """Remove ``path``'s temporary files (``PATH.tmpPID``) that a killed write left: the PID is
    not a live process here and the file is older than ABANDONED_AFTER_S (a write from another
    host sharing the folder is never that idle). Best effort, never raises."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return
    for n in names:
        pid = n[len(name) + 4:] if n.startswith(name + ".tmp") else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        leftover = os.path.join(folder, n)
        try:
            os.kill(int(pid), 0)
            continue  # a live process of this host: its write in progress
        except ProcessLookupError:
            pass
        except OSError:
            continue  # alive, another user's
        try:
            if time.time() - os.stat(leftover).st_mtime > ABANDONED_AFTER_S:
                os.unlink(leftover)
        except OSError:
            pass


def write_cache(batch, features, acts):
    """Write the activations beside the batch, atomically (a temporary name, then a rename);
    a folder that cannot be written only costs the cache (a note). Not collective: rank 0."""
    path = cache_path(batch.path, features)
    tmp = f"{path}.tmp{os.getpid()}"
    _remove_abandoned(path)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(cache_key(batch, features)),
                     **dict(zip(_ACT_NAMES, acts)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # the one write of the cache: not worth stopping the evaluation
        try:
            os.unlink(tmp)
        except OSError:
            pass
        _note(f"activation cache {path} not written ({type(e).__name__}: {e})")
        return None
    return path


# ----------------------------------------------------------------------------------------------
# The five figures


def compute_metrics(ref_acts, sample_acts, ref_stats=(None, None), fid_method="auto",
                    split_size=5000):
    """
    ADM's five figures from the activations ``(pool, spatial, logits)`` of both batches (the
    reference's precomputed ``ref_stats`` (FID, sFID) used where given, as ADM does): a dict
    ``inception_score`` (the samples' logits), ``fid``, ``sfid``, ``precision``, ``recall``
    (NaN when a side has fewer than 4 images: k=3 needs 3 neighbours).
    """
    out = {"inception_score": compute_inception_score(sample_acts[2], split_size)}
    for key, i in (("fid", 0), ("sfid", 1)):
        ref = ref_stats[i] if ref_stats[i] is not None else compute_statistics(ref_acts[i])
        out[key] = compute_statistics(sample_acts[i]).frechet_distance(ref, method=fid_method)
    if min(len(ref_acts[0]), len(sample_acts[0])) >= 4:
        out["precision"], out["recall"] = compute_prec_recall(ref_acts[0], sample_acts[0])
    else:
        out["precision"] = out["recall"] = float("nan")
    return out


def check_batches(ref_path, sample_path, dims):
    """EvaluationError (naming the file) unless both batches can be evaluated with features of
    widths ``dims`` (the reference's precomputed statistics included). Not collective."""
    open_batch(ref_path)
    open_batch(sample_path)
    read_statistics(ref_path, dims[0], dims[1])


def evaluate(ref_path, sample_path, features, batch_size=64, fid_method="auto"):
    """
    Score ``sample_path`` against ``ref_path`` (npz batches, arr_0 uint8 NHWC): both batches
    checked first (nothing computed or written for a bad one), the activations of each read
    from its cache or computed across the ranks, the figures computed on rank 0, then the
    caches written (rank 0, only once both batches' activations are finite, the reference
    passed check_reference and FID and sFID are numbers). Returns the dict of compute_metrics
    plus the batch sizes on every rank.

    Collective: call from all ranks with the same arguments.
    """
    from . import dist_util

    ref_path, sample_path = os.fspath(ref_path), os.fspath(sample_path)
    pool_dim, spatial_dim = features.dims[:2]

    # the same verdict on every rank
    dist_util.run_on_rank0(lambda: check_batches(ref_path, sample_path, features.dims))
    batches = {"ref": open_batch(ref_path), "sample": open_batch(sample_path)}
    acts, fresh = dict.fromkeys(batches), []  # None on ranks > 0, whether cached or computed
    same = os.path.realpath(ref_path) == os.path.realpath(sample_path)
    for name, batch in batches.items():
        if name == "sample" and same:
            acts["sample"] = acts["ref"]
            continue

        def probe(name=name, batch=batch):
            acts[name] = read_cache(batch, features)
            return acts[name] is not None

        if dist_util.run_on_rank0(probe):
            _note(f"activations of {batch.path} from {cache_path(batch.path, features)}")
        else:
            acts[name] = batch_activations(batch, features, batch_size)
            fresh.append(name)

    def finish():
        stats = read_statistics(ref_path, pool_dim, spatial_dim)
        check_reference(ref_path, features, acts["ref"])
        out = compute_metrics(acts["ref"], acts["sample"], stats, fid_method)
        for key in ("fid", "sfid"):
            if not np.isfinite(out[key]):
                raise EvaluationError(
                    f"{sample_path}: its {key.upper()} against {ref_path} is {out[key]}, not a "
                    f"number (statistics that are not finite?); nothing was cached")
        for name in fresh:
            write_cache(batches[name], features, acts[name])
        return out

    result = dist_util.run_on_rank0(finish)
    for b in batches.values():
        b.close()
    result.update(num_ref=batches["ref"].num, num_samples=batches["sample"].num)
    return result


# ----------------------------------------------------------------------------------------------
# A reference batch of one's own data (scripts/evaluate.py --data_dir DIR --image_size N REF.npz)


def write_reference_batch(data_dir, image_size, path, num_images=0, seed=0, batch_size=64,
                          out=None):
    """
    Write ``path`` (a new .npz): ADM's reference batch of the images in ``data_dir``, each as
    ``train.py --data_dir DATA_DIR --image_size IMAGE_SIZE`` trains on it: the folder listed
    and checked by image_datasets.load_data and every image loaded by its ImageDataset (the
    box-halving, bicubic resize and centre crop of upstream), back to uint8 (exact: the
    training's float is ``u / 127.5 - 1``). ``arr_0`` uint8 [N, H, W, 3] in file order, or a
    seeded random subset of ``num_images`` (still in file order), stored uncompressed (as
    np.savez and ADM's batches: memory-mapped when read) and written a batch at a time under a
    temporary name, then renamed: never half-written under its name, never over a file.
    Progress goes to ``out`` (stderr). Returns the number of images. Run in one process.

    UsageError for a bad flag; DataError for the folder (missing, empty, unreadable image);
    EvaluationError for a folder of latents or an existing ``path``.
    """
    import torch as th

    from . import image_datasets

    out = out or sys.stderr
    path = os.fspath(path)
    if image_size is None or image_size < 1:
        raise UsageError("--data_dir needs --image_size N (at least 1): the side the training "
                         "resizes the images to (train.py's --image_size)")
    if num_images < 0:
        raise UsageError(f"--num_images {num_images}: must be 0 (all the images) or more")
    if not path.endswith(".npz"):
        raise UsageError(f"{path}: the reference batch to write must be named *.npz")
    from .infra import storage

    remote = storage.is_remote(path)
    storage.check_store(path, "REF_BATCH")
    if storage.exists(path):
        raise EvaluationError(f"{path}: already exists; refusing to overwrite it (remove it or "
                              "give another name)")
    inside = (storage.dirname(path) if remote
              else os.path.realpath(os.path.dirname(os.path.abspath(path))))
    data_root = data_dir.rstrip("/") if storage.is_remote(data_dir) else os.path.realpath(data_dir)
    if (inside + os.sep).startswith(data_root + os.sep):
        raise UsageError(f"{path}: inside --data_dir {data_dir}, where the training would take "
                         "the .npz for a latent; write the reference batch elsewhere")
    loader = image_datasets.load_data(data_dir=data_dir, batch_size=1, image_size=image_size,
                                      deterministic=True, rank=0, world_size=1, num_workers=0)
    dataset = loader.dataset
    loader.close()
    if not isinstance(dataset, image_datasets.ImageDataset):
        raise EvaluationError(f"--data_dir {data_dir}: holds latents, not images; a reference "
                              "batch is images (make it from the images the latents were "
                              "encoded from)")
    n = len(dataset)
    if num_images > n:
        raise UsageError(f"--num_images {num_images}: {data_dir} holds only {n} images")
    indices = (np.sort(np.random.default_rng(seed).choice(n, num_images, replace=False))
               if num_images else np.arange(n))
    if len(indices) < 2:
        raise EvaluationError(f"--data_dir {data_dir}: holds {len(indices)} image; a reference "
                              "batch needs at least 2")
    shape = (len(indices), image_size, image_size, 3)
    if remote:  # written locally, then streamed up under its final name (storage.open_write)
        import tempfile
        tmp = os.path.join(tempfile.mkdtemp(prefix="improved-diffusion-ref-"),
                           f"{storage.basename(path)}.tmp{os.getpid()}")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
    t0 = last = time.time()
    try:
        with open(tmp, "wb") as raw:
            with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array_header_1_0(
                        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                            "fortran_order": False, "shape": shape})
                    for start in range(0, len(indices), batch_size):
                        part = [dataset[int(i)][0] for i in indices[start:start + batch_size]]
                        x = th.from_numpy(np.stack(part))  # float32 [B, 3, H, W] in [-1, 1]
                        u = ((x + 1) * 127.5).round().clamp(0, 255).to(th.uint8)
                        f.write(np.ascontiguousarray(u.permute(0, 2, 3, 1).numpy()).tobytes())
                        now, done = time.time(), min(start + batch_size, len(indices))
                        if now - last >= 10.0 or done == len(indices):
                            out.write(f"{path}: {done}/{len(indices)} images, "
                                      f"{done / max(now - t0, 1e-9):.1f} images/s\n")
                            out.flush()
                            last = now
            raw.flush()
            os.fsync(raw.fileno())
        if remote:
            import shutil
            with open(tmp, "rb") as src, storage.open_write(path, exclusive=True) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if remote:
            os.rmdir(os.path.dirname(tmp))
    return len(indices)


# ----------------------------------------------------------------------------------------------
# The command line (scripts/evaluate.py)

USAGE = """\
Score samples against a reference batch with ADM's evaluator: Inception Score, FID, sFID,
precision and recall, the numbers of guided-diffusion's evaluations/evaluator.py.

    python scripts/evaluate.py REF_BATCH SAMPLE_BATCH [--inception_weights PATH]
    mpiexec -n 4 python scripts/evaluate.py ...   # the activations split across ranks
    python scripts/evaluate.py --data_dir DIR --image_size N REF_BATCH   # write a reference

REF_BATCH: an ADM reference batch (VIRTUAL_imagenet64_labeled.npz, ...: arr_0 uint8 NHWC, and
mu/sigma/mu_s/sigma_s, used instead of recomputing them) or any npz with arr_0 uint8 NHWC;
SAMPLE_BATCH: e.g. sample.py's samples_NxHxWx3.npz. Activations are cached beside each batch
(NAME.acts.npz). With --data_dir: write REF_BATCH from the training images instead, resized as
train.py --data_dir DIR --image_size N resizes them. See docs/evaluation.md.
"""


def create_parser():
    import argparse

    from .infra.flags import FlagParser

    p = FlagParser(prog="evaluate.py", description=USAGE,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ref_batch", help="reference batch (npz, arr_0 uint8 NHWC); with "
                   "--data_dir: the reference batch to write")
    p.add_argument("sample_batch", nargs="?", default=None,
                   help="sample batch (npz, arr_0 uint8 NHWC)")
    p.add_argument("--data_dir", default=None,
                   help="write REF_BATCH from this image folder (train.py's --data_dir) instead "
                        "of scoring: each image resized as the training resizes it")
    p.add_argument("--image_size", type=int, default=None,
                   help="with --data_dir: the side the images are resized to (train.py's)")
    p.add_argument("--num_images", type=int, default=0,
                   help="with --data_dir: a random subset of this many images (0: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --data_dir --num_images: the subset's seed")
    p.add_argument("--inception_weights", default=None,
                   help="the FID Inception's weights (weights-inception-2015-12-05-6726825d.pth;"
                        " default $ID_INCEPTION_WEIGHTS)")
    p.add_argument("--features", default="inception", choices=["inception", "digits"],
                   help="feature network: the FID Inception, or the demo's digits classifier")
    p.add_argument("--batch_size", type=int, default=64, help="images per forward pass")
    p.add_argument("--fid_method", default="auto", choices=["auto", "sqrtm", "eigh"],
                   help="auto: ADM's sqrtm, or the exact low-rank trace when a batch has fewer "
                        "images than features; eigh: faster, the same figures to ~1e-9")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--dist_timeout", type=float, default=600.0,
                   help="seconds any rank waits for the others")
    return p


def make_reference(args):
    """evaluate.py --data_dir DIR --image_size N REF_BATCH: write_reference_batch, one line on
    stdout. Returns 0."""
    if args.sample_batch is not None:
        raise UsageError(f"--data_dir writes one batch: got {args.ref_batch} and "
                         f"{args.sample_batch}; give only the reference batch to write")
    n = write_reference_batch(args.data_dir, args.image_size, args.ref_batch,
                              num_images=args.num_images, seed=args.seed,
                              batch_size=args.batch_size)
    print(f"wrote {args.ref_batch}: {n} images of {args.image_size}x{args.image_size} from "
          f"{args.data_dir}, as train.py --image_size {args.image_size} sees them")
    sys.stdout.flush()
    return 0


def main(argv=None, feature_factories=None):
    """
    scripts/evaluate.py: parse, set up the ranks, build the feature network, evaluate, print
    (rank 0). ``feature_factories``: name -> callable returning a feature network (the script
    supplies "digits" from datasets/digits.py). Returns 0.

    Collective: call from all ranks with the same arguments.
    """
    import json

    from .infra import cli
    from . import dist_util, inception

    args = create_parser().parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size {args.batch_size}: must be at least 1")
    if args.data_dir is not None:
        return make_reference(args)
    for flag in ("image_size", "num_images", "seed"):
        if getattr(args, flag) != create_parser().get_default(flag):
            raise UsageError(f"--{flag} is for writing a reference batch: give --data_dir DIR "
                             "too")
    if args.sample_batch is None:
        raise UsageError("evaluate.py needs REF_BATCH SAMPLE_BATCH (or --data_dir DIR "
                         "--image_size N REF_BATCH to write a reference batch); see --help")
    cli.check_dist_timeout(args.dist_timeout)
    if args.features == "inception":
        inception.resolve_weights_path(args.inception_weights)  # before anything else
    dist_util.setup_dist(timeout=args.dist_timeout)
    dims = InceptionFeatures.dims if args.features == "inception" else None
    if dims is not None:  # a bad batch is told before the weights are read
        dist_util.run_on_rank0(lambda: check_batches(args.ref_batch, args.sample_batch, dims))
    if args.features == "inception":
        features = InceptionFeatures(inception.load_inception(args.inception_weights, log=_note))
        features.weights_path = inception.resolve_weights_path(args.inception_weights)
    else:
        factory = (feature_factories or {}).get(args.features)
        if factory is None:
            raise UsageError(f"--features {args.features}: not available from this entry point")
        features = factory()
    result = evaluate(args.ref_batch, args.sample_batch, features, args.batch_size,
                      args.fid_method)
    if dist_util.get_rank() == 0:
        if args.json:
            result.update(ref_batch=args.ref_batch, sample_batch=args.sample_batch,
                          features=args.features, **{k: v for k, v in features.identity.items()
                                                     if k != "features"})
            print(json.dumps({k: (None if isinstance(v, float) and v != v else v)
                              for k, v in result.items()}, sort_keys=True))
        else:
            print("Inception Score:", result["inception_score"])
            print("FID:", result["fid"])
            print("sFID:", result["sfid"])
            print("Precision:", result["precision"])
            print("Recall:", result["recall"])
        sys.stdout.flush()
    return 0
