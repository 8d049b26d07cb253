"""Rules on quantized layers: leaves present, in their format's dtype and shape.

A module is *quantized* when it stores a ``weight`` in a non-float dtype some
registered format stores codes in (float8_e4m3fn, uint8, int8), or a weight
scale. Its format is the declared one (:mod:`~exportlm.inspection._declared`),
else the one registered format whose leaves it stores. Dtypes, leaves, packing
and scale granularity all come from that :class:`~exportlm.quant.formats.FormatSpec`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from exportlm.inspection._declared import Declared, LayerScheme
from exportlm.inspection._files import FLOAT_SCALE_DTYPES, Checkpoint, safetensors_dtype
from exportlm.inspection._header import TensorInfo
from exportlm.inspection._native import native_modules, native_shape_findings
from exportlm.inspection._rules import RULES, Finding
from exportlm.inspection._tiles import layout_tiles, scale_tile, tile_scale_findings
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    FormatSpec,
    Leaf,
    LeafCodec,
    formats,
    scale_leaf_names,
)

__all__ = ["QuantizedLayer", "layer_findings", "modules_of", "quantized_layers"]

#: The activation leaf that is per input feature (AWQ); every other activation scale is per tensor.
_PER_INPUT_FEATURE = "pre_quant_scale"


def modules_of(checkpoint: Checkpoint) -> dict[str, dict[str, TensorInfo]]:
    """``{module path: {leaf: tensor}}`` (``a.b.weight`` -> module ``a.b``, leaf ``weight``)."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in checkpoint.tensors.items():
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, {})[leaf] = info
    return modules


@dataclass(frozen=True)
class QuantizedLayer:
    """A quantized module, its stored leaves and the format they are read in.

    Attributes:
        module: the saved module path.
        leaves: its stored tensors by leaf name.
        spec: its format (``None``: no registered format fits; only generic rules apply).
        scheme: its declaration (``None``: nothing declared for it).
    """

    module: str
    leaves: Mapping[str, TensorInfo]
    spec: FormatSpec | None
    scheme: LayerScheme | None


def _code_dtypes() -> set[str]:
    """The non-float dtypes registered formats store codes in."""
    dtypes = {safetensors_dtype(spec.stored_dtype) for spec in formats()}
    return dtypes - FLOAT_SCALE_DTYPES


def _weight_scale_names() -> set[str]:
    return {leaf.name for spec in formats() for leaf in spec.weight_leaves if leaf.source != "data"}


def _codec_codes() -> set[tuple[str, str]]:
    """The codes leaves layouts store under their own names, with their dtypes.

    ``("weight_packed", "I32")``. A name of its own marks a quantized layer whatever
    its dtype (a wrong dtype is then reported); a layout that keeps the codes under
    ``weight`` (compressed-tensors W8A8), which every float layer has too, needs the dtype.
    """
    return {
        (codec.codes.name, safetensors_dtype(codec.codes.dtype))
        for spec in formats()
        for layout in CHECKPOINT_LAYOUTS.values()
        if (codec := layout.codec(spec)) is not None
    }


def _codec(spec: FormatSpec, declared: Declared) -> LeafCodec | None:
    layout = CHECKPOINT_LAYOUTS.get(declared.layout)
    return layout.codec(spec) if layout is not None else None


def quantized_layers(checkpoint: Checkpoint, declared: Declared) -> list[QuantizedLayer]:
    """Every quantized module of ``checkpoint`` with its format (see the module docstring)."""
    codes, scales, packed = _code_dtypes(), _weight_scale_names(), _codec_codes()
    packed_names = {name for name, _ in packed}
    found: list[QuantizedLayer] = []
    # gpt-oss's experts.gate_up_proj_blocks: the leaves of a module experts.gate_up_proj
    for module, leaves in sorted(native_modules(modules_of(checkpoint), declared.layout).items()):
        weight = leaves.get("weight")
        # a layout's own codes leaf (compressed-tensors' weight_packed) marks a quantized layer
        native = weight is not None and (weight.dtype in codes or bool(scales & set(leaves)))
        layout_codes = any(
            (name, info.dtype) in packed or (name != "weight" and name in packed_names)
            for name, info in leaves.items()
        )
        if not (native or layout_codes):
            continue
        scheme = declared.scheme(module)
        spec = scheme.spec if scheme is not None else _fitting_spec(leaves)
        found.append(QuantizedLayer(module, leaves, spec, scheme))
    return found


def _fitting_spec(leaves: Mapping[str, TensorInfo]) -> FormatSpec | None:
    """The one registered format whose code dtype and weight leaves ``leaves`` store."""
    if "weight" not in leaves:
        return None
    fits = [
        spec
        for spec in formats()
        if leaves["weight"].dtype == safetensors_dtype(spec.stored_dtype)
        and {leaf.name for leaf in spec.weight_leaves} <= set(leaves)
    ]
    return fits[0] if len(fits) == 1 else None


def layer_findings(checkpoint: Checkpoint, declared: Declared) -> Iterator[Finding]:
    """``format-unchecked``, ``weight-dtype``, ``scale-missing``, ``scale-dtype``,
    ``scale-shape``, ``block-scale-shape`` and ``excluded-stray-scale``."""
    layers = quantized_layers(checkpoint, declared)
    unchecked: dict[str, list[str]] = {}
    for layer in layers:
        if layer.spec is None:
            label = layer.scheme.label if layer.scheme is not None else "(undeclared)"
            unchecked.setdefault(label, []).append(layer.module)
            continue
        yield from _layer(layer, layer.spec, declared)
    for label, modules in sorted(unchecked.items()):
        yield RULES["format-unchecked"].finding(
            label,
            f"{len(modules)} quantized layer(s) (e.g. {modules[0]!r}) are in format {label!r}, "
            "for which no registered FormatSpec exists; their leaves, dtypes and shapes were not "
            "checked (register the format with exportlm.quant.register_format to check them)",
            modules=len(modules),
        )
    yield from _stray_scales(checkpoint, {layer.module for layer in layers})


def _codec_layer(layer: QuantizedLayer, spec: FormatSpec, codec: LeafCodec) -> Iterator[Finding]:
    """A layer stored in a layout's own names: its stored leaves present, in their dtypes.

    Shapes are not checked here (the logical shape is a stored value, ``weight_shape``);
    the loader checks them when it decodes the layer.
    """
    for leaf in codec.weights:
        info = layer.leaves.get(leaf.name)
        expected = safetensors_dtype(leaf.dtype)
        if info is None:
            yield RULES["scale-missing"].finding(
                f"{layer.module}.{leaf.name}",
                f"{layer.module} is quantized as {spec.name} but stores no {leaf.name} (the "
                "layout stores it for every quantized weight); loaders fail on the missing "
                "parameter. Export the layer with all of its tensors",
                format=spec.name,
            )
            continue
        # compressed-tensors stores float scales in the model's dtype (bf16 / fp16 / fp32)
        floats = leaf.kind == "scale" and leaf.dtype.is_floating_point and leaf.dtype.itemsize == 4
        allowed = FLOAT_SCALE_DTYPES if floats else {expected}
        if info.dtype not in allowed:
            rule = "weight-dtype" if leaf.kind == "codes" else "scale-dtype"
            yield RULES[rule].finding(
                info.name,
                f"{info.name} is stored as {info.dtype}; format {spec.name!r} in this layout "
                f"stores {leaf.name} as {' or '.join(sorted(allowed))}. Kernels read its raw bytes",
                stored=info.dtype,
                expected=sorted(allowed),
            )


def _renamed_tiles(
    layer: QuantizedLayer, spec: FormatSpec, codec: LeafCodec, layout: str
) -> Iterator[Finding]:
    """Tile scales a layout stores under its own name (finegrained-fp8's ``weight_scale_inv``)
    or shape (ModelOpt's FP8_PB_WO) over codes it keeps as they are: their shape, as
    :func:`_shapes` checks the format's own; in the tile the scale's shape gives where no
    config records one (:func:`~exportlm.inspection._tiles.scale_tile`)."""
    codes = layer.leaves[codec.codes.name]
    if spec.granularity != "tile" or codes.dtype != safetensors_dtype(spec.stored_dtype):
        return
    block = (layer.scheme.block_size if layer.scheme is not None else spec.block_size) or 1
    unrecorded = not layout_tiles(spec, layout)[0] and not (
        layer.scheme and layer.scheme.group_size
    )
    for leaf in codec.weights:
        info = layer.leaves.get(leaf.name)
        if leaf.kind == "scale" and info is not None:
            shapes, weight = codec.scale_shapes, tuple(codes.shape)
            tile = scale_tile(info.shape, weight, block, shapes) if unrecorded else block
            yield from tile_scale_findings(info, spec.name, weight, tile, shapes)


def _layer(layer: QuantizedLayer, spec: FormatSpec, declared: Declared) -> Iterator[Finding]:
    codec = _codec(spec, declared)
    if codec is not None and codec.codes.name in layer.leaves:
        yield from _codec_layer(layer, spec, codec)
        yield from _renamed_tiles(layer, spec, codec, declared.layout)
        yield from native_shape_findings(layer.module, layer.leaves, spec)
        return
    weight = layer.leaves["weight"]
    expected = safetensors_dtype(spec.stored_dtype)
    if weight.dtype != expected:
        yield RULES["weight-dtype"].finding(
            weight.name,
            f"{weight.name} is stored as {weight.dtype}, but format {spec.name!r} stores its codes "
            f"as {expected}; a loader would reinterpret the values. Re-export the layer",
            stored=weight.dtype,
            expected=expected,
        )
    static = layer.scheme.static_inputs if layer.scheme is not None else False
    required = [leaf for leaf in spec.weight_leaves if leaf.source != "data"]
    required += [leaf for leaf in spec.leaves if leaf.name == "input_scale" and static]
    for leaf in required:
        if leaf.name not in layer.leaves:
            why = (
                "activations are quantized statically"
                if leaf.role == "activation"
                else (f"format {spec.name!r} stores it for every quantized weight")
            )
            yield RULES["scale-missing"].finding(
                f"{layer.module}.{leaf.name}",
                f"{layer.module} has a quantized weight but no {leaf.name} ({why}, as "
                f"{declared.source} declares); loaders fail on the missing parameter or run with "
                "an uninitialised scale. Export the layer with all of its scales",
                format=spec.name,
            )
    for leaf in spec.leaves:
        info = layer.leaves.get(leaf.name)
        if info is not None and leaf.source != "data":
            yield from _scale_dtype(info, leaf, spec, declared.layout)
    if weight.dtype == expected:
        yield from _shapes(layer, spec, weight)


#: The AWQ / SmoothQuant activation multiplier, stored in any float dtype.
_SMOOTHING = "pre_quant_scale"


def _scale_dtype(info: TensorInfo, leaf: Leaf, spec: FormatSpec, layout: str) -> Iterator[Finding]:
    expected = safetensors_dtype(leaf.dtype)
    # compressed-tensors stores float scales in the model's dtype (bf16 / fp16 / fp32), and
    # ModelOpt an AWQ / SmoothQuant pre_quant_scale (a multiplier of the activations, which
    # the loaders apply in the activation dtype): ModelOpt 0.47's int8_sq of a bf16 model
    # stores it as BF16, and the loaders read it
    allowed = (
        FLOAT_SCALE_DTYPES
        if leaf.is_float32_scale and (layout == "compressed-tensors" or leaf.name == _SMOOTHING)
        else {expected}
    )
    if info.dtype not in allowed:
        yield RULES["scale-dtype"].finding(
            info.name,
            f"{info.name} is stored as {info.dtype}; format {spec.name!r} stores {leaf.name} as "
            f"{' or '.join(sorted(allowed))}. Kernels read the scale's raw bytes in that dtype",
            stored=info.dtype,
            expected=sorted(allowed),
        )


def _shapes(layer: QuantizedLayer, spec: FormatSpec, weight: TensorInfo) -> Iterator[Finding]:
    logical = spec.logical_shape(weight.shape)
    stacked = math.prod(logical[:-2])  # experts stacked in one 3-D weight: one scale each
    for leaf in spec.leaves:
        info = layer.leaves.get(leaf.name)
        if info is None or leaf.source == "data" or leaf.role == "kv_cache":
            continue
        if leaf.source == "scale" and spec.granularity == "block":
            yield from _block_shape(layer, spec, info, logical)
            continue
        if leaf.source == "scale" and spec.granularity == "tile":
            block = layer.scheme.block_size if layer.scheme is not None else spec.block_size
            yield from tile_scale_findings(info, spec.name, logical, block or 1)
            continue
        if leaf.source == "scale" and spec.granularity == "row":
            want, ok = logical[:-1], _squeeze(info.shape) == _squeeze(logical[:-1])
        elif leaf.name == _PER_INPUT_FEATURE:
            want, ok = (logical[-1],), info.shape == (logical[-1],)
        else:  # a per-tensor scale: one value (0-d or [1]), one per stacked expert
            want, ok = (), info.numel in (1, stacked)
        if not ok:
            yield RULES["scale-shape"].finding(
                info.name,
                f"{info.name} has shape {list(info.shape)}; for the {spec.name} weight "
                f"{weight.name} (logical shape {list(logical)}) it must be "
                f"{list(want) if want else 'one value (shape [] or [1])'}",
                shape=list(info.shape),
                expected=list(want),
            )


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without trailing ones (a per-row scale may be ``[out]`` or ``[out, 1]``)."""
    dims = list(shape)
    while dims and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def _block_shape(
    layer: QuantizedLayer, spec: FormatSpec, info: TensorInfo, logical: tuple[int, ...]
) -> Iterator[Finding]:
    block = layer.scheme.block_size if layer.scheme is not None else None
    block = block or spec.block_size
    if not block:
        return
    want = (*logical[:-1], logical[-1] // block)
    if logical[-1] % block == 0 and info.shape == want:
        return
    yield RULES["block-scale-shape"].finding(
        info.name,
        f"{info.name} has shape {list(info.shape)}; {spec.name} blocks of {block} over the "
        f"weight's logical shape {list(logical)} (stored {list(layer.leaves['weight'].shape)}) "
        f"need {list(want)}"
        + ("" if logical[-1] % block == 0 else f", and {logical[-1]} inputs are not a multiple")
        + ". A loader reads the scales block by block and would misalign every block after "
        "the first wrong one",
        shape=list(info.shape),
        expected=list(want),
        block_size=block,
    )


def _stray_scales(checkpoint: Checkpoint, quantized: set[str]) -> Iterator[Finding]:
    """Scale leaves on modules without a quantized weight (KV-cache scales excepted)."""
    kv = {leaf.name for spec in formats() for leaf in spec.leaves if leaf.role == "kv_cache"}
    stray_names = set(scale_leaf_names()) - kv
    for module, leaves in sorted(modules_of(checkpoint).items()):
        if module in quantized:
            continue
        for leaf in sorted(stray_names & set(leaves)):
            weight = leaves.get("weight")
            held = f"its weight is {weight.dtype}" if weight else "it saves no weight"
            yield RULES["excluded-stray-scale"].finding(
                f"{module}.{leaf}",
                f"{module}.{leaf} is saved but {module} is not quantized ({held}); vLLM and SGLang "
                f'create no {leaf} parameter for an unquantized layer and fail with "no module '
                f"or parameter named '{module}.{leaf}'\" (KeyError). Drop the scale, or quantize "
                "the layer and list it as quantized",
            )
