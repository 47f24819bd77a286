"""The layout of improved_diffusion/ (issue 28): upstream's modules at the top level under
upstream's names, the checkpoint and resume system in its own subpackage ckpt/ with its map, and
docs/ARCHITECTURE.md's module tables naming exactly the modules of the tree."""
import ast
import re
import subprocess
import sys

from conftest import REPO, child_env, hang_s

PKG = REPO / "improved_diffusion"
UPSTREAM = ("train_util", "dist_util", "script_util", "gaussian_diffusion", "unet",
            "image_datasets", "logger", "nn", "resample", "respace", "losses")


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
    assert set(tables) == {"improved_diffusion/", "improved_diffusion/ckpt/"}
    for folder, names in tables.items():
        assert len(names) == len(set(names)), f"ARCHITECTURE.md lists a module twice: {names}"
        tree = modules_in(REPO / folder)
        assert set(names) == tree, (
            f"docs/ARCHITECTURE.md's table of {folder} is stale: missing {sorted(tree - set(names))}"
            f", not in the tree {sorted(set(names) - tree)}")


def test_upstream_modules_stay_at_the_top_level():
    assert set(UPSTREAM) <= modules_in(PKG)
    assert not set(UPSTREAM) & modules_in(PKG / "ckpt")


def test_the_ckpt_map_names_every_module_of_the_package():
    doc = ast.get_docstring(ast.parse((PKG / "ckpt" / "__init__.py").read_text()))
    listed = set(re.findall(r"^    (\w+)\s{2,}", doc, re.M))
    assert listed == modules_in(PKG / "ckpt"), listed ^ modules_in(PKG / "ckpt")


def test_importing_preemption_from_ckpt_imports_no_torch():
    code = ("import sys; from improved_diffusion.ckpt import preemption; "
            "print(sorted(m for m in ('torch', 'numpy', 'blobfile') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=str(REPO),
                         capture_output=True, text=True, timeout=hang_s(60), check=True).stdout
    assert out.strip() == "[]"


def private_uses_of_ckpt(path):
    """`mod._name` and `from ...ckpt.mod import _name` in ``path``, where mod is a ckpt module."""
    tree = ast.parse(path.read_text())
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if re.search(r"(^|\.)ckpt$", module):
                aliases |= {n.asname or n.name for n in node.names}
            elif re.search(r"(^|\.)ckpt\.", module):
                found += [f"{path.name}:{node.lineno} {n.name}" for n in node.names
                          if n.name.startswith("_")]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_outside_ckpt_uses_its_private_names():
    outside = [p for d in ("improved_diffusion", "scripts", "tests", "examples", "benchmarks",
                           "datasets") for p in (REPO / d).rglob("*.py")
               if (PKG / "ckpt") not in p.parents and ".venv" not in p.parts]
    found = [use for p in outside for use in private_uses_of_ckpt(p)]
    assert not found, f"private names of ckpt/ used outside it: {found}"
