# The few targets people type. Each creates .venv and installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The latest lane (`make test-latest`, run by .ci/run after `make test`): the newest releases on PyPI.
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
# Installed first, newest release each, by themselves; the package's install must keep every one of them.
LATEST_PKGS := torch triton transformers accelerate peft datasets numpy

.PHONY: demo test test-latest lint format clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# An exact torch pin: on the project's CPU machines it is a local CPU wheel; a looser spec pulls CUDA (GBs).
	# triton: the release torch 2.13.0's Linux (CUDA) wheel pins itself, so the CPU lane tests the same pair.
	$(PY) -m pip install -q torch==2.13.0 "triton==3.7.1; platform_system == 'Linux'"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The newest torch from PyPI is its CUDA build (torch 2.15.0: 2.6 GB of downloads, 5.3 GB installed, ~1.5 min
# here). PIP_CONSTRAINT=/dev/null replaces, for these installs only, the constraints file of the project's
# machines (/etc/xdg/pip caps torch at the releases on their disk).
$(LATEST_VENV)/.installed: pyproject.toml
	rm -rf $(LATEST_VENV)
	python3 -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q --upgrade pip
	PIP_CONSTRAINT=/dev/null $(LATEST_PY) -m pip install -q --upgrade $(LATEST_PKGS)
	$(LATEST_PY) -m pip freeze > $(LATEST_VENV)/freeze-before.txt
	PIP_CONSTRAINT=/dev/null $(LATEST_PY) -m pip install -q -e ".[test]"
	$(LATEST_PY) -m pip freeze > $(LATEST_VENV)/freeze-after.txt
	$(LATEST_PY) .ci/check_no_downgrade.py $(LATEST_VENV)/freeze-before.txt $(LATEST_VENV)/freeze-after.txt $(LATEST_PKGS)
	touch $@

demo: $(VENV)/.installed  ## train the toy Llama-3 on the shipped preference data (CPU, ~15 s)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) scripts/train_cpo.py --config recipes/dev/tiny_cpo.yaml

test: $(VENV)/.installed  ## CPU test suite (Triton kernels through the interpreter)
	$(PY) -m pytest -q

test-latest: $(LATEST_VENV)/.installed  ## the CPU suite on the newest torch, triton, transformers, ... (CI's second lane)
	$(LATEST_PY) -m pip list 2>/dev/null | grep -iE '^($(shell echo $(LATEST_PKGS) trl | tr ' ' '|'))[[:space:]]'
	$(LATEST_PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check trl_fused_cpo scripts tests
	$(VENV)/bin/ruff format --check trl_fused_cpo scripts tests

format: $(VENV)/.installed
	$(VENV)/bin/ruff format trl_fused_cpo scripts tests
	$(VENV)/bin/ruff check --fix trl_fused_cpo scripts tests

clean:
	rm -rf $(VENV) $(LATEST_VENV) outputs .pytest_cache
