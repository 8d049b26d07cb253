"""``w4a8-fp8-range``: a W4A8_AWQ layer's INT4 values fit FP8 after its second scale.

TensorRT-LLM's W4A8 AWQ GEMM runs the weight in FP8: each INT4 code times
``weight_scale / weight_scale_2`` (the per-group scale over the per-tensor FP8 scale)
becomes an FP8 value, which saturates at 448. ModelOpt writes ``weight_scale_2 =
amax / 448`` of the INT4-dequantized weight, so ``7 * max(weight_scale) <= 448 *
weight_scale_2``; a second scale computed another way (NVFP4's ``amax / (6 * 448)``, or
the weight's amax before the AWQ scale multiplied it) clips the largest weights
without an error. Only the two scales are read (a few bytes per group).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from exportlm.errors import MalformedCheckpointError
from exportlm.inspection._files import Checkpoint
from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._rules import RULES, Finding
from exportlm.quant._tensor import FP8_MAX, INT4_MAX
from exportlm.quant.formats._w4a8 import W4A8

__all__ = ["w4a8_findings"]

_REL_TOL = 1e-6


def w4a8_findings(checkpoint: Checkpoint, layers: list[QuantizedLayer]) -> Iterator[Finding]:
    """``w4a8-fp8-range`` for every layer read in the W4A8 format."""
    for layer in layers:
        if layer.spec is not W4A8:
            continue
        group, second = layer.leaves.get("weight_scale"), layer.leaves.get("weight_scale_2")
        if group is None or second is None:
            continue  # scale-missing says so
        if not (checkpoint.readable(group.name) and checkpoint.readable(second.name)):
            continue
        try:
            groups = checkpoint.values(group.name).float()
            s2 = checkpoint.values(second.name).float()
        except MalformedCheckpointError:
            continue  # shard-unreadable says so
        finding = _range_problem(layer.module, groups, s2)
        if finding is not None:
            yield finding


def _range_problem(module: str, groups: torch.Tensor, s2: torch.Tensor) -> Finding | None:
    if s2.numel() != 1 or not bool(torch.isfinite(groups).all()) or groups.numel() == 0:
        return None  # the shape, finiteness and sign rules say so
    second = float(s2.reshape(()))
    if not second > 0 or second != second:
        return None
    peak = INT4_MAX * float(groups.abs().max()) / second
    if peak <= FP8_MAX * (1 + _REL_TOL):
        return None
    return RULES["w4a8-fp8-range"].finding(
        f"{module}.weight_scale_2",
        f"{module}: 7 x max(weight_scale) / weight_scale_2 = {peak:.6g} > 448: TensorRT-LLM's "
        "W4A8 GEMM turns each INT4 code times weight_scale / weight_scale_2 into FP8, which "
        "saturates at 448, so the largest weights are clipped without an error. Write "
        "weight_scale_2 = amax / 448 of the INT4-dequantized weight (ModelOpt's W4A8_AWQ; "
        "exportlm's recipe 'w4a8_awq' does), one per fused GEMM",
        peak=peak,
    )
