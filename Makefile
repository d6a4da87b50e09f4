# Set-up and the two everyday commands. Everything installs into ./.venv from scratch.
#   make demo   - train and evaluate a real drafter on the embedded default (CPU is enough)
#   make test   - the test suite (plus ruff), exactly what CI runs
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	@# Without a GPU take the CPU build of torch (a local wheel where the machine has one).
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.9"; fi
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dflash-train demo

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
