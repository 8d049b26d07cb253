"""Which ``quant_method`` each loader knows.

The serving engines' lists are fixed here from their sources (cited per loader in
``docs/checkpoint-rules.md#quant-method-unknown``); transformers' list is read from
the installed transformers (``transformers.quantizers.auto``), so the answer
follows the version the user has.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["SERVING_QUANT_METHODS", "loaders_knowing", "transformers_quant_methods"]

#: ``quant_method`` values each serving engine dispatches on (a subset: the common ones).
SERVING_QUANT_METHODS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        # vllm/model_executor/layers/quantization/__init__.py (QuantizationMethods)
        "vLLM": frozenset(
            {
                "awq", "awq_marlin", "bitsandbytes", "compressed-tensors", "experts_int8",
                "fbgemm_fp8", "fp8", "gguf", "gptq", "gptq_marlin", "hqq", "modelopt",
                "modelopt_fp4", "moe_wna16", "mxfp4", "quark", "torchao", "auto-round",
            }
        ),
        # python/sglang/srt/layers/quantization/__init__.py (QUANTIZATION_METHODS)
        "SGLang": frozenset(
            {
                "awq", "awq_marlin", "bitsandbytes", "compressed-tensors", "fp8", "gguf", "gptq",
                "gptq_marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "w8a8_fp8",
                "w8a8_int8",
            }
        ),
        # tensorrt_llm reads ModelOpt's hf_quant_config.json (quant_method "modelopt")
        "TensorRT-LLM": frozenset({"modelopt"}),
    }
)  # fmt: skip


def transformers_quant_methods() -> frozenset[str] | None:
    """The ``quant_method`` values the installed transformers loads (``None``: not installed)."""
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    except ImportError:
        return None
    return frozenset(AUTO_QUANTIZATION_CONFIG_MAPPING)


def loaders_knowing(method: str) -> tuple[list[str], list[str]]:
    """``(loaders that know method, loaders that do not)``, transformers with its version."""
    known: list[str] = []
    unknown: list[str] = []
    for loader, methods in SERVING_QUANT_METHODS.items():
        (known if method in methods else unknown).append(loader)
    hf = transformers_quant_methods()
    if hf is not None:
        from importlib.metadata import version

        label = f"transformers {version('transformers')}"
        (known if method in hf else unknown).append(label)
    return known, unknown
