"""What the tests' drivers of scripts/train.py share (amp_train.py, fault_train.py,
nan_train.py, record_io_train.py, slow_save_train.py): the repository importable, and train.py
run as ``python scripts/train.py ARGS`` would run it, ARGS being the driver's own arguments.
A driver patches what it needs first, then calls ``run_train_py()``."""
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_train_py():
    """Run scripts/train.py as __main__ with this process's arguments (exits as it exits)."""
    script = str(REPO / "scripts" / "train.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
