"""Which quantization format each stored tensor is in, as the checkpoint's configs declare it.

* ModelOpt layout: ``hf_quant_config.json`` (or, without it, ``config.json``'s
  ``quantization_config`` with ``quant_method: "modelopt"``) names one
  ``quant_algo``, or ``MIXED_PRECISION`` with ``quantized_layers`` (layer ->
  ``quant_algo``), and the KV cache's ``kv_cache_quant_algo`` (``config.json``:
  ``kv_cache_scheme``).
* compressed-tensors: ``config.json``'s ``quantization_config`` holds
  ``config_groups`` and a ``kv_cache_scheme``.

Each name maps to a registered :class:`~exportlm.quant.formats.FormatSpec`
(``format_for_quant_algo``, or the spec whose scheme equals the stored one), so a
format registered with :func:`~exportlm.quant.register_format` is read like a
built-in one. Where a checkpoint declares nothing for a layer, the format is the
one registered spec whose stored dtype and weight leaves match what is stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exportlm.errors import UnknownNameError, UnsupportedFormatError
from exportlm.export.hf_checkpoint.configs import HF_QUANT_CONFIG_NAME, MIXED_PRECISION
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    CheckpointLayout,
    FormatSpec,
    format_for_kv_cache_algo,
    format_for_quant_algo,
    formats,
)

__all__ = ["StoredFormats"]


@dataclass(frozen=True)
class StoredFormats:
    """The formats a checkpoint declares for its weights and its KV cache.

    Attributes:
        weights: the one format of every quantized layer, or ``None``.
        layers: ``{saved layer path: format}`` (``MIXED_PRECISION`` checkpoints).
        kv_cache: the KV-cache format, or ``None`` when none is declared.
        source: the file the declaration was read from, for error messages.
        layout: the checkpoint layout the tensors are stored in (its names for a
            format's leaves: :meth:`CheckpointLayout.weight_leaves`).
    """

    weights: FormatSpec | None = None
    layers: Mapping[str, FormatSpec] = field(default_factory=dict)
    kv_cache: FormatSpec | None = None
    source: str = "the checkpoint"
    layout: CheckpointLayout = CHECKPOINT_LAYOUTS["modelopt"]

    @classmethod
    def read(cls, directory: Path) -> StoredFormats:
        """What ``directory``'s ``hf_quant_config.json`` / ``config.json`` declare."""
        hf_quant = directory / HF_QUANT_CONFIG_NAME
        if hf_quant.is_file():
            section = json.loads(hf_quant.read_text()).get("quantization") or {}
            kv = section.get("kv_cache_quant_algo")
            return cls._modelopt(section, _kv_by_algo(kv) if kv else None, hf_quant.name)
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()).get("quantization_config") or {}
        method = config.get("quant_method")
        where = f"{config_path.name} quantization_config"
        if method is None:
            return cls(source=where)
        if method == "modelopt":
            return cls._modelopt(config, _kv_by_scheme(config, "modelopt"), where)
        if method == "compressed-tensors":
            return cls._compressed_tensors(config, where)
        raise UnsupportedFormatError(
            f"{config_path}: quant_method {method!r} cannot be read; the hf_checkpoint runtime "
            "reads 'modelopt' and 'compressed-tensors' checkpoints"
        )

    @classmethod
    def _modelopt(
        cls, section: Mapping[str, Any], kv_cache: FormatSpec | None, source: str
    ) -> StoredFormats:
        algo = section.get("quant_algo")
        if algo == MIXED_PRECISION:
            layers = {
                layer: _by_algo(str(cfg["quant_algo"]), source)
                for layer, cfg in (section.get("quantized_layers") or {}).items()
            }
            return cls(layers=layers, kv_cache=kv_cache, source=source)
        weights = _by_algo(str(algo), source) if algo else None
        return cls(weights=weights, kv_cache=kv_cache, source=source)

    @classmethod
    def _compressed_tensors(cls, config: Mapping[str, Any], source: str) -> StoredFormats:
        groups = list((config.get("config_groups") or {}).values())
        default = config.get("format")  # a group without its own format has the config's
        specs = [_by_group(group, source, default) for group in groups]
        # one group: every quantized layer is in its format; several: read by stored leaves
        weights = specs[0] if len(specs) == 1 else None
        return cls(
            weights=weights,
            kv_cache=_kv_by_scheme(config, "compressed_tensors"),
            source=source,
            layout=CHECKPOINT_LAYOUTS["compressed-tensors"],
        )

    def weight_format(self, layer: str, leaves: Mapping[str, torch.Tensor]) -> FormatSpec:
        """The format of ``layer``'s quantized weight, stored as ``leaves`` (``{leaf: tensor}``).

        The declared one; for a layer nothing declares, the one registered format
        whose stored dtype and weight leaves are exactly these. Raises
        :class:`UnsupportedFormatError` when none, or more than one, fits.
        """
        declared = self.layers.get(layer) if self.layers else self.weights
        if declared is not None:
            return declared
        fits = [spec for spec in formats() if _stores(spec, leaves)]
        if len(fits) == 1:
            return fits[0]
        stored = {name: str(t.dtype).removeprefix("torch.") for name, t in sorted(leaves.items())}
        if not fits:
            raise UnsupportedFormatError(
                f"{layer}: no registered quantization format stores {stored}, and {self.source} "
                "declares none for it; register the format's FormatSpec "
                "(exportlm.quant.register_format) before loading"
            )
        raise UnsupportedFormatError(
            f"{layer}: {self.source} declares no format for it and the stored leaves {stored} "
            f"fit several registered formats ({', '.join(s.name for s in fits)}); declare the "
            "layer's quant_algo in hf_quant_config.json"
        )

    def kv_cache_format(self, name: str) -> FormatSpec:
        """The format of KV-cache scale ``name``: the declared one, else the only KV-cache format."""
        if self.kv_cache is not None:
            return self.kv_cache
        fits = [spec for spec in formats() if spec.kv_cache is not None]
        if len(fits) == 1:
            return fits[0]
        raise UnsupportedFormatError(
            f"{name}: {self.source} declares no KV-cache format and "
            f"{len(fits)} registered formats have one ({', '.join(s.name for s in fits)}); "
            "declare kv_cache_quant_algo in hf_quant_config.json"
        )


def _stores(spec: FormatSpec, leaves: Mapping[str, torch.Tensor]) -> bool:
    """``leaves`` are exactly ``spec``'s weight leaves, codes in its stored dtype."""
    data = leaves.get(spec.data_leaf.name)
    names = {leaf.name for leaf in spec.weight_leaves}
    return data is not None and data.dtype == spec.stored_dtype and set(leaves) == names


def _by_algo(quant_algo: str, source: str) -> FormatSpec:
    try:
        return format_for_quant_algo(quant_algo)
    except UnknownNameError as err:
        raise UnsupportedFormatError(
            f"{source} declares quant_algo {quant_algo!r}, which no registered quantization "
            f"format writes (known: {', '.join(err.available) or 'none'}); register its "
            "FormatSpec (exportlm.quant.register_format) before loading"
        ) from err


def _kv_by_algo(kv_cache_quant_algo: str) -> FormatSpec:
    try:
        return format_for_kv_cache_algo(kv_cache_quant_algo)
    except UnknownNameError as err:
        raise UnsupportedFormatError(
            f"{HF_QUANT_CONFIG_NAME} declares kv_cache_quant_algo {kv_cache_quant_algo!r}, "
            f"which no registered format writes (known: {', '.join(err.available) or 'none'}); "
            "register its FormatSpec before loading"
        ) from err


def _kv_by_scheme(config: Mapping[str, Any], layout: str) -> FormatSpec | None:
    """The format whose ``kv_cache.<layout>`` scheme means ``config["kv_cache_scheme"]``."""
    scheme = config.get("kv_cache_scheme")
    if not scheme:
        return None
    for spec in formats():
        own = getattr(spec.kv_cache, layout, None) if spec.kv_cache else None
        if own is not None and _meaning(own) == _meaning(scheme):
            return spec
    raise UnsupportedFormatError(
        f"kv_cache_scheme {scheme!r} is no registered format's KV-cache scheme; register "
        "its FormatSpec (with a KVCacheScheme) before loading"
    )


#: What a compressed-tensors ``QuantizationArgs`` means for the stored tensors, with
#: compressed-tensors' defaults for a key left out. The rest (``observer``,
#: ``observer_kwargs``, ``scale_dtype``, ``zp_dtype``, ``block_structure`` of a
#: non-block strategy...) says how the producer calibrated or stores what the tensors'
#: own dtypes say: llm-compressor writes them, and they do not change what is read.
_MEANINGFUL = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": None,
    "group_size": None,
    "dynamic": False,
}
_GROUPED = frozenset({"group", "tensor_group"})
#: ``actorder`` values under which the codes are stored in column order (no ``g_idx``).
_PLAIN_ORDER = frozenset({None, False, "static"})


def _meaning(args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``args`` reduced to :data:`_MEANINGFUL` (defaults filled in), ``None`` for none."""
    if args is None:
        return None
    out = {k: default if args.get(k) is None else args[k] for k, default in _MEANINGFUL.items()}
    if out["strategy"] not in _GROUPED:
        out["group_size"] = None
    return out


def _group_meaning(group: Mapping[str, Any], default_format: Any) -> tuple[Any, ...]:
    return (
        group.get("format") or default_format,
        _meaning(group.get("weights")),
        _meaning(group.get("input_activations")),
        _meaning(group.get("output_activations")),
    )


def _by_group(group: Mapping[str, Any], source: str, default_format: Any = None) -> FormatSpec:
    """The format whose compressed-tensors scheme writes what ``group`` means.

    Compared by meaning (:data:`_MEANINGFUL` of the weights, input and output args, and
    the group's format, else the config's), so another producer's defaults
    (llm-compressor's ``observer``, ``scale_dtype``...) read as ours do. An ``actorder``
    that stores a ``g_idx`` permutation is refused: the codes would be read out of order.
    """
    order = (group.get("weights") or {}).get("actorder")
    if order not in _PLAIN_ORDER:
        raise UnsupportedFormatError(
            f"{source}: config group {dict(group)!r} stores its weights with "
            f"actorder={order!r} (a weight_g_idx permutation), which the hf_checkpoint "
            "runtime does not read; export with actorder='static' or None"
        )
    targets = list(group.get("targets") or [])
    size = (group.get("weights") or {}).get("group_size")
    wanted = _group_meaning(group, default_format)
    for spec in formats():
        scheme = spec.compressed_tensors
        if scheme is not None and _group_meaning(scheme.group(targets, size), None) == wanted:
            return spec
    raise UnsupportedFormatError(
        f"{source}: config group {dict(group)!r} is no registered format's compressed-tensors "
        "scheme; register its FormatSpec (with a CompressedTensorsScheme) before loading"
    )
