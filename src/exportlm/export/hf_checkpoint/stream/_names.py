"""Which checkpoint tensors a streamed model tensor is read from (internal to :mod:`exportlm.stream`).

Mixtral and Qwen2-MoE / Qwen3-MoE checkpoints hold their experts one tensor per expert;
transformers fuses them on load into 3-D parameters. :class:`CheckpointNames` maps each
model tensor to the checkpoint tensor(s) and regions :class:`~._source.CheckpointSource`
reads it from.
"""

from __future__ import annotations

from typing import Any

import torch

from exportlm.errors import InvalidConfigError
from exportlm.export.hf_checkpoint.naming import CheckpointNamer, forward_conversions

__all__ = ["CheckpointNames"]


class CheckpointNames:
    """Model tensor name -> the checkpoint tensor(s) transformers loads it from.

    The checkpoint names are the exporter's own :class:`CheckpointNamer`'s
    (transformers' conversion table reversed: what ``save_pretrained`` and our writer
    write), and each is checked against transformers' forward conversion (its
    renamings, then at most one converter), so a tensor is read only from the name
    transformers would load it from. The one converter read is the fusion of
    per-expert tensors, as ``transformers.conversion_mapping`` declares it for Mixtral
    and Qwen2-MoE (Qwen3-MoE uses Qwen2-MoE's): ``MergeModulelist(dim=0)`` stacks the
    experts in index order, then ``Concatenate(dim=1)`` joins the two sources in their
    order, so ``gate_up_proj[e] = cat([gate_e, up_e])`` ``[2I, H]`` and
    ``down_proj[e] = down_e`` ``[H, I]``. Each expert's tensor is read into its region
    of the fused parameter (``gate_up_proj[e, :I]`` is contiguous, so no copy).
    """

    def __init__(self, model: Any) -> None:
        self._namer = CheckpointNamer(model)
        self._renamings: list[Any] = []
        self._converters: list[Any] = []
        if not self._namer.identity:
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            # the conversions the namer reverses (identity when there are none)
            forward = forward_conversions(model)
            self._renamings = [c for c in forward if isinstance(c, WeightRenaming)]
            self._converters = [c for c in forward if isinstance(c, WeightConverter)]
        self._unread = [c for c in self._converters if _fused_parts(c) is None]

    @property
    def namer(self) -> CheckpointNamer:
        """The exporter's namer for this model (the names the stream's writer uses too)."""
        return self._namer

    @property
    def readable(self) -> bool:
        """Names unchanged, or only expert fusions (at least one) and renamings."""
        return self._namer.identity or (bool(self._converters) and not self._unread)

    def pieces(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str]]:
        """``(checkpoint name, region of tensor, what it is)`` for model tensor ``name``.

        Raises:
            InvalidConfigError: transformers converts ``name`` in a way not read here.
        """
        if self._namer.identity:
            return [(name, tensor, "")]
        for converter in self._converters:
            target = str(converter.target_patterns[0])
            if name == target.lstrip(".") or name.endswith("." + target.lstrip(".")):
                return self._fused(name, tensor, converter)
        (stored,) = (n for n, _ in self._namer.rename(name, tensor))
        self._check_loads_as(stored, name, None)
        return [(stored, tensor, "")]

    def _fused(
        self, name: str, tensor: torch.Tensor, converter: Any
    ) -> list[tuple[str, torch.Tensor, str]]:
        parts = _fused_parts(converter)
        if parts is None or tensor.dim() != 3 or tensor.shape[1] % len(parts):
            raise InvalidConfigError(
                f"{name} {list(tensor.shape)} is built on load by {converter!r}, which "
                "streaming does not read (it reads per-expert tensors stacked over experts "
                "and concatenated along dim 1); export the model in memory instead"
            )
        experts = name.rsplit(".", 1)[0]
        blocks = tensor.chunk(len(parts), dim=1)  # Concatenate(dim=1), undone
        found = []
        for e in range(tensor.shape[0]):  # MergeModulelist(dim=0), undone
            for source, part, block in zip(converter.source_patterns, parts, blocks, strict=True):
                stored = self._namer.module_name(f"{experts}.{e}.{part}_proj") + ".weight"
                self._check_loads_as(stored, name, source)
                found.append((stored, block[e], f"expert {e}'s {part}_proj of {name}"))
        return found

    def _check_loads_as(self, stored: str, name: str, source: str | None) -> None:
        """Refuse a checkpoint name transformers would not load as ``name`` (via ``source``)."""
        from transformers.core_model_loading import apply_converters, apply_renamings

        loaded, matched = apply_converters(
            apply_renamings(stored, self._renamings), self._converters
        )
        if loaded != name or matched != source:
            raise InvalidConfigError(
                f"the checkpoint tensor for {name} would be {stored!r}, which transformers "
                f"loads as {loaded!r} (through {matched!r}, expected {source!r}); this "
                "model's name conversion does not stream; export it in memory instead"
            )


def _fused_parts(converter: Any) -> tuple[str, ...] | None:
    """The namer's per-expert projections a converter fuses, in source order, or ``None``.

    ``("gate", "up")`` for ``experts.gate_up_proj`` from two per-expert sources through
    ``MergeModulelist(dim=0)``, ``Concatenate(dim=1)``; ``("down",)`` for
    ``experts.down_proj`` from one through ``MergeModulelist(dim=0)``; ``None`` for
    anything else.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    targets, sources = converter.target_patterns, converter.source_patterns
    if len(targets) != 1 or not all(".*." in f".{s}" for s in sources):
        return None
    if targets[0].endswith("experts.gate_up_proj") and len(sources) == 2:
        fused = ops == [(MergeModulelist, 0), (Concatenate, 1)]
        return ("gate", "up") if fused else None
    if targets[0].endswith("experts.down_proj") and len(sources) == 1:
        return ("down",) if ops == [(MergeModulelist, 0)] else None
    return None
