"""Per-expert linears back into the stacked parameters of the model's own experts modules.

The expert exporters split stacked experts into canonical per-expert linears,
``<experts>.{e}.{gate,up,down}_proj.{weight,bias}`` (the names vLLM's loaders
read). For a model with a transformers conversion table (Mixtral, Qwen-MoE)
transformers merges them back on load; for the others (GptOss, Llama4)
:func:`fuse_split_experts` does it, in the layout of each experts module of the
rebuilt model: the layout is not guessed from names but read from the module's
quantized wrapper class (:func:`exportlm.quant.experts_base`), whose
:meth:`~exportlm.quant.QuantExperts.stored_weights` is the exact inverse of the
split (GptOss: ``[E, H, 2I]`` with gate/up columns interleaved; Llama4: gate
columns, then up columns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from exportlm.errors import MalformedCheckpointError, UnsupportedFormatError
from exportlm.quant import experts_base

__all__ = ["SPLIT_EXPERT", "fuse_split_experts", "native_experts"]

#: A canonical per-expert tensor: ``<experts module>.<e>.<gate|up|down>_proj.<weight|bias>``.
SPLIT_EXPERT = re.compile(
    r"^(?P<module>.+)\.(?P<e>\d+)\.(?P<linear>gate_proj|up_proj|down_proj)\.(?P<leaf>weight|bias)$"
)
#: The canonical split linears of each stacked projection (gate rows, then up rows).
_SPLIT_LINEARS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def fuse_split_experts(
    weights: Mapping[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """``weights`` with every split experts module of ``model`` stacked back into its parameters.

    ``model`` only gives the module paths and layouts (it may live on the ``meta``
    device). Names that belong to no experts module of ``model`` pass through.

    Raises :class:`UnsupportedFormatError` when an expert or a projection is missing.
    """
    split: dict[str, dict[tuple[str, str, int], torch.Tensor]] = {}
    for name, tensor in weights.items():
        match = SPLIT_EXPERT.match(name)
        if match is not None:
            key = (match["linear"], match["leaf"], int(match["e"]))
            split.setdefault(match["module"], {})[key] = tensor
    if not split:
        return dict(weights)
    fused: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for name, module in model.named_modules():
        base = experts_base(module)
        if base is None or name not in split:
            continue
        experts = split[name]
        count = _expert_count(name, experts)
        for projection, linears in _SPLIT_LINEARS.items():
            for leaf in ("weight", "bias"):
                if not any((linears[0], leaf, e) in experts for e in range(count)):
                    continue
                rows = [_stack(name, experts, linear, leaf, count) for linear in linears]
                canonical = torch.cat(rows, dim=1)
                # A bias is a weight with one input column: the same reordering places it.
                stacked = base.stored_weights(
                    module, projection, canonical if leaf == "weight" else canonical.unsqueeze(-1)
                )
                for path, tensor in stacked.items():
                    stored = f"{name}.{path}" if leaf == "weight" else f"{name}.{path}_bias"
                    fused[stored] = tensor if leaf == "weight" else tensor.reshape(count, -1)
        consumed.add(name)
    for name, tensor in weights.items():
        match = SPLIT_EXPERT.match(name)
        if match is None or match["module"] not in consumed:
            fused[name] = tensor
    return fused


def _expert_count(name: str, experts: Mapping[tuple[str, str, int], torch.Tensor]) -> int:
    indices = {e for _, _, e in experts}
    count = max(indices) + 1
    if indices != set(range(count)):
        missing = sorted(set(range(count)) - indices)
        raise UnsupportedFormatError(
            f"{name}: the checkpoint holds experts {sorted(indices)} but not {missing}; "
            "every expert of a block is needed to rebuild its stacked weights"
        )
    return count


def _stack(
    name: str,
    experts: Mapping[tuple[str, str, int], torch.Tensor],
    linear: str,
    leaf: str,
    count: int,
) -> torch.Tensor:
    try:
        return torch.stack([experts[(linear, leaf, e)] for e in range(count)])
    except KeyError as err:
        raise UnsupportedFormatError(
            f"{name}: expert {err.args[0][2]} has no {linear}.{leaf}; every expert of a block "
            f"stores {' / '.join(_SPLIT_LINEARS['gate_up_proj'] + ('down_proj',))} {leaf}s"
        ) from err


def native_experts(
    weights: Mapping[str, torch.Tensor], native: frozenset[str], model: nn.Module
) -> dict[str, torch.Tensor]:
    """``weights`` with each parameter stored as its leaves (gpt-oss's ``gate_up_proj_blocks``),
    dequantized as the canonical ``[E, out, in]``, laid out as ``model``'s parameter.

    The rows are already in the parameter's order (GptOss: gate / up interleaved); a
    transposed experts module (``[E, in, out]``) gets the transpose. ``model`` only gives
    the module paths and layouts (it may live on the ``meta`` device). A name that is no
    projection of a stacked experts module of ``model`` is refused.
    """
    if not native:
        return dict(weights)
    restored = dict(weights)
    for name in sorted(native):
        module_path, _, projection = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        base = experts_base(module)
        if base is None or projection not in base.PROJECTIONS:
            raise MalformedCheckpointError(
                f"{name}_*: quantized leaves of a stacked expert projection, but {module_path!r} "
                f"is a {type(module).__name__}, not a stacked experts module with a "
                f"{projection!r}; the checkpoint is not this model's",
                field=name,
            )
        transposed = bool(getattr(module, "is_transposed", base.default_transposed))
        weight = weights[name]
        restored[name] = weight.transpose(-1, -2).contiguous() if transposed else weight
    return restored
