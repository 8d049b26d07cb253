#!/usr/bin/env bash
# The CUDA conformance subset on one GPU: the roundtrips of every target that
# declares 'cuda', the golden checks and fp8_gemm, all on CUDA with TF32 off.
# Installs nothing, reaches no network. See docs/gpu.md.
#
#   benchmarks/gpu/check.sh                       # uses .venv/bin/python
#   PYTHON=/usr/bin/python3 benchmarks/gpu/check.sh   # a python whose torch has CUDA
#
# Environment: PYTHON (default .venv/bin/python), BUDGET_S (pytest's wall-clock
# limit, default 280), WORKERS (xdist workers, default 4; 0 runs in-process),
# OUT (report directory, default a new temporary directory), DEVICE (default
# cuda; DEVICE=cpu runs the same subset on the CPU, a dry run of this script).
# VLLM_PYTHON (default $EXPORTLM_ENGINE_VLLM): the interpreter of a GPU build of vLLM
# (`pip install vllm==0.32.0` in a venv of its own); when set, step 3 runs the `served`
# items of hf_checkpoint on CUDA: ModelOpt FP8, compressed-tensors FP8, ModelOpt NVFP4,
# compressed-tensors FP8_BLOCK (blocks of 32), ModelOpt MXFP8, compressed-tensors
# MXFP4A16 and (Hopper only) W4AFP8 checkpoints in vLLM, in bfloat16 (SERVED_BUDGET_S, default 900; every engine
# run starts vLLM afresh, ~30-60 s). Unset: step 3 is skipped, and says so.
# Exit status: pytest's (0 all passed; the worse of the two pytest runs), 2 when this
# python cannot run CUDA, 124 when pytest ran past its budget.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-.venv/bin/python}"
BUDGET_S="${BUDGET_S:-280}"
WORKERS="${WORKERS:-4}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/exportlm-gpu-check.XXXXXX")}"
CHECKS="roundtrip_logits,dynamic_shapes,cache_wrapper,deterministic,golden_checkpoint,golden_calibration,fp8_gemm"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

say() { printf '== %s\n' "$*"; }

say "repository: $ROOT"
say "python: $PYTHON"
if ! command -v "$PYTHON" >/dev/null 2>&1 && [ ! -x "$PYTHON" ]; then
    echo "error: $PYTHON is not an executable python; set PYTHON=/path/to/python (one whose torch has CUDA)" >&2
    exit 2
fi

mkdir -p "$OUT"
# A python the checkout is not installed in (e.g. a system python with a CUDA
# torch) gets the checkout on PYTHONPATH and its entry points from a generated
# dist-info under $OUT: nothing is installed.
EXTRA="$("$PYTHON" "$ROOT/benchmarks/gpu/checkout.py" "$ROOT" "$OUT/site")" || exit 2
if [ -n "$EXTRA" ]; then
    export PYTHONPATH="$EXTRA${PYTHONPATH:+:$PYTHONPATH}"
    say "exportlm is not installed in this python: using the checkout (PYTHONPATH=$PYTHONPATH)"
fi

# Step 1: the environment. Prints torch, CUDA, the device; exits 2 without CUDA.
# Its last line is the comma-separated list of targets that declare 'cuda'.
say "step 1/4: environment"
ENV_OUT="$("$PYTHON" "$ROOT/benchmarks/gpu/env.py" "$DEVICE")"
status=$?
if [ "$status" -ne 0 ]; then
    printf '%s\n' "$ENV_OUT"
    exit "$status"
fi
printf '%s\n' "$ENV_OUT" | sed '$d'
TARGETS="$(printf '%s\n' "$ENV_OUT" | tail -n 1)"
if [ -z "$TARGETS" ]; then
    echo "error: no registered target declares 'cuda'; nothing to run" >&2
    exit 2
fi

# Step 2: the subset, on CUDA only; --export-require-device turns a missing or
# too old GPU into failures instead of skips.
say "step 2/4: pytest (budget ${BUDGET_S}s, workers ${WORKERS}, targets ${TARGETS})"
say "report: $OUT/report.json, log: $OUT/pytest.log"
XDIST=()
if [ "$WORKERS" != "0" ]; then
    XDIST=(-n "$WORKERS")
fi
GATE=(--export-device=cuda --export-require-device)
if [ "$DEVICE" = "cpu" ]; then
    GATE=(--export-device=cpu)
fi
start=$(date +%s)
timeout --signal=INT --kill-after=20 "$BUDGET_S" "$PYTHON" -m pytest -p no:cacheprovider \
    "${XDIST[@]}" -q -rfEs \
    "${GATE[@]}" --export-only \
    --export-targets="$TARGETS" --export-exporters=all --export-checks="$CHECKS" \
    --export-report="$OUT/report.json" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
wall=$(( $(date +%s) - start ))
if [ "$rc" -eq 124 ]; then
    echo "error: pytest ran past the budget of ${BUDGET_S}s (BUDGET_S); the partial log is $OUT/pytest.log" >&2
fi

# Step 3: vLLM's GPU-only FP8 / NVFP4 paths, through the `served` check (docs/engines.md).
# The engine runs in its own interpreter; --export-require-engines makes a VLLM_PYTHON
# that does not import vLLM a failure, not a skip.
VLLM_PYTHON="${VLLM_PYTHON:-${EXPORTLM_ENGINE_VLLM:-}}"
SERVED_BUDGET_S="${SERVED_BUDGET_S:-900}"
served_rc=0
if [ -z "$VLLM_PYTHON" ]; then
    say "step 3/4: served on ${DEVICE}: skipped (set VLLM_PYTHON to a GPU build of vLLM's python)"
else
    say "step 3/4: served on ${DEVICE} with vLLM ${VLLM_PYTHON} (budget ${SERVED_BUDGET_S}s)"
    # vLLM's item only (one served item per engine): the transformers item would be
    # 'unverified' here (this venv's transformers is not its table's 5.19.0).
    timeout --signal=INT --kill-after=20 "$SERVED_BUDGET_S" "$PYTHON" -m pytest \
        "exportcheck::served[hf_checkpoint-vllm-llama-${DEVICE}]" \
        -p no:cacheprovider -n 0 -q -rfEs "${GATE[@]}" --export-only \
        --export-targets=hf_checkpoint --export-checks=served --export-models=llama \
        --export-engine "vllm=$VLLM_PYTHON" --export-require-engines \
        --export-report="$OUT/served.json" 2>&1 | tee "$OUT/served.log"
    served_rc=${PIPESTATUS[0]}
    if [ "$served_rc" -eq 124 ]; then
        echo "error: the served items ran past ${SERVED_BUDGET_S}s (SERVED_BUDGET_S); log: $OUT/served.log" >&2
    fi
fi

# Step 4: the summary, from the JSON report.
say "step 4/4: summary (pytest exit status $rc, served $served_rc, wall ${wall}s)"
"$PYTHON" "$ROOT/benchmarks/gpu/summary.py" "$OUT/report.json" "$wall" || true
if [ "$rc" -eq 0 ]; then
    rc=$served_rc
fi
exit "$rc"
