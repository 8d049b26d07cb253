"""What a checkpoint's configs declare about its quantization, read leniently.

Unlike the ``hf_checkpoint`` runtime, which refuses what it cannot load, the
inspector reads any producer's configs (ours, NVIDIA ModelOpt's, llm-compressor's)
and turns what it cannot map to a registered
:class:`~exportlm.quant.formats.FormatSpec` into a finding, not an exception.
The configs are read by the checkpoint room's one reader
(:attr:`Checkpoint.declaration`, :func:`exportlm.checkpoint.declaration_of`); this
module maps that declaration to formats.

* ModelOpt layout: ``hf_quant_config.json``'s ``quantization`` (or ``config.json``'s
  ``quantization_config`` with ``quant_method: "modelopt"``): ``quant_algo``, or
  ``MIXED_PRECISION`` with ``quantized_layers``; ``kv_cache_quant_algo``.
* compressed-tensors: ``config.json``'s ``quantization_config`` ``config_groups``
  (``weights`` / ``input_activations`` args, ``format``) and ``kv_cache_scheme``.
* finegrained-fp8: ``quant_method: "fp8"`` with square ``weight_block_size`` tiles
  (DeepSeek-V3, Qwen3-FP8): the format whose ``finegrained_fp8`` scheme it is.
* gpt-oss-mxfp4: ``quant_method: "mxfp4"`` (openai/gpt-oss): the format whose
  ``gpt_oss_mxfp4`` scheme it is (``mxfp4``), for every quantized layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exportlm.checkpoint import ConfigGroup, QuantArgs, Section, quant_args
from exportlm.errors import UnknownNameError
from exportlm.inspection._files import Checkpoint
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    MIXED_PRECISION,
    FormatSpec,
    format_for_quant_algo,
    formats,
)

__all__ = ["MIXED_PRECISION", "Declared", "LayerScheme", "read_declared"]

_CONFIG_WHERE = "config.json quantization_config"


@dataclass(frozen=True)
class LayerScheme:
    """How one quantized layer is declared.

    Attributes:
        spec: the format, ``None`` when no registered format matches the declaration.
        label: the declaration as written (``"FP8"``, ``"W4A16_AWQ"``,
            ``"nvfp4-pack-quantized"``), for messages.
        static_inputs: activations are quantized with a stored ``input_scale``.
        group_size: the declared block / group size, if any.
    """

    spec: FormatSpec | None
    label: str
    static_inputs: bool
    group_size: int | None = None

    @property
    def block_size(self) -> int | None:
        """The block size scales are checked against: declared, else the format's own."""
        if self.group_size:
            return self.group_size
        return self.spec.block_size if self.spec is not None else None


@dataclass(frozen=True)
class Declared:
    """A checkpoint's quantization declaration.

    Attributes:
        layout: ``"modelopt"``, ``"compressed-tensors"``, ``"finegrained-fp8"``, ``"other"`` (another
            ``quant_method``) or ``"none"`` (nothing declared).
        quant_method: ``config.json``'s ``quant_method`` (``None`` when absent).
        source: the file the declaration was read from.
        default: the scheme of every quantized layer (one format), or ``None``.
        layers: ``{saved layer path: scheme}`` (ModelOpt ``MIXED_PRECISION``).
        kv_cache: KV-cache quantization is declared.
    """

    layout: str
    quant_method: str | None
    source: str
    default: LayerScheme | None = None
    layers: Mapping[str, LayerScheme] = field(default_factory=dict)
    kv_cache: bool = False

    def scheme(self, layer: str) -> LayerScheme | None:
        """The declared scheme of ``layer`` (``None``: nothing declared for it)."""
        return self.layers.get(layer, self.default) if self.layers else self.default

    @property
    def schemes(self) -> list[LayerScheme]:
        """Every declared scheme (the default one and the per-layer ones)."""
        found = list(self.layers.values())
        return [self.default, *found] if self.default is not None else found


def read_declared(checkpoint: Checkpoint) -> Declared:
    """The quantization ``checkpoint``'s configs declare (see the module docstring)."""
    declaration = checkpoint.declaration
    method = declaration.quant_method
    section = declaration.primary
    if section is None:
        return Declared("none", method, _CONFIG_WHERE)
    if section.layout == "modelopt":
        return _modelopt(section, method)
    if section.layout == "compressed-tensors":
        return _compressed_tensors(section)
    if section.layout == "finegrained-fp8":
        return _finegrained(section, method)
    if section.layout == "gpt-oss-mxfp4":  # one format (mxfp4) for every quantized layer
        held = [spec for spec in formats() if CHECKPOINT_LAYOUTS[section.layout].holds(spec)]
        spec = held[0] if len(held) == 1 else None
        scheme = LayerScheme(spec, f"{method} (gpt-oss)", False)
        return Declared(section.layout, method, section.source, default=scheme)
    return Declared(section.layout, method, section.source)


def _finegrained(section: Section, method: str | None) -> Declared:
    """``quant_method: "fp8"``: the format with a ``finegrained_fp8`` scheme, square tiles."""
    layout = CHECKPOINT_LAYOUTS["finegrained-fp8"]
    fields = section.finegrained
    block = fields.block if fields is not None else None
    holders = [spec for spec in formats() if layout.holds(spec)]
    spec = holders[0] if len(holders) == 1 and block is not None else None
    size = fields.weight_block_size if fields is not None else None
    scheme = LayerScheme(spec, f"fp8 (weight_block_size={size!r})", False, block)
    return Declared("finegrained-fp8", method, section.source, default=scheme)


def _modelopt(section: Section, method: str | None) -> Declared:
    kv = bool(section.kv_cache_quant_algo)
    if section.mixed:
        layers = {
            layer.name: _modelopt_scheme(layer.quant_algo, layer.group_size)
            for layer in section.quantized_layers
            if layer.is_object
        }
        return Declared("modelopt", method, section.source, layers=layers, kv_cache=kv)
    algo = section.quant_algo
    default = _modelopt_scheme(algo, section.group_size) if algo else None
    return Declared("modelopt", method, section.source, default=default, kv_cache=kv)


def _modelopt_scheme(algo: Any, group_size: Any) -> LayerScheme:
    try:
        spec: FormatSpec | None = format_for_quant_algo(str(algo))
    except UnknownNameError:
        spec = None
    static = bool(spec is not None and spec.activations is not None)
    return LayerScheme(spec, str(algo), static, _group_size(group_size))


def _group_size(value: Any) -> int | None:
    """A declared group size; anything but a positive int is none (``config-field-invalid``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _compressed_tensors(section: Section) -> Declared:
    schemes = [_ct_scheme(group) for group in section.config_groups or () if group.is_object]
    return Declared(
        "compressed-tensors",
        "compressed-tensors",
        section.source,
        default=schemes[0] if len(schemes) == 1 else None,
        kv_cache=section.kv_cache_scheme is not None or bool(section.kv_cache_scheme_invalid),
    )


def _ct_scheme(group: ConfigGroup) -> LayerScheme:
    """The registered format whose compressed-tensors scheme stores ``group``'s layout."""
    weights = group.weights or QuantArgs()
    inputs = group.input_activations
    fmt = str(group.format or "?")
    static = inputs is not None and not (inputs.dynamic or False)
    layout = _layout(weights)
    size = _group_size(weights.group_size) or _tile_edge(weights.block_structure)
    fits = [
        spec
        for spec in formats()
        if (scheme := spec.compressed_tensors) is not None
        and scheme.format == fmt
        and layout == _layout(quant_args(scheme.weights) or QuantArgs())
    ]
    # the same weights with other inputs (W4A16 / W4AFP8): the format whose inputs match
    same_inputs = [spec for spec in fits if _inputs(spec) == _inputs_of(inputs)]
    if fits:
        return LayerScheme((same_inputs or fits)[0], fmt, static, size)
    label = f"{fmt} (num_bits={weights.num_bits}, type={weights.type}, strategy={weights.strategy})"
    return LayerScheme(None, label, static, size)


def _inputs(spec: FormatSpec) -> tuple[Any, ...] | None:
    scheme = spec.compressed_tensors
    return _inputs_of(quant_args(scheme.input_activations) if scheme is not None else None)


def _inputs_of(args: QuantArgs | None) -> tuple[Any, ...] | None:
    """The input args' layout and whether they are dynamic, ``None`` for weight-only."""
    return None if args is None else (*_layout(args), bool(args.dynamic))


def _tile_edge(block_structure: Any) -> int | None:
    """The edge of square ``block_structure`` tiles (``[128, 128]``: 128), else ``None``."""
    if isinstance(block_structure, list) and len(block_structure) == 2:
        rows, cols = (_group_size(v) for v in block_structure)
        return rows if rows is not None and rows == cols else None
    return None


def _layout(args: QuantArgs) -> tuple[Any, ...]:
    """The args that decide the stored layout: ``num_bits``, ``type``, ``strategy``."""
    return args.num_bits, args.type, args.strategy
