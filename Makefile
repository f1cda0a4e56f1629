# Two commands for a new user: `make demo` and `make test` (see README.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of a known-good torch; on a GPU box: `make setup TORCH=torch CONSTRAINTS=`.
TORCH  ?= torch==2.13.0
# Keeps that torch when nnunetv2 comes in (extra "nnunet"); on a GPU box: CONSTRAINTS=
CONSTRAINTS ?= .ci/constraints-cpu.txt
DEMO   ?= 900
PYTEST_ARGS ?=
# Two pytest-xdist workers (the box has 2 cores, and much of the suite waits on the processes
# it starts); a worker runs a whole test file (its module fixtures are built once) and the
# files with the most slow tests go first (tests/conftest.py). PYTEST_XDIST= runs serially.
PYTEST_XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder

.PHONY: setup demo demo-data demo-train test lint screenshots

setup: $(VENV)/.installed

# Each step checks what an interrupted earlier run may have left: a venv without a working
# pip is made anew, a torch that does not import is installed again over the broken one, and
# the stamp is written only after the project imports.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PY) -m pip --version >/dev/null 2>&1 || python3 -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --force-reinstall "$(TORCH)"
	$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev,nnunet,plot]'
	$(PY) -c "import app.main, trainer.run, textual, blosc2, safetensors, nibabel, matplotlib" 2>/dev/null \
	  || $(PY) -m pip install -q --force-reinstall $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev,nnunet,plot]'
	$(PY) -c "import app.main, trainer.run, textual, blosc2, safetensors, nibabel, matplotlib"
	touch $@

demo-data: setup
	$(VENV)/bin/nnui-demo-data
	$(VENV)/bin/nnui-preprocess $(DEMO) -pl nnuiCPUPlanner -c 2d 3d_fullres

# Demo data, then the TUI (real GPUs if there are any, otherwise it offers CPU slots). The
# demo asks for the CPU-sized plans nnuiCPUPlans: the default plans are nnU-Net's, GPU-sized.
demo: demo-data
	$(VENV)/bin/nnui

# A short headless CPU training of fold 0, for machines without a terminal UI.
demo-train: demo-data
	$(VENV)/bin/nnui-train $(DEMO) 3d_fullres 0 -p nnuiCPUPlans -device cpu --epochs 5 --iterations-per-epoch 10 --val-iterations 3

test: setup
	$(VENV)/bin/ruff check app trainer tests bench
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check app trainer tests bench
	$(VENV)/bin/ruff format --check app trainer tests bench
	$(VENV)/bin/mypy

screenshots: setup
	$(PY) screenshots/make_screenshots.py
