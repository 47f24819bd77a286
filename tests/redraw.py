"""Test inputs drawn again from their seeded recipes instead of stored in tests/fixtures/.

The recipes are those of the project's reference data (../shared/compat/README.md, "Drawing the
random inputs again instead of storing them"): what upstream's code was given was drawn from
seeded generators, so only upstream's outputs need to be kept. Each draw is checked against the
SHA-256 that the recipe gives; a generator whose stream changed fails here by name, not as a
numerical mismatch three calls further on. Draws are cached per process (a session of pytest or
an xdist worker): a few seconds each.
"""
import functools
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"

ADM_SEED = INCEPTION_SEED = 20261201

# SHA-256 of each float16 array's C-order bytes (shared/compat/README.md)
ADM_SHA256 = {
    "ref_pool": "b4aaf3d71acad7997570437724fab6a13b51e2eaf4d89ef94e30e8274cd2d885",
    "sample_pool": "91bba6c1f4a49e106083bff3e31518e245d15f9801ffaa62796b1a8a6ff552f2",
    "ref_spatial": "4bcfc8431d63520d7a39951d8491b1c8294245374c5eaf46aca574da1e517a6a",
    "sample_spatial": "bbf7580dd8f6b9a9f707ce30a7b0c47e77397f7538386838f2bb9f78f4eb7ddc",
    "near_ref": "2d5261d85bbe2c9a48e9d79e8da4c667ef54775cfe4cc002671ed25c11a2c63b",
    "near_sample": "eefafb49fdf8f75f5a98e4b40e00b54b95e7fe269c215e67f12f69db18b4bb8c",
    "logits_w": "9bca07b8477499a30ccc0e406bd5059922c1d462b2c66601a7edbc238cb27958",
}
# over each entry in order: its UTF-8 name, then the tensor's contiguous bytes
INCEPTION_STATE_SHA256 = "4bf1ecd6557575bc0ec3ddac8c9ab8ebf8f8741b392b5ab24d02023aa450502c"
# the uint8 bytes of images_{size} as the reference file held them (checked 2026-12-07)
INCEPTION_IMAGES_SHA256 = {
    32: "2792cdcf61c472ed1390d92783111fe2a6c4dd5f71099243a6f7de5b68e94443",
    64: "137173f05d695a920890369be0ae53f9f53d68ee62721d8a25ce08b07cbaf025",
    256: "e0a6448e52968ae89e1e36c1fe5d9b0f39dbcd2a7207f1cf565ce2f0763359f9",
}


class RedrawError(AssertionError):
    """A drawn input is not the one the recipe's digest names."""


def check_digest(what, got, want):
    if got != want:
        raise RedrawError(f"{what}'s sha256 is {got}, the recipe says {want}: "
                          "the generator changed its stream (numpy's or torch's), so these are "
                          "not the inputs upstream's outputs were computed from")


@functools.lru_cache(maxsize=None)
def adm_inputs():
    """adm_evaluator_reference's inputs, float16 as ADM's evaluator was given them."""
    rng = np.random.default_rng(ADM_SEED)

    def family(d, r):
        return rng.standard_normal((r, d)) / math.sqrt(r)

    def draw(basis, n, shift, noise):
        z = rng.standard_normal((n, basis.shape[0]))
        x = z @ basis + noise * rng.standard_normal((n, basis.shape[1])) + shift
        return np.abs(x).astype(np.float16)

    pool, spatial = family(2048, 64), family(2023, 48)
    out = {"ref_pool": draw(pool, 2200, 0.40, 0.30), "sample_pool": draw(pool, 2100, 0.43, 0.33),
           "ref_spatial": draw(spatial, 2100, 0.20, 0.30),
           "sample_spatial": draw(spatial, 2050, 0.22, 0.32)}
    small = family(64, 16)
    out["near_ref"] = draw(small, 4000, 0.40, 0.30)
    out["near_sample"] = draw(small, 3000, 0.41, 0.30)
    out["logits_w"] = (rng.standard_normal((2048, 1008)) * 0.05).astype(np.float16)
    for name, a in out.items():
        check_digest(f"adm_evaluator_reference: the drawn {name}",
                     hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
                     ADM_SHA256[name])
        a.setflags(write=False)
    return out


def inception_layout():
    """[(name, shape, dtype)] of torch-fidelity's FeatureExtractorInceptionV3.state_dict()."""
    spec = json.loads((FIXTURES / "fid_inception_state_dict_layout.json").read_text())
    return [(name, tuple(shape), dtype) for name, shape, dtype in spec["entries"]]


def _draw_entry(name, shape, g):
    if name.endswith("num_batches_tracked"):
        return torch.zeros(shape, dtype=torch.int64)
    if name.endswith("running_var"):
        t = torch.rand(shape, generator=g) + 0.5
    elif name.endswith("running_mean"):
        t = torch.randn(shape, generator=g) * 0.1
    elif name.endswith("bn.weight"):
        t = torch.rand(shape, generator=g) * 0.5 + 0.75
    elif name.endswith("bn.bias"):
        t = torch.randn(shape, generator=g) * 0.1
    elif len(shape) >= 2:
        t = torch.randn(shape, generator=g) * math.sqrt(2 / math.prod(shape[1:]))
    else:
        t = torch.randn(shape, generator=g) * 0.05
    return t.half()


@functools.lru_cache(maxsize=None)
def _inception_state_dict():
    g = torch.Generator().manual_seed(INCEPTION_SEED)
    h = hashlib.sha256()
    sd = {}
    for name, shape, dtype in inception_layout():
        t = _draw_entry(name, shape, g)
        assert str(t.dtype) == dtype, (name, t.dtype, dtype)
        sd[name] = t
        h.update(name.encode("utf-8"))
        h.update(t.contiguous().numpy().tobytes())
    check_digest("fid_inception_reference: the drawn state_dict", h.hexdigest(),
                 INCEPTION_STATE_SHA256)
    return sd


def inception_state_dict():
    """The seeded random weights the Inception reference outputs were computed with, in
    torch-fidelity's key layout, float16 (cast to float32: the exact weights used). A fresh dict
    of the cached tensors: callers may change the dict, not the tensors."""
    return dict(_inception_state_dict())


@functools.lru_cache(maxsize=None)
def _inception_images(size):
    g = torch.Generator().manual_seed(size)
    images = torch.randint(0, 256, (3, 3, size, size), generator=g, dtype=torch.uint8)
    images[0] = 0
    check_digest(f"fid_inception_reference: the drawn images_{size}",
                 hashlib.sha256(images.numpy().tobytes()).hexdigest(),
                 INCEPTION_IMAGES_SHA256[size])
    return images


def inception_images(size):
    """uint8 [3, 3, size, size] (image 0 all black): the images the outputs are of."""
    return _inception_images(size).clone()


# ---------------------------------------------------------------- upstream's initial weights
#
# The small models of upstream_init_layouts.json (tests/fixtures/upstream_init_layouts.py wrote
# it, from upstream's own modules) are upstream's own initialisation after torch.manual_seed(
# seed), then every all-zero parameter re-drawn from N(0, 0.02), in state-dict order, from the
# same generator. Each entry names the draw that upstream's module made for it (PyTorch's
# default reset_parameters, or upstream's own), so the weights come back without upstream's
# code; the layout's sha256 is that of the state dict upstream's process held.


@functools.lru_cache(maxsize=None)
def init_layouts():
    return json.loads((FIXTURES / "upstream_init_layouts.json").read_text())


def state_dict_sha256(sd):
    """Over each entry in order: its UTF-8 name, then the tensor's contiguous bytes."""
    h = hashlib.sha256()
    for name, t in sd.items():
        h.update(name.encode("utf-8"))
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _init_entry(shape, kind, g):
    t = torch.empty(shape)
    if kind[0] == "kaiming_uniform":  # Conv*d / Linear weight: kaiming_uniform_(a=sqrt(5))
        torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    elif kind[0] == "fan_in_uniform":  # their bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1 / math.sqrt(kind[1])
        torch.nn.init.uniform_(t, -bound, bound, generator=g)
    elif kind[0] == "normal":  # Embedding
        torch.nn.init.normal_(t, generator=g)
    elif kind[0] == "randn_over_sqrt_dim0":  # guided's AttentionPool2d.positional_embedding
        t = torch.randn(shape, generator=g) / shape[0] ** 0.5
    elif kind[0] == "ones":
        t.fill_(1.0)
    elif kind[0] == "zeros":
        t.zero_()
    else:
        raise ValueError(f"unknown draw {kind}")
    if "zeroed" in kind:  # zero_module(): drawn, then zeroed
        t.zero_()
    return t


def build_init_state_dict(layout):
    g = torch.Generator().manual_seed(layout["seed"])
    sd = {name: _init_entry(tuple(shape), kind, g) for name, shape, kind in layout["entries"]}
    for t in sd.values():  # the informative re-draw of what upstream left at zero
        if not t.any():
            t.normal_(0, 0.02, generator=g)
    return sd


@functools.lru_cache(maxsize=None)
def _upstream_init(fixture, model):
    layout = init_layouts()[fixture][model]
    sd = build_init_state_dict(layout)
    check_digest(f"{fixture}[{model!r}]: the drawn state_dict", state_dict_sha256(sd),
                 layout["sha256"])
    return sd


def upstream_init(fixture, model=""):
    """The weights of FIXTURE (its model MODEL; "" for a file of one state dict), a fresh dict
    of fresh tensors."""
    return {k: v.clone() for k, v in _upstream_init(fixture, model).items()}


def upstream_init_file(fixture, path):
    """Write FIXTURE's weights to PATH as upstream's file held them (a raw state dict, or
    {model: state dict}); returns PATH."""
    models = init_layouts()[fixture]
    if list(models) == [""]:
        torch.save(upstream_init(fixture), path)
    else:
        torch.save({m: upstream_init(fixture, m) for m in models}, path)
    return path


def upstream_weights(fixture):
    """What FIXTURE.pt held: a raw state dict, or {model: state dict}; fresh tensors."""
    models = init_layouts()[fixture]
    if list(models) == [""]:
        return upstream_init(fixture)
    return {m: upstream_init(fixture, m) for m in models}
