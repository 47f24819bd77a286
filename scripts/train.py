r"""Train a diffusion model on images (upstream's image_train.py; resume works on any rank count).

    mpiexec -n N python scripts/train.py --data_dir D --log_dir L $MODEL_FLAGS $DIFFUSION_FLAGS \
        $TRAIN_FLAGS [--resume_checkpoint auto|L/modelNNNNNN.pt|RUN_DIR] [--max_steps N]

Exit codes: 0 done; 75 (train_util.PREEMPTED_EXIT_CODE) after a SIGTERM/SIGUSR1 save;
1 on errors (one line "error: ..." on stderr, once for the job); 2 bad usage; 130 after a
KeyboardInterrupt (a SystemExit keeps its code) on any rank, which ends every rank.

--dist_timeout SECONDS (default 600) bounds the rendezvous and every wait between ranks: a rank or
host that dies ends the job within about that long, with a message naming the lost rank(s). Under
a multi-host mpiexec, set MASTER_ADDR to an address of rank 0's host that every host can reach
when it cannot be found (the job says so at once). One job per log dir: a second job waits up to
--lock_wait seconds for the first, then fails naming it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # first, before torch is imported: SIGTERM/SIGUSR1 from here on
    from improved_diffusion.infra import preemption  # end the job with exit 75 (preemption.py)

    preemption.install()

from improved_diffusion.infra import cli
from improved_diffusion import dist_util, logger, train_job, train_util  # noqa: E402
from improved_diffusion.image_datasets import describe_classes, load_data  # noqa: E402
from improved_diffusion.resample import create_named_schedule_sampler  # noqa: E402
from improved_diffusion.script_util import (  # noqa: E402
    create_model_and_diffusion,
    model_and_diffusion_defaults,
    train_defaults,
)
from improved_diffusion.infra.flags import args_to_dict, create_parser, explicit_args  # noqa: E402


def create_argparser():
    defaults = train_defaults()
    defaults.update(model_and_diffusion_defaults())
    return create_parser(__doc__, defaults, prog="train.py")


def build(args):
    """Flags -> the model, diffusion and data of a TrainLoop (collective: call on all ranks)."""
    args.num_classes = train_job.num_classes(args)
    model_flags = args_to_dict(args, model_and_diffusion_defaults().keys())
    train_util.seed_rngs(args.seed, 0, 0)  # identical model init on every rank
    model, diffusion = create_model_and_diffusion(**model_flags)
    model.to(dist_util.dev())
    data = load_data(
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        image_size=args.image_size,
        class_cond=args.class_cond,
        num_classes=args.num_classes if args.class_cond else None,
        seed=args.seed,
        num_workers=args.num_workers,
        in_channels=args.in_channels,
        log=logger.warn,  # a resume's data warnings: one line, once for the job
    )
    if args.class_cond:  # (TrainLoop stores the names in the weights files, for sampling)
        logger.log(describe_classes(data.class_rule, data.class_names))
    sampler = create_named_schedule_sampler(args.schedule_sampler, diffusion)
    return train_job.Parts(model, diffusion, data, model_flags, sampler)


def train(argv=None):
    """Parse flags and run the job; returns the exit code (0 done, 75 preempted)."""
    parser = create_argparser()
    args = parser.parse_args(argv)
    given = explicit_args(parser, argv)  # a resume takes the others from the checkpoint
    if args.class_cond and "num_classes" not in given:
        args.num_classes = None  # build(): the resumed checkpoint's, else --data_dir's
    return train_job.run_training(args, build, given, check=train_job.check_train_args)


def main(argv=None):
    return cli.run_main(train, argv)


if __name__ == "__main__":
    cli.exit_process(main())
