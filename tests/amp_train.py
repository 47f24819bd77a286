"""Run scripts/train.py as if this CPU had, or had not, bfloat16 units, so that a test takes the
`--use_fp16 True` branch it means on any CPU.

Usage: CPU_BF16=0 python tests/amp_train.py [train.py flags...]   (also under mpiexec)

``CPU_BF16=0``: `--use_fp16 True` on the CPU is float16 autocast with a GradScaler (as on a CPU
without bfloat16 units); ``CPU_BF16=1``: bfloat16 autocast without a scaler (as on one with them).
Unset: the CPU decides. Other drivers (tests/nan_train.py) call ``force_cpu_bf16_from_env()``
too. Nothing else about train.py changes (same flags, output and exit code); a test checks the
branch it asked for in the run's output ("--use_fp16: bfloat16 autocast" or the GradScaler's
"loss_scale"), so a forcing that stopped working fails the test instead of testing the other
branch.
"""
import os
import sys

from train_driver import run_train_py  # tests/ (this script's folder); makes the repo importable


def force_cpu_bf16(value):
    """Make every loaded improved_diffusion module's ``cpu_has_fast_bf16()`` return ``value``
    (the library's own question, answered wherever it lives)."""
    import improved_diffusion.train_job  # noqa: F401  (loads what train.py uses)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("improved_diffusion") and hasattr(module, "cpu_has_fast_bf16"):
            setattr(module, "cpu_has_fast_bf16", lambda *args, **kwargs: value)
            patched.append(name)
    if not patched:
        raise RuntimeError("no improved_diffusion module defines cpu_has_fast_bf16 any more: "
                           "update tests/amp_train.py")


def force_cpu_bf16_from_env():
    """Apply ``CPU_BF16`` (``0``, ``1``, or unset: the CPU decides)."""
    value = os.environ.get("CPU_BF16", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"CPU_BF16 must be 0 or 1, not {value!r}")
    if value:
        force_cpu_bf16(value == "1")


if __name__ == "__main__":
    force_cpu_bf16_from_env()
    run_train_py()
