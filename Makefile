# MaskServe: every target creates the virtual environment first when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup test test-fast lint up bench clean clean-data docs

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

# Tests that need no model, no Redis and no browser (markers set in tests/conftest.py).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not redis and not model and not browser and not gpu" $(PYTEST_ARGS)

# ruff (lint and format check) over the tree; mypy over the code, strict on the pure cores.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/bandit -q -c pyproject.toml -r backend studio templates_store

up: $(STAMP)
	$(VENV)/bin/maskserve up

# Regenerates the configuration reference from the settings tree (a test fails when it is stale).
docs: $(STAMP)
	$(VENV)/bin/maskserve config-reference --out docs/configuration.md

bench: $(STAMP)
	$(VENV)/bin/maskserve bench engine --model small-flux-fill --json bench_out/engine.json

# What setup and runs rebuild: the virtual environment, benchmark output, the activation cache and
# the built random-weight models. Templates, results, keys, logs and training runs in .maskserve
# stay; clean-data deletes them too, only when asked twice.
clean:
	rm -rf $(VENV) bench_out .maskserve/template_cache .maskserve/models

clean-data:
	@if [ "$(CONFIRM)" != 1 ]; then \
		echo "clean-data deletes .maskserve: your templates, results, API key, studio password,"; \
		echo "logs, Redis data and training runs. To go ahead: make clean-data CONFIRM=1"; \
		exit 2; \
	fi
	rm -rf .maskserve
