"""Training step time on this CPU: fp32 vs bfloat16 autocast vs float16 autocast (issue 13).

What `--use_fp16 True` costs on a CPU, measured side by side in the same run on the demo's model
(a class-conditional UNet, 16 px, 32 channels, batch 32): forward + backward + AdamW step, the
median of --repeat timed steps after --warmup untimed ones, one thread. fp32 is the reference.
It also prints what amp.make_amp decides for this CPU. One JSON line per figure:

    python benchmarks/amp_cpu.py [--repeat 10] [--warmup 3] [--batch_size 32]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch as th  # noqa: E402

from improved_diffusion import amp, script_util  # noqa: E402

CMD = "python benchmarks/amp_cpu.py"


def step_time(dtype, args):
    th.manual_seed(0)
    flags = script_util.model_and_diffusion_defaults()
    flags.update(image_size=16, num_channels=32, num_res_blocks=1, channel_mult="1,2,2",
                 attention_resolutions="", class_cond=True, num_classes=10, diffusion_steps=200,
                 noise_schedule="cosine", predict_xstart=True)
    model, diffusion = script_util.create_model_and_diffusion(**flags)
    opt = th.optim.AdamW(model.parameters(), lr=1e-4)
    x = th.randn(args.batch_size, 3, 16, 16)
    y = th.randint(0, 10, (args.batch_size,))
    times = []
    for i in range(args.warmup + args.repeat):
        t = th.randint(0, 200, (args.batch_size,))
        start = time.perf_counter()
        ctx = (th.autocast("cpu", dtype=dtype) if dtype is not None
               else contextlib.nullcontext())
        with ctx:
            loss = diffusion.training_losses(model, x, t, model_kwargs={"y": y})["loss"].mean()
        opt.zero_grad()
        loss.float().backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=32)
    args = p.parse_args()
    th.set_num_threads(1)
    ref = step_time(None, args)
    print(json.dumps({"figure": "cpu_step_s_fp32", "value": round(ref, 4), "unit": "s",
                      "reference": True, "command": CMD}), flush=True)
    for name, dtype in (("bf16", th.bfloat16), ("fp16", th.float16)):
        try:
            t = step_time(dtype, args)
        except RuntimeError as e:  # autocast dtype unsupported by this torch on CPU
            print(json.dumps({"figure": f"cpu_step_s_{name}_autocast", "value": None,
                              "error": str(e).splitlines()[0], "command": CMD}), flush=True)
            continue
        print(json.dumps({"figure": f"cpu_step_s_{name}_autocast", "value": round(t, 4),
                          "unit": "s", "vs_fp32": round(t / ref, 2), "command": CMD}),
              flush=True)
    print(json.dumps({"figure": "cpu_fast_bf16", "value": amp.cpu_has_fast_bf16(),
                      "command": CMD}), flush=True)


if __name__ == "__main__":
    main()
