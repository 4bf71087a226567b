# Two entry points that set everything up themselves (idempotent):
#   make demo   create .venv, install, run `latentloop demo` on the embedded stdlib data
#   make test   create/update .venv, install with test extras, run the test suite
# torch is installed first, pinned by TORCH_SPEC, when the venv has none: on CPU-only machines
# this picks the local CPU wheel instead of a multi-GB CUDA build. Override e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126'

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,plot,hf,lm_eval,serve
PYTEST_ARGS ?= -m "not slow"
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell echo '$(EXTRAS)' | tr ',' '-')

.PHONY: demo test test-all bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(BIN)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	touch $@

$(STAMP): pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: $(STAMP)
	$(BIN)/latentloop demo

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ""

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_baseline.py

lint: $(STAMP)
	$(BIN)/ruff check latentloop tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
