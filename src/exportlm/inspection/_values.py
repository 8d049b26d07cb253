"""Rules on scale values: finite, positive, shared where loaders share them.

Only scales are read (leaves whose name contains ``scale``: a few bytes each, NVFP4 block scales
1/16 of the weight count), one tensor at a time. Stored values are compared
within a relative tolerance of 1e-6: two copies of one scale are equal, two
calibrations are not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import torch

from exportlm.errors import MalformedCheckpointError
from exportlm.inspection._files import FLOAT_SCALE_DTYPES, Checkpoint
from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._rules import RULES, Finding

__all__ = ["value_findings"]

_REL_TOL = 1e-6
_SCALE_DTYPES = FLOAT_SCALE_DTYPES | {"F8_E4M3", "F8_E5M2", "F64"}
_EXPERT_INPUT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>.+)\.input_scale$")
#: Projections loaders fuse into one GEMM (``gate_up_proj`` / ``w13``): (gate, up).
_FUSED_PAIRS = (("gate_proj", "up_proj"), ("w1", "w3"))


def value_findings(checkpoint: Checkpoint, layers: list[QuantizedLayer]) -> Iterator[Finding]:
    """``scale-nonfinite``, ``scale-nonpositive``, ``scale-zero-entries``,
    ``moe-input-scale-shared`` and ``gate-up-scale-consistent``."""
    scales = sorted(
        name
        for name, info in checkpoint.tensors.items()
        if "scale" in name.rpartition(".")[2]
        and info.dtype in _SCALE_DTYPES
        and checkpoint.readable(name)
    )
    singles: dict[str, float] = {}
    try:
        for name, tensor in checkpoint.iter_values(scales):
            values = tensor.float()
            file = checkpoint.tensors[name].file
            for found in _value_problems(name, values):  # the file too: the tensor is in it
                details = MappingProxyType({**found.details, "file": file})
                yield replace(found, message=f"{found.message} (in {file})", details=details)
            if values.numel() == 1:
                singles[name] = float(values.reshape(()))
    except MalformedCheckpointError as err:  # a header sound to us that safetensors refuses
        yield RULES["shard-unreadable"].finding(Path(str(err.path)).name, str(err))
        return
    yield from _moe_input_scales(singles)
    yield from _gate_up(layers, singles)


def _value_problems(name: str, values: torch.Tensor) -> Iterator[Finding]:
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        yield RULES["scale-nonfinite"].finding(
            name,
            f"{name} holds {int(bad.sum())} NaN / infinite value(s) of {values.numel()}: every "
            "dequantized value (or activation) it scales becomes NaN. Recalibrate; a zero amax "
            "must give a finite positive scale",
        )
        return
    if values.numel() == 1 and float(values.reshape(())) <= 0:
        value = float(values.reshape(()))
        yield RULES["scale-nonpositive"].finding(
            name,
            f"{name} is {value:g}: loaders divide by per-tensor scales (vLLM computes "
            "1 / input_scale), so a zero gives inf and NaN outputs. Recalibrate the layer, or "
            "floor a zero amax at a positive scale",
            value=value,
        )
        return
    negative = int((values < 0).sum())
    if negative:
        yield RULES["scale-nonpositive"].finding(
            name, f"{name} has {negative} negative value(s); scales are magnitudes", count=negative
        )
    zeros = int((values == 0).sum())
    if zeros:
        yield RULES["scale-zero-entries"].finding(
            name,
            f"{name} has {zeros} zero entr(y/ies) of {values.numel()}: those rows or blocks "
            "dequantize to 0, and a loader that requantizes (divides by the scale) gets inf",
            count=zeros,
        )


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=0.0)


def _moe_input_scales(singles: dict[str, float]) -> Iterator[Finding]:
    groups: dict[tuple[str, str], dict[int, float]] = {}
    for name, value in singles.items():
        match = _EXPERT_INPUT.match(name)
        if match:
            key = (match["block"], match["proj"])
            groups.setdefault(key, {})[int(match["expert"])] = value
    for (block, proj), by_expert in sorted(groups.items()):
        low, high = min(by_expert.values()), max(by_expert.values())
        if len(by_expert) > 1 and not _close(low, high):
            yield RULES["moe-input-scale-shared"].finding(
                f"{block}.*.{proj}.input_scale",
                f"the {len(by_expert)} experts of {block} store different {proj}.input_scale "
                f"values ({low:g} .. {high:g}); vLLM's and SGLang's fused MoE kernels take one "
                "activation scale per block and use the maximum (with a warning), so the "
                "experts run at another scale than calibrated. Export one shared input_scale "
                "(the maximum amax over the experts)",
                low=low,
                high=high,
            )


def _gate_up(layers: list[QuantizedLayer], singles: dict[str, float]) -> Iterator[Finding]:
    by_module = {layer.module: layer for layer in layers}
    for layer in layers:
        parent, _, own = layer.module.rpartition(".")
        for gate, up in _FUSED_PAIRS:
            other = by_module.get(f"{parent}.{up}")
            if own != gate or other is None or layer.spec is None or other.spec is not layer.spec:
                continue
            spec = layer.spec
            shared = spec.share_fused_weight_amax or (
                spec.share_expert_gate_up_amax and ".experts." in f"{layer.module}."
            )
            if not shared:
                continue
            source = "scale_2" if any(lf.source == "scale_2" for lf in spec.leaves) else "scale"
            leaf = next(lf.name for lf in spec.weight_leaves if lf.source == source)
            a, b = singles.get(f"{layer.module}.{leaf}"), singles.get(f"{other.module}.{leaf}")
            if a is not None and b is not None and not _close(a, b):
                yield RULES["gate-up-scale-consistent"].finding(
                    f"{layer.module}.{leaf}",
                    f"{layer.module}.{leaf} = {a:g} but {other.module}.{leaf} = {b:g}; loaders "
                    f"fuse {gate} and {up} into one GEMM with one {spec.name} {leaf} (vLLM warns "
                    "and uses one of them, TensorRT-LLM requantizes), losing accuracy. Share "
                    "one weight amax between the two",
                    values=[a, b],
                )
