"""The package as a user installs it (issue 56 item 1; DESIGN.md, "A library people install").

The checkout is built into a wheel (not editable) and the wheel installed into a fresh virtual
environment outside the checkout. That environment takes torch, numpy, mpi4py ... from this
venv's site-packages through a plain path line in a .pth file: the .pth files of a directory
added that way are not run, so this venv's editable finder (which maps improved_diffusion to a
checkout) stays off there, and nothing puts the checkout on sys.path (no PYTHONPATH, the
working directory outside). What runs there imports the installed copy or nothing.
"""
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PY, REPO, hang_s, resumed_step, write_images

# The old paths of modules that moved (1b29d1d: ckpt/; 38da466: infra/ and apps/), as the
# examples and docs of earlier releases imported them -> their place now.
OLD_MODULES = {
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
# Import lines of earlier releases' examples (own_loop.py, own_model.py) and docs, verbatim.
OLD_IMPORT_LINES = [
    "from improved_diffusion import cli, dist_util, logger, train_job",
    "from improved_diffusion import cli, dist_util, logger, train_job, virtual_shards",
    "from improved_diffusion.checkpointer import PREEMPTED_EXIT_CODE, CheckpointConfig, "
    "Checkpointer",
    "from improved_diffusion.rng import seed_rngs",
    "from improved_diffusion.script_util import create_parser, train_defaults",
    "from improved_diffusion.flags import create_parser, explicit_args",
    "from improved_diffusion.checkpoint import CheckpointError",
    "from improved_diffusion.errors import UsageError, UserError",
    "from improved_diffusion.ckpt import preemption",
    "from improved_diffusion import preemption",
    "from improved_diffusion.ckpt.ckpt_tool import main",
    "from improved_diffusion.demo_page import write_page",
]

# Run inside the installed environment: where the package comes from, every module of it
# (pkgutil's walk of the installed package) imported, and the old names.
CHECK = r'''
import importlib, json, os, pkgutil, sys, warnings

old_modules, old_lines = json.loads(sys.argv[1]), json.loads(sys.argv[2])
import improved_diffusion

report = {"file": improved_diffusion.__file__, "path": [os.path.abspath(p) for p in sys.path],
          "meta_path": [c.__module__ + "." + c.__qualname__ for c in
                        (f if isinstance(f, type) else type(f) for f in sys.meta_path)],
          "modules": {}, "failed": {}, "old": {}, "lines": {}}
for info in pkgutil.walk_packages(improved_diffusion.__path__, "improved_diffusion.",
                                  onerror=lambda name: report["failed"].setdefault(name, "walk")):
    try:
        report["modules"][info.name] = importlib.import_module(info.name).__file__
    except Exception as e:
        report["failed"][info.name] = repr(e)


def run_as_main(code, filename):
    """``code`` run as a user's script would (its own globals named __main__, the default
    warning filters): (its globals, [(category, message, filename)] of its warnings)."""
    ns = {"__name__": "__main__"}
    with warnings.catch_warnings(record=True) as caught:
        exec(compile(code, filename, "exec"), ns)
    return ns, [(w.category.__name__, str(w.message), w.filename) for w in caught]


for old, new in old_modules.items():
    try:
        ns, caught = run_as_main(f"import {old}", f"import_{old}.py")
        mod = sys.modules[new]
        parent, _, child = old.rpartition(".")
        public = sorted(k for k, v in vars(mod).items()
                        if not k.startswith("_") and getattr(v, "__module__", None) == new)
        ns2, _ = run_as_main(f"from {old} import {public[0]}", "from.py")
        report["old"][old] = {
            "warnings": caught,
            "is_new_module": sys.modules[old] is mod and getattr(sys.modules[parent], child) is mod,
            "spec_untouched": mod.__spec__.name == new and mod.__name__ == new,
            "same_object": ns2[public[0]] is getattr(mod, public[0]),
            "copies": [k for k, m in sys.modules.items()
                       if getattr(m, "__file__", None) == mod.__file__ and m is not mod]}
    except Exception as e:
        report["old"][old] = repr(e)

for line in old_lines:
    try:
        ns, caught = run_as_main(line, "user_script.py")
        names = line.split(" import ", 1)[1].split(", ")
        report["lines"][line] = {"warnings": caught,
                                 "bound": sorted(n for n in names if n in ns)}
    except Exception as e:
        report["lines"][line] = repr(e)
print("REPORT " + json.dumps(report))
'''


def clean_env(env_dir, shared_lib):
    """The environment's own interpreter first on PATH (mpiexec from this venv after it), no
    PYTHONPATH; mpi4py finds the mpich wheel's libmpi of this venv (a user's environment has
    it in its own lib/)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k not in ("OPENAI_LOGDIR", "RANK", "WORLD_SIZE",
                                                       "LOCAL_RANK", "MASTER_ADDR",
                                                       "MASTER_PORT")}
    env["PATH"] = os.pathsep.join([str(env_dir / "bin"), str(Path(PY).parent),
                                   env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(shared_lib), env.get("LD_LIBRARY_PATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(cmd, cwd, env=None, timeout=60):
    proc = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, timeout=hang_s(timeout))
    assert proc.returncode == 0, f"exit {proc.returncode}: {cmd}\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the environment's python, its site-packages, its environment variables, a folder
    outside the checkout to run in): the checkout's wheel installed there."""
    root = tmp_path_factory.mktemp("installed")
    assert REPO not in root.parents
    # What `pip install .` builds from, copied so that the build leaves no build/ or
    # egg-info in the checkout: the top-level files (setup.py ...) and the package.
    src = root / "src"
    shutil.copytree(REPO / "improved_diffusion", src / "improved_diffusion",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in REPO.iterdir():
        if f.is_file():
            shutil.copy(f, src)
    pip = [PY, "-m", "pip", "--disable-pip-version-check", "--no-input"]  # offline
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", root / "wheel", src], cwd=root)
    shutil.rmtree(src)
    (wheel,) = (root / "wheel").glob("improved_diffusion-*.whl")
    env_dir = root / "env"
    run([PY, "-m", "venv", "--without-pip", env_dir], cwd=root)
    py = env_dir / "bin" / "python"
    purelib = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=root).strip())
    run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", purelib, wheel],
        cwd=root)
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    away = root / "away"
    away.mkdir()
    return py, purelib, clean_env(env_dir, Path(sys.prefix) / "lib"), away


@pytest.fixture(scope="module")
def report(installed):
    py, _, env, away = installed
    out = run([py, "-c", CHECK, json.dumps(OLD_MODULES), json.dumps(OLD_IMPORT_LINES)], away,
              env=env, timeout=90)
    return json.loads(out.split("REPORT ", 1)[1])


def checkout_modules():
    return {".".join(p.relative_to(REPO).with_suffix("").parts[:-1] if p.name == "__init__.py"
                     else p.relative_to(REPO).with_suffix("").parts)
            for p in (REPO / "improved_diffusion").rglob("*.py") if "__pycache__" not in p.parts}


def test_the_installed_package_is_imported_and_not_the_checkout(installed, report):
    _, purelib, _, _ = installed
    assert Path(report["file"]).parent == purelib / "improved_diffusion", report["file"]
    assert str(REPO) not in map(str, (Path(p).resolve() for p in report["path"])), report["path"]
    assert not any("editable" in f for f in report["meta_path"]), report["meta_path"]


def test_the_installed_package_holds_and_imports_every_module_of_the_checkout(installed, report):
    _, purelib, _, _ = installed
    assert not report["failed"], report["failed"]
    wanted = checkout_modules() - {"improved_diffusion"}
    assert set(report["modules"]) == wanted, (
        f"missing from the installed package: {sorted(wanted - set(report['modules']))}")
    outside = {m: f for m, f in report["modules"].items() if purelib not in Path(f).parents}
    assert not outside, outside


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_a_moved_modules_old_name_is_the_new_module_with_a_warning_naming_it(report, old):
    got = report["old"][old]
    assert isinstance(got, dict), got
    new = OLD_MODULES[old]
    assert got["is_new_module"] and got["spec_untouched"] and got["same_object"], got
    assert not got["copies"], got["copies"]
    (warning,) = got["warnings"]
    assert warning[0] == "DeprecationWarning" and f"moved to {new}" in warning[1], warning
    assert warning[2] == f"import_{old}.py", warning  # the importing line's, shown by default


@pytest.mark.parametrize("line", OLD_IMPORT_LINES)
def test_an_import_line_of_an_earlier_release_still_runs(report, line):
    got = report["lines"][line]
    assert isinstance(got, dict), got
    assert got["bound"] == sorted(line.split(" import ", 1)[1].split(", ")), got
    for category, message, filename in got["warnings"]:
        assert category == "DeprecationWarning" and " moved to " in message, got
        assert filename == "user_script.py", got


def test_own_loop_copied_out_of_the_checkout_trains_saves_and_resumes_on_the_installed_package(
        installed, tmp_path):
    py, _, env, away = installed
    script = away / "own_loop.py"
    shutil.copy(REPO / "examples" / "own_loop.py", script)
    data = write_images(tmp_path / "images", n=6)
    args = ["--data_dir", data, "--log_dir", tmp_path / "run", "--batch_size", 2,
            "--log_interval", 1, "--seed", 3, "--save_interval", 2]
    out = run([py, script, *args, "--max_steps", 2], away, env=env, timeout=120)
    assert "step 2/2  loss" in out, out[-3000:]
    out = run([py, script, *args, "--max_steps", 4], away, env=env, timeout=120)
    assert "step 4/4  loss" in out and resumed_step(out) == 2, out[-3000:]
    assert "Warning" not in out, out[-3000:]  # the example imports the new names only
    assert (tmp_path / "run" / "manifest000004.json").exists(), sorted(os.listdir(tmp_path / "run"))
