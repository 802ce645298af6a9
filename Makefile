# The README's two commands live here: `make demo` and `make test`, each from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch (this pin is on local disk on the team's machines; on a GPU box
# install the CUDA build of your choice first, and setup will keep it).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup demo demo-quick test test-fast lint bench clean

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

test: setup
	$(PY) -m pytest -q

# The quick loop while editing: everything but the tests marked slow (subprocesses, the demo, venvs).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	for b in benchmarks/[!_]*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs/demo .pytest_cache
