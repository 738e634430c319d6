# Two entry points: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# NOTE: torch is installed first and pinned, so the project's `torch>=2.3` is already
# satisfied and pip never pulls a multi-GB CUDA build on a CPU-only machine.
TORCH ?= torch==2.13.0

.PHONY: demo test lint install clean browser

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,examples]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/disttrain run --nproc 4 examples/digits.py

test: install browser
	$(PY) -m pytest -q

# `disttrain report`'s page is tested in headless Chromium (Debian's package): installed
# when missing; without it that test fails on CI (CI=true) instead of passing unseen.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium) \
		>/dev/null 2>&1 || echo "make: could not install chromium: the report's browser test fails on CI" >&2

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks tools
	$(PY) tools/budget.py
	$(PY) tools/cycles.py
	$(PY) tools/privates.py

clean:
	rm -rf $(VENV) build src/*.egg-info
