r"""Train guided-diffusion's noised image classifier (its classifier_train.py, with its flags), for
classifier guidance (classifier_sample.py --classifier_path); resume works on any rank count.

    mpiexec -n N python scripts/classifier_train.py --data_dir D --log_dir L \
        --image_size 64 --classifier_width 128 --classifier_depth 2 --iterations 300000 \
        --batch_size 64 --lr 3e-4 --save_interval 10000 [--val_data_dir V --eval_interval 5]
    torchrun --nproc_per_node N scripts/classifier_train.py ...      # or plain python: one rank

The class of an image is its file name before the first '_' (as train.py's --class_cond); the
number of classes comes from --data_dir (or the resumed file), unless --classifier_num_classes
says it. Each step noises the batch to x_t at timesteps drawn by --schedule_sampler (--noised
True) and trains on the cross-entropy of the logits; the log shows train_loss, train_acc@1 and
train_acc@5 overall and by quarter of the timestep range (_q0 .. _q3), and every --eval_interval
steps the same on --val_data_dir (val_*).

Checkpoints as train.py's, in --log_dir: model{S}.pt (kind "classifier": the weights and the
classifier's and diffusion's flags), opt{S}.pt (optimizer and trainer state), manifest{S}.json
last. The same command again auto-resumes the newest complete step, bitwise equal to a straight
run on the same ranks; another rank count continues the data. With --global_batch_size G
--microbatch m instead of --batch_size, the run is the same bit for bit on any rank count
dividing G/m (virtual shards: improved_diffusion/virtual_shards.py), validation included. guided-diffusion's raw files
resume as they are: --resume_checkpoint RUN/model010000.pt (its opt010000.pt beside).

Exit codes: 0 done; 75 after a SIGTERM/SIGUSR1 save (requeue on it); 1 on errors (one line
"error: ..."); 2 bad usage. One job per log dir (--lock_wait).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # first, before torch is imported: SIGTERM/SIGUSR1 from here on
    from improved_diffusion.infra import preemption  # end the job with exit 75 (preemption.py)

    preemption.install()

from improved_diffusion import classifier_train
from improved_diffusion.infra import cli  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    classifier_and_diffusion_defaults,
    classifier_train_defaults,
)
from improved_diffusion.infra.flags import create_parser, explicit_args  # noqa: E402


def create_argparser():
    defaults = classifier_train_defaults()
    defaults.update(classifier_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="classifier_train.py")


def train(argv=None):
    """Parse flags and run the job; returns the exit code (0 done, 75 preempted)."""
    parser = create_argparser()
    args = parser.parse_args(argv)
    given = explicit_args(parser, argv)  # the others: the resumed file's, --diffusion_from's
    if "classifier_num_classes" not in given:
        args.classifier_num_classes = None  # the resumed file's, else --data_dir's
    return classifier_train.run_job(args, given)  # checks the flags first (check_args)


def main(argv=None):
    return cli.run_main(train, argv)


if __name__ == "__main__":
    cli.exit_process(main())
