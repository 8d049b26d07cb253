"""``w4afp8-group-size``: vLLM runs a compressed-tensors W4AFP8 layer only in groups of 128.

A compressed-tensors ``W4AFP8`` group (INT4 symmetric group weights, FP8 inputs per token
at run time: llm-compressor's preset, exportlm's recipe ``w4afp8``) has one kernel in
vLLM 0.32: ``CompressedTensorsW4A8Fp8`` (``compressed_tensors/schemes/
compressed_tensors_w4a8_fp8.py``), which raises "W4A8 kernels require group quantization
with group size 128" for any other group size. transformers + compressed-tensors load any
group size, so another one is a warning, named once per group size (only the config is read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._loaders import LayerRefusal
from exportlm.inspection._rules import RULES, Finding
from exportlm.quant.formats._w4afp8 import VLLM_GROUP_SIZE, W4AFP8

__all__ = ["w4afp8_findings", "w4afp8_refusals"]


def _other_sizes(layers: list[QuantizedLayer]) -> list[tuple[int | None, int]]:
    """``(group size, layers)`` of the W4AFP8 layers in groups other than 128."""
    sizes = Counter(
        layer.scheme.block_size
        for layer in layers
        if layer.spec is W4AFP8 and layer.scheme is not None
    )
    return [
        (size, count)
        for size, count in sorted(sizes.items(), key=lambda item: str(item[0]))
        if size != VLLM_GROUP_SIZE
    ]


def w4afp8_refusals(layers: list[QuantizedLayer]) -> list[LayerRefusal]:
    """vLLM, where some W4AFP8 layer is in groups other than 128 (the loaders line's verdict)."""
    sizes = " and ".join(str(size) for size, _ in _other_sizes(layers))
    reason = f"W4AFP8 groups of {sizes}"
    return [LayerRefusal("vLLM", "w4afp8-group-size", reason)] if sizes else []


def w4afp8_findings(layers: list[QuantizedLayer]) -> Iterator[Finding]:
    """``w4afp8-group-size`` for each group size other than 128 of layers read as W4AFP8."""
    for size, count in _other_sizes(layers):
        yield RULES["w4afp8-group-size"].finding(
            "config.json",
            f"{count} W4AFP8 layer(s) in groups of {size}: vLLM's W4AFP8 kernel "
            f"(CompressedTensorsW4A8Fp8, compute capability 9.0) takes groups of "
            f"{VLLM_GROUP_SIZE} only and refuses to load them; transformers + "
            "compressed-tensors load them. For vLLM, quantize with group_size="
            f"{VLLM_GROUP_SIZE} (input features divisible by {VLLM_GROUP_SIZE})",
            group_size=size,
            layers=count,
        )
