"""Test helper: scripts/train.py that sends itself SIGTERM on rank RANK while its first
--eval_interval evaluation samples (once per MARKER file: a resumed job evaluates undisturbed).

Usage: python tests/train_eval_preempt.py RANK MARKER [train.py flags...]   (under mpiexec too)
"""
import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if __name__ == "__main__":  # as train.py: the preemption signals are owned from here on
    from improved_diffusion.infra import preemption

    preemption.install()

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, train_eval  # noqa: E402


def main(argv):
    rank, marker, argv = int(argv[0]), Path(argv[1]), argv[2:]
    features_of = train_eval.TrainEval._features_of

    def preempted_features_of(self, model, idx, *rest):
        if dist_util.get_rank() == rank and not marker.exists():
            marker.write_text(f"SIGTERM during the evaluation, rank {rank}\n")
            os.kill(os.getpid(), signal.SIGTERM)
        return features_of(self, model, idx, *rest)

    train_eval.TrainEval._features_of = preempted_features_of
    train = runpy.run_path(str(REPO / "scripts" / "train.py"), run_name="train_module")
    return train["train"](argv)


if __name__ == "__main__":
    sys.exit(cli.run_main(main, sys.argv[1:]))
