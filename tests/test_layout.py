"""The layout of improved_diffusion/ (issues 28 and 46): the floors a newcomer sees.

- the ground floor: our infrastructure in ``infra/`` (errors, storage, heartbeat, rendezvous,
  preemption, fsdp, flags, cli, config_check) beside upstream's ``dist_util`` and ``logger``,
  which keep upstream's import paths; it imports nothing of the floors above;
- the library: upstream's modules at the top level under upstream's names, ours beside them,
  and the checkpoint and resume system in ``ckpt/`` (which knows nothing of diffusion);
- the applications: ``apps/`` (the checkpoint doctor, the demo page), which nothing in the
  library imports.

docs/ARCHITECTURE.md's module tables name exactly the modules of each package, and no module
uses a private name of another package's module."""
import ast
import re
import subprocess
import sys

import pytest
from conftest import REPO, child_env, hang_s

PKG = REPO / "improved_diffusion"
UPSTREAM = ("train_util", "dist_util", "script_util", "gaussian_diffusion", "unet",
            "image_datasets", "logger", "nn", "resample", "respace", "losses")
GROUND = {"dist_util", "logger"}  # upstream's names, on the ground floor with infra/
PACKAGES = ("improved_diffusion/", "improved_diffusion/infra/", "improved_diffusion/ckpt/",
            "improved_diffusion/apps/")


def modules_in(folder):
    return {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}


def tables_of_architecture():
    """{heading line of each module table: the module names its first column lists}."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The modules", 1)[1].split("\n## ", 1)[0]
    tables, current = {}, None
    for line in section.splitlines():
        if line.startswith("`improved_diffusion/"):
            current = tables.setdefault(line.split("`")[1], [])
        elif line.startswith("| `") and current is not None:
            current.extend(re.findall(r"`(\w+)`", line.split("|")[1]))
    return tables


def test_the_architecture_tables_name_every_module_of_the_tree_once():
    tables = tables_of_architecture()
    assert set(tables) == set(PACKAGES)
    for folder, names in tables.items():
        assert len(names) == len(set(names)), f"ARCHITECTURE.md lists a module twice: {names}"
        tree = modules_in(REPO / folder)
        assert set(names) == tree, (
            f"docs/ARCHITECTURE.md's table of {folder} is stale: missing {sorted(tree - set(names))}"
            f", not in the tree {sorted(set(names) - tree)}")


def test_upstream_modules_stay_at_the_top_level():
    assert set(UPSTREAM) <= modules_in(PKG)
    for sub in ("ckpt", "infra", "apps"):
        assert not set(UPSTREAM) & modules_in(PKG / sub), sub


@pytest.mark.parametrize("package", ["ckpt", "infra", "apps"])
def test_each_subpackages_map_names_every_module_of_the_package(package):
    doc = ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text()))
    listed = set(re.findall(r"^    (\w+)\s{2,}", doc, re.M))
    assert listed == modules_in(PKG / package), listed ^ modules_in(PKG / package)


@pytest.mark.parametrize("module", ["preemption", "process_exit"])  # first and last lines
def test_importing_preemption_or_process_exit_imports_no_torch(module):  # of every script
    code = (f"import sys; from improved_diffusion.infra import {module}; "
            "print(sorted(m for m in ('torch', 'numpy', 'blobfile') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=str(REPO),
                         capture_output=True, text=True, timeout=hang_s(60), check=True).stdout
    assert out.strip() == "[]"


def module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path):
    """[(line, absolute module imported)] of ``path`` (relative imports resolved; `from P import
    m` gives P.m where m is a module of P), at any depth (imports inside functions count)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = REPO.joinpath(*f"{mod}.{a.name}".split("."))
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                found.append((node.lineno, f"{mod}.{a.name}" if is_module else mod))
    return [(n, m) for n, m in found if m == "improved_diffusion"
            or m.startswith("improved_diffusion.")]


def floor(module):
    """0: the ground (infra/, dist_util, logger); 1: the library; 2: the applications."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "infra" or len(parts) == 2 and parts[1] in GROUND:
        return 0
    if len(parts) > 1 and parts[1] == "apps":
        return 2
    return 1


def library_files():
    return [p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]


def test_no_module_imports_a_floor_above_its_own():
    """The ground floor imports nothing of the library or the applications, the library nothing
    of the applications; so logger and ckpt/ no longer import each other (issue 46)."""
    upward = [f"{p.relative_to(REPO)}:{line} imports {m}" for p in library_files()
              for line, m in imports_of(p) if floor(m) > floor(module_name(p))]
    assert not upward, "imports of a floor above:\n" + "\n".join(upward)


def test_the_checkpoint_package_imports_no_diffusion_module():
    """ckpt/ takes from the ground floor and from script_util's flag values only."""
    allowed = {"improved_diffusion.script_util"}
    found = [f"{p.relative_to(REPO)}:{line} imports {m}" for p in (PKG / "ckpt").rglob("*.py")
             for line, m in imports_of(p)
             if floor(m) == 1 and not m.startswith("improved_diffusion.ckpt") and m not in allowed]
    assert not found, "\n".join(found)


def private_uses(path):
    """[(package, "file:line name")]: `mod._name` and `from improved_diffusion...mod import
    _name` in ``path``, where mod is a module of another package than ``path``'s (its package
    given)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    own = ".".join(package)
    aliases, found = {}, []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if not (mod == "improved_diffusion" or mod.startswith("improved_diffusion.")):
                continue
            for n in node.names:
                if REPO.joinpath(*f"{mod}.{n.name}".split(".")).with_suffix(".py").exists():
                    if mod != own:  # a module of package mod
                        aliases[n.asname or n.name] = mod
                elif n.name.startswith("_") and mod.rsplit(".", 1)[0] != own:
                    found.append((mod.rsplit(".", 1)[0], f"{path.name}:{node.lineno} {n.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append((aliases[node.value.id],
                          f"{path.name}:{node.lineno} {node.value.id}.{node.attr}"))
    return found


def test_no_module_uses_a_private_name_of_another_package():
    """In the library, no module uses a private name (`_x`) of another package's module; in the
    scripts, tests, examples, benchmarks and datasets, none of ckpt/'s (whose privates are the
    checkpoint format's internals)."""
    found = [use for p in library_files() for _, use in private_uses(p)]
    outside = [p for d in ("scripts", "tests", "examples", "benchmarks", "datasets")
               for p in (REPO / d).rglob("*.py")]
    found += [use for p in outside for package, use in private_uses(p)
              if package == "improved_diffusion.ckpt"]
    assert not found, f"private names used outside their package: {found}"


def test_the_flags_help_states_the_async_writers_threshold_of_ckpt():
    """flags (ground floor) words --save_writer auto's threshold without importing ckpt/."""
    from improved_diffusion.ckpt import writer_process
    from improved_diffusion.infra.flags import FLAG_HELP
    assert f"{writer_process.PROCESS_MIN_BYTES >> 20} MiB or more" in FLAG_HELP["save_writer"][1]
