"""
upstream improved-diffusion's name for scripts/sample.py: samples from a model into an npz.

    export OPENAI_LOGDIR=OUT
    python scripts/image_sample.py --model_path RUN/ema_0.9999_010000.pt $MODEL_FLAGS \
        $DIFFUSION_FLAGS --num_samples 100 --batch_size 16 [--use_ddim True]

Takes upstream's flags (clip_denoised, num_samples, batch_size, use_ddim, model_path and the
model and diffusion flags) and writes upstream's ``samples_{N}x{H}x{W}x3.npz`` (``arr_0`` uint8
NHWC, ``arr_1`` the labels of a class-conditional model) into $OPENAI_LOGDIR (or --log_dir,
else a fresh temporary directory, as upstream). This file only runs sample.py under upstream's
name; see sample.py for what it adds (flags read from our files, per-sample seeds, a png grid).
"""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample.py"),
                   run_name="__main__")
