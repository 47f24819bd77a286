"""
The random-number state of one process: seeding, and a state that a checkpoint can hold.

    seed_rngs(seed, step, rank)      # python, numpy and torch (CPU and this rank's GPU)
    state = get_rng_state()          # weights_only-loadable data
    note = set_rng_state(state)      # None, or one line saying what could not be restored

What a state holds: python's ``random``, numpy's global generator, torch's CPU generator, and the
generator of this process's own CUDA device (``torch.cuda.current_device()``; the one its
dropout and noise draw from), with that device's index. Each rank saves its own state, and a
checkpoint keeps them by rank (checkpointer.py), so a resume on another GPU layout (2 nodes x 4
GPUs -> 1 x 8, per-task CUDA_VISIBLE_DEVICES) puts each rank's generator back on whatever device
that rank now uses. Nothing here is collective or knows about ranks: the rank is an argument.
"""
import random

import numpy as np
import torch as th


def derived_seed(seed, step, rank):
    """One 32-bit seed from (seed, step, rank): different streams for every rank and step."""
    return int(np.random.SeedSequence([int(seed), int(step), int(rank)]).generate_state(1)[0])


def seed_rngs(seed, step=0, rank=0):
    """Seed python, numpy and torch (CPU and every CUDA device) from (seed, step, rank)."""
    s = derived_seed(seed, step, rank)
    random.seed(s)
    np.random.seed(s)
    th.manual_seed(s)


def _cuda_device():
    """This process's CUDA device index, or None without CUDA."""
    if not th.cuda.is_available():
        return None
    return th.cuda.current_device()


def get_rng_state():
    """This process's RNG states as weights_only-loadable data (dicts, lists, ints, tensors).

    ``"cuda"`` is the state of this process's own CUDA device (a uint8 tensor) and
    ``"cuda_device"`` its index; both None without CUDA."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, pystate, gauss_next = random.getstate()
    device = _cuda_device()
    return {
        "torch": th.get_rng_state(),
        "numpy": {"name": str(name), "keys": th.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": [int(x) for x in pystate],
                   "gauss_next": None if gauss_next is None else float(gauss_next)},
        "cuda": None if device is None else th.cuda.get_rng_state(device),
        "cuda_device": device,
    }


def set_rng_state(state):
    """Inverse of get_rng_state(). Returns None when every generator was restored, else one line
    saying which was not (the CUDA generator when this process has no CUDA device, or the
    checkpoint had none; the caller logs it)."""
    th.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    return _set_cuda_state(state.get("cuda"), state.get("cuda_device"))


def _set_cuda_state(saved, saved_device):
    device = _cuda_device()
    if isinstance(saved, (list, tuple)):  # older files: every visible device's state, by index
        if device is None or device >= len(saved):
            return _mismatch(device, f"the states of {len(saved)} device(s), an older layout")
        th.cuda.set_rng_state(saved[device], device)
        return None
    if saved is None and device is None:
        return None
    if saved is None or device is None:
        return _mismatch(device, "none" if saved is None else f"cuda:{saved_device}'s")
    th.cuda.set_rng_state(saved, device)
    return None


def _mismatch(device, saved_what):
    here = "no CUDA device" if device is None else f"device cuda:{device}"
    return (f"the CUDA RNG state was not restored (checkpoint: {saved_what}; this process: "
            f"{here}); dropout and noise on the GPU draw from a fresh stream")
