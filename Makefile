# The two commands of the README:
#   make demo   create .venv, install the package with the demo extra, train a tiny LoRA end to end on CPU (a few
#               minutes at most); no test or lint tools
#   make test   create .venv with the dev extras, run `make check` (lint, format, type check), then the tests on CPU
# and on a GPU machine (CI stays CPU-only):
#   make test-gpu TORCH=keep   the tests marked `gpu` alone (make test skips them), with the system's CUDA torch
#
# TORCH=cpu (default) pins the CPU build of torch through constraints-cpu.txt, so pip can never pull a multi-GB
# CUDA build by accident. On a GPU machine use TORCH=keep: the venv then sees the torch already installed in the
# system Python (CUDA or ROCm build) and pip keeps it. Set TORCH_INDEX to a wheel index (for example
# https://download.pytorch.org/whl/cpu) where the pinned CPU wheel is not already available to pip.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= cpu
TORCH_INDEX ?=
DEMO_DIR ?= .demo

BIN := $(VENV)/bin
ifeq ($(TORCH),keep)
VENV_FLAGS := --system-site-packages
PIP_TORCH :=
else
VENV_FLAGS :=
PIP_TORCH := -c constraints-cpu.txt torch
endif
ifneq ($(TORCH_INDEX),)
PIP_TORCH += --extra-index-url $(TORCH_INDEX)
endif

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: demo test test-gpu check install lint clean-demo

# One pip command for every install (the Docker images copy it with TORCH=keep: tests/test_docker.py).
PIP_INSTALL := $(BIN)/python -m pip install --disable-pip-version-check -q $(PIP_TORCH)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

# Two stamps, one per install: `make demo` installs the package with the demo extra, `make test` (and `make check`,
# `make install`) with the dev extra. The dev extra includes the demo one, so its install stamps both: `make demo`
# after `make test` installs nothing, `make test` after `make demo` installs only the dev extras it lacks
# (tests/test_packaging.py runs both orders with stub tools).
$(VENV)/.installed-demo: $(BIN)/python pyproject.toml constraints-cpu.txt
	$(PIP_INSTALL) -e '.[demo]'
	@touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml constraints-cpu.txt
	$(PIP_INSTALL) -e '.[dev]'
	@touch $@ $(VENV)/.installed-demo

install: $(VENV)/.installed-dev

demo: $(VENV)/.installed-demo
	$(BIN)/python -m lightning_lora.cli.demo --out $(DEMO_DIR)
	$(BIN)/lightning-lora fit --config configs/tiny_cpu.yaml \
		--trainer.default_root_dir runs/demo/$$(date +%Y%m%d-%H%M%S)

# Test processes (pytest-xdist): one per core of a 2-core CI machine, tests handed out one by one (whole files per
# process left one core idle: 15m19 against 7m32 for the same tests from a fresh clone), but the tests of one
# xdist_group go to one process together (the 2-process DDP run that tests/test_fsdp.py and tests/test_multinode.py
# compare with is made once, and so are each family's runs in tests/families/test_contract.py; tests/test_suite.py
# checks it). PYTEST_WORKERS=0 runs them in this process.
# The 20 slowest tests are listed at the end: CI has to stay well under 15 minutes on 2 cores.
PYTEST_WORKERS ?= 2

test: check
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=20

# The tests that need a CUDA GPU (marker `gpu`, tests/conftest.py), one process: their header names the GPU and the
# versions. GPU_REPORT=path also writes pytest's JUnit XML there (the record of the run). On a machine without a
# network, skip the install and run the same line with a Python that has pytest:
#   python3 -m pytest -m gpu -p no:cacheprovider -rA --junitxml=gpu-tests.xml
GPU_REPORT ?=

test-gpu: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m gpu -p no:cacheprovider -rA -n 0 $(if $(GPU_REPORT),--junitxml=$(GPU_REPORT))

check: $(VENV)/.installed-dev
	$(BIN)/ruff check lightning_lora tests tools
	$(BIN)/ruff format --check lightning_lora tests tools
	$(BIN)/mypy

lint: check

clean-demo:
	rm -rf $(DEMO_DIR) runs/demo
