# The two commands a newcomer needs: `make dev` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines get the CPU build of torch first; otherwise pip would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: dev test lint fmt venv clean chromium native bench bench-gpu agents-smoke

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

# The native CPU operators (kernels/native.py): compiled once for this machine and this torch, a no-op when the
# library is already there; without a compiler it warns and the torch paths serve.
native: $(STAMP)
	$(BIN)/python -m loraplex.kernels.native

dev: $(STAMP) native
	$(BIN)/loraplex dev

test: $(STAMP) native chromium
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The browser tests (the console's and the billing page's) drive Debian's chromium through Playwright
# (docs/decisions/0013-billing-page.md, 0029-console.md).
# Installed only when none is found; `apt-get update` only if the install fails (a fresh image has no lists).
# Without apt-get, or without root or sudo, it says so and the test fails with what to install.
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
chromium:
	@if command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "warning: no chromium and no apt-get: install Chromium for the browser tests" >&2; exit 0; fi; \
	if [ "$$(id -u)" -eq 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
		echo "warning: no chromium, and neither root nor sudo to run: apt-get install chromium" >&2; exit 0; fi; \
	echo "installing Debian's chromium (for the browser tests)"; \
	$$SUDO env $(APT_CHROMIUM) || { $$SUDO apt-get update && $$SUDO env $(APT_CHROMIUM); }

# The CPU benchmark suite, then docs/benchmarks.md and its plots regenerated from benchmarks/results/ (report.py).
# Fewer repeats than the commands on that page, aiming at 20 minutes on 2 cores. Measured with every step below: 16
# minutes on an AMD EPYC with AVX-512 VNNI (2026-12-05; platform_overhead's three setups alone took 3.8), 14 on an
# Intel Xeon with AMX (2026-12-05, platform_overhead then in two setups); on 2026-12-03 an AVX2-only EPYC took 22
# minutes before the suite was trimmed to its present size (its large-model headline and sweeps send fewer requests).
# platform_overhead's services setups need Postgres and Redis at their default URLs (see its --database-url and
# --redis-url); without them: make bench BENCH_OVERHEAD_ARGS="--setup embedded".
BENCH_OVERHEAD_ARGS ?= --setup all --requests 100
bench: $(STAMP) native
	$(BIN)/python benchmarks/engine_throughput.py --repeats 1 --batch-sizes 32,64
	for family in qwen3 gemma3 phi3; do $(BIN)/python benchmarks/engine_throughput.py --family $$family --batch-sizes 32; done
	$(BIN)/python benchmarks/lora_throughput.py --repeats 1 --batch-sizes 64
	$(BIN)/python benchmarks/sliding_window_memory.py
	$(BIN)/python benchmarks/quant_throughput.py --rounds 2 --requests 32 --modes float32,bfloat16,int8,int4,fp8
	$(BIN)/python benchmarks/platform_overhead.py $(BENCH_OVERHEAD_ARGS)
	$(BIN)/python benchmarks/tensor_parallel.py
	$(BIN)/python benchmarks/kv_transfer.py
	$(BIN)/python benchmarks/protocol_overhead.py
	$(BIN)/python benchmarks/suite.py
	$(BIN)/python benchmarks/report.py

# Opt-in: the real agent CLIs (Codex CLI, Claude Code, from npm) one turn each against `loraplex dev`.
agents-smoke: $(STAMP)
	npm install --no-audit --no-fund --prefix build/agents @openai/codex @anthropic-ai/claude-code
	LPX_AGENTS_SMOKE=1 $(BIN)/python -m pytest tests/test_agents_smoke.py -q -p no:cacheprovider

# The GPU variant (a larger model, --device cuda, the Triton kernels): run on a machine with a CUDA GPU.
bench-gpu: $(STAMP)
	scripts/bench_gpu.sh

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
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache kernels/_native
