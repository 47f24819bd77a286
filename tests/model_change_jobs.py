"""Test helper: several scripts/train.py jobs in one process, each rank's state dumped after
each job's resume (tests/test_model_change.py).

Usage: python tests/model_change_jobs.py DUMP_DIR JOBS_JSON      (under mpiexec -n N too)

JOBS_JSON: a file holding [[name, [train.py flags...]], ...], run in order in one process group
(one python start for a whole matrix). Per job and rank r, right after its TrainLoop was built
(i.e. after its resume): DUMP_DIR/{name}_loaded_rank{r}.pt (tests/train_dump.py's run_job and
dump: step, model, EMAs, named optimizer state; {name}_final_rank{r}.pt after training) and
DUMP_DIR/{name}_trainer_rank{r}.pt ({"data", "rng", "sampler", "model_changes"} as restored). Then the job trains to its --max_steps and saves, as
train.py does. `run_jobs(dump_dir, jobs)` does the same in the calling process (1 rank).
"""
import json
import os
import sys
from pathlib import Path

import torch as th

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from improved_diffusion import dist_util, train_util  # noqa: E402
from train_dump import run_job  # noqa: E402


def _dump_trainer(dump_dir, name):
    def after_load(loop, rank):
        th.save({"data": loop.data.state_dict(), "rng": train_util.get_rng_state(),
                 "sampler": loop.schedule_sampler.state_dict(),
                 "model_changes": loop.checkpointer.model_changes},
                os.path.join(dump_dir, f"{name}_trainer_rank{rank}.pt"))
    return after_load


def run_jobs(dump_dir, jobs):
    os.makedirs(dump_dir, exist_ok=True)
    for name, argv in jobs:
        code = run_job(dump_dir, argv, prefix=f"{name}_", after_load=_dump_trainer(dump_dir, name))
        if code != 0:
            return code
    return 0


def main():
    dump_dir, jobs_file = sys.argv[1], sys.argv[2]
    code = run_jobs(dump_dir, json.loads(Path(jobs_file).read_text()))
    dist_util.cleanup()
    return code


if __name__ == "__main__":
    from improved_diffusion.infra.process_exit import exit_process

    exit_process(main())
