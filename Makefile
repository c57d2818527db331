# MaskServe: every target creates the virtual environment first when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup test up bench profile clean docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the local CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# The studio's browser test drives Debian's chromium through Playwright (never a downloaded browser).
$(CHROMIUM):
	$(SUDO) apt-get install -y -q chromium || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -q $(PYTEST_ARGS)

up: $(STAMP)
	$(VENV)/bin/maskserve up

# Regenerates the configuration reference from the settings tree (a test fails when it is stale).
docs: $(STAMP)
	$(VENV)/bin/maskserve config-reference --out docs/configuration.md

bench: $(STAMP)
	$(VENV)/bin/maskserve bench engine --model small-flux-fill --json bench_out/engine.json

clean:
	rm -rf $(VENV) .maskserve bench_out
