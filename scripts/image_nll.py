"""
upstream improved-diffusion's name for scripts/nll.py: bits/dim of an image folder under a model.

    export OPENAI_LOGDIR=OUT
    python scripts/image_nll.py --data_dir IMAGES --model_path RUN/ema_0.9999_010000.pt \
        $MODEL_FLAGS $DIFFUSION_FLAGS --num_samples 1000 --batch_size 8

Takes upstream's flags (data_dir, clip_denoised, num_samples, batch_size, model_path and the
model and diffusion flags), logs "done N samples: bpd=..." and writes upstream's
``{vb,mse,xstart_mse}_terms.npz`` into $OPENAI_LOGDIR (or --log_dir). This file only runs nll.py
under upstream's name; see nll.py for the rest.
"""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "nll.py"),
                   run_name="__main__")
