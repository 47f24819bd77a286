"""The model sizes the benchmarks share: UNets of about 10M, 60M and 250M parameters (and 30M:
between the first two, where the checkpoint's writer changes, writer_process.PROCESS_MIN_BYTES).

``SIZES``: the models as trained (learn_sigma, the CIFAR-10 / ImageNet-64 recipes' shapes).
``LIGHT``: the same widths, levels and attention blocks (so the same parameters and the same
checkpoint bytes) on 8x8 images: a step whose compute is small beside its parameter count, for
figures about what saves cost a run rather than about the step itself.
"""

SIZES = {
    "10M": dict(image_size=32, num_channels=64, num_res_blocks=2, attention_resolutions="16,8"),
    "30M": dict(image_size=64, num_channels=64, num_res_blocks=3, attention_resolutions="16,8"),
    "60M": dict(image_size=64, num_channels=96, num_res_blocks=3, attention_resolutions="16,8"),
    "250M": dict(image_size=64, num_channels=192, num_res_blocks=3,
                 attention_resolutions="32,16,8"),
}

# attention at the same downsampling levels (image_size / resolution) as in SIZES
LIGHT = {
    "10M": dict(SIZES["10M"], image_size=8, channel_mult="1,2,2,2", attention_resolutions="4,2"),
    "30M": dict(SIZES["30M"], image_size=8, channel_mult="1,2,3,4", attention_resolutions="2,1"),
    "60M": dict(SIZES["60M"], image_size=8, channel_mult="1,2,3,4", attention_resolutions="2,1"),
    "250M": dict(SIZES["250M"], image_size=8, channel_mult="1,2,3,4",
                 attention_resolutions="4,2,1"),
}


def model_flags(size, light=False):
    """All model and diffusion flags of ``size`` (a key of SIZES), learned sigma, 100 steps."""
    from improved_diffusion.script_util import model_and_diffusion_defaults

    flags = model_and_diffusion_defaults()
    flags.update((LIGHT if light else SIZES)[size], learn_sigma=True, diffusion_steps=100)
    return flags
