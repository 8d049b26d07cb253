"""The scale shape of a tile-granular weight (FP8 block-wise, compressed-tensors ``FP8_BLOCK``).

One scale per ``b x b`` tile of the weight's last two dimensions: ``weight_scale``
``[..., ceil(out / b), in / b]``, the last row tile possibly partial (compressed-tensors
and vLLM take ``ceil``), the input features a multiple of ``b`` (the inputs are
quantized in groups of ``b`` at run time, and vLLM's block GEMM asserts it). A finding
of the ``block-scale-shape`` rule otherwise.

A layout whose configs record no block (ModelOpt's ``FP8_PB_WO``: ``group_size_field``
off) is read as exportlm's loader reads it: the tile edge is the one the scale's shape
gives (``in / ib``, :func:`scale_tile`), the format's default where that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from exportlm.inspection._header import TensorInfo
from exportlm.inspection._rules import RULES, Finding
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec

__all__ = ["layout_tiles", "scale_tile", "tile_leaves", "tile_scale_findings", "tile_scale_shape"]

Shapes = Callable[[tuple[int, ...]], tuple[tuple[int, ...], ...]]


def tile_scale_shape(logical: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The tile scales' shape of a weight of ``logical`` shape in tiles of ``block``."""
    *lead, rows, cols = logical
    return (*lead, -(-rows // block), -(-cols // block))


def layout_tiles(spec: FormatSpec, layout_name: str) -> tuple[bool, tuple[int, ...]]:
    """``(records the block, the only blocks it holds)`` of ``spec`` in the layout: ModelOpt's
    FP8_PB_WO records none and holds 128 (what vLLM reads); ``(True, ())`` for any other."""
    layout = CHECKPOINT_LAYOUTS.get(layout_name)
    scheme = None if layout is None else getattr(spec, layout.scheme or "modelopt", None)
    return getattr(scheme, "group_size_field", True), getattr(scheme, "block_sizes", ())


def tile_leaves(
    spec: FormatSpec | None, leaves: Mapping[str, TensorInfo], layout: str
) -> tuple[TensorInfo, TensorInfo, Shapes | None] | None:
    """``(codes, scale, the layout's stored scale shapes)`` of a tile-granular layer's
    ``leaves`` as ``layout`` stores them: under its codec's names (ModelOpt, finegrained-fp8)
    or the format's own (compressed-tensors); ``None`` for another layer or a leaf missing."""
    if spec is None or spec.granularity != "tile" or layout not in CHECKPOINT_LAYOUTS:
        return None
    codec = CHECKPOINT_LAYOUTS[layout].codec(spec)
    if codec is not None:
        codes_name, shapes = codec.codes.name, codec.scale_shapes
        scale_names = [leaf.name for leaf in codec.weights if leaf.kind == "scale"]
    else:
        codes_name = next(leaf.name for leaf in spec.weight_leaves if leaf.source == "data")
        scale_names = [leaf.name for leaf in spec.weight_leaves if leaf.source == "scale"]
        shapes = None
    codes = leaves.get(codes_name)
    scale = next((leaves[name] for name in scale_names if name in leaves), None)
    return None if codes is None or scale is None else (codes, scale, shapes)


def scale_tile(
    shape: tuple[int, ...], weight_shape: tuple[int, ...], block: int, stored: Shapes | None
) -> int:
    """The tile edge of a scale of ``shape`` over a weight of ``weight_shape`` when no config
    records it: ``block`` where the shape fits it, else ``in / ib`` where that fits (as
    exportlm's loader reads it), else ``block`` (the shape is then wrong for any)."""
    cols = weight_shape[-1]
    ibs = dict.fromkeys(reversed(shape[-2:]))  # [ob, ib] / [ob, 1, ib, 1]: ib last or next
    candidates = [block, *(cols // ib for ib in ibs if ib and cols % ib == 0)]
    for tile in candidates:
        grid = tile_scale_shape(weight_shape, tile)
        if cols % tile == 0 and shape in (stored(grid) if stored is not None else (grid,)):
            return tile
    return block


def tile_scale_findings(
    info: TensorInfo,
    fmt: str,
    weight_shape: tuple[int, ...],
    block: int,
    stored: Shapes | None = None,
) -> Iterator[Finding]:
    """A ``block-scale-shape`` finding when ``info`` is not the tile scales of the weight.

    ``stored``: the shapes the layout may store tile scales of a shape with (its codec's
    ``scale_shapes``: ModelOpt's ``[ceil(out / b), 1, in / b, 1]``), the first expected.
    """
    grid = tile_scale_shape(weight_shape, block)
    accepted = stored(grid) if stored is not None else (grid,)
    want = accepted[0]
    divisible = weight_shape[-1] % block == 0
    if divisible and tuple(info.shape) in accepted:
        return
    yield RULES["block-scale-shape"].finding(
        info.name,
        f"{info.name} has shape {list(info.shape)}; {fmt} tiles of {block} x {block} over the "
        f"weight's shape {list(weight_shape)} need {list(want)} (one scale per tile, the last "
        "row tile may be partial)"
        + ("" if divisible else f", and {weight_shape[-1]} inputs are not a multiple of {block}")
        + ". A block-wise FP8 kernel reads the scales tile by tile and would misalign every "
        "tile after the first wrong one",
        shape=list(info.shape),
        expected=list(want),
        block_size=block,
    )
