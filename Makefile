# Two commands do all the set-up on a fresh machine:
#   make demo   # create .venv, install, run the main job (2-rank CPU training through FSDP1 and FSDP2)
#   make test   # create .venv, install, run the test suite
# torch is installed first and pinned (CPU build 2.13.0): an unpinned torch pulls CUDA wheels.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test install

$(BIN)/fsdp-bridge: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $@

install: $(BIN)/fsdp-bridge

demo: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 examples/quickstart.py

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest
