"""Where a checkpoint stores each quantized weight's leaves: the registered leaf names
(:class:`Leaves`) and one :class:`Slot` per quantized weight (:func:`slots`), in the three
arrangements :mod:`~exportlm.export.hf_checkpoint.dequantize` reads."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec, formats, scale_leaf_names

__all__ = ["Leaves", "Slot", "slots"]


@dataclass(frozen=True)
class Leaves:
    """The registered formats' leaf names, by what they hold (read once per load)."""

    data: frozenset[str]
    scale: frozenset[str]
    weight: frozenset[str]
    kv_cache: frozenset[str]
    scales: frozenset[str]
    #: The codes / scale leaves of layouts storing a parameter as ``<param>_<leaf>``.
    native_data: frozenset[str] = frozenset()
    native_scale: frozenset[str] = frozenset()

    @classmethod
    def registered(cls) -> Leaves:
        """Over every registered format, as every checkpoint layout stores it (the leaves
        of a parameter stored as its leaves, ``<param>_blocks``, only in ``native_*`` and
        ``weight``: another checkpoint's ``foo.scales`` stays a plain tensor)."""
        specs = formats()
        layouts = [layout for layout in CHECKPOINT_LAYOUTS.values() if not layout.native_experts]
        stored = [leaf for s in specs for layout in layouts for leaf in layout.weight_leaves(s)]
        renamed = {  # activation leaves a layout stores under its own name (input_global_scale)
            scale.name
            for s in specs
            for layout in CHECKPOINT_LAYOUTS.values()
            if (codec := layout.codec(s)) is not None
            for scale in codec.activations.values()
            if scale is not None
        }
        scales = {leaf.name for leaf in stored if leaf.kind == "scale"}
        native = [
            leaf
            for s in specs
            for layout in CHECKPOINT_LAYOUTS.values()
            if layout.native_experts
            for leaf in layout.weight_leaves(s)
        ]
        return cls(
            data=frozenset(leaf.name for leaf in stored if leaf.kind == "codes"),
            scale=frozenset(scales),
            weight=frozenset(leaf.name for leaf in stored + native),
            kv_cache=frozenset(
                leaf.name for s in specs for leaf in s.leaves if leaf.role == "kv_cache"
            ),
            scales=frozenset(scale_leaf_names()) | scales | renamed,
            native_data=frozenset(leaf.name for leaf in native if leaf.kind == "codes"),
            native_scale=frozenset(leaf.name for leaf in native if leaf.kind == "scale"),
        )


@dataclass(frozen=True)
class Slot:
    """Where one quantized weight's leaves are stored.

    ``layer`` is the module path the quantization config lists; ``data`` the codes'
    tensor name; every other leaf ``l`` is ``stem + l`` (``"<module>."`` for a
    module's weight, ``"<module>.<param>_"`` for a bare parameter or one stored as its
    leaves).
    """

    layer: str
    data: str
    stem: str

    def weight(self, spec: FormatSpec) -> str:
        """The name of the float weight: the format's own codes leaf (``weight``, not
        a layout's ``weight_packed``), or the parameter itself (``<param>_``'s ``<param>``)."""
        return self.stem[:-1] if self.stem.endswith("_") else self.stem + spec.data_leaf.name

    @property
    def native(self) -> bool:
        """The parameter is stored as its leaves (``<param>_blocks``), not under its name."""
        return self.stem.endswith("_") and self.data != self.stem[:-1]

    def name(self, leaf: str, data_leaves: frozenset[str]) -> str:
        """The tensor name of ``leaf`` of this weight."""
        if self.stem.endswith("_") and leaf in data_leaves:
            return self.data
        return self.stem + leaf


def slots(tensors: Mapping[str, torch.Tensor], leaves: Leaves) -> Iterator[Slot]:
    """Every quantized weight: a data leaf beside one of its format's scale leaves."""
    for name in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in leaves.data and any(f"{prefix}.{s}" in tensors for s in leaves.scale):
            yield Slot(prefix, name, f"{prefix}.")
        elif any(f"{name}_{s}" in tensors for s in leaves.scale):
            yield Slot(prefix, name, f"{name}_")
        else:
            stem = next((name[: -len(d)] for d in leaves.native_data if leaf.endswith(f"_{d}")), "")
            if stem and any(stem + s in tensors for s in leaves.native_scale):
                yield Slot(prefix, name, stem)
