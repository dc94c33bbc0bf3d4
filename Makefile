# Quick start (fresh machine): `make demo` sets up and trains a tiny Llama with Kiln next to eager;
# `make test` sets up and runs the test suite. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all bench setup clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0: its CPU wheel is on the machine; anything looser pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m kiln demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

# everything, including tests marked slow (torch.compile comparisons)
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m ''

bench: $(VENV)/.installed
	$(PY) benchmarks/step_compare.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
