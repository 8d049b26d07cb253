"""The parts a :class:`~exportlm.quant.formats.FormatSpec` is made of.

The checkpoint leaves a format writes (:class:`Leaf`), its config fields in each
checkpoint layout (:class:`ModelOptScheme`, :class:`CompressedTensorsScheme`,
:class:`KVCacheScheme`) and the deprecated :class:`WeightRecipe` (a recipe is a
record of its own, :class:`exportlm.quant.Recipe`). All frozen; mappings are read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = [
    "CompressedTensorsScheme",
    "FineGrainedFP8Scheme",
    "GptOssMxfp4Scheme",
    "KVCacheScheme",
    "Leaf",
    "LeafCodec",
    "LeafRole",
    "ModelOptScheme",
    "StoredLeaf",
    "StoredScale",
    "WeightRecipe",
    "is_token",
]

#: What a leaf is written from: the quantized weight, an activation statistic, the KV cache.
LeafRole = Literal["weight", "activation", "kv_cache"]
_SOURCES = ("data", "scale", "scale_2")


def is_token(name: object) -> bool:
    """A non-empty string without whitespace (format and recipe names)."""
    return isinstance(name, str) and bool(name) and not any(c.isspace() for c in name)


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Leaf:
    """One tensor a quantized module writes, as ``<module>.<name>``.

    Attributes:
        name: the leaf name (``"weight"``, ``"weight_scale"``, ``"input_scale"``...).
        dtype: the stored dtype.
        role: ``"weight"`` (from the quantized weight), ``"activation"`` (from
            calibration: ``input_scale``, AWQ ``pre_quant_scale``) or ``"kv_cache"``.
        source: for a weight leaf, the :class:`QuantizedTensor` field it is
            (``"data"``, ``"scale"`` or ``"scale_2"``).
    """

    name: str
    dtype: torch.dtype
    role: LeafRole = "weight"
    source: Literal["data", "scale", "scale_2"] | None = None

    def __post_init__(self) -> None:
        if (self.role == "weight") != (self.source in _SOURCES):
            raise ValueError(
                f"leaf {self.name!r}: a weight leaf names its QuantizedTensor field "
                f"(source in {_SOURCES}) and no other leaf does; got role={self.role!r}, "
                f"source={self.source!r}"
            )

    @property
    def is_float32_scale(self) -> bool:
        """A float32 scale: written through ``ExportContext.emit_scale`` (0-d per-tensor
        scales in ModelOpt, ``[1]`` in compressed-tensors)."""
        return self.source != "data" and self.dtype == torch.float32


@dataclass(frozen=True)
class WeightRecipe:
    """Deprecated: the :func:`~exportlm.quant.quantize` recipe a format declares itself.

    A recipe is a record of its own (:class:`exportlm.quant.Recipe`,
    :func:`exportlm.quant.register_recipe`); a spec that still sets ``recipe=`` has it
    registered as one by :func:`~exportlm.quant.register_format`.

    Attributes:
        name: the recipe name (``"int4_awq"``).
        block_size: the block / group size the recipe uses (block formats).
        axis: ``0`` for per-row amax collection (INT8), else ``None``.
        quantize_inputs: activations are quantized with the same format (static,
            calibrated per-tensor scale); ``False`` for weight-only recipes.
        awq: compute an AWQ ``pre_quant_scale`` from calibration activations.
        input_format: the registered format activations are quantized to when it is
            not this one (INT8 W8A8: per-row int8 weights, per-tensor static or
            per-token dynamic int8 inputs); ``None``: the format itself.
        smoothquant_alpha: SmoothQuant's migration strength; set, the recipe smooths
            each quantized linear's input channels into its weight before quantizing
            (:mod:`exportlm.quant._smoothquant`). ``None``: no smoothing.
        smoothquant_fold: smooth only groups of linears whose scale folds into the norm
            that feeds them (llm-compressor's ``SmoothQuantModifier``: the layout then
            needs no ``pre_quant_scale``); ``False``: every linear, the scale kept as
            ``pre_quant_scale`` (ModelOpt's ``smoothquant``).
        group_sizes: the group sizes the recipe takes as its ``group_size`` option
            (``block_size`` among them); empty: ``block_size`` only.
    """

    name: str
    block_size: int | None = None
    axis: int | None = None
    quantize_inputs: bool = False
    awq: bool = False
    input_format: str | None = None
    smoothquant_alpha: float | None = None
    smoothquant_fold: bool = False
    group_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelOptScheme:
    """The format in NVIDIA ModelOpt's checkpoint layout.

    Attributes:
        quant_algo: ``hf_quant_config.json``'s ``quant_algo`` (``"FP8"``, ``"W4A16_AWQ"``).
        weights: the ``weights`` entry of a ``config.json`` ``config_groups`` group
            (``dynamic``, ``num_bits``, ``type``); block formats add ``group_size``.
        input_activations: the ``input_activations`` entry, ``None`` for weight-only.
        layer_fields: extra fields of the layer's ``hf_quant_config.json`` entry
            (AWQ: ``has_zero_point``, ``pre_quant_scale``).
        config_groups: a single-format checkpoint's ``config.json``
            ``quantization_config`` carries a ``config_groups`` block (ModelOpt 0.47
            writes one for FP8, NVFP4, W4A16_NVFP4, NVFP4_SVD only; not for W8A16 or
            W4A16_AWQ, whose specs set ``False``). Mixed precision always has one, a
            group per layer config.
        codec: how the layout stores the format's tensors when it differs from the
            format's own leaves (FP8_PB_WO's 4-D tile scales), ``None``: as they are.
        block_sizes: the only block sizes the layout can hold the format in, ``()``: any
            (FP8_PB_WO: ``(128,)``; ModelOpt 0.47 records none and vLLM reads 128 x 128).
        group_size_field: the layer config carries ``group_size`` (ModelOpt writes none
            for ``fp8_pb_wo``).
        named_group: ModelOpt's mixed-precision ``config_groups`` group for this
            ``quant_algo`` is ``{"quant_algo": ...}`` alone (0.47's
            ``_quant_algo_to_group_config`` has no entry for it and falls back to that).
    """

    quant_algo: str
    weights: Mapping[str, Any]
    input_activations: Mapping[str, Any] | None = None
    layer_fields: Mapping[str, Any] = field(default_factory=dict)
    config_groups: bool = True
    codec: LeafCodec | None = None
    block_sizes: tuple[int, ...] = ()
    group_size_field: bool = True
    named_group: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _frozen(self.weights))
        object.__setattr__(self, "layer_fields", _frozen(self.layer_fields))
        if self.input_activations is not None:
            object.__setattr__(self, "input_activations", _frozen(self.input_activations))

    def block_problem(self, block: int | None, fmt: str, others: Sequence[str]) -> str | None:
        """Why this layout cannot hold format ``fmt`` in blocks of ``block``, or ``None``.

        ``others``: the other layouts that hold the format (named as the way out).
        """
        if not self.block_sizes or block in self.block_sizes:
            return None
        sizes = " or ".join(str(b) for b in self.block_sizes)
        names = " or ".join(f"-o format={name}" for name in others)
        instead = f", or export with {names}, which record the block" if names else ""
        return (
            f"the ModelOpt layout holds format {fmt!r} ({self.quant_algo}) in blocks of {sizes} "
            f"only: its config declares no block size and vLLM reads {sizes} x {sizes} tiles, "
            f"so blocks of {block} would be misread; quantize with group_size="
            f"{self.block_sizes[0]}{instead}"
        )


#: What a stored weight leaf holds: the codes, a scale, or the logical shape (an integer tensor).
StoredKind = Literal["codes", "scale", "shape"]
#: ``{leaf name: tensor}`` of one quantized weight (or of its activation scales).
LeafTensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StoredLeaf:
    """One tensor a layout stores for a quantized weight, under the layout's own name.

    Attributes:
        name: the stored leaf name (``"weight_packed"``).
        dtype: the stored dtype.
        kind: ``"codes"`` (exactly one per codec), ``"scale"`` (checked like every
            scale when read) or ``"shape"`` (an integer tensor, read as is).
    """

    name: str
    dtype: torch.dtype
    kind: StoredKind = "scale"


@dataclass(frozen=True)
class StoredScale:
    """How a layout stores one of a format's activation leaves (``input_scale``).

    Attributes:
        name: the stored name (``"input_global_scale"``).
        reciprocal: stored as ``1 / scale`` (compressed-tensors' global scales).
    """

    name: str
    reciprocal: bool = False


@dataclass(frozen=True)
class LeafCodec:
    """A layout's own tensors for a format's leaves: other names, dtypes and shapes.

    The format's kernels and its :class:`Leaf` list stay the one source of the
    numbers; a codec only re-lays them out, both ways, as pure functions of the
    leaves (so the checkpoint writer and the loader call them without knowing the
    format or the layout).

    Attributes:
        weights: the stored weight leaves, in writing order (one of kind ``"codes"``).
        encode: the format's weight leaves (``{"weight": ..., "weight_scale": ...}``,
            float32 scales already float32) to the stored ones (every name of ``weights``).
        decode: the stored weight leaves back to the format's (inverse of ``encode``).
        activations: the format's activation leaves by name: how the layout stores
            each, or ``None`` where the layout has no tensor for it (the writer refuses
            a module that would need it, naming the leaf and ``refusal``). A leaf
            not listed is stored under its own name.
        refusal: why a leaf mapped to ``None`` cannot be stored and what to do instead.
        global_scale: the layout stores the format's second level (``scale_2``) as a
            global scale, its divisor form (compressed-tensors' ``weight_global_scale``):
            ``encode`` gets it and ``decode`` gives it back in that form, and the layout
            converts a ModelOpt ``scale_2`` (the float32 reciprocal: not exact).
        scale_shapes: the shapes a tile scale of the format's shape (``[..., ceil(out / b),
            in / b]``) may be stored with in the layout, the writer's first (ModelOpt's
            4-D FP8_PB_WO scales); ``None``: the format's own shape only.
    """

    weights: tuple[StoredLeaf, ...]
    encode: Callable[[LeafTensors], dict[str, torch.Tensor]]
    decode: Callable[[LeafTensors], dict[str, torch.Tensor]]
    activations: Mapping[str, StoredScale | None] = field(default_factory=dict)
    refusal: str = ""
    global_scale: bool = False
    scale_shapes: Callable[[tuple[int, ...]], tuple[tuple[int, ...], ...]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "activations", _frozen(self.activations))
        if [leaf.kind for leaf in self.weights].count("codes") != 1:
            raise ValueError("a LeafCodec stores exactly one leaf of kind 'codes'")

    @property
    def codes(self) -> StoredLeaf:
        """The stored leaf holding the codes (``weight_packed``)."""
        return next(leaf for leaf in self.weights if leaf.kind == "codes")


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """The format in compressed-tensors' layout (``quantization_config.config_groups``).

    Attributes:
        format: the compressed-tensors format name (``"float-quantized"``,
            ``"pack-quantized"``, ``"nvfp4-pack-quantized"``).
        weights: the group's ``weights`` quantization args (``num_bits``, ``type``,
            ``strategy``, ``symmetric``, ``dynamic``...), as compressed-tensors
            serializes them; a ``group_size`` key is set to the layer's group size.
        input_activations: the group's ``input_activations`` args, ``None`` for weight-only.
        codec: how the layout stores the format's tensors when it differs from the
            format's own leaves (INT4 ``weight_packed`` int32...), ``None``: as they are.
        scale_divisor: compressed-tensors' symmetric divisor of the weight scales it
            derives from the weight per row or group, ``amax / ((q_max - q_min) / 2)``
            (INT4 7.5, INT8 127.5, FP8 448), kept in the weight's dtype: what the recipe
            option ``scales=compressed-tensors`` quantizes with. ``None``: the format's
            scales are not such (calibrated per-tensor scales, NVFP4's and MX's own dtypes).
    """

    format: str
    weights: Mapping[str, Any]
    input_activations: Mapping[str, Any] | None = None
    codec: LeafCodec | None = None
    scale_divisor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _frozen(self.weights))
        if self.input_activations is not None:
            object.__setattr__(self, "input_activations", _frozen(self.input_activations))

    def group(self, targets: list[str], group_size: int | None = None) -> dict[str, Any]:
        """One ``config_groups`` entry for ``targets`` (keys in compressed-tensors' order).

        ``group_size`` (a block format's layer group size) replaces the ``group_size``
        of the args that have one.
        """
        group: dict[str, Any] = {
            "targets": list(targets),
            "weights": _sized(self.weights, group_size),
        }
        if self.input_activations is not None:
            group["input_activations"] = _sized(self.input_activations, group_size)
        group["format"] = self.format
        return group


@dataclass(frozen=True)
class FineGrainedFP8Scheme:
    """The format in the layout of DeepSeek-V3 / Qwen3-FP8 checkpoints (``format="finegrained-fp8"``).

    ``config.json``'s ``quantization_config`` is ``{"quant_method": "fp8",
    "activation_scheme": "dynamic", "weight_block_size": [b, b],
    "modules_to_not_convert": [...]}``: transformers' ``FineGrainedFP8Config`` and
    vLLM's ``Fp8Config`` read it (``docs/checkpoint-format.md``).

    Attributes:
        codec: the layout's names for the format's leaves (``weight_scale`` is stored as
            ``weight_scale_inv``, the same float32 numbers).
        quant_method: ``quantization_config.quant_method``.
        activation_scheme: ``quantization_config.activation_scheme`` (inputs quantized
            per group of ``b`` at run time: ``"dynamic"``).
    """

    codec: LeafCodec
    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"

    def config(self, block: int, not_converted: list[str]) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` for square tiles of ``block``.

        ``not_converted``: the unquantized linear modules, under the name both loaders
        read (transformers' ``modules_to_not_convert``; vLLM's ``Fp8Config.from_config``
        falls back to it when ``ignored_layers`` is absent).
        """
        return {
            "quant_method": self.quant_method,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": [block, block],
            "modules_to_not_convert": list(not_converted),
        }


@dataclass(frozen=True)
class GptOssMxfp4Scheme:
    """The format as openai/gpt-oss checkpoints ship it (``format="gpt-oss-mxfp4"``).

    ``config.json``'s ``quantization_config`` is ``{"quant_method": "mxfp4",
    "modules_to_not_convert": [...]}`` (transformers' ``Mxfp4Config``, vLLM's
    ``GptOssMxfp4Config``); each GptOss experts module stores its projection ``p``
    stacked as ``<experts>.<p>_blocks`` / ``<experts>.<p>_scales`` (``docs/checkpoint-format.md``).

    Attributes:
        codec: the layout's names for one expert's leaves (``blocks``: the packed codes
            ``[out, in / 32, 16]``; ``scales``: the E8M0 codes ``[out, in / 32]``).
        quant_method: ``quantization_config.quant_method``.
    """

    codec: LeafCodec
    quant_method: str = "mxfp4"

    def config(self, not_converted: list[str]) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``; ``not_converted``: the unquantized
        modules (transformers' ``modules_to_not_convert``; vLLM's ``Mxfp4Config`` reads none)."""
        return {"quant_method": self.quant_method, "modules_to_not_convert": list(not_converted)}


def _sized(args: Mapping[str, Any], group_size: int | None) -> dict[str, Any]:
    entry = dict(args)
    if group_size and entry.get("group_size") is not None and entry.get("strategy") == "group":
        entry["group_size"] = group_size
    if entry.get("strategy") == "block" and entry.get("block_structure") is not None:
        edge = group_size or entry["block_structure"][0]  # square tiles (fp8_block)
        entry["block_structure"] = [edge, edge]
    return entry


@dataclass(frozen=True)
class KVCacheScheme:
    """The format's KV-cache fields in each layout (scales written as ``k_scale`` / ``v_scale``).

    Attributes:
        recipe: the KV-cache recipe's name (``"fp8_kv"``): registered as a
            :class:`~exportlm.quant.KVCacheRecipe` unless a record of that name is.
        quant_algo: ``hf_quant_config.json``'s ``kv_cache_quant_algo``.
        modelopt: ModelOpt's ``config.json`` ``kv_cache_scheme``.
        compressed_tensors: compressed-tensors' ``kv_cache_scheme``, ``None`` if unsupported.
    """

    recipe: str
    quant_algo: str
    modelopt: Mapping[str, Any]
    compressed_tensors: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modelopt", _frozen(self.modelopt))
        if self.compressed_tensors is not None:
            object.__setattr__(self, "compressed_tensors", _frozen(self.compressed_tensors))
