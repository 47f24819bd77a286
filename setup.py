from setuptools import setup

setup(
    name="improved-diffusion",
    version="0.1.0",
    description="Diffusion-model trainer (improved-diffusion style) with checkpoint/resume that is "
    "correct on any number of ranks",
    packages=["improved_diffusion", "improved_diffusion.ckpt"],
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "blobfile", "mpi4py", "pillow", "tqdm"],
    extras_require={
        "mpi": ["mpich"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist"],
        "demo": ["scikit-learn", "matplotlib"],  # the loss curve (progress_plot)
        "safetensors": ["safetensors"],
        "tensorboard": ["tensorboard"],  # --tensorboard True
    },
)
