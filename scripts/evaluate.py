"""
Score samples against a reference batch with ADM's evaluator (guided-diffusion's
evaluations/evaluator.py, in PyTorch): Inception Score, FID, sFID, precision, recall.

    python scripts/evaluate.py REF_BATCH SAMPLE_BATCH [--inception_weights PATH] [--batch_size N]
        [--json] [--features inception|digits] [--fid_method auto|sqrtm|eigh]
    mpiexec -n 4 python scripts/evaluate.py ...     # the activations split across ranks
    python scripts/evaluate.py --data_dir DIR --image_size N REF_BATCH [--num_images N]
                                 # a reference batch of the training images, as train.py sees them

The logic lives in improved_diffusion/evaluation.py (and inception.py); docs/evaluation.md.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from improved_diffusion.infra import cli
from improved_diffusion import evaluation  # noqa: E402


def digits_features():
    """The demo's digits classifier (datasets/digits.py) as the feature network."""
    sys.path.insert(0, os.path.join(REPO, "datasets"))
    import digits

    return digits.DigitFeatures()


def main(argv=None):
    return evaluation.main(argv, feature_factories={"digits": digits_features})


if __name__ == "__main__":
    cli.exit_process(cli.run_main(main))
