"""
The checkpoint doctor: inspect, verify, diff, convert and prune checkpoints; reconstruct
post-hoc EMAs.

    python scripts/ckpt.py inspect FILE
    python scripts/ckpt.py verify DIR [--quick]      (deep by default: loads files, checks checksums)
    python scripts/ckpt.py diff FILE --flags "--image_size 32 ..."   (or --against FILE2)
    python scripts/ckpt.py convert SRC --to tagged|raw|safetensors --out DIR [--flags "..."]
    python scripts/ckpt.py prune DIR --keep K [--delete_snapshots]   (snapshots are kept)
    python scripts/ckpt.py phema DIR --std 0.07 [--std 0.1 ...] [--step S] --out FILE_OR_DIR
                                   (post-hoc EMA: EDM2's reconstruction from phema_*.pt snapshots)
    python scripts/ckpt.py phema DIR --std 0.03,0.05,0.1 --evaluate REF.npz [--num_samples M]
                                   (the widths scored by FID, the best named, phema_sweep.png)

Add --json for machine-readable output. Exit status: 0 healthy, 1 problem found, 2 bad usage.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion.apps.ckpt_tool import main  # noqa: E402

if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(main())
