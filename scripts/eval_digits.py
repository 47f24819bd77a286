"""
Score generated digits (an npz written by sample.py) with a classifier trained on the real
8x8 digits: mean confidence, label agreement, class histogram, Frechet distance.

    python scripts/eval_digits.py samples_100x16x16x3.npz [--json figures.json]

The logic lives in datasets/digits.py.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets"))

import digits  # noqa: E402  (datasets/digits.py)

if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(digits.eval_main())
