"""The numerics tests on the other kinds of CPU (issue 29, item 22): a CPU without AVX-512 and
bfloat16 units takes other kernels (PyTorch's ATen dispatch, oneDNN's), whose float32 results
differ in the last bits. The tolerances come from the float32 error of each computation, not
from one CPU, so the tolerance-bound tests must pass whichever kernels run. This machine cannot
lose its units, so the child pytest is told to use the older ones: ``ATEN_CPU_CAPABILITY``
(default: no vector extensions; avx2) and ``ONEDNN_MAX_CPU_ISA``. `make soak` (a few minutes)."""
import subprocess
import sys

import pytest

from conftest import REPO, child_env, hang_s

# The tests whose tolerances depend on the kernels (float32 sums in another order).
NUMERICS = ["tests/test_cfg.py", "tests/test_upstream_numerics.py", "tests/test_diffusion.py",
            "tests/test_dit.py"]


@pytest.mark.slow
@pytest.mark.parametrize("aten, onednn", [("default", "SSE41"), ("avx2", "AVX2")])
def test_the_numerics_tests_pass_with_the_kernels_of_a_cpu_without_avx512_or_bf16(aten, onednn):
    env = child_env({"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn})
    check = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    used = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                          text=True, timeout=hang_s(120), check=True).stdout.strip()
    assert used == aten.upper(), used  # the child really runs the older kernels
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *NUMERICS], cwd=str(REPO), env=env, capture_output=True, text=True,
                          timeout=hang_s(1800))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
