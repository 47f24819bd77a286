from setuptools import find_packages, setup

setup(
    name="improved-diffusion",
    version="0.1.0",
    description="Diffusion-model trainer (improved-diffusion style) with checkpoint/resume that is "
    "correct on any number of ranks",
    # every subpackage (infra/, ckpt/, apps/, and any later one): tests/test_install.py installs
    # the wheel outside the checkout and imports every module of the tree from it
    packages=find_packages(include=["improved_diffusion", "improved_diffusion.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "blobfile", "mpi4py", "pillow", "tqdm"],
    extras_require={
        "mpi": ["mpich"],
        # object-store log dirs (s3://, gs://, az://: infra/storage.py)
        "cloud": ["fsspec", "s3fs", "gcsfs", "adlfs"],
        # ... and the real servers test_object_store.py runs them against (Azurite: npm, below
        # the Makefile's install)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "fsspec", "s3fs", "gcsfs", "adlfs",
                 "moto[server]", "gcp-storage-emulator", "wandb", "mlflow-skinny",
                 # mlflow-skinny's default store (sqlite) needs these two (trackers.py)
                 "sqlalchemy>=1.4,<3", "alembic!=1.10.0,<2",
                 # tests/test_install.py builds the wheel offline (no build isolation):
                 # setuptools with bdist_wheel of its own
                 "setuptools>=70.1"],
        "demo": ["scikit-learn", "matplotlib"],  # the loss curve (progress_plot)
        "safetensors": ["safetensors"],
        "tensorboard": ["tensorboard"],  # --tensorboard True
        # --tracker wandb,mlflow (trackers.py); MLflow's default store is sqlite:///mlflow.db,
        # which mlflow-skinny opens only with sqlalchemy and alembic (full mlflow's own
        # requirements for it; full mlflow adds ~40 packages more: pandas, scipy, scikit-learn,
        # matplotlib, pyarrow, Flask, gunicorn, docker, graphene ...: pip install mlflow for
        # its UI, `mlflow ui`)
        "tracking": ["wandb", "mlflow-skinny", "sqlalchemy>=1.4,<3", "alembic!=1.10.0,<2"],
    },
)
