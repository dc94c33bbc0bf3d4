# Quick start (fresh machine): `make demo` sets up and trains a tiny Llama with Kiln next to eager;
# `make test` sets up and runs the test suite. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all bench setup clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0: its CPU wheel is on the machine; anything looser pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m kiln demo

# The CPUs that run CI differ (AVX2 only, or AVX-512 with BF16): on a CPU above AVX2 the parity tests run
# again on the AVX2 kernels, so tolerances hold on both (on an AVX2-only CPU the first run already did).
ISA_TESTS := tests/models/test_parity.py tests/models/test_amp_parity.py tests/dialects/test_upcast.py \
	tests/kernels/test_attention_backward.py tests/kernels/test_attention_forward.py tests/passes/test_chunk.py
CPU_ISA = $(shell $(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')

test: $(VENV)/.installed
	$(PY) -m pytest -q
	@if [ "$(CPU_ISA)" = "AVX2" ] || [ "$(CPU_ISA)" = "DEFAULT" ]; then \
		echo "the CPU runs $(CPU_ISA) kernels: the AVX2 pass of $(ISA_TESTS) was the run above"; \
	else \
		ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q $(ISA_TESTS); \
	fi

# everything, including tests marked slow (torch.compile comparisons)
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m ''

bench: $(VENV)/.installed
	$(PY) benchmarks/step_compare.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build kiln/kernels/_native_*.so
