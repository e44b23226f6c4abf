# The two commands a newcomer needs: `make dev` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines get the CPU build of torch first; otherwise pip would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: dev test lint fmt venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "loraplex needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip 'setuptools>=77' wheel
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: torch comes from the project's dependencies"; \
	else \
		echo "no CUDA: installing $(TORCH_CPU) (CPU build) first"; \
		$(BIN)/python -m pip install --quiet '$(TORCH_CPU)'; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev,kernels]'
	touch $(STAMP)

dev: $(STAMP)
	$(BIN)/loraplex dev

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/loraplex
	ln -s ../../../platform build/typecheck/loraplex/platform
	ln -s ../../../engine build/typecheck/loraplex/engine
	ln -s ../../../kernels build/typecheck/loraplex/kernels
	cd build/typecheck && MYPYPATH=. ../../$(BIN)/mypy --config-file ../../pyproject.toml \
		--explicit-package-bases -p loraplex.platform -p loraplex.engine -p loraplex.kernels

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
