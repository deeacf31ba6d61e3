# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use. torch is pinned; on a machine whose pip does not already find the CPU wheel,
# pass TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI's Linux wheels of torch are CUDA builds, which
# also run on CPU). torch 2.11-2.14 are supported, each with the fbgemm-gpu release built for it (1.6, 1.7,
# 1.8, 1.9): make test TORCH=2.11.0 picks FBGEMM=1.6.0. A torch newer than every fbgemm release (2.15) installs
# without fbgemm and runs on torch kernels only.
PYTHON ?= python3
VENV ?= .venv
CUDA ?= 0
TORCH ?= 2.14.1
FBGEMM ?= $(if $(filter 2.11.%,$(TORCH)),1.6.0,$(if $(filter 2.12.%,$(TORCH)),1.7.0,$(if $(filter 2.13.%,$(TORCH)),1.8.0,$(if $(filter 2.14.%,$(TORCH)),1.9.0,))))
TORCH_INDEX ?=
OLDEST_TORCH := 2.11.0
KERNELS := $(if $(filter 1,$(CUDA)),cuda,cpu)
FBGEMM_PKG := $(if $(filter 1,$(CUDA)),fbgemm-gpu,fbgemm-gpu-cpu)
COMMA := ,
EXTRAS := $(if $(FBGEMM),$(KERNELS)$(COMMA)dev,dev)
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python

$(VENV)/.installed-$(KERNELS)-$(TORCH): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[$(EXTRAS)]" $(if $(FBGEMM),"$(FBGEMM_PKG)==$(FBGEMM)")
	touch $@

install: $(VENV)/.installed-$(KERNELS)-$(TORCH)

demo: install
	$(PY) examples/dlrm.py

demo-lookup: install
	$(PY) examples/sharded_lookup_demo.py

test: install
	$(PY) -m pytest -q -x tests

test-fast: install   # the unit tier: no processes launched, no graphs compiled, under a minute
	$(PY) -m pytest -q -x tests/unit

# the unit tier on the oldest supported pair (torch 2.11 + fbgemm 1.6), in a venv of its own
test-oldest:
	$(MAKE) test-fast TORCH=$(OLDEST_TORCH) VENV=.venv-$(OLDEST_TORCH)

# CUDA tests and the GPU benchmark; on a machine whose python already has a CUDA torch (and, optionally,
# fbgemm-gpu), skip the venv: make gpu-check NO_VENV=1 PY=python3
gpu-check: $(if $(NO_VENV),,install)
	$(PY) -m pytest -q -m gpu tests
	$(PY) benchmarks/bench_gpu.py

lint: install
	$(VENV)/bin/ruff check lightning_rec tests benchmarks examples
	$(VENV)/bin/ruff format --check lightning_rec tests benchmarks examples
	$(VENV)/bin/mypy lightning_rec

bench: install
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_sharding.py
	$(PY) benchmarks/bench_strategy.py
	$(PY) benchmarks/bench_dlrm.py

.PHONY: install demo demo-lookup test test-fast test-oldest lint gpu-check bench
