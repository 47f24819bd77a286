# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use with nothing but Python 3 installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean-venv

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first: the pinned CPU build. A bare `torch` requirement would pull the CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[mpi,test,demo]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) scripts/demo.py

clean-venv:
	rm -rf $(VENV)
