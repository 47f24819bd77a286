# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use with nothing but Python 3 installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STORES_STAMP := .stores/.installed

.PHONY: demo demo-run test soak conformance install clean-venv
DEMO_ARGS ?=

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	# torch first: the pinned CPU build. A bare `torch` requirement would pull the CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[mpi,test,demo,tensorboard]'
	touch $(STAMP)

# The test servers, for `make test` only (`make demo` needs nothing but Python 3): Azurite, the
# Azure blob emulator test_object_store.py runs az:// against (skipped there with its reason
# where npm is missing, as the S3 and GCS cases are without their pip-installed servers).
# Without npm nothing is stamped: a later `make test` tries again.
$(STORES_STAMP):
	if command -v npm >/dev/null; then \
	  npm install --no-audit --no-fund --prefix .stores azurite && touch $(STORES_STAMP); \
	else echo "npm not found: the Azure (az://) tests will be skipped"; fi

install: $(STAMP)

# Two test files at a time (pytest-xdist): the suite's jobs wait on each other's ranks and on
# the disk for about half of their time. Whole files (--dist loadfile): a module's fixtures
# (the tiny demo's run, ...) are made once, and test_multihost's fixed host names are one
# test's at a time. TEST_WORKERS=0 runs everything in this process, one test after another.
TEST_WORKERS ?= 2

test: $(STAMP) $(STORES_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The slow tests the default suite skips (@pytest.mark.slow): 200 save/resume cycles with random
# kills (SOAK_CYCLES=N to change the count), and the slower variants of default tests (other rank
# counts, signals, launchers, parameters; `pytest -m slow --collect-only -q tests` lists them).
soak: $(STAMP) $(STORES_STAMP)
	$(PY) -m pytest -q -m slow tests

# The resume conformance run (issue 44, docs/RELIABILITY.md): a straight 1-rank run against the
# same run SIGTERMed and kill -9ed on 2 -> 3 -> 1 -> 4 -> 6 ranks (mpiexec and torchrun in turn),
# one table; exit 0 only if every segment equals the straight run. Not part of `make test`.
# CONFORMANCE_ARGS="--quick" (2 segments), "--seed N" (other interruptions).
CONFORMANCE_ARGS ?=

conformance: $(STAMP)
	PATH="$(dir $(abspath $(PY))):$$PATH" $(PY) benchmarks/conformance.py $(CONFORMANCE_ARGS)

demo: $(STAMP)
	$(MAKE) --no-print-directory demo-run PY=$(PY)

# The demo itself; the test suite runs this target at a tiny size with its own PY and DEMO_ARGS.
demo-run:
	PATH="$(dir $(abspath $(PY))):$$PATH" $(PY) scripts/demo.py $(DEMO_ARGS)

clean-venv:
	rm -rf $(VENV)
