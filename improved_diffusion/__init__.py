"""improved-diffusion: a diffusion-model trainer whose checkpoint and resume are correct on any
number of ranks (README.md; the layout: docs/ARCHITECTURE.md, "The modules")."""
from .old_names import install as _install_old_names

_install_old_names()  # the old import paths of moved modules, with a warning (old_names.py)
