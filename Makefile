# The few targets people type. Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint format gpu-wheels clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# An exact torch pin: on the project's CPU machines it is a local CPU wheel; a looser spec pulls CUDA (GBs).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed  ## train the toy Llama-3 on the shipped preference data (CPU, ~1-2 min)
	$(PY) scripts/train_cpo.py --config recipes/dev/tiny_cpo.yaml

test: $(VENV)/.installed  ## CPU test suite (Triton kernels through the interpreter)
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check trl_fused_cpo scripts tests
	$(VENV)/bin/ruff format --check trl_fused_cpo scripts tests

format: $(VENV)/.installed
	$(VENV)/bin/ruff format trl_fused_cpo scripts tests
	$(VENV)/bin/ruff check --fix trl_fused_cpo scripts tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
