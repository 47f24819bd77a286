"""
The FID Inception network: TensorFlow's Inception graph of 2015-12-05 (``classify_image_graph_def
.pb``), the one TTUR's FID, ADM's evaluator and torch-fidelity use, as torch-fidelity ports it.

``load_inception(path)`` builds it and loads the published PyTorch weights strictly:
torch-fidelity's ``weights-inception-2015-12-05-6726825d.pth`` (URL below), or pytorch-fid's
``pt_inception-2015-12-05-6726825d.pth`` (the same key layout: torchvision's names; BatchNorm's
``num_batches_tracked`` may be absent). Any floating dtype is read as float32. Its sha256 is
logged and kept as ``.sha256`` (the activation caches are keyed by it). No weights ship with
the project and nothing is downloaded.

Called on uint8 images ``[N, H, W, 3]`` (NHWC, any size; a NumPy array or a tensor) it returns
``(pool [N, 2048], spatial [N, 2023], logits [N, 1008])``, float32:

* the graph's own preprocessing first: TensorFlow 1.x's bilinear resize to 299 x 299
  (``align_corners=False``, no half-pixel centres: source = destination * in/out), then
  ``x / 128 - 1``;
* ``pool``: ``pool_3`` (the 2048 features of FID);
* ``spatial``: ADM's ``mixed_6/conv:0[..., :7]``, read as the output of ``Mixed_6d.branch1x1``
  after its ReLU, its first 7 channels at 17 x 17, flattened in NHWC order (the order ADM's
  precomputed ``mu_s`` / ``sigma_s`` assume);
* ``logits``: ``pool @ fc.weight.T``, without the bias (ADM's Inception Score softmax).
"""
import hashlib
import io
import os

import torch as th
import torch.nn as nn
import torch.nn.functional as F

from .infra.errors import UserError

WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
               + WEIGHTS_NAME)
WEIGHTS_ENV = "ID_INCEPTION_WEIGHTS"
INPUT_SIZE = 299
SPATIAL_CHANNELS = 7


class InceptionWeightsError(UserError):
    """No weights file, or a file that is not the FID Inception's weights (exit 1)."""


def missing_weights_message():
    return (f"no Inception weights: pass --inception_weights PATH or set ${WEIGHTS_ENV} to "
            f"{WEIGHTS_NAME}, published at {WEIGHTS_URL} (this evaluator never downloads)")


def resolve_weights_path(path=None):
    """``path``, else $ID_INCEPTION_WEIGHTS; InceptionWeightsError (one line saying where to get
    the file) when neither is given."""
    path = path or os.environ.get(WEIGHTS_ENV) or None
    if not path:
        raise InceptionWeightsError(missing_weights_message())
    return path


# ----------------------------------------------------------------------------------------------
# The network (torch-fidelity's FeatureExtractorInceptionV3 layout)


class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm (eps 1e-3, inference statistics) -> ReLU."""

    def __init__(self, cin, cout, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _avg_pool(x):
    # TensorFlow's average pool ignores the zero padding in its count
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    def __init__(self, cin, pool_features):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x):
        a = self.branch1x1(x)
        b = self.branch5x5_2(self.branch5x5_1(x))
        c = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        d = self.branch_pool(_avg_pool(x))
        return th.cat([a, b, c, d], 1)


class InceptionB(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        a = self.branch3x3(x)
        b = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return th.cat([a, b, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionC(nn.Module):
    """``forward`` returns (output, branch1x1): the latter is the spatial feature of Mixed_6d."""

    def __init__(self, cin, c7):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        a = self.branch1x1(x)
        b = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        c = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3,
                      self.branch7x7dbl_4, self.branch7x7dbl_5):
            c = layer(c)
        d = self.branch_pool(_avg_pool(x))
        return th.cat([a, b, c, d], 1), a


class InceptionD(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        a = self.branch3x3_2(self.branch3x3_1(x))
        b = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return th.cat([a, b, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionE(nn.Module):
    """``max_pool``: the graph's last block pools by max where the paper (and the first E block)
    averages; the port keeps it."""

    def __init__(self, cin, max_pool):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        a = self.branch1x1(x)
        b = self.branch3x3_1(x)
        b = th.cat([self.branch3x3_2a(b), self.branch3x3_2b(b)], 1)
        c = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        c = th.cat([self.branch3x3dbl_3a(c), self.branch3x3dbl_3b(c)], 1)
        pooled = (F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool
                  else _avg_pool(x))
        return th.cat([a, b, c, self.branch_pool(pooled)], 1)


def resize_like_tf1(x, size=INPUT_SIZE):
    """
    TensorFlow 1.x's ``resize_bilinear`` (align_corners=False, half_pixel_centers=False) of
    float [N, C, H, W] to [N, C, size, size]: source coordinate = destination * (in / out) in
    float32, the two neighbours below and above (the last clamped), lerped along x, then y.
    """
    def axis(n_in):
        g = th.arange(size, dtype=th.float32) * th.tensor(n_in / size, dtype=th.float32)
        lo = g.long()
        hi = (lo + 1).clamp_max(n_in - 1)
        return lo, hi, g - lo.float()

    h, w = x.shape[2], x.shape[3]
    if (h, w) == (size, size):
        return x
    lo, hi, dx = axis(w)
    a, b = x[:, :, :, lo], x[:, :, :, hi]
    x = a + (b - a) * dx.view(1, 1, 1, size)
    lo, hi, dy = axis(h)
    a, b = x[:, :, lo, :], x[:, :, hi, :]
    return a + (b - a) * dy.view(1, 1, size, 1)


class FIDInceptionV3(nn.Module):
    """The 2015-12-05 Inception graph (state-dict keys as torch-fidelity's port). ``forward``:
    uint8 [N, H, W, 3] -> (pool [N, 2048], spatial [N, 2023], logits [N, 1008])."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, c7=128)
        self.Mixed_6c = InceptionC(768, c7=160)
        self.Mixed_6d = InceptionC(768, c7=160)
        self.Mixed_6e = InceptionC(768, c7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)
        self.sha256 = None
        self.eval()
        self.requires_grad_(False)

    @th.inference_mode()
    def forward(self, images):
        x = th.as_tensor(images)
        if x.dtype != th.uint8 or x.dim() != 4 or x.shape[-1] != 3:
            raise ValueError(f"expected uint8 images [N, H, W, 3], got {x.dtype} "
                             f"{list(x.shape)}")
        x = x.to(self.fc.weight.device).permute(0, 3, 1, 2).float()
        x = resize_like_tf1(x)
        x = (x - 128) / 128
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6a(x)
        x, _ = self.Mixed_6b(x)
        x, _ = self.Mixed_6c(x)
        x, mixed_6 = self.Mixed_6d(x)
        x, _ = self.Mixed_6e(x)
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        pool = x.mean(dim=(2, 3))
        spatial = mixed_6[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(len(x), -1)
        logits = pool.mm(self.fc.weight.T)
        return pool.float(), spatial.float(), logits.float()


# ----------------------------------------------------------------------------------------------
# Loading


def _skeleton():
    """The network on the meta device: its keys, shapes and dtypes without storage, and without
    the random initialisation its layers would draw from torch's global generator (the weights
    are loaded over it anyway: building it for real moved a training job's RNG streams, issue
    37)."""
    with th.device("meta"):
        return FIDInceptionV3()


def _layout_problem(path, state, expected):
    """None when ``state`` (a dict) has exactly the expected keys and shapes (BatchNorm's
    num_batches_tracked optional), else one line naming the file and the difference."""
    if not isinstance(state, dict):
        return f"{path}: not a state dict (a {type(state).__name__}); expected {WEIGHTS_NAME}"
    keys = set(state)
    optional = {k for k in expected if k.endswith("num_batches_tracked")}
    missing = sorted(set(expected) - keys - optional)
    unexpected = sorted(keys - set(expected))
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys ({', '.join(unexpected[:3])}"
                     f"{', ...' if len(unexpected) > 3 else ''})")
    if not parts:
        for k, v in state.items():
            if not isinstance(v, th.Tensor):
                parts.append(f"{k} is a {type(v).__name__}, not a tensor")
                break
            if tuple(v.shape) != tuple(expected[k].shape):
                parts.append(f"{k} has shape {list(v.shape)}, expected "
                             f"{list(expected[k].shape)}")
                break
            if not k.endswith("num_batches_tracked") and not v.is_floating_point():
                parts.append(f"{k} is {v.dtype}, expected floating point")
                break
    if not parts:
        return None
    return (f"{path}: not the FID Inception weights ({WEIGHTS_NAME}, torch-fidelity's layout): "
            + "; ".join(parts))


def check_weights_file(path=None):
    """
    The weights path (``path``, else $ID_INCEPTION_WEIGHTS) once its file is found to be the FID
    Inception's weights, without building the network or reading the tensors (memory-mapped):
    for the start-up checks of a job (train.py's --eval_features inception) before anything is
    written. InceptionWeightsError (one line naming the file) otherwise. Not collective.
    """
    path = resolve_weights_path(path)
    if not os.path.isfile(path):
        why = "is a directory" if os.path.isdir(path) else "no such file"
        raise InceptionWeightsError(f"{path}: {why}; {missing_weights_message()}")
    try:
        state = th.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old (non-zip) torch file cannot be memory-mapped: read it
        try:
            state = th.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # the bytes of one known call: not a torch file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InceptionWeightsError(
                f"{path}: not a loadable torch file ({type(e).__name__}: {first[:160]}); "
                f"expected {WEIGHTS_NAME}") from None
    problem = _layout_problem(path, state, _skeleton().state_dict())
    if problem:
        raise InceptionWeightsError(problem)
    return path


def load_inception(path=None, device="cpu", log=None):
    """
    The FID Inception network with the weights of ``path`` (else $ID_INCEPTION_WEIGHTS), loaded
    strictly; ``.sha256`` is the file's. ``log``: a callable given one line (the file and its
    sha256). Errors: InceptionWeightsError (one line naming the file).

    Collective: call from all ranks with the same arguments (rank 0 reads, broadcasts).
    """
    from . import dist_util

    path = resolve_weights_path(path)
    try:
        data = dist_util.load_bytes(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise InceptionWeightsError(f"{e}; {missing_weights_message()}") from None
    digest = hashlib.sha256(data).hexdigest()
    try:
        state = th.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # the bytes of one known call: not a torch file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InceptionWeightsError(
            f"{path}: not a loadable torch file ({type(e).__name__}: {first[:160]}); expected "
            f"{WEIGHTS_NAME}") from None
    del data
    net = _skeleton()  # draws nothing: the file's tensors become its weights
    expected = net.state_dict()
    problem = _layout_problem(path, state, expected)
    if problem:
        raise InceptionWeightsError(problem)
    # BatchNorm's num_batches_tracked, when the file has none: 0, as a fresh BatchNorm's
    full = {k: state[k].to(ref.dtype) if k in state else th.zeros(ref.shape, dtype=ref.dtype)
            for k, ref in expected.items()}
    net.load_state_dict(full, strict=True, assign=True)
    net.sha256 = digest
    net.to(device)
    if log is not None:
        log(f"Inception weights {path} (sha256 {digest})")
    return net
