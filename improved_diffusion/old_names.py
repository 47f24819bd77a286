"""The old import paths of modules that moved (DESIGN.md, "A library people install").

A script written against an earlier layout (``from improved_diffusion import cli``, ``from
improved_diffusion.checkpoint import CheckpointError``, ``import improved_diffusion.ckpt_tool``)
still runs: importing an old name gives the module at its new place, the very same module
object (no second copy of its state), with one DeprecationWarning naming the new place. The
names stay for a release after their move, then go.

How: a finder on ``sys.meta_path`` (after the path finders, so a real file of that name would
win) that knows only the names of ``MOVED``. Its loader puts the new module in ``sys.modules``
under the old name; the import system then hands that object back and sets it as the attribute
of the parent package. The new module is never run again and its ``__spec__`` is untouched.
Nothing here imports a moved module until its old name is imported.

Names that moved out of a module that stays (MOVED_ATTRIBUTES) are that module's attributes
still, through its ``__getattr__``, with the same warning.
"""
import importlib
import importlib.machinery
import sys
import warnings

# old name -> new name (1b29d1d: the checkpoint system into ckpt/; 38da466: infra/ and apps/)
MOVED = {
    **{f"improved_diffusion.{m}": f"improved_diffusion.ckpt.{m}" for m in (
        "async_save", "checkpoint", "checkpointer", "model_change", "optim_state", "rng",
        "run_dir", "run_lock", "state_fit")},
    **{f"improved_diffusion.{m}": f"improved_diffusion.infra.{m}" for m in (
        "cli", "config_check", "errors", "flags", "fsdp", "heartbeat", "preemption",
        "rendezvous")},
    "improved_diffusion.ckpt.preemption": "improved_diffusion.infra.preemption",
    "improved_diffusion.ckpt.storage": "improved_diffusion.infra.storage",
    "improved_diffusion.ckpt_tool": "improved_diffusion.apps.ckpt_tool",
    "improved_diffusion.ckpt.ckpt_tool": "improved_diffusion.apps.ckpt_tool",
    "improved_diffusion.demo_page": "improved_diffusion.apps.demo_page",
}

# module -> (the module its names moved to, the names) (9c8ef08: the command line out of
# script_util into flags); the module's __getattr__ calls moved_attribute
MOVED_ATTRIBUTES = {
    "improved_diffusion.script_util": ("improved_diffusion.infra.flags", (
        "FLAG_GROUPS", "FLAG_HELP", "FlagHelpFormatter", "FlagParser", "closest_flags",
        "create_parser", "explicit_args", "flag_default_text", "flag_to_argv", "flags_markdown",
        "flags_to_argv", "unknown_flag_message")),
}


def warning_text(old):
    new = MOVED[old]
    return f"{old} moved to {new}: import {new} (the old name goes in a later release)"


def moved_attribute(module, name):
    """``name`` of ``module`` where it moved to (MOVED_ATTRIBUTES), with a DeprecationWarning
    naming the new place; AttributeError for any other name (a module's ``__getattr__``)."""
    new, names = MOVED_ATTRIBUTES.get(module, (None, ()))
    if name not in names:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    # stacklevel 3: the line that asked for the name (past the module's __getattr__)
    warnings.warn(f"{module}.{name} moved to {new}.{name}: import it from {new} (the old name "
                  f"goes in a later release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


class _OldNameLoader:
    def __init__(self, new):
        self.new = new

    def create_module(self, spec):
        return None  # a placeholder module; exec_module puts the real one in its place

    def exec_module(self, module):
        # stacklevel 2: the warning names the line that imported the old name (the import
        # system's own frames are skipped)
        warnings.warn(warning_text(module.__name__), DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(self.new)


class OldNameFinder:
    """Finds the old names of ``MOVED`` only (a meta path finder)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(name, _OldNameLoader(new))


def install():
    """Put the finder on sys.meta_path once (improved_diffusion/__init__.py calls this)."""
    if not any(getattr(f, "finds_old_improved_diffusion_names", False) for f in sys.meta_path):
        finder = OldNameFinder()
        finder.finds_old_improved_diffusion_names = True
        sys.meta_path.append(finder)
