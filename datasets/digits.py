"""
The embedded default data set: scikit-learn's bundled 8x8 handwritten digits (1797 real images,
no download), written as an image folder, and an evaluator for generated digits.

Writing:   python datasets/digits.py --out DIR [--size 16]
  Files are named `{label}_{index:04d}.png` (label = the digit, index = position in sklearn's
  set), so `load_data(class_cond=True)` reads the digit as the class. Images are 8-bit grayscale,
  upscaled from 8x8 with bicubic interpolation. Running it again on a complete folder does nothing.

Evaluating: python scripts/eval_digits.py SAMPLES.npz [--json OUT]
  (or `evaluate_npz(path)` from this module). Samples are converted to gray, box-downsampled to
  8x8 and mapped to sklearn's 0..16 scale, then scored by an RBF SVM trained on all real digits
  (`SVC(probability=True, random_state=0)`; about 97% 3-fold accuracy). Figures: mean top-class
  probability, the share of samples whose predicted class is the requested label (when the npz
  holds labels as `arr_1`), the 10-class histogram of predictions, and the Frechet distance
  between real and generated samples in the classifier's feature space (its 45 one-vs-one
  decision values), beside the same distance between two halves of the real data.
"""
import argparse
import functools
import json
import os
import sys
import warnings

import numpy as np
from PIL import Image

NUM_CLASSES = 10
SOURCE_SIZE = 8
DEFAULT_SIZE = 16


# ---------------------------------------------------------------- the data


def load_real_digits():
    """
    :return: (X: np.float64 [1797, 64] on sklearn's 0..16 scale, y: np.int64 [1797]).
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data.astype(np.float64), d.target.astype(np.int64)


def digit_filename(label, index):
    return f"{int(label)}_{int(index):04d}.png"


def digit_to_image(x, size=DEFAULT_SIZE):
    """
    :param x: [64] or [8, 8] values on the 0..16 scale.
    :return: a PIL "L" image of size x size (bicubic upscaling from 8x8).
    """
    arr = np.asarray(x, dtype=np.float64).reshape(SOURCE_SIZE, SOURCE_SIZE)
    arr = np.clip(np.round(arr * 255.0 / 16.0), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr, mode="L")
    if size != SOURCE_SIZE:
        img = img.resize((size, size), resample=Image.BICUBIC)
    return img


def _folder_is_complete(out_dir, names, size):
    if not all(os.path.isfile(os.path.join(out_dir, n)) for n in names):
        return False
    try:
        with Image.open(os.path.join(out_dir, names[0])) as im:
            return im.size == (size, size)
    except OSError:
        return False


def write_digits_folder(out_dir, size=DEFAULT_SIZE, log=print):
    """
    Write the 1797 digits as `{label}_{index:04d}.png` into `out_dir` (created if needed).
    Idempotent: a complete folder of the same size is left alone. Each file is written under a
    temporary name and renamed, so an interrupted run never leaves a half-written image.

    :return: the number of images in the folder.
    """
    if int(size) != size or size < SOURCE_SIZE:
        raise ValueError(f"--size must be an integer of at least {SOURCE_SIZE}, got {size}")
    size = int(size)
    X, y = load_real_digits()
    names = [digit_filename(label, i) for i, label in enumerate(y)]
    os.makedirs(out_dir, exist_ok=True)
    if _folder_is_complete(out_dir, names, size):
        log(f"digits: {out_dir} already holds all {len(names)} images at {size}px; nothing to do")
        return len(names)
    for x, name in zip(X, names):
        path = os.path.join(out_dir, name)
        tmp = os.path.join(out_dir, f".tmp-{os.getpid()}-{name}")
        digit_to_image(x, size).save(tmp, format="PNG")
        os.replace(tmp, path)
    log(f"digits: wrote {len(names)} images ({size}x{size}, 10 classes) to {out_dir}")
    return len(names)


# ---------------------------------------------------------------- evaluation


def images_to_digit_features(images):
    """
    Bring images of any size to sklearn's digit format.

    :param images: uint8 [N, H, W, C] (C = 1 or 3) or [N, H, W], values 0..255.
    :return: np.float64 [N, 64] on the 0..16 scale (gray, box-downsampled to 8x8).
    """
    arr = np.asarray(images)
    if arr.ndim == 4:
        if arr.shape[-1] not in (1, 3, 4):
            raise ValueError(
                f"expected images shaped [N, H, W, C] with C in 1, 3, 4; got {arr.shape}"
            )
        arr = arr[..., :3].astype(np.float64).mean(axis=-1)
    elif arr.ndim == 3:
        arr = arr.astype(np.float64)
    else:
        raise ValueError(f"expected images shaped [N, H, W, C] or [N, H, W]; got {arr.shape}")
    out = np.empty((arr.shape[0], SOURCE_SIZE * SOURCE_SIZE), dtype=np.float64)
    for i, im in enumerate(arr):
        if im.shape != (SOURCE_SIZE, SOURCE_SIZE):
            pil = Image.fromarray(im.astype(np.float32), mode="F")
            im = np.asarray(pil.resize((SOURCE_SIZE, SOURCE_SIZE), resample=Image.BOX))
        out[i] = np.clip(im, 0, 255).reshape(-1) * 16.0 / 255.0
    return out


class DigitScorer:
    """
    An RBF SVM trained on all 1797 real digits (deterministic: random_state=0).

    `predict_proba(X) -> [N, 10]`, `features(X) -> [N, 45]` (one-vs-one decision values: the
    feature space for the Frechet distance). X is [N, 64] on the 0..16 scale.
    """

    def __init__(self, random_state=0):
        from sklearn.svm import SVC

        self.X, self.y = load_real_digits()
        Xs = self.X / 16.0
        # libsvm's pairwise-coupled probabilities (Platt scaling on internal 5-fold CV) give low
        # confidence far from the data (noise scores ~0.2), unlike one-vs-rest calibration
        # (~0.85 on noise). scikit-learn 1.9 deprecates `probability=True` (removal planned for
        # 1.11); the fallback keeps working there, with a less discriminating confidence.
        self.clf = self.calibrated = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                self.clf = SVC(
                    kernel="rbf", gamma="scale", probability=True,
                    decision_function_shape="ovo", random_state=random_state,
                )
                self.clf.fit(Xs, self.y)
            except TypeError:  # pragma: no cover - scikit-learn >= 1.11
                self.clf = None
        if self.clf is None:  # pragma: no cover
            from sklearn.calibration import CalibratedClassifierCV

            self.calibrated = CalibratedClassifierCV(
                SVC(kernel="rbf", gamma="scale"), method="sigmoid", cv=5, ensemble=False
            ).fit(Xs, self.y)
            self.clf = SVC(kernel="rbf", gamma="scale", decision_function_shape="ovo")
            self.clf.fit(Xs, self.y)
        self.classes_ = self.clf.classes_
        self.real_features = self.features(self.X)

    def predict_proba(self, X):
        X = np.asarray(X, dtype=np.float64) / 16.0
        if self.calibrated is not None:  # pragma: no cover
            return self.calibrated.predict_proba(X)
        return self.clf.predict_proba(X)

    def features(self, X):
        return self.clf.decision_function(np.asarray(X, dtype=np.float64) / 16.0)


@functools.lru_cache(maxsize=2)
def get_scorer(random_state=0):
    """The trained DigitScorer, built once per process."""
    return DigitScorer(random_state=random_state)


class DigitFeatures:
    """
    The digits classifier as a feature network for ADM's metrics (``scripts/evaluate.py
    --features digits``): uint8 images [N, H, W, C] -> float32 ``(pool [N, 45]`` the SVM's
    one-vs-one decision values (the space of this module's Frechet distance), ``spatial
    [N, 64]`` the 8x8 gray image on the 0..16 scale (what sFID's spatial features are to
    Inception), ``logits [N, 10]`` the log of the class probabilities (softmax gives them back:
    the Inception Score of the classifier)).
    """

    name = "digits"
    dims = (45, SOURCE_SIZE * SOURCE_SIZE, NUM_CLASSES)

    def __init__(self, random_state=0):
        import sklearn

        self.scorer = get_scorer(random_state)
        self.identity = {"features": "digits", "scorer": f"SVC rbf random_state={random_state}",
                         "sklearn": sklearn.__version__}

    def __call__(self, images):
        X = images_to_digit_features(images)
        proba = self.scorer.predict_proba(X)
        logits = np.log(np.clip(proba, 1e-30, None))
        return (self.scorer.features(X).astype(np.float32), X.astype(np.float32),
                logits.astype(np.float32))


def _sqrtm(m):
    from scipy import linalg

    out = linalg.sqrtm(m)
    return out[0] if isinstance(out, tuple) else out


def frechet_distance(feats_a, feats_b, eps=1e-6):
    """
    Frechet distance between Gaussians fitted to two feature sets:
    |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)).

    :param feats_a, feats_b: [N, D] and [M, D], N, M >= 2.
    """
    a = np.asarray(feats_a, dtype=np.float64)
    b = np.asarray(feats_b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("the Frechet distance needs at least 2 samples on each side")
    mu1, mu2 = a.mean(axis=0), b.mean(axis=0)
    s1, s2 = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    diff = mu1 - mu2
    covmean = _sqrtm(s1.dot(s2))
    if not np.isfinite(covmean).all():
        offset = np.eye(s1.shape[0]) * eps
        covmean = _sqrtm((s1 + offset).dot(s2 + offset))
    covmean = np.real(covmean)
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def real_halves(n, seed=0):
    """A fixed split of range(n) into two halves: (idx_a, idx_b)."""
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[: n // 2]), np.sort(perm[n // 2 :])


def evaluate_samples(images, labels=None, scorer=None):
    """
    Score generated digits.

    :param images: uint8 [N, H, W, C] or [N, H, W] (N >= 2), values 0..255.
    :param labels: optional int [N], the class each sample was asked to be.
    :return: dict with num_samples, mean_confidence, label_agreement (None without labels),
        histogram (10 counts of predicted classes), predicted (list), fid_real_vs_generated,
        fid_real_halves (two halves of the real set), fid_real_subset_same_n (one real half
        against N real images from the other half: the floor for this N; N capped at the half's
        size and given as fid_real_subset_n).
    """
    scorer = scorer or get_scorer()
    X = images_to_digit_features(images)
    n = len(X)
    if n < 2:
        raise ValueError(f"need at least 2 samples to evaluate, got {n}")
    proba = scorer.predict_proba(X)
    pred = scorer.classes_[proba.argmax(axis=1)].astype(np.int64)
    agreement = None
    if labels is not None:
        labels = np.asarray(labels).astype(np.int64).reshape(-1)
        if len(labels) != n:
            raise ValueError(f"got {len(labels)} labels for {n} samples")
        agreement = float(np.mean(pred == labels))
    feats = scorer.features(X)
    ia, ib = real_halves(len(scorer.X))
    real_a, real_b = scorer.real_features[ia], scorer.real_features[ib]
    subset = real_b[np.random.default_rng(1).permutation(len(real_b))[: min(n, len(real_b))]]
    return {
        "num_samples": int(n),
        "mean_confidence": float(proba.max(axis=1).mean()),
        "label_agreement": agreement,
        "histogram": np.bincount(pred, minlength=NUM_CLASSES).astype(int).tolist(),
        "predicted": pred.tolist(),
        "fid_real_vs_generated": frechet_distance(scorer.real_features, feats),
        "fid_real_halves": frechet_distance(real_a, real_b),
        "fid_real_subset_same_n": frechet_distance(real_a, subset),
        "fid_real_subset_n": int(len(subset)),
    }


def load_samples_npz(path):
    """
    :return: (images uint8 [N, H, W, C], labels int64 [N] or None) from sample.py's npz
        (`arr_0`, optional `arr_1`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"samples file {path} not found; pass the .npz written by sample.py")
    try:
        with np.load(path) as f:
            if "arr_0" not in f.files:
                raise ValueError(
                    f"samples file {path} holds no arr_0 (has {', '.join(f.files) or 'nothing'}); "
                    "pass the .npz written by sample.py"
                )
            images = f["arr_0"]
            labels = f["arr_1"] if "arr_1" in f.files else None
    except (OSError, EOFError) as e:
        raise ValueError(f"samples file {path} is not a readable .npz ({e})") from e
    if images.dtype != np.uint8:
        raise ValueError(f"samples file {path}: arr_0 is {images.dtype}, expected uint8 NHWC")
    return images, labels


def evaluate_npz(path):
    """evaluate_samples() on an npz written by sample.py, plus "path"."""
    images, labels = load_samples_npz(path)
    out = evaluate_samples(images, labels)
    out["path"] = path
    return out


def format_report(r):
    """A readable multi-line summary of evaluate_samples()'s dict."""
    lines = [f"digit evaluation of {r['num_samples']} samples"
             + (f" ({r['path']})" if r.get("path") else "")]
    lines.append(f"  mean top-class confidence : {r['mean_confidence']:.3f}")
    if r.get("label_agreement") is not None:
        lines.append(f"  label agreement           : {r['label_agreement']:.3f}")
    else:
        lines.append("  label agreement           : n/a (no labels in the samples)")
    hist = " ".join(f"{d}:{c}" for d, c in enumerate(r["histogram"]))
    lines.append(f"  predicted class histogram : {hist}")
    lines.append(
        f"  Frechet distance (SVM features): real vs generated {r['fid_real_vs_generated']:.2f}"
        f" | real half vs half {r['fid_real_halves']:.2f}"
        f" | real vs {r.get('fid_real_subset_n', r['num_samples'])} real"
        f" {r['fid_real_subset_same_n']:.2f}"
    )
    return "\n".join(lines)


def eval_main(argv=None):
    """CLI of scripts/eval_digits.py. Returns the exit code."""
    parser = argparse.ArgumentParser(
        description="Score generated digits with a classifier trained on the real digits."
    )
    parser.add_argument("samples", help="npz written by sample.py (arr_0 uint8 NHWC, arr_1 labels)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    try:
        result = evaluate_npz(args.samples)
        print(format_report(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write scikit-learn's 8x8 digits as an image folder {label}_{index:04d}.png."
    )
    parser.add_argument("--out", required=True, help="output folder (created if needed)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="image side in pixels")
    args = parser.parse_args(argv)
    try:
        write_digits_folder(args.out, args.size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
