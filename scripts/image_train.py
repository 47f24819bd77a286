"""
upstream improved-diffusion's name for scripts/train.py: train a diffusion model on images.

    export OPENAI_LOGDIR=RUN
    mpiexec -n N python scripts/image_train.py --data_dir D $MODEL_FLAGS $DIFFUSION_FLAGS $TRAIN_FLAGS

Job scripts written for upstream run unchanged: train.py takes every flag of upstream's
image_train.py (with upstream's defaults) plus its own, writes the same file names into
$OPENAI_LOGDIR (or --log_dir), and resumes that directory's newest complete step by itself.
This file only runs train.py under upstream's name (see train.py for the rest). One difference:
with neither $OPENAI_LOGDIR nor --log_dir set, upstream trained into a fresh temporary directory
(its checkpoints then easy to lose); this stops at once with exit 2 and asks for one.
"""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
                   run_name="__main__")
