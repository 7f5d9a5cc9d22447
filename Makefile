# Two commands on a fresh machine with Python 3.11 and pip:  `make run` (the default job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# jax_privacy 2.0.0 with CPU jax, apart from the project's venv: tests/test_bandmf.py's independent BandMF accountant
ORACLE ?= .venv-oracle

.PHONY: install oracle run test test-fast fuzz mutants bench bench-quick clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build on a machine without a GPU
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(ORACLE)/.installed:
	test -x $(ORACLE)/bin/python || $(PYTHON) -m venv $(ORACLE)
	$(ORACLE)/bin/python -m pip install -q jax-privacy==2.0.0 'jax[cpu]==0.10.2' dp-accounting==0.6.0
	touch $@

oracle: $(ORACLE)/.installed

install: $(VENV)/.installed

run: install
	$(PY) -m workbench

test: install oracle
	$(PY) -m pytest -q

test-fast: install oracle
	$(PY) -m pytest -q -m "not slow"

# The floating-point bound attacked with many more random cases than `make test` draws (tests/test_fp_bound.py).
fuzz: install
	WORKBENCH_FUZZ_EXAMPLES=$${WORKBENCH_FUZZ_EXAMPLES:-3000} $(PY) -m pytest -q tests/test_fp_bound.py

# Deliberate privacy bugs, each of which a named test must catch (tests/mutants.py); fails if one survives.
mutants: install
	$(PY) -m tests.mutants

bench: install
	$(PY) -m benchmarks
	$(PY) -m benchmarks.adaptive_clipping
	$(PY) -m benchmarks.dp_adam
	$(PY) -m benchmarks.bandmf --text

bench-quick: install
	$(PY) -m pytest -q -m bench tests/test_benchmarks.py   # every quick figure written, with its targets checked

clean:
	rm -rf $(VENV) $(ORACLE) outputs multirun mlflow.db
