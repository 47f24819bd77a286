"""DiT against the demo's UNet on the digits at 16 px, on this machine (issue 22).

A DiT-S/2-sized model (hidden size 384, 6 heads, patch 2; --dit_depth blocks instead of DiT-S's
12, for CPU time) and the demo's UNet (scripts/demo.py: channel_mult 1,2,2, one residual block per
level, no attention) widened to about the same parameter count (the width and residual blocks of
the demo's family closest to the DiT's count). Both are class-conditional x0-predictors on the
demo's 200-step cosine schedule, trained by the real TrainLoop (checkpoints off) in this one
process for the same wall time (--seconds each, data loading included), on the same digits
folder (datasets/digits.py), then sampled with DDIM (--num_samples, classes 0..9 in turn, the
trained weights: the EMA of so short a run lags too far behind) and scored as the demo scores its
samples (scripts/eval_digits.py: label agreement of a classifier trained on the real digits).

    flock /tmp/heavy.lock python benchmarks/dit_vs_unet.py --seconds 60 --threads 1

One JSON line per figure: steps_per_s and label_agreement for each model, with its parameter
count and the steps it took. Not a race on CPU: it tells users what to expect here.
"""
import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "datasets"))

# scripts/demo.py's model and training settings (its defaults for a full run).
DEMO = dict(image_size=16, class_cond=True, num_classes=10, num_channels=32, num_res_blocks=1,
            channel_mult="1,2,2", attention_resolutions="", learn_sigma=False,
            predict_xstart=True, diffusion_steps=200, noise_schedule="cosine")
DEMO_LR, DEMO_BATCH = 2e-3, 32


def params_of(flags):
    import torch as th

    from improved_diffusion.script_util import create_model_and_diffusion

    with th.device("meta"):
        model, _ = create_model_and_diffusion(**flags)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def model_flags(dit_depth):
    """(DiT flags, UNet flags): the DiT-S/2-sized DiT, and the demo's UNet family member with
    the parameter count closest to it."""
    from improved_diffusion.script_util import model_and_diffusion_defaults

    base = dict(model_and_diffusion_defaults(), **DEMO)
    dit = dict(base, arch="DiT-S/2", dit_depth=dit_depth)
    target = params_of(dit)
    unets = [dict(base, num_channels=c, num_res_blocks=r) for c in (32, 64, 96, 128, 160)
             for r in (1, 2, 3)]
    unet = min(unets, key=lambda f: abs(params_of(f) - target))
    return dit, unet


def train_for(flags, data_dir, seconds, lr, batch, log_dir):
    """Train with the real TrainLoop until `seconds` of wall time; returns (model, diffusion,
    steps, elapsed seconds)."""
    from improved_diffusion import logger, train_util
    from improved_diffusion.image_datasets import load_data
    from improved_diffusion.script_util import create_model_and_diffusion

    class NoSave(train_util.TrainLoop):
        def save(self, wait=False):  # the benchmark measures steps, not checkpoints
            pass

    logger.configure(dir=log_dir, format_strs=[])
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = create_model_and_diffusion(**flags)
    data = load_data(data_dir=data_dir, batch_size=batch, image_size=flags["image_size"],
                     class_cond=True, num_classes=10, seed=0)
    loop = NoSave(model=model, diffusion=diffusion, data=data, batch_size=batch, microbatch=-1,
                  lr=lr, ema_rate="0.995", log_interval=10 ** 9, save_interval=0,
                  resume_checkpoint="", log_dir=log_dir, model_flags=flags, max_steps=0, seed=0)
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        loop.max_steps = loop.step + 1
        loop.run_loop()
    return model, diffusion, loop.step, time.perf_counter() - began


def label_agreement(model, flags, num_samples, sample_steps):
    """The demo's evaluation of `num_samples` DDIM samples (classes 0..9 in turn)."""
    import digits  # datasets/digits.py

    from improved_diffusion import sampling
    from improved_diffusion.script_util import create_gaussian_diffusion

    spaced = create_gaussian_diffusion(
        steps=flags["diffusion_steps"], learn_sigma=flags["learn_sigma"],
        noise_schedule=flags["noise_schedule"], predict_xstart=flags["predict_xstart"],
        rescale_timesteps=flags["rescale_timesteps"], timestep_respacing=f"ddim{sample_steps}")
    model.eval()
    images, labels = sampling.generate(
        model, spaced, num_samples=num_samples, batch_size=num_samples, shape=(3, 16, 16),
        use_ddim=True, num_classes=10, classes=list(range(10)), progress=False)
    return digits.evaluate_samples(images, labels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="training wall time per model")
    p.add_argument("--dit_depth", type=int, default=2, help="DiT blocks (DiT-S has 12)")
    p.add_argument("--dit_lr", type=float, default=5e-4,
                   help="the DiT's lr (the demo's 2e-3 is the UNet's)")
    p.add_argument("--batch_size", type=int, default=DEMO_BATCH)
    p.add_argument("--num_samples", type=int, default=50)
    p.add_argument("--sample_steps", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch as th

    import digits  # datasets/digits.py

    th.set_num_threads(args.threads)
    command = "python benchmarks/dit_vs_unet.py " + " ".join(argv or sys.argv[1:])
    dit, unet = model_flags(args.dit_depth)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "digits")
        digits.write_digits_folder(data_dir, size=16, log=lambda *a: None)
        for name, flags, lr in (("unet", unet, DEMO_LR), ("dit", dit, args.dit_lr)):
            model, _, steps, took = train_for(flags, data_dir, args.seconds, lr,
                                              args.batch_size, os.path.join(tmp, name))
            scores = label_agreement(model, flags, args.num_samples, args.sample_steps)
            config = {"arch": flags["arch"], "params": params_of(flags), "lr": lr,
                      "batch_size": args.batch_size, "threads": args.threads}
            if name == "dit":
                config.update(dit_depth=flags["dit_depth"], hidden_size=384, patch_size=2)
            else:
                config.update(num_channels=flags["num_channels"],
                              num_res_blocks=flags["num_res_blocks"])
            for figure, value, unit in (
                    ("steps_per_s", round(steps / took, 3), "steps/s"),
                    ("label_agreement", round(scores["label_agreement"], 3), "share")):
                print(json.dumps({"figure": f"{name}_{figure}", "value": value, "unit": unit,
                                  "steps": steps, "train_seconds": round(took, 1),
                                  "num_samples": args.num_samples,
                                  "ddim_steps": args.sample_steps, **config,
                                  "command": command}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
