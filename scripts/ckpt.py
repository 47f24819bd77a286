"""
The checkpoint doctor: inspect, verify, diff, convert and prune checkpoints.

    python scripts/ckpt.py inspect FILE
    python scripts/ckpt.py verify DIR [--quick]      (deep by default: loads files, checks checksums)
    python scripts/ckpt.py diff FILE --flags "--image_size 32 ..."   (or --against FILE2)
    python scripts/ckpt.py convert SRC --to tagged|raw|safetensors --out DIR [--flags "..."]
    python scripts/ckpt.py prune DIR --keep K

Add --json for machine-readable output. Exit status: 0 healthy, 1 problem found, 2 bad usage.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion.ckpt_tool import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
