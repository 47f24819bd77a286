"""The command line of every script: one table of every flag's group and meaning, and the parser.

``FLAG_HELP`` maps each flag to its --help group and one-line meaning; the scripts' --help and the
flag table of docs/flags.md (``flags_markdown``) are made from it. The defaults are not here: they
live in script_util's ``*_defaults()`` functions, and a script's parser is
``create_parser(__doc__, defaults)``, which types each ``--key`` like its default.
``FlagParser`` is argparse without prefix matching whose errors are one line (a UsageError, exit 2)
naming the closest known flags; ``explicit_args`` tells the flags typed on the command line from
the defaults (a resume takes the checkpoint's value for the others). ``flags_to_argv`` writes a dict
of flags back as a command line that pastes into any script.

upstream's helpers keep their names here and in script_util (``add_dict_to_argparser``,
``args_to_dict``, ``str2bool``), so upstream's scripts run unchanged.

Example::

    parser = create_parser(__doc__, dict(model_and_diffusion_defaults(), lr=1e-4), "train.py")
    args = parser.parse_args(["--image_size", "32"])   # args.image_size == 32 (an int)
    explicit_args(parser, ["--image_size", "32"])      # {"image_size": 32}
"""
import argparse

from .errors import UsageError


def add_dict_to_argparser(parser, default_dict):
    """Add a ``--key`` option per entry of ``default_dict``, typed like its default value, in the
    group of FLAG_HELP with its meaning and default (flags the table lacks go under "other")."""
    groups = {}
    existing = {g.title: g for g in getattr(parser, "_action_groups", [])}
    order = {g: i for i, g in enumerate(FLAG_GROUPS)}

    def group_of(k):
        group = FLAG_HELP.get(k, ("other",))[0]
        # --batch_size and --seed of a script that does not train are sampling flags there
        return "sampling" if group == "training" and "lr" not in default_dict else group

    items = sorted(default_dict.items(), key=lambda kv: order.get(group_of(kv[0]), len(order)))
    for k, v in items:
        v_type = type(v)
        if v is None:
            v_type = str
        elif isinstance(v, bool):
            v_type = str2bool
        group_name, meaning = group_of(k), FLAG_HELP.get(k, ("other", ""))[1]
        if group_name not in groups:
            title = f"{group_name} flags"
            groups[group_name] = existing.get(title) or parser.add_argument_group(title)
        help_text = f"{meaning} (default {flag_default_text(v)})".strip().replace("%", "%%")
        groups[group_name].add_argument(f"--{k}", default=v, type=v_type, metavar=_metavar(v),
                                        help=help_text)


def args_to_dict(args, keys):
    """Pick ``keys`` from an argparse namespace into a dict."""
    return {k: getattr(args, k) for k in keys}


def str2bool(v):
    """Parse a boolean flag value (true/false, yes/no, t/f, y/n, 1/0; any case).

    https://stackoverflow.com/questions/15008758/parsing-boolean-values-with-argparse
    :raises argparse.ArgumentTypeError: for anything else.
    """
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("yes", "true", "t", "y", "1"):
        return True
    if s in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected a boolean (true/false, yes/no, 1/0), got {v!r}"
    )


# ---------------------------------------------------------------------------------------------
# The command line: one table of every flag's group and meaning (the scripts' --help and the
# flag table of docs/flags.md are made from it), and the parser every script uses.

# Groups in the order --help shows them.
FLAG_GROUPS = ("model", "classifier", "diffusion", "data", "training", "checkpointing",
               "logging", "distributed", "sampling")

# flag -> (group, one-line meaning). Defaults live in script_util's *_defaults() functions.
FLAG_HELP = {
    # model
    "image_size": ("model", "image side in pixels (for latents: the latent side)"),
    "num_channels": ("model", "base channel count of the UNet (a multiple of 32)"),
    "num_res_blocks": ("model", "residual blocks per resolution level"),
    "num_heads": ("model", "attention heads (when --num_head_channels is -1)"),
    "num_heads_upsample": ("model", "attention heads on the way up; -1 = --num_heads"),
    "num_head_channels": ("model", "channels per attention head; -1 = use --num_heads"),
    "attention_resolutions": ("model", "feature-map sizes with self-attention, e.g. 16,8; '' = "
                              "none"),
    "channel_mult": ("model", "width multiplier per level, e.g. 1,2,2; '' = upstream's choice for "
                     "--image_size"),
    "dropout": ("model", "dropout rate in the residual blocks"),
    "learn_sigma": ("model", "the model also outputs the variance (2 x --in_channels output "
                    "channels)"),
    "class_cond": ("model", "class-conditional model: the class of a file is its folder's name "
                   "when --data_dir holds one folder per class, else its name before the "
                   "first '_'"),
    "num_classes": ("model", "classes of a --class_cond model; training without it counts the "
                    "class names in --data_dir"),
    "use_checkpoint": ("model", "gradient checkpointing: less memory, slower steps"),
    "use_scale_shift_norm": ("model", "FiLM-style timestep conditioning in the residual blocks"),
    "resblock_updown": ("model", "residual blocks for up/downsampling (guided-diffusion)"),
    "use_new_attention_order": ("model", "split qkv before the heads (guided-diffusion)"),
    "arch": ("model", "the network: unet, or a DiT of DiT's table: DiT-S/2 ... DiT-XL/8 "
             "(S, B, L, XL; patch 2, 4, 8)"),
    "in_channels": ("model", "input channels: 3 for images, 4 for VAE latents (a --data_dir of "
                    ".npy/.npz latents)"),
    "dit_depth": ("model", "DiT blocks; 0 = --arch's (DiT-S and -B 12, L 24, XL 28)"),
    "dit_hidden_size": ("model", "DiT width; 0 = --arch's (DiT-S 384, B 768, L 1024, XL 1152)"),
    "dit_num_heads": ("model", "DiT attention heads; 0 = --arch's (DiT-S 6, B 12, L and XL 16)"),
    "class_dropout_prob": ("model", "classifier-free guidance: a --class_cond model gets a null "
                           "label (index num_classes) that replaces each training label with "
                           "this probability; 0 = none"),
    "large_size": ("model", "super-resolution output side in pixels"),
    "small_size": ("model", "super-resolution input side in pixels"),
    # classifier (guided-diffusion's noised image classifier)
    "diffusion_from": ("classifier", "the diffusion model the classifier will guide (a model or "
                       "EMA file, or its run dir): its --image_size and noise process are taken"),
    "classifier_width": ("classifier", "base channel count of the classifier (a multiple of 32)"),
    "classifier_depth": ("classifier", "residual blocks per resolution level of the classifier"),
    "classifier_attention_resolutions": ("classifier", "feature-map sizes with self-attention in "
                                         "the classifier (64 channels per head)"),
    "classifier_use_scale_shift_norm": ("classifier", "FiLM-style timestep conditioning in the "
                                        "classifier's residual blocks"),
    "classifier_resblock_updown": ("classifier", "residual blocks for downsampling in the "
                                   "classifier"),
    "classifier_pool": ("classifier", "the classifier's head: attention, adaptive, spatial or "
                        "spatial_v2"),
    "classifier_channel_mult": ("classifier", "classifier width multiplier per level; '' = the "
                                "UNet's choice for --image_size (guided's for 64-512)"),
    "classifier_num_classes": ("classifier", "classes (logits) of the classifier; a file's stored "
                               "flags say it (upstream's: 1000)"),
    "classifier_use_fp16": ("classifier", "run the classifier's torso in float16 "
                            "(convert_to_fp16), as guided-diffusion"),
    "classifier_path": ("classifier", "the noised classifier's file (ours, or guided-diffusion's "
                        "e.g. 64x64_classifier.pt)"),
    "classifier_scale": ("classifier", "classifier guidance: the gradient of log p(y|x_t) is "
                         "multiplied by this"),
    # diffusion
    "diffusion_steps": ("diffusion", "timesteps of the diffusion process"),
    "noise_schedule": ("diffusion", "beta schedule: linear or cosine"),
    "timestep_respacing": ("diffusion", "use fewer timesteps, e.g. 250 or ddim50 (sampling); '' "
                           "= all"),
    "sigma_small": ("diffusion", "fixed small variance instead of the large one (without "
                    "--learn_sigma)"),
    "use_kl": ("diffusion", "train on the variational bound (KL) instead of MSE"),
    "predict_xstart": ("diffusion", "the model predicts x0 instead of the noise"),
    "rescale_timesteps": ("diffusion", "feed timesteps scaled to 0..1000 to the model"),
    "rescale_learned_sigmas": ("diffusion", "weigh the learned-variance term as upstream "
                               "(RESCALED_MSE)"),
    # data
    "data_dir": ("data", "folder of images (.png/.jpg/.jpeg/.gif, searched recursively), or of "
                 "latents (.npy/.npz, one [C, H, W] array each)"),
    "num_workers": ("data", "data-loading worker processes, 4 batches ahead each (output never "
                    "depends on their number); -1 = auto: 0 on the CPU, 1-8 on a GPU"),
    "base_samples": ("data", "npz of low-resolution samples to upsample (as sample.py writes)"),
    "val_data_dir": ("data", "classifier_train.py: a folder of labelled images to validate on "
                     "every --eval_interval steps; '' = none"),
    # training
    "lr": ("training", "learning rate (AdamW)"),
    "weight_decay": ("training", "AdamW weight decay"),
    "lr_anneal_steps": ("training", "anneal the lr linearly to 0 over this many steps, then stop; "
                        "0 = constant lr, no stop"),
    "batch_size": ("training", "images per rank per step (sampling: per forward pass)"),
    "microbatch": ("training", "split each batch into microbatches of this size; -1 = off "
                   "(with --global_batch_size: the samples of one virtual shard)"),
    "global_batch_size": ("training", "samples per optimizer step over all ranks, in virtual "
                          "shards of --microbatch: the same run bit for bit on any rank count "
                          "dividing G/microbatch (virtual_shards.py); 0 = off (--batch_size per "
                          "rank)"),
    "ema_rate": ("training", "comma-separated EMA rates, e.g. 0.9999,0.999"),
    "schedule_sampler": ("training", "timestep sampler: uniform or loss-second-moment"),
    "use_fp16": ("training", "mixed precision (autocast; fp16 + loss scaling on GPU)"),
    "fp16_scale_growth": ("training", "loss-scale growth per good step (log2), as upstream"),
    "iterations": ("training", "classifier_train.py: train this many optimizer steps in total "
                   "(guided-diffusion's; --max_steps, when > 0, stops earlier)"),
    "anneal_lr": ("training", "classifier_train.py: decay the lr linearly to 0 over "
                  "--iterations"),
    "noised": ("training", "classifier_train.py: classify noised images x_t at timesteps drawn "
               "by --schedule_sampler (guidance needs it); False = clean images at t = 0"),
    "max_steps": ("training", "stop after this many optimizer steps in total (resumed ones "
                  "count); 0 = no limit"),
    "seed": ("training", "seeds everything (data order, noise, sampled labels)"),
    "nan_policy": ("training", "a step with a NaN/Inf loss or gradient: stop (exit 1) or skip"),
    "find_unused_parameters": ("training", "DDP's find_unused_parameters, for a model of one's own "
                               "that leaves parameters out of the loss on some steps (2+ ranks)"),
    "fsdp": ("training", "shard parameters, gradients, Adam moments and EMAs over the ranks "
             "(FSDP2) instead of a whole copy on each (DDP)"),
    "compile": ("training", "torch.compile the model's forward/backward (keys unchanged; a slower "
                "start, then faster steps)"),
    "deterministic": ("training", "deterministic GPU kernels (cuDNN, cuBLAS, atomics), so that a "
                      "resumed GPU run is bitwise a straight one; slower"),
    # checkpointing
    "log_dir": ("checkpointing", "where checkpoints and logs go; '' reads $OPENAI_LOGDIR "
                "(sampling: else a new temporary directory)"),
    "save_interval": ("checkpointing", "save a checkpoint every this many steps; 0 = only at "
                      "the end"),
    "resume_checkpoint": ("checkpointing", "auto, a model file, or a run dir (its newest complete "
                          "step); '' = auto in --log_dir"),
    "keep_checkpoints": ("checkpointing", "keep the newest K complete steps; 0 = keep all"),
    "async_save": ("checkpointing", "write checkpoints in a background thread; a save pauses "
                   "training only to copy the state to host memory"),
    "save_layout": ("checkpointing", "full: rank 0 writes model/ema/opt files every tool reads; "
                    "sharded (--fsdp only): every rank writes its shards of one DCP folder per "
                    "step (ckpt.py consolidate makes the files)"),
    "save_writer": ("checkpointing", "where async saves are written: process (a writer "
                    "process fed through shared memory, off the trainer's core), thread (a "
                    "thread of the trainer), auto (the process for steps of "
                    "64 MiB or more where the training "  # ckpt.writer_process.PROCESS_MIN_BYTES
                    "leaves a core free for it, else the thread)"),
    "allow_model_change": ("checkpointing", "on resume, keep the tensors whose name and shape "
                           "fit the model of the flags and start the others fresh (off: a "
                           "one-line error)"),
    "phema_stds": ("checkpointing", "post-hoc EMA: comma-separated relative widths to track, "
                   "e.g. 0.05,0.1 (EDM2); snapshots phema_STD_STEP.pt are written with saves "
                   "and never pruned; `ckpt.py phema` reconstructs any width; '' = off"),
    "phema_interval": ("checkpointing", "post-hoc EMA snapshots every this many steps (a "
                       "multiple of --save_interval) and at the last step; 0 = every save"),
    "lock_wait": ("checkpointing", "seconds to wait for another job holding --log_dir"),
    "class_map": ("checkpointing", "a class-conditional resume whose --data_dir classes differ "
                  "from the checkpoint's class names: check (refuse, naming the differences), "
                  "keep (the checkpoint's labels by class name; a new class takes the next free "
                  "label), data (the folder's labels, the stored names replaced)"),
    "model_path": ("checkpointing", "model or EMA file to load (ours or upstream's), or a "
                   "sharded step: its stepNNNNNN.dcp folder, a file in it by name "
                   "(step000010.dcp/model000010.pt) or its manifest"),
    "weights": ("checkpointing", "which weights of a combined file or a sharded step: auto "
                "(the EMA, if it holds one), model or ema"),
    # logging
    "log_interval": ("logging", "log (a progress line, a progress.csv row) every this many steps"),
    "log_format": ("logging", "stdout: progress (one line per --log_interval) or table "
                   "(upstream's key/value table)"),
    "log_sample_indices": ("logging", "append each rank's dataset indices per step to "
                           "LOG_DIR/sample_indices/rankR.csv"),
    "progress": ("logging", "show progress (a bar on a terminal, plain lines otherwise)"),
    "sample_interval": ("logging", "every this many steps and at the end, rank 0 writes a grid "
                        "of EMA samples to LOG_DIR/samples/grid_STEP.png (fixed seeds and "
                        "labels); 0 = off"),
    "sample_count": ("logging", "images in each --sample_interval grid"),
    "sample_steps": ("logging", "DDIM steps of the --sample_interval grids"),
    "eval_interval": ("logging", "every this many steps (a multiple of --log_interval), all "
                      "ranks sample --eval_num_samples EMA images (DDIM, --sample_steps) and log "
                      "their FID and IS against --eval_ref_batch as fid_ema_RATE, is_ema_RATE; "
                      "training is unchanged; classifier_train.py (upstream's meaning): "
                      "validation loss and accuracy on --val_data_dir; 0 = off"),
    "eval_ref_batch": ("logging", "the reference batch of --eval_interval's FID (an npz, arr_0 "
                       "uint8 [N, H, W, 3]; its activations are cached beside it)"),
    "eval_num_samples": ("logging", "samples per --eval_interval evaluation (at least 2)"),
    "eval_features": ("logging", "feature network of --eval_interval's FID: inception (the FID "
                      "Inception, --inception_weights) or digits (the demo's classifier)"),
    "inception_weights": ("logging", "the FID Inception's weights file (weights-inception-"
                          "2015-12-05-6726825d.pth); '' = $ID_INCEPTION_WEIGHTS"),
    "tensorboard": ("logging", "also log the progress scalars and the sample grids to "
                    "TensorBoard in LOG_DIR/tb/ (needs the tensorboard package)"),
    "tracker": ("logging", "also log the progress scalars, the sample grids and the flags to "
                "these trackers, comma-separated: wandb, mlflow (rank 0; a step once a "
                "checkpoint holds it; a resume continues the tracker run; needs pip install -e "
                "'.[tracking]')"),
    # distributed
    "dist_timeout": ("distributed", "seconds any wait between ranks may take; a dead rank ends "
                     "the job within about this long"),
    # sampling
    "num_samples": ("sampling", "how many samples to draw (nll.py: images to evaluate)"),
    "use_ddim": ("sampling", "DDIM sampling (with --timestep_respacing ddimN)"),
    "clip_denoised": ("sampling", "clip the predicted x0 to [-1, 1]"),
    "classes": ("sampling", "comma-separated class labels to cycle through; '' = random labels "
                "of the trained classes"),
    "guidance_scale": ("sampling", "classifier-free guidance: eps = uncond + S * (cond - "
                       "uncond), with learned sigma on the mean only (the conditional variance "
                       "is kept, as DiT); 1 = plain conditional, 0 = unconditional (null label)"),
    "grid": ("sampling", "also write a PNG grid of the samples"),
    "overwrite": ("sampling", "replace an existing samples npz"),
}


def flag_default_text(value):
    """A default as --help and docs/flags.md show it: '' for an empty string, else the value."""
    return "''" if value == "" else str(value)


def flag_to_argv(key, value):
    """``--key value`` shell-quoted, so that it pastes back into any script ('' when empty)."""
    import shlex

    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    return f"--{key} {shlex.quote(text)}"


def flags_to_argv(flags):
    """A dict of flags as one command-line string that pastes back into any script."""
    return " ".join(flag_to_argv(k, v) for k, v in flags.items())


def _metavar(value):
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "N"
    if isinstance(value, float):
        return "X"
    return "STR"


class FlagHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, then each flag with its meaning and default on one line."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=110)

    def _format_usage(self, usage, actions, groups, prefix):
        # One short usage line: the full list of ~60 flags is what --help is for.
        return f"usage: {self._prog} [--flag value ...]   (flags below)\n\n"


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching whose errors are one line (a UsageError, exit 2):
    an unknown flag names the closest known ones ("did you mean --num_channels?")."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", FlagHelpFormatter)
        super().__init__(*args, **kwargs)

    def known_flags(self):
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def error(self, message):
        raise UsageError(unknown_flag_message(message, self.known_flags(), self.prog))


def closest_flags(flag, known, n=2):
    """The known flags closest to ``flag`` (difflib), best first: the best match and any other
    about as close, or the longer flags it is a prefix of."""
    import difflib

    name = flag.split("=", 1)[0].lstrip("-")
    bare = {k.lstrip("-"): k for k in known}
    scored = sorted(((difflib.SequenceMatcher(None, name, b).ratio(), b) for b in bare),
                    reverse=True)
    hits = [b for r, b in scored if r >= 0.6 and r >= scored[0][0] - 0.05][:n] if scored else []
    if not hits:  # a prefix of a longer flag (no abbreviations any more)
        hits = [b for b in bare if b.startswith(name)][:n]
    return [bare[h] for h in hits]


def unknown_flag_message(message, known, prog):
    """argparse's error ``message`` as one line; unknown flags get "did you mean ...?"."""
    prefix = "unrecognized arguments: "
    if message.startswith(prefix):
        words = message[len(prefix):].split()
        flags = [w for w in words if w.startswith("-")]
        if flags:
            parts = []
            for f in flags:
                near = closest_flags(f, known)
                hint = f" (did you mean {' or '.join(near)}?)" if near else ""
                parts.append(f"{f.split('=', 1)[0]}{hint}")
            what = "unknown flag" if len(parts) == 1 else "unknown flags"
            return f"{prog}: {what} {', '.join(parts)}; see {prog} --help"
        return (f"{prog}: unexpected argument {words[0]!r} (flags are --name value); "
                f"see {prog} --help")
    return f"{prog}: {message}; see {prog} --help"


def create_parser(description, defaults, prog=None):
    """The parser of a script: ``--key`` per entry of ``defaults``, grouped as FLAG_GROUPS, each
    with its meaning and default in --help. ``description``: the script's docstring."""
    parser = FlagParser(prog=prog, description=description)
    add_dict_to_argparser(parser, defaults)
    return parser


def explicit_args(parser, argv=None):
    """The flags given explicitly on the command line, as a dict (parsed and typed).

    Re-parses `argv` with every default replaced by a sentinel object, so a flag that was not
    typed is absent from the result even when its value equals the default.
    """
    import copy

    unset = object()
    quiet = copy.deepcopy(parser)
    quiet.set_defaults(**{a.dest: unset for a in quiet._actions if a.dest != "help"})
    return {k: v for k, v in vars(quiet.parse_args(argv)).items() if v is not unset}


def flags_markdown(script_defaults):
    """The flag table of docs/flags.md, grouped as --help groups them: | flag | default | scripts |
    meaning |. ``script_defaults``: {script name: {flag: default}} of the scripts' parsers; a
    default that differs between scripts is shown per script. Every flag of FLAG_HELP has a row
    (one no script takes yet shows "-")."""
    rows = ["| flag | default | taken by | meaning |", "|---|---|---|---|"]
    names = list(script_defaults)
    for group in FLAG_GROUPS:
        rows.append(f"| **{group}** | | | |")
        for k, (g, meaning) in FLAG_HELP.items():
            if g != group:
                continue
            takers = [n for n in names if k in script_defaults[n]]
            shown = {}
            for n in takers:
                shown.setdefault(flag_default_text(script_defaults[n][k]), []).append(n)
            if not shown:
                default = "-"
            elif len(shown) == 1:
                default = f"`{next(iter(shown))}`"
            else:
                default = "; ".join(f"`{v}` ({', '.join(ns)})" for v, ns in shown.items())
            by = "all" if takers == names else (", ".join(takers) or "-")
            rows.append(f"| `--{k}` | {default} | {by} | {meaning} |")
    return "\n".join(rows) + "\n"
