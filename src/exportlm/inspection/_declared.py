"""What a checkpoint's configs declare about its quantization, read leniently.

Unlike the ``hf_checkpoint`` runtime, which refuses what it cannot load, the
inspector reads any producer's configs (ours, NVIDIA ModelOpt's, llm-compressor's)
and turns what it cannot map to a registered
:class:`~exportlm.quant.formats.FormatSpec` into a finding, not an exception.

* ModelOpt layout: ``hf_quant_config.json``'s ``quantization`` (or ``config.json``'s
  ``quantization_config`` with ``quant_method: "modelopt"``): ``quant_algo``, or
  ``MIXED_PRECISION`` with ``quantized_layers``; ``kv_cache_quant_algo``.
* compressed-tensors: ``config.json``'s ``quantization_config`` ``config_groups``
  (``weights`` / ``input_activations`` args, ``format``) and ``kv_cache_scheme``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exportlm.errors import UnknownNameError
from exportlm.inspection._files import HF_QUANT_CONFIG, Checkpoint
from exportlm.quant.formats import MIXED_PRECISION, FormatSpec, format_for_quant_algo, formats

__all__ = ["MIXED_PRECISION", "Declared", "LayerScheme", "read_declared"]

#: compressed-tensors quantization-args keys that decide the stored layout.
_CT_LAYOUT_KEYS = ("num_bits", "type", "strategy")


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
        layout: ``"modelopt"``, ``"compressed-tensors"``, ``"other"`` (another
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
    section = checkpoint.hf_quant_config.get("quantization")
    config = checkpoint.quantization_config
    method = config.get("quant_method")
    method = str(method) if method is not None else None
    if isinstance(section, dict):
        return _modelopt(section, method, HF_QUANT_CONFIG)
    if method == "modelopt":
        return _modelopt(config, method, "config.json quantization_config")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    return Declared("other" if method else "none", method, "config.json quantization_config")


def _modelopt(section: Mapping[str, Any], method: str | None, source: str) -> Declared:
    kv = section.get("kv_cache_quant_algo")
    algo = section.get("quant_algo")
    group = section.get("group_size")
    if algo == MIXED_PRECISION:
        listed = section.get("quantized_layers")
        layers = {
            str(layer): _modelopt_scheme(cfg.get("quant_algo"), cfg.get("group_size"))
            for layer, cfg in (listed.items() if isinstance(listed, dict) else ())
            if isinstance(cfg, dict)
        }
        return Declared("modelopt", method, source, layers=layers, kv_cache=bool(kv))
    default = _modelopt_scheme(algo, group) if algo else None
    return Declared("modelopt", method, source, default=default, kv_cache=bool(kv))


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


def _compressed_tensors(config: Mapping[str, Any]) -> Declared:
    listed = config.get("config_groups")
    groups = [
        g for g in (listed.values() if isinstance(listed, dict) else ()) if isinstance(g, dict)
    ]
    schemes = [_ct_scheme(group, config.get("format")) for group in groups]
    default = schemes[0] if len(schemes) == 1 else None
    source = "config.json quantization_config"
    return Declared(
        "compressed-tensors",
        "compressed-tensors",
        source,
        default=default,
        kv_cache=bool(config.get("kv_cache_scheme")),
    )


def _ct_scheme(group: Mapping[str, Any], default_format: Any) -> LayerScheme:
    """The registered format whose compressed-tensors scheme stores ``group``'s layout."""
    weights = group.get("weights")
    weights = weights if isinstance(weights, dict) else {}
    inputs = group.get("input_activations")
    fmt = str(group.get("format") or default_format or "?")
    static = isinstance(inputs, dict) and not inputs.get("dynamic", False)
    for spec in formats():
        scheme = spec.compressed_tensors
        if scheme is None or scheme.format != fmt:
            continue
        if all(weights.get(key) == scheme.weights.get(key) for key in _CT_LAYOUT_KEYS):
            return LayerScheme(spec, fmt, static, _group_size(weights.get("group_size")))
    label = f"{fmt} ({', '.join(f'{k}={weights.get(k)}' for k in _CT_LAYOUT_KEYS)})"
    return LayerScheme(None, label, static, _group_size(weights.get("group_size")))
