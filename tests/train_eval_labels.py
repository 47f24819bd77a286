"""Test helper: scripts/train.py whose --eval_interval evaluations record, on each rank, what
they draw: the global sample indices, their class labels and their images, batch by batch
(OUT/rank{R}.npz: ``indices``, ``labels``, ``images``, in the order drawn).

Usage: python tests/train_eval_labels.py OUT [train.py flags...]   (under mpiexec too)
"""
import runpy
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if __name__ == "__main__":  # as train.py: the preemption signals are owned from here on
    from improved_diffusion.infra import preemption

    preemption.install()

from improved_diffusion.infra import cli
from improved_diffusion import logger, sampling  # noqa: E402


def main(argv):
    out, argv = Path(argv[0]), argv[1:]
    drawn = {"indices": [], "labels": [], "images": []}
    sample_indices = sampling.sample_indices

    def recorded(model, diffusion, idx, **kwargs):
        images, labels = sample_indices(model, diffusion, idx, **kwargs)
        drawn["indices"].append(np.asarray(idx, np.int64))
        drawn["labels"].append(np.full(len(idx), -1) if labels is None else labels)
        drawn["images"].append(images)
        return images, labels

    sampling.sample_indices = recorded
    train = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")
    code = train["train"](argv)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{logger.get_rank_without_dist()}.npz",  # the group is gone by now
             **{k: np.concatenate(v) if v else np.zeros(0) for k, v in drawn.items()})
    return code


if __name__ == "__main__":
    sys.exit(cli.run_main(main, sys.argv[1:]))
