# The few targets people type. Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The latest lane (`make test-latest`, run by .ci/run after `make test`): the newest releases on PyPI.
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
# Installed first, newest release each, by themselves; the package's install must keep every one of them.
LATEST_PKGS := torch triton transformers accelerate peft datasets numpy

.PHONY: help demo test test-fast test-latest lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/'

# Comments stay out of the recipes below (make would echo them). torch has an exact pin: on a CPU-only machine with
# a local CPU wheel that is what installs; a looser spec pulls the CUDA build (GBs). triton: the release torch
# 2.13.0's Linux (CUDA) wheel pins itself, so the CPU lane tests the same pair.
$(VENV)/.installed: pyproject.toml
	@echo "Creating $(VENV) and installing torch, triton and the package with its test extras (about 2 minutes, once)"
	@python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q torch==2.13.0 "triton==3.7.1; platform_system == 'Linux'"
	@$(PY) -m pip install -q -e ".[test]"
	@touch $@

# The newest torch from PyPI is its CUDA build (torch 2.15.0: 2.6 GB of downloads, 5.3 GB installed, ~1.5 min).
# PIP_CONSTRAINT=/dev/null replaces, for these installs only, any pip constraints file of the machine (one that caps
# torch at the releases on its disk).
$(LATEST_VENV)/.installed: pyproject.toml
	@echo "Creating $(LATEST_VENV) with the newest releases of $(LATEST_PKGS), then the package"
	@rm -rf $(LATEST_VENV)
	@python3 -m venv $(LATEST_VENV)
	@$(LATEST_PY) -m pip install -q --upgrade pip
	@PIP_CONSTRAINT=/dev/null $(LATEST_PY) -m pip install -q --upgrade $(LATEST_PKGS)
	@$(LATEST_PY) -m pip freeze > $(LATEST_VENV)/freeze-before.txt
	@PIP_CONSTRAINT=/dev/null $(LATEST_PY) -m pip install -q -e ".[test]"
	@$(LATEST_PY) -m pip freeze > $(LATEST_VENV)/freeze-after.txt
	@$(LATEST_PY) .ci/check_no_downgrade.py $(LATEST_VENV)/freeze-before.txt $(LATEST_VENV)/freeze-after.txt $(LATEST_PKGS)
	@touch $@

demo: $(VENV)/.installed  ## train the toy Llama-3 on the shipped preference data (CPU, ~10 s on 2 cores)
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) scripts/train_cpo.py --config recipes/dev/tiny_cpo.yaml

test: $(VENV)/.installed  ## the whole CPU test suite (Triton kernels through the interpreter; ~20 CPU-minutes)
	@$(PY) -m pytest -q

test-fast: $(VENV)/.installed  ## the CPU suite without the tests marked slow (subprocess and end-to-end runs)
	@$(PY) -m pytest -q -m "not slow"

test-latest: $(LATEST_VENV)/.installed  ## the CPU suite on the newest torch, triton, transformers, ... (CI's second lane)
	@$(LATEST_PY) -m pip list 2>/dev/null | grep -iE '^($(shell echo $(LATEST_PKGS) trl | tr ' ' '|'))[[:space:]]'
	@$(LATEST_PY) -m pytest -q

lint: $(VENV)/.installed  ## ruff check and ruff format --check
	@$(VENV)/bin/ruff check trl_fused_cpo scripts tests
	@$(VENV)/bin/ruff format --check trl_fused_cpo scripts tests

format: $(VENV)/.installed  ## ruff format, then ruff check --fix
	@$(VENV)/bin/ruff format trl_fused_cpo scripts tests
	@$(VENV)/bin/ruff check --fix trl_fused_cpo scripts tests

clean:  ## remove the virtual environments, outputs/ and pytest's cache
	@rm -rf $(VENV) $(LATEST_VENV) outputs .pytest_cache
