r"""Draw a run's loss curve (PNG) from its progress.csv: the loss by timestep quartile
(loss_q0..loss_q3) against the step, on a log scale; the steps where the run was preempted or
resumed (from RUN_DIR/log.txt) are marked with a dashed line.

    python scripts/plot_progress.py RUN_DIR [--out RUN_DIR/loss_curve.png]

Exit codes: 0 written, 1 no progress.csv or no loss values in it, 2 bad usage.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from improved_diffusion.infra import cli  # noqa: E402
from improved_diffusion.progress_plot import plot_loss_curve, run_events  # noqa: E402
from improved_diffusion.infra.flags import FlagParser  # noqa: E402


def main(argv=None):
    p = FlagParser(prog="plot_progress.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a --log_dir of train.py")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="where to write the PNG (default RUN_DIR/loss_curve.png)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(args.run_dir, "loss_curve.png")
    n = plot_loss_curve(os.path.join(args.run_dir, "progress.csv"), out,
                        marks=run_events(os.path.join(args.run_dir, "log.txt")))
    print(f"loss curve of {n} logged steps: {out}")
    return 0


if __name__ == "__main__":
    cli.exit_process(cli.run_main(main))
