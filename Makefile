PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test serve lint typecheck bench clean gpu-wheels image-check

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0 -c constraints-cpu.txt
	$(PIP) install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

# schemathesis' fuzz items share one node id, so under xdist they are deselected (tests/conftest.py) and
# run on their own after. scripts/test-deps.sh first installs the non-Python tools the suite runs
# (prometheus, promtool), or stops naming the command that does
test: $(STAMP)
	scripts/test-deps.sh
	$(PY) -m pytest -q -n 2 --dist loadgroup tests
	$(PY) -m pytest -q tests/service/api/test_fuzz.py::test_every_response_is_documented_and_no_5xx

serve: $(STAMP)
	$(VENV)/bin/reformer serve

lint: $(STAMP)
	$(VENV)/bin/ruff check model export service train loadtest bench tests
	$(VENV)/bin/mypy model export service train loadtest

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[bench]"
	$(PY) bench/forward/forward.py

# Wheels bench/gpu/gpu_check.sh installs on the lent GPU machine (no network there; its python3 is 3.12 and
# lacks these): the versions of this venv, for CPython 3.12 on x86-64 Linux, with their dependencies.
GPU_WHEEL_PACKAGES := fastapi uvicorn pydantic pydantic-settings starlette
gpu-wheels: $(STAMP)
	rm -rf bench/wheels
	$(PIP) download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d bench/wheels $$($(PY) -c "import importlib.metadata as m; \
	  print(' '.join(f'{p}=={m.version(p)}' for p in '$(GPU_WHEEL_PACKAGES)'.split()))")
	ls bench/wheels

# Builds the CUDA and CPU images from cold caches and runs them as a user would (bench/docker/image_check.py;
# needs root for dockerd and debootstrap; 25 minutes on 2 busy cores). Writes bench/results/image_check.json.
image-check: $(STAMP)
	nice -n 10 $(PY) bench/docker/image_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
