# The two commands a newcomer runs: `make conformance` and `make test`.
# Both create .venv on first use and install the package (editable) with its
# test extras; the CPU build of torch is pinned through constraints-cpu.txt.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.exportlm-installed
INTEROP_STAMP := $(VENV)/.exportlm-interop-installed
PIP    := $(BIN)/python -m pip
JOBS   ?= auto
# One Hypothesis seed for the generated-structure checks, so a rerun draws the same
# structures and reuses their cached artifacts; `make conformance CONFORMANCE_SEED=`
# draws new ones each run.
CONFORMANCE_SEED ?= --hypothesis-seed=0

.PHONY: install test lint conformance bench clean

# Let the venv keep compiled bytecode even where the environment disables it:
# every pytest process (one per xdist worker) would otherwise recompile torch's,
# hypothesis' and pytest's imports on each run, ~1.5 s per process.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml constraints-cpu.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[test]'
	@touch $(STAMP)

# The reference implementations (nvidia-modelopt, compressed-tensors) for the
# interop tests: test-only, never runtime dependencies of the package.
$(INTEROP_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[test,interop]'
	@touch $(INTEROP_STAMP)

install: $(STAMP)

test: $(INTEROP_STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup tests

lint: $(STAMP)
	$(BIN)/ruff check src pytest_exportcheck tests benchmarks examples
	$(BIN)/ruff format --check src pytest_exportcheck tests benchmarks examples
	$(BIN)/mypy

conformance: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --export-targets=all --export-only \
		--export-report=conformance-report.json $(CONFORMANCE_SEED)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_export_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache conformance-report.json
