# Two entry points that set everything up themselves (idempotent):
#   make demo   create .venv, install, run `latentloop demo` on the embedded stdlib data
#   make test   create/update .venv, install with test extras, bubblewrap (the code sandbox) and chromium
#               (the chat page's browser test), run the tests
# torch is installed first, pinned by TORCH_SPEC, when the venv has none: on CPU-only machines
# this picks the local CPU wheel instead of a multi-GB CUDA build. Override e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126'

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,plot,hf,lm-eval,serve,tensorboard,wandb
# the demo needs the package and its loss plot only: a first `make demo` installs no more
DEMO_EXTRAS ?= plot
# One pytest worker per core (pytest-xdist, idle workers take queued tests from busy ones):
# tests/conftest.py gives each worker its share of the cores' threads. Most tests are short and
# single-threaded, so one process left a core idle; TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= auto
PYTEST_ARGS ?= -m "not slow" -n $(TEST_WORKERS) --dist worksteal
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell echo '$(EXTRAS)' | tr ',' '-')
DEMO_STAMP := $(VENV)/.installed-$(shell echo '$(DEMO_EXTRAS)' | tr ',' '-')

.PHONY: demo test test-all bench lint clean sandbox-tools browser-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(BIN)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	touch $@

$(STAMP): pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

ifneq ($(DEMO_STAMP),$(STAMP))
$(DEMO_STAMP): pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e ".[$(DEMO_EXTRAS)]"
	touch $@
endif

# The code sandbox (HumanEval candidates, latentloop.eval.sandbox) runs under bubblewrap. As root with
# apt-get, install it when missing (quiet; nothing to do when present); otherwise say so: the sandbox
# then refuses to run code and its tests are skipped.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || { \
	  echo "installing bubblewrap (the code sandbox)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }; }
	@command -v bwrap >/dev/null 2>&1 || \
	  echo "note: bubblewrap (bwrap) is not installed, so the code sandbox is unavailable (apt-get install bubblewrap, as root)" >&2

# The chat page's browser test (tests/test_chat_page.py) drives Debian's chromium with Playwright (the
# dev extra installs playwright; its own browser download needs a network this machine may lack). As
# root with apt-get, install chromium when missing; otherwise say so: the browser test then skips.
browser-tools:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || { \
	  echo "installing chromium (the chat page's browser test)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null; }; }
	@command -v chromium >/dev/null 2>&1 || \
	  echo "note: chromium is not installed, so the chat page's browser test is skipped (apt-get install chromium, as root)" >&2

demo: $(DEMO_STAMP)
	$(BIN)/latentloop demo

test: $(STAMP) sandbox-tools browser-tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP) sandbox-tools browser-tools
	$(BIN)/python -m pytest -q -m ""

bench: $(STAMP)
	$(BIN)/python -m benchmarks.baseline

lint: $(STAMP)
	$(BIN)/ruff check latentloop tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
