"""conftest's rule for hang detectors: what a test writes is the quiet machine's bound, and what
applies is TIMEOUT_FACTOR times that (issue 43: a test ran into its timeout on a loaded machine)."""
import os
import subprocess

import pytest
import pytest_timeout

import conftest
from conftest import TIMEOUT_FACTOR, hang_s


def test_the_factor_is_5_unless_the_environment_says_otherwise():
    assert TIMEOUT_FACTOR == float(os.environ.get("TEST_TIMEOUT_FACTOR", "5"))
    assert hang_s(7) == 7 * TIMEOUT_FACTOR


@pytest.mark.timeout(7)
def test_a_timeout_marker_applies_times_the_factor(request):
    assert pytest_timeout._get_item_settings(request.node).timeout == hang_s(7)


@pytest.mark.timeout(timeout=7, method="thread")
def test_a_timeout_marker_with_keywords_keeps_them(request):
    settings = pytest_timeout._get_item_settings(request.node)
    assert (settings.timeout, settings.method) == (hang_s(7), "thread")


def test_the_ini_default_applies_times_the_factor(request, pytestconfig):
    default = pytest_timeout.get_env_settings(pytestconfig).timeout
    assert pytest_timeout._get_item_settings(request.node).timeout == hang_s(default)


def test_the_run_helpers_pass_the_child_times_the_factor(monkeypatch):
    seen = []

    def fake_run(*args, timeout=None, **kwargs):
        seen.append(timeout)
        return subprocess.CompletedProcess(args, 0, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    conftest.run_script("train.py", timeout=11)
    conftest.run_mpi(2, "train.py", timeout=13)
    conftest.run_module_mpi(2, "pass", timeout=17)
    assert seen == [hang_s(11), hang_s(13), hang_s(17)]
