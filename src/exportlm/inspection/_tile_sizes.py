"""``fp8-pb-wo-tile-size``: tiles a layout records nowhere, in a size its engine does not read.

ModelOpt's ``FP8_PB_WO`` config records no block size (``ModelOptScheme.group_size_field``
off); exportlm's loader takes the tile from the scale's shape (``in / ib``), so a ModelOpt
export in tiles of 32 loads there, but vLLM reads 128 x 128 tiles only
(``vllm/model_executor/layers/quantization/modelopt.py``, ``KFp8Block128.create_weights``:
``weight_scale`` registered as ``[ceil(out / 128), 1, in / 128, 1]``, and ``in % 128 != 0``
raises), so its weight loader fails on the scale's shape. SGLang takes no ``FP8_PB_WO``
(``engine-refuses-scheme``). A limit of one engine, so a warning (as ``w4afp8-group-size``);
a scale that fits no tile at all stays a ``block-scale-shape`` error.
"""

from __future__ import annotations

from collections.abc import Iterator

from exportlm.inspection._declared import Declared
from exportlm.inspection._header import TensorInfo
from exportlm.inspection._layers import QuantizedLayer
from exportlm.inspection._loaders import LayerRefusal
from exportlm.inspection._rules import RULES, Finding
from exportlm.inspection._tiles import layout_tiles, scale_tile, tile_leaves
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec

__all__ = ["tile_size_findings", "tile_size_refusals"]


_Unheld = tuple[int, TensorInfo, TensorInfo, tuple[int, ...]]


def _unheld(layer: QuantizedLayer, layout: str) -> _Unheld | None:
    """``(tile, scale, codes, held tiles)`` of a layer whose tile, recorded nowhere, is not
    one the layout holds."""
    found = tile_leaves(layer.spec, layer.leaves, layout)
    if found is None or layer.spec is None:
        return None
    records, held = layout_tiles(layer.spec, layout)
    if records or not held or (layer.scheme is not None and layer.scheme.group_size):
        return None
    codes, scale, shapes = found
    tile = scale_tile(scale.shape, tuple(codes.shape), held[0], shapes)
    return None if tile in held else (tile, scale, codes, held)


def _instead(spec: FormatSpec) -> str:
    """The layouts that hold ``spec`` and record its block (``-o format=...``)."""
    names = [
        n for n, lay in CHECKPOINT_LAYOUTS.items() if lay.holds(spec) and layout_tiles(spec, n)[0]
    ]
    return " or ".join(f"-o format={name}" for name in names)


def _by_tile(
    layers: list[QuantizedLayer], declared: Declared
) -> dict[int, list[tuple[QuantizedLayer, _Unheld]]]:
    """The layers whose tile the engines do not read, by tile edge (smallest first)."""
    by_tile: dict[int, list[tuple[QuantizedLayer, _Unheld]]] = {}
    for layer in layers:
        unheld = _unheld(layer, declared.layout)
        if unheld is not None:
            by_tile.setdefault(unheld[0], []).append((layer, unheld))
    return dict(sorted(by_tile.items()))


def _algo(layer: QuantizedLayer) -> str:
    return layer.scheme.label.upper() if layer.scheme is not None else "FP8_PB_WO"


def tile_size_refusals(layers: list[QuantizedLayer], declared: Declared) -> list[LayerRefusal]:
    """vLLM, where some layer is in a tile it does not read (the loaders line's verdict)."""
    by_tile = _by_tile(layers, declared)
    if not by_tile:
        return []
    algo = _algo(next(iter(by_tile.values()))[0][0])
    tiles = " and ".join(f"{tile} x {tile}" for tile in by_tile)
    return [LayerRefusal("vLLM", "fp8-pb-wo-tile-size", f"{algo} tiles of {tiles}")]


def tile_size_findings(layers: list[QuantizedLayer], declared: Declared) -> Iterator[Finding]:
    """One ``fp8-pb-wo-tile-size`` warning per tile size the engines do not read."""
    for tile, found in _by_tile(layers, declared).items():
        layer, (_, scale, codes, held) = found[0]
        algo = _algo(layer)
        sizes = " or ".join(f"{b} x {b}" for b in held)
        instead = _instead(layer.spec) if layer.spec is not None else ""
        yield RULES["fp8-pb-wo-tile-size"].finding(
            scale.name,
            f"{len(found)} {algo} layer(s) (e.g. {scale.name} {list(scale.shape)} "
            f"over the weight {list(codes.shape)}) are in tiles of {tile} x {tile}, which the "
            f"config does not record. vLLM's ModelOpt {algo} reads tiles of {sizes} only "
            "(modelopt.py KFp8Block128.create_weights registers [ceil(out / 128), 1, in / 128, 1] "
            "scales): its weight loader fails on these scales' shape. exportlm's loader "
            "(exportlm.load_exported) takes the tile from the scale's shape and reads them; "
            f"SGLang takes no {algo}. For vLLM quantize in tiles of {held[0]}, or export with "
            f"{instead}, which record the tile",
            tile=tile,
            layers=len(found),
            engine_tiles=list(held),
        )
