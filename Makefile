# The README's two commands live here: `make demo` and `make test`, each from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch (this pin is on local disk on the team's machines; on a GPU box
# install the CUDA build of your choice first, and setup will keep it).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup demo demo-quick figures test test-e2e test-fast lint bench clean gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(PY) scripts/demo.py

demo-quick: setup
	$(PY) scripts/demo.py --quick

# The README's figures in docs/figures from the full demo in runs/demo (a rerun reuses every finished stage); only
# the figures of the names the demo draws are replaced.
figures: setup
	$(PY) scripts/demo.py --publish-figures

# Without shellcheck the SLURM scripts' lint tests skip: say so first, with the install command.
SHELLCHECK_NOTE := command -v shellcheck >/dev/null 2>&1 || echo "note: shellcheck is not installed, so the \
tests that lint slurm/*.sh will be skipped. Fix: sudo apt-get install shellcheck (Debian/Ubuntu), then rerun"

# The suite but its end-to-end runs (marked e2e: the quick demo, the cluster rehearsal, multi-process trainings, doctor,
# RULER's eleven tasks), which test-e2e runs; CI runs both.
test: setup
	@$(SHELLCHECK_NOTE)
	@echo "make test leaves out the end-to-end runs marked e2e (minutes each): make test-e2e runs them, CI runs both"
	$(PY) -m pytest -q -m "not e2e"

test-e2e: setup
	$(PY) -m pytest -q -m e2e

# The quick loop while editing: everything but the tests marked slow (subprocesses, the demo, venvs, lm-eval, and
# any test over about a second on 2 cores), in one process: on 2 cores pytest-xdist's two workers were slower than
# one (docs/performance.md). On a machine of more cores: make test-fast PYTEST_ARGS="-n auto".
PYTEST_ARGS ?=
test-fast: setup
	@$(SHELLCHECK_NOTE)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

# Everything CUDA on one GPU, offline, in minutes (train/preflight/gpu_check.py); without a GPU, what runs on a CPU.
# GPU_PY picks the Python (one with CUDA torch >= 2.10 and lightning); ARGS passes options (--only STAGE ...).
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

# The pure-Python packages (and two small binary wheels) a GPU image with torch, lightning and transformers
# lacks, as wheels for GPU_PYTHON (default 3.12) on x86-64 Linux, for gpu-check on a machine without network.
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= 3.12
GPU_PACKAGES := jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 \
	liger-kernel==0.8.5 quicktok-v1==0.4.0 zstandard==0.25.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_PACKAGES)

clean:
	rm -rf $(VENV) runs/demo .pytest_cache .gpu-site
