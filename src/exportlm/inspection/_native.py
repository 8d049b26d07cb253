"""Parameters a layout stores as their leaves (gpt-oss-mxfp4's ``experts.gate_up_proj_blocks``).

``inspect`` groups a checkpoint's tensors by module (``a.b.weight``: module ``a.b``); a
layout of ``native_experts`` stores each quantized projection ``p`` of an experts module
as ``<experts>.<p>_<leaf>``, so here those tensors are read as the leaves of a module of
their own, ``<experts>.<p>`` (``blocks``, ``scales``), and their shapes checked against
each other: ``blocks`` ``[..., out, in / block, block / packing]`` and ``scales`` its
shape without the last dimension (one E8M0 code per block of 32, gpt-oss's ``mxfp4``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from exportlm.inspection._header import TensorInfo
from exportlm.inspection._rules import RULES, Finding
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec, formats

__all__ = ["native_modules", "native_shape_findings"]


def _native_leaves(layout_name: str) -> tuple[set[str], set[str]]:
    """``(codes leaf names, every stored leaf name)`` of the layout, if it stores native experts."""
    layout = CHECKPOINT_LAYOUTS.get(layout_name)
    if layout is None or not layout.native_experts:
        return set(), set()
    stored = [
        leaf for spec in formats() if layout.holds(spec) for leaf in layout.weight_leaves(spec)
    ]
    return {leaf.name for leaf in stored if leaf.kind == "codes"}, {leaf.name for leaf in stored}


def native_modules(
    modules: Mapping[str, Mapping[str, TensorInfo]], layout_name: str
) -> dict[str, dict[str, TensorInfo]]:
    """``modules`` with each ``<p>_<leaf>`` of a native layout split into module ``<module>.<p>``.

    A module whose leaves hold a codes leaf (``gate_up_proj_blocks``) gives up every
    ``gate_up_proj_<stored leaf>``; its other tensors (``gate_up_proj_bias``) stay.
    """
    codes, stored = _native_leaves(layout_name)
    if not codes:
        return {name: dict(leaves) for name, leaves in modules.items()}
    split: dict[str, dict[str, TensorInfo]] = {}
    for module, leaves in modules.items():
        params = {n[: -len(c) - 1] for n in leaves for c in codes if n.endswith(f"_{c}")}
        own = dict(leaves)
        for param in sorted(params):
            split[f"{module}.{param}"] = {
                leaf: own.pop(f"{param}_{leaf}") for leaf in stored if f"{param}_{leaf}" in own
            }
        if own:
            split[module] = own
    return split


def native_shape_findings(
    module: str, leaves: Mapping[str, TensorInfo], spec: FormatSpec
) -> Iterator[Finding]:
    """``block-scale-shape`` where the codes are not ``[..., in / block, block / packing]`` or
    the scales not the codes' shape without the last dimension."""
    blocks, scales = leaves.get("blocks"), leaves.get("scales")
    block = spec.block_size or 1
    per_block = block // (spec.packing or 1)
    if blocks is None or scales is None:
        return
    want = tuple(blocks.shape[:-1])
    if blocks.shape and blocks.shape[-1] == per_block and scales.shape == want:
        return
    yield RULES["block-scale-shape"].finding(
        scales.name,
        f"{module}: {blocks.name} has shape {list(blocks.shape)} and {scales.name} "
        f"{list(scales.shape)}; {spec.name} stores {per_block} bytes per block of {block} "
        f"([..., out, in / {block}, {per_block}]) and one scale per block ({list(want)}). A "
        "loader reads the scales block by block and would misalign every block after the "
        "first wrong one",
        shape=list(scales.shape),
        expected=list(want),
        block_size=block,
    )
