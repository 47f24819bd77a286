"""A 2-rank gloo job that ends the way every trainer here ends, as fast as it can: a DDP
wrapper built on the group (which keeps it alive in C++ after destroy_process_group), a few
object broadcasts (run_on_rank0's), then dist_util.cleanup() and the interpreter's exit.

    mpiexec -n 2 python tests/exit_race_job.py [--no_pause] [--switch S]

``--switch S``: sys.setswitchinterval(S) (default Python's 0.005): a long one keeps the GIL
with the main thread until it blocks, as a loaded machine makes the worker late for it.
``--no_pause``: dist_util.GIL_HANDOVER_S = 0, cleanup as it was before its pause (to show the
abort that pause prevents: signal 6 at exit in a few runs in ten on a loaded machine)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch as th  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from improved_diffusion import dist_util  # noqa: E402

if "--switch" in sys.argv:
    sys.setswitchinterval(float(sys.argv[sys.argv.index("--switch") + 1]))
dist_util.setup_dist()
net = DDP(th.nn.Linear(3, 3))
del net
if "--no_pause" in sys.argv:
    dist_util.GIL_HANDOVER_S = 0
for _ in range(3):
    dist_util.broadcast_object(list(range(100)))
dist_util.cleanup()
