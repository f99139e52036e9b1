# The two set-up commands: `make demo` (main job on the bundled model) and `make test` (whole suite).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test train-reference clean

setup: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel on disk and never resolves a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/moetailor demo

test: setup
	$(PY) -m pytest tests

train-reference: setup
	$(PY) -m moetailor.training.reference --out build/reference-run

clean:
	rm -rf build .pytest_cache
