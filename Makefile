# The two commands of the README: `make demo` and `make test`. Both set up what they need first
# (idempotent: a second run skips the install unless pyproject.toml changed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlpipe-installed

.PHONY: setup dev demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

## setup: create .venv and install rlpipe (editable) with its dev tools
setup: $(STAMP)

## dev: force a reinstall (after adding a package folder)
dev:
	rm -f $(STAMP)
	$(MAKE) setup

## test: the whole test suite (what CI runs)
test: setup
	$(PY) -m pytest

## test-fast: skip the tests marked slow
test-fast: setup
	$(PY) -m pytest -m "not slow and not gpu"

lint: setup
	$(VENV)/bin/ruff check schemas stages pipelines flows cluster tests benchmarks

clean:
	rm -rf build *.egg-info .pytest_cache runs
