"""Re-apply a checkpoint's static activation scales to the rebuilt float model.

What a serving engine does with ``input_scale`` / ``k_scale`` / ``v_scale``,
done with :mod:`exportlm.quant`'s own quantized modules: every module that owns
a scale is converted with :func:`exportlm.quant.wrap_module` (its weights pass
through: they are already dequantized) and the scale is loaded into its input or
KV quantizer with :meth:`~exportlm.quant.TensorQuantizer.load_scale`, so the
runtime runs the fake quantizer's own forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.export.hf_checkpoint.dequantize import ActivationScale
from exportlm.export.hf_checkpoint.naming import CheckpointNamer
from exportlm.quant import (
    QuantExperts,
    QuantLinear,
    experts_base,
    route_kv_cache_to_attention,
    wrap_module,
)
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, formats, scale_leaf_names

__all__ = ["StaticQuantization"]

logger = logging.getLogger(__name__)

#: The canonical split linears of each stacked projection.
_SPLIT_LINEARS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class StaticQuantization:
    """Re-applies a checkpoint's static activation scales to the rebuilt model.

    Covers ``nn.Linear`` input and KV-cache scales, and the per-projection input
    scales of stacked experts (shared by the experts of a block), stored per
    split expert (``experts.{e}.gate_proj.input_scale``) or per stored parameter
    (DBRX ``experts.mlp.w1_input_scale``). Experts with quantized weights are
    wrapped even without activation scales, so that they route tokens exactly
    as the fake-quantized experts do. Checkpoint names of a module's scales come
    from the export's own :class:`CheckpointNamer` applied to the rebuilt model.
    """

    def __init__(
        self, model: nn.Module, scales: Mapping[str, ActivationScale], tensor_names: set[str]
    ) -> None:
        self._namer = CheckpointNamer(model)
        self._placeholder = torch.empty(())  # rename() maps names; the tensor is not used
        self._scales = scales
        self._tensor_names = tensor_names
        # the formats' scale leaves, and the names layouts store them under (weight_scale_inv)
        stored = {
            leaf.name
            for spec in formats()
            for layout in CHECKPOINT_LAYOUTS.values()
            if not layout.native_experts  # stored as <param>_<leaf>, with no input scales
            for leaf in layout.weight_leaves(spec)
            if leaf.kind == "scale"
        }
        self._scale_leaves = tuple(scale_leaf_names()) + tuple(sorted(stored))
        self._used: set[str] = set()

    def apply(self, model: nn.Module) -> None:
        """Wrap and load every scale; warn about scales no module owns."""
        for name, module in list(model.named_modules()):
            if experts_base(module) is not None:
                self._experts(name, module)
            elif isinstance(module, nn.Linear):
                self._linear(name, module)
        # K / V scales apply to the cached tensors (post-RoPE K), as in the fake-quant model
        route_kv_cache_to_attention(model)
        unused = sorted(set(self._scales) - self._used)
        if unused:
            logger.warning(
                "hf_checkpoint runtime: %d activation scale(s) belong to no module of the "
                "rebuilt model and are not applied: %s",
                len(unused),
                ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""),
            )

    def _checkpoint_name(self, name: str) -> str:
        return next(iter(self._namer.rename(name, self._placeholder)))[0]

    def _take(self, *names: str) -> ActivationScale | None:
        """The first scale stored under one of ``names`` (in-model names), marked used."""
        for name in names:
            key = self._checkpoint_name(name)
            if key in self._scales:
                self._used.add(key)
                return self._scales[key]
        return None

    def _linear(self, name: str, module: nn.Linear) -> None:
        attention, _, leaf = name.rpartition(".")
        role = {"k_proj": "k", "v_proj": "v"}.get(leaf)
        inputs = self._take(f"{name}.input_scale")
        # ModelOpt stores KV scales on k_proj / v_proj, compressed-tensors on the attention
        kv = self._take(f"{name}.{role}_scale", f"{attention}.{role}_scale") if role else None
        if inputs is None and kv is None:
            return
        wrapper = cast(QuantLinear, wrap_module(module, name))
        if inputs is not None:
            quantizer = wrapper.input_quantizer
            quantizer.load_scale(
                inputs.scale, inputs.format, block_size=inputs.block_size, divides=inputs.divides
            )
            if inputs.pre_quant_scale is not None:  # SmoothQuant: scale, then quantize
                quantizer.pre_quant_scale = inputs.pre_quant_scale
                quantizer.weight_smoothed = True
        if kv is not None:
            wrapper.output_quantizer.load_scale(kv.scale, kv.format)
            wrapper.output_quantizer.kv_role = (
                role  # routed to the attention function if it has one
            )

    def _quantized(self, name: str) -> bool:
        """Some checkpoint scale lies under experts module ``name`` (split or stored layout)."""
        prefix = self._namer.module_name(name) + "."
        return any(
            tensor.startswith(prefix) and tensor.endswith(self._scale_leaves)
            for tensor in self._tensor_names
        )

    def _experts(self, name: str, module: nn.Module) -> None:
        if not self._quantized(name):
            return
        wrapper = cast(QuantExperts, wrap_module(module, name))
        for projection in wrapper.PROJECTIONS:
            found = list(self._expert_input_scales(name, wrapper, projection))
            present = [s for s in found if s is not None]
            if not present:
                continue
            if len({str(s.format) for s in present}) > 1 or len(present) < len(found):
                raise UnsupportedFormatError(
                    f"{name}.{projection}: the experts' input scales are missing for some "
                    "experts or mix formats; the experts of one block share one static input "
                    "quantizer, so every expert needs an input_scale of the same format"
                )
            # one shared input quantizer per projection: the block's largest scale
            # (what the exporter writes for every expert, and what vLLM uses); of global
            # scales (divisors), the smallest
            stacked = torch.stack([s.scale.reshape(()) for s in present])
            divides = present[0].divides
            quantizer = wrapper.input_quantizer_of(projection)
            quantizer.load_scale(
                stacked.amin() if divides else stacked.amax(),
                present[0].format,
                block_size=present[0].block_size,
                divides=divides,
            )

    def _expert_input_scales(
        self, name: str, wrapper: QuantExperts, projection: str
    ) -> Iterator[ActivationScale | None]:
        """The input scales of ``projection``: one per split expert linear, or one per
        stored parameter (``mlp.w1_input_scale``), whichever layout the checkpoint has."""
        canonical = wrapper.canonical_weight(projection).detach()
        stored = [
            f"{name}.{path}_input_scale"
            for path in type(wrapper).stored_weights(wrapper, projection, canonical)
        ]
        if any(self._checkpoint_name(s) in self._scales for s in stored):
            for path in stored:
                yield self._take(path)
            return
        for expert in range(canonical.shape[0]):
            for linear in _SPLIT_LINEARS[projection]:
                yield self._take(f"{name}.{expert}.{linear}.input_scale")
