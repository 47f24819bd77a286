"""
Mixed precision for --use_fp16: torch.autocast plus torch's GradScaler, no fp16 master weights.

    dtype, scaler = make_amp(device, use_fp16, fp16_scale_growth)
    with autocast(device, dtype): loss = ...        # a no-op context when dtype is None

What --use_fp16 gives, by device:

- CUDA: float16 autocast with a GradScaler (upstream's initial loss scale 2**20).
- a CPU with bfloat16 units (x86 AVX512-BF16 or AMX, Arm BF16; ``cpu_has_fast_bf16``): bfloat16
  autocast without a scaler (bf16 has float32's range: no overflow, no skipped steps).
  benchmarks/amp_cpu.py on an Intel Xeon with AVX512-BF16/AMX, 2026-12-01: bf16 0.6-0.7x the
  fp32 step time, fp16 134-155x.
- other CPUs: float16 autocast with a GradScaler as asked, and a one-line warning: there it is
  emulated and far slower than float32 (benchmarks/amp_cpu.py without BF16 units: bf16 4.8x,
  fp16 57x the fp32 step time).
- bfloat16 without a scaler wherever this torch has no float16 autocast or no GradScaler for the
  device (torch.amp.GradScaler exists from torch 2.3; before, only torch.cuda.amp.GradScaler).

Upstream raised log2(loss scale) by fp16_scale_growth per good step; GradScaler doubles the scale
after 1/fp16_scale_growth good steps, which is the same rate in steps of 2x.
"""
import contextlib

import torch as th

from . import logger

# Upstream's initial fp16 loss scale was 2**20 (INITIAL_LOG_LOSS_SCALE = 20.0).
INITIAL_LOSS_SCALE = 2.0 ** 20


def make_amp(device, use_fp16, fp16_scale_growth):
    """(autocast dtype or None, GradScaler or None) for --use_fp16 on ``device`` (see above)."""
    if not use_fp16:
        return None, None
    if device.type == "cpu" and cpu_has_fast_bf16():
        logger.log("--use_fp16: bfloat16 autocast (this CPU has bfloat16 units; no loss scaling)")
        return th.bfloat16, None
    if device.type == "cpu":
        logger.log("warning: --use_fp16 True: this CPU has no float16/bfloat16 units, so mixed "
                   "precision is slower than fp32 here (benchmarks/amp_cpu.py); using float16 "
                   "autocast as asked (--use_fp16 False trains faster)")
    interval = max(1, int(round(1.0 / fp16_scale_growth))) if fp16_scale_growth > 0 else 10 ** 9
    try:
        scaler = grad_scaler(device.type, init_scale=INITIAL_LOSS_SCALE, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=interval)
        with th.autocast(device_type=device.type, dtype=th.float16):
            th.nn.functional.conv2d(th.zeros(1, 1, 3, 3, device=device),
                                    th.zeros(1, 1, 1, 1, device=device))
        return th.float16, scaler
    except (RuntimeError, AssertionError, ValueError) as e:
        logger.log(f"--use_fp16: float16 autocast unsupported on {device.type} ({e}); using "
                   f"bfloat16")
        return th.bfloat16, None


def grad_scaler(device_type, **kwargs):
    """A GradScaler for ``device_type``: torch.amp.GradScaler (torch >= 2.3), else
    torch.cuda.amp.GradScaler on CUDA; RuntimeError when this torch has none for the device."""
    cls = getattr(th.amp, "GradScaler", None)
    if cls is not None:
        return cls(device_type, **kwargs)
    if device_type == "cuda":
        return th.cuda.amp.GradScaler(**kwargs)
    raise RuntimeError(f"torch {th.__version__} has no GradScaler for {device_type}")


def autocast(device, dtype):
    """torch.autocast for ``dtype`` on ``device``, or a no-op context when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return th.autocast(device_type=device.type, dtype=dtype)


def cpu_has_fast_bf16(cpuinfo="/proc/cpuinfo"):
    """True when this CPU computes in bfloat16 natively (x86 AVX512-BF16 or AMX, Arm BF16); False
    elsewhere, where bf16 is emulated and slower than fp32 (benchmarks/amp_cpu.py)."""
    try:
        with open(cpuinfo) as f:
            words = set(f.read().split())
    except OSError:  # no /proc (macOS, Windows): do not guess
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def scale_tensor(scaler):
    """The GradScaler's current scale as a device tensor (not read to the host)."""
    get = getattr(scaler, "_get_scale_async", None)
    return get() if callable(get) else th.tensor(scaler.get_scale())


def scaled_step(scaler, opt, step):
    """The optimizer step of training step ``step`` through ``scaler`` (its gradients already
    unscaled): step, update, and the loss scale logged (on the device). Returns False when the
    scaler skipped it (NaN/inf float16 gradients: the scale went down, said in one line), else
    True. One host sync: the comparison of the scales."""
    scale = scale_tensor(scaler).clone()
    scaler.step(opt)
    scaler.update()
    new_scale = scale_tensor(scaler)
    logger.logkv_device("loss_scale", new_scale)
    if bool(new_scale < scale):
        logger.logkv_mean("fp16_skipped", 1)
        logger.log(f"step {step} skipped: NaN/inf float16 gradients at loss scale "
                   f"{float(scale):g} (now {float(new_scale):g}; usual in the first steps)")
        return False
    return True
