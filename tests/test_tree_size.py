"""The tracked tree stays small enough to travel (issue 53, item 1): a GPU machine takes a copy of
at most 64 MiB of the working tree, and a user clones it. Test inputs drawn from seeded
generators are drawn again at test time (tests/redraw.py); the fixtures keep upstream's outputs."""
import os
import shutil
import subprocess

import pytest

from conftest import REPO

LIMIT = 40 * 2**20


def tracked_files():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked files cannot be listed")
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout (git ls-files: "
                    f"{proc.stderr.decode(errors='replace').strip()})")
    return [name for name in proc.stdout.decode().split("\0") if name]


def test_the_tracked_files_sum_to_at_most_40_mib():
    sizes = {}
    for name in tracked_files():
        path = REPO / name
        sizes[name] = os.lstat(path).st_size if os.path.lexists(path) else 0
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:10]
    assert total <= LIMIT, (f"the tracked files sum to {total / 2**20:.1f} MiB, over "
                            f"{LIMIT / 2**20:.0f} MiB; the largest: "
                            + ", ".join(f"{n} ({s / 1e6:.1f} MB)" for n, s in largest))
