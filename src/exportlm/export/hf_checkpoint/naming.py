"""Checkpoint tensor names: the ones the model's own ``save_pretrained`` writes.

transformers 5 loads some families through weight conversions (Mixtral's
``block_sparse_moe.experts.N.w1/w2/w3`` become ``mlp.experts.gate_up_proj`` /
``down_proj``) and reverts them in ``save_pretrained``. The export driver emits
in-memory names, with quantized fused experts already split into canonical
``...experts.{e}.{gate,up,down}_proj.<tensor>``; :class:`CheckpointNamer` maps
them to on-disk names with transformers' own conversion table
(``transformers.conversion_mapping``), so a quantized checkpoint uses the same
names as the original checkpoint and an unquantized one equals ``save_pretrained``.
Models without a conversion table (GptOss, plain torch models) keep their names.
:meth:`CheckpointNamer.module_name` applies the same renaming to module paths, for
the names a quantization config lists (``exclude_modules``, ``quantized_layers``),
and :func:`module_namer` maps the export's module paths to saved ones.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointNamer", "forward_conversions", "module_namer"]

logger = logging.getLogger(__name__)

_SPLIT_EXPERT = re.compile(
    r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<leaf>\w+)$"
)


class CheckpointNamer:
    """Map the export driver's tensor names to ``save_pretrained``'s names for ``model``.

    Built once per export; ``rename(name, tensor)`` yields ``(checkpoint_name, tensor)``
    pairs: one for a plain tensor, several for a fused tensor that transformers
    splits on save (an unquantized ``experts.gate_up_proj`` becomes per-expert
    ``w1`` / ``w3`` weights for Mixtral).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model: Any = model
        self._renamings: list[Any] = []
        self._converters: list[Any] = []
        self._expert_patterns: dict[str, str] = {}
        forward = forward_conversions(model)
        if forward:
            reverse = [c.reverse_transform() for c in forward[::-1]]
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            self._renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
            self._converters = [c for c in reverse if isinstance(c, WeightConverter)]
            self._expert_patterns = _split_expert_patterns(forward)

    @property
    def identity(self) -> bool:
        """True when the model has no conversion table: names are written unchanged."""
        return not (self._renamings or self._converters)

    def rename(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint name(s) and tensor(s) for one emitted tensor."""
        if self.identity:
            yield name, tensor
            return
        from transformers.core_model_loading import apply_converters

        _, source_pattern = apply_converters(name, self._converters)
        if source_pattern is not None:
            yield from self._revert_fused(name, tensor)
            return
        yield self._renamed(name), tensor

    def module_name(self, module: str) -> str:
        """The checkpoint path of in-memory module ``module`` (a linear, router, embedding or
        canonical split expert ``...experts.{e}.gate_proj``).

        The path its ``weight`` is written under, minus the leaf: the very renaming
        :meth:`rename` applies to the module's tensors, so the names a quantization
        config lists (``exclude_modules``, ``quantized_layers``, ``ignore``) are prefixes
        of saved tensors (Mixtral ``model.layers.0.mlp.gate`` ->
        ``model.layers.0.block_sparse_moe.gate``).
        """
        if self.identity:
            return module
        renamed = self._renamed(f"{module}.weight")
        return renamed.removesuffix(".weight") if renamed.endswith(".weight") else module

    def _renamed(self, name: str) -> str:
        """One unfused tensor's checkpoint name (canonical split experts included)."""
        from transformers.core_model_loading import apply_renamings

        return str(apply_renamings(self._split_expert_name(name), self._renamings))

    def _split_expert_name(self, name: str) -> str:
        match = _SPLIT_EXPERT.match(name)
        if match is None or match["proj"] not in self._expert_patterns:
            return name
        tail = self._expert_patterns[match["proj"]].replace("*", match["e"])
        return f"{match['prefix']}.{tail}.{match['leaf']}"

    def _revert_fused(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        for new_name, value in revert_weight_conversion(self._model, {name: tensor}).items():
            yield new_name, value.contiguous()


def forward_conversions(model: Any) -> list[Any]:
    """transformers' forward weight conversions for ``model`` (empty if none or not HF)."""
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # an older transformers without conversion tables: names are unchanged
        return []
    weight_conversions = getattr(model, "_weight_conversions", None)
    if weight_conversions is None:
        # save_pretrained's own rule for a model not loaded by from_pretrained
        weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
        weight_conversions = [c for c in weight_conversions if not isinstance(c, PrefixChange)]
    return list(weight_conversions)


def _split_expert_patterns(forward: list[Any]) -> dict[str, str]:
    """``{"gate"|"up"|"down": "experts.*.<name>"}`` from the converters that fuse experts."""
    patterns: dict[str, str] = {}
    for conv in forward:
        targets = getattr(conv, "target_patterns", [])
        sources = getattr(conv, "source_patterns", [])
        if len(targets) != 1:
            continue
        if targets[0].endswith("experts.gate_up_proj") and len(sources) == 2:
            patterns.update(gate=_expert_tail(sources[0]), up=_expert_tail(sources[1]))
        elif targets[0].endswith("experts.down_proj") and len(sources) == 1:
            patterns["down"] = _expert_tail(sources[0])
    return {k: v for k, v in patterns.items() if v}


def _expert_tail(pattern: str) -> str:
    """``".experts.*.w1.weight"`` -> ``"experts.*.w1"``; ``""`` when the pattern is not per-expert."""
    start = pattern.find("experts.*.")
    if start < 0 or not pattern.endswith(".weight"):
        return ""
    return pattern[start:].removesuffix(".weight")


def module_namer(
    model: nn.Module, namer: CheckpointNamer, is_qlora: bool
) -> Callable[[str], str | None]:
    """In-memory module path -> the module path its tensors are saved under (``None``: not saved).

    The path the module's ``weight`` is written under, through the same steps as the
    tensors: a tied weight is written under its source (a tied ``lm_head`` is the
    saved ``model.embed_tokens``), QLoRA drops ``base_layer`` (the driver's own
    sink), then the namer's :meth:`~CheckpointNamer.module_name` (transformers' save-time renaming:
    Mixtral ``mlp.gate`` -> ``block_sparse_moe.gate``, split experts ``w1``/``w2``/``w3``).
    A QLoRA adapter, whose tensors are dropped, is not saved.
    """
    from exportlm.module_exporters import qlora_saved_name, resolve_tied_weights

    ties = resolve_tied_weights(model)  # {dropped tensor name: kept tensor name}

    def saved_module(module: str) -> str | None:
        weight = f"{module}.weight"
        weight = ties.get(weight, weight)
        if is_qlora:
            saved = qlora_saved_name(weight)  # the export's own QLoRA renaming
            if saved is None:
                return None  # an adapter: dropped with its tensors
            weight = saved
        if not weight.endswith(".weight"):
            return module
        return namer.module_name(weight.removesuffix(".weight"))

    # ModelOpt lists a tied lm_head among the excluded modules under its own name too.
    saved_module.tied_aliases = frozenset(  # type: ignore[attr-defined]
        namer.module_name(dropped.removesuffix(".weight"))
        for dropped in ties
        if dropped.endswith(".weight")
    )
    return saved_module
