# Two entry points: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# NOTE: torch is installed first and pinned, so the project's `torch>=2.3` is already
# satisfied and pip never pulls a multi-GB CUDA build on a CPU-only machine.
TORCH ?= torch==2.13.0

.PHONY: demo test lint install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,examples]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/disttrain run --nproc 4 examples/digits.py

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks tools
	$(PY) tools/budget.py

clean:
	rm -rf $(VENV) build src/*.egg-info
