PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test serve lint typecheck bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0 -c constraints-cpu.txt
	$(PIP) install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

serve: $(STAMP)
	$(VENV)/bin/reformer serve

lint: $(STAMP)
	$(VENV)/bin/ruff check model export service bench tests
	$(VENV)/bin/mypy model export service

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[bench]"
	$(PY) bench/forward.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
