# Two commands do all the set-up on a fresh machine:
#   make train  # create .venv, install, run the main job: `fsdp-bridge train` (built-in tiny job, 2 CPU ranks)
#   make test   # create .venv, install, lint (ruff check, ruff format --check, mypy, lint-imports), run the test suite
# make test-slow runs the slow tier (long end-to-end runs; CI runs it after the suite).
# make ab runs examples/ab_backends.py: the same loop through FSDP1 and FSDP2, losses side by side.
# torch is installed first and pinned (CPU build 2.13.0): an unpinned torch pulls CUDA wheels.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# pytest-xdist workers for the suite: two share a 2-core machine's spawned ranks and subprocesses.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: train ab test test-slow install lint

$(BIN)/fsdp-bridge: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $@

install: $(BIN)/fsdp-bridge

train: install
	OMP_NUM_THREADS=1 $(BIN)/fsdp-bridge train

ab: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 examples/ab_backends.py

lint: install
	$(BIN)/python -m ruff check fsdp_bridge tests examples benchmarks
	$(BIN)/python -m ruff format --check fsdp_bridge tests examples benchmarks
	$(BIN)/python -m mypy
	$(BIN)/lint-imports

test: install lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

# The slow tier: long end-to-end runs (fault injection through torchrun, the full checkpoint matrix,
# Ray Train, torch.compile); each has a cheaper sibling in `make test`. .ci/run runs it too.
test-slow: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) -m slow
