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

# The CPUs that run CI differ (AVX2 only, or AVX-512 with BF16): the parity tests run again on the
# AVX2 kernels (a no-op on an AVX2-only machine), so tolerances hold on both.
ISA_TESTS := tests/models/test_parity.py tests/models/test_amp_parity.py tests/dialects/test_upcast.py

test: $(VENV)/.installed
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q $(ISA_TESTS)

# everything, including tests marked slow (torch.compile comparisons)
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m ''

bench: $(VENV)/.installed
	$(PY) benchmarks/step_compare.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
