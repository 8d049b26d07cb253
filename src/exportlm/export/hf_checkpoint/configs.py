"""The checkpoint's configuration files, in the two supported formats.

* ModelOpt (``format="modelopt"``; vLLM, TensorRT-LLM, SGLang):
  ``hf_quant_config.json`` ``{"producer", "quantization": {quant_algo,
  kv_cache_quant_algo, exclude_modules, ...}}`` and the same information as
  ``config.json``'s ``quantization_config`` (``quant_method: "modelopt"``).
* compressed-tensors (``format="compressed-tensors"``; transformers): one
  ``config_groups`` group in ``config.json``'s ``quantization_config`` (FP8
  per-tensor ``float-quantized`` of the built-ins).

Every format-specific field comes from the format's
:class:`~exportlm.quant.formats.FormatSpec` (``modelopt`` / ``compressed_tensors``
/ ``kv_cache`` schemes), so a registered format is written like a built-in one.

Module names in every list are the saved ones (:func:`~exportlm.export.hf_checkpoint.naming.module_namer`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from exportlm.errors import UnknownNameError, UnsupportedFormatError

if TYPE_CHECKING:
    from exportlm.quant.formats import FormatSpec

__all__ = [
    "CHECKPOINT_FORMATS",
    "HF_QUANT_CONFIG_NAME",
    "MIXED_PRECISION",
    "compressed_tensors_quantization_config",
    "modelopt_quantization_config",
    "quantization_section",
    "write_configs",
]

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
#: ``format=`` values: the ModelOpt layout, or compressed-tensors' (FP8 ``float-quantized``
#: of the built-ins).
CHECKPOINT_FORMATS = ("modelopt", "compressed-tensors")

#: ``quant_algo`` of a model whose layers use more than one format (``quantized_layers``).
MIXED_PRECISION = "MIXED_PRECISION"


def _weight_format(quant_algo: str) -> FormatSpec:
    """The spec of ModelOpt ``quant_algo``; :class:`UnsupportedFormatError` when none has it."""
    from exportlm.quant.formats import format_for_quant_algo

    try:
        return format_for_quant_algo(quant_algo)
    except UnknownNameError as err:
        raise UnsupportedFormatError(
            f"no registered quantization format writes quant_algo {quant_algo!r} (known: "
            f"{', '.join(err.available) or 'none'}); register its FormatSpec with "
            "exportlm.quant.register_format"
        ) from err


def _kv_cache_format(kv_cache_quant_algo: str) -> FormatSpec:
    """The spec whose KV-cache recipe writes ``kv_cache_quant_algo``."""
    from exportlm.quant.formats import format_for_kv_cache_algo

    try:
        return format_for_kv_cache_algo(kv_cache_quant_algo)
    except UnknownNameError as err:
        raise UnsupportedFormatError(
            f"no registered quantization format writes kv_cache_quant_algo "
            f"{kv_cache_quant_algo!r} (known: {', '.join(err.available) or 'none'}); register "
            "its FormatSpec (with a KVCacheScheme) with exportlm.quant.register_format"
        ) from err


def quantization_section(
    summary: Any, saved_module: Callable[[str], str | None] = lambda m: m
) -> dict[str, Any] | None:
    """The ``quantization`` section of ``hf_quant_config.json``; ``None`` for an unquantized model.

    Module names (``exclude_modules``, ``quantized_layers``) are mapped with
    ``saved_module`` to the prefixes of the tensors the checkpoint saves (modules it
    does not save are left out, except a tied module such as ``lm_head``: ModelOpt
    lists it as excluded under its own name too).

    One format: its ``quant_algo`` with the format's layer fields, ``group_size`` and
    ``exclude_modules``. Several (``MIXED_PRECISION``): ``quantized_layers`` in the
    model's module order (stacked experts as one entry, their experts module) and no
    ``exclude_modules``, as ModelOpt 0.47 writes it (``config.json``'s ``ignore`` is
    then empty).
    """
    quant_algo = getattr(summary, "quant_algo", None)
    kv_algo = getattr(summary, "kv_cache_quant_algo", None)
    if quant_algo is None and kv_algo is None:
        return None
    excluded_modules = list(getattr(summary, "exclude_modules", None) or [])
    excluded = {saved_module(m) for m in excluded_modules}
    # A tied module (lm_head) saves its weight under its source's name; ModelOpt lists the
    # tied module itself as excluded too, and so do we (``tied_aliases`` of the namer).
    aliases: frozenset[str] = getattr(saved_module, "tied_aliases", frozenset())
    excluded.update(m for m in excluded_modules if m in aliases)
    section: dict[str, Any] = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo}
    if quant_algo == MIXED_PRECISION:
        # As ModelOpt 0.47: the layers in the model's order (``config_groups`` are numbered
        # by first appearance) and no ``exclude_modules``: a layer not listed is unquantized.
        # Split stacked experts are listed as their experts module, as ModelOpt lists
        # them (and as serving engines name a fused-MoE layer), not per expert linear.
        layers = dict(getattr(summary, "quantized_layers", None) or {})
        split = dict(getattr(summary, "canonical_modules", None) or {})
        listed: dict[str, dict[str, Any]] = {}
        for layer, cfg in layers.items():
            name = saved_module(split[layer].module) if layer in split else saved_module(layer)
            if name:
                listed.setdefault(name, dict(cfg))
        section["quantized_layers"] = listed
        return section
    section["exclude_modules"] = sorted(m for m in excluded if m is not None)
    group_size = getattr(summary, "group_size", None)
    if group_size:
        section["group_size"] = group_size
    if quant_algo is not None:
        scheme = _weight_format(quant_algo).modelopt
        section.update(copy.deepcopy(dict(scheme.layer_fields if scheme else {})))
    return section


def _producer() -> dict[str, str]:
    from exportlm import __version__

    return {"name": "exportlm", "version": __version__}


def modelopt_quantization_config(quant: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for the ModelOpt layout (as ModelOpt writes it)."""
    algo = quant.get("quant_algo")
    config: dict[str, Any] = {}
    if algo == MIXED_PRECISION:
        by_config: dict[tuple[tuple[str, Any], ...], list[str]] = {}
        for layer, cfg in quant.get("quantized_layers", {}).items():
            by_config.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        groups = {}
        for i, (key, layers) in enumerate(by_config.items()):
            cfg = dict(key)
            groups[f"group_{i}"] = {
                **_group_config(cfg["quant_algo"], cfg.get("group_size")),
                "targets": sorted(layers),
            }
        config["config_groups"] = groups
        config["quantized_layers"] = quant.get("quantized_layers", {})
    elif algo is not None and _writes_config_groups(algo):
        config["config_groups"] = {
            "group_0": {**_group_config(algo, quant.get("group_size")), "targets": ["Linear"]}
        }
    config["ignore"] = list(quant.get("exclude_modules") or [])
    if algo:
        config["quant_algo"] = algo
    kv = quant.get("kv_cache_quant_algo")
    if kv:
        kv_scheme = _kv_cache_format(kv).kv_cache
        config["kv_cache_scheme"] = dict(kv_scheme.modelopt) if kv_scheme else kv
    config["producer"] = _producer()
    config["quant_method"] = "modelopt"
    return config


def _writes_config_groups(algo: str) -> bool:
    """ModelOpt writes ``config_groups`` for a single-format checkpoint of ``algo``."""
    scheme = _weight_format(algo).modelopt
    return scheme is not None and scheme.config_groups


def _group_config(algo: str, group_size: int | None) -> dict[str, Any]:
    """A ``config_groups`` group of ``algo`` as ModelOpt writes it (the spec's fields)."""
    return _weight_format(algo).modelopt_group(group_size)


def compressed_tensors_quantization_config(quant: Mapping[str, Any]) -> dict[str, Any]:
    """``quantization_config`` in compressed-tensors' layout.

    The weight format (and the KV-cache format) must declare a compressed-tensors
    scheme (:class:`~exportlm.quant.formats.CompressedTensorsScheme`; of the
    built-ins, FP8 per-tensor ``float-quantized``); one group targets every ``Linear``.
    """
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    weights = None if algo is None else _compressed_tensors_weight_format(algo)
    kv_args: Mapping[str, Any] | None = None
    top_format = (
        weights.compressed_tensors.format if weights and weights.compressed_tensors else None
    )
    if kv is not None:
        kv_spec = _kv_cache_format(kv)
        kv_args = kv_spec.kv_cache.compressed_tensors if kv_spec.kv_cache else None
        if kv_args is None or kv_spec.compressed_tensors is None:
            raise UnsupportedFormatError(
                f"format='compressed-tensors' cannot hold kv_cache_quant_algo {kv!r}: its "
                f"format {kv_spec.name!r} declares no compressed-tensors KV-cache scheme; use "
                "format='modelopt'"
            )
        top_format = top_format or kv_spec.compressed_tensors.format
    groups = {}
    if weights is not None and weights.compressed_tensors is not None:
        groups["group_0"] = weights.compressed_tensors.group(["Linear"])
    ignore = [_ct_ignore_entry(m) for m in quant.get("exclude_modules") or []]
    return {
        "quant_method": "compressed-tensors",
        "format": top_format,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None if kv_args is None else dict(kv_args),
    }


def _compressed_tensors_weight_format(algo: str) -> FormatSpec:
    """The spec of ``algo``, refused when compressed-tensors' layout cannot hold it."""
    from exportlm.quant.formats import formats

    writable = " / ".join(s.name.upper() for s in formats() if s.compressed_tensors is not None)
    spec = None if algo == MIXED_PRECISION else _weight_format(algo)
    if spec is None or spec.compressed_tensors is None:
        raise UnsupportedFormatError(
            f"format='compressed-tensors' writes {writable} only (one format for every "
            f"quantized layer), but the model is quantized as {algo!r}; use format='modelopt' "
            "or quantize with a format that declares a compressed-tensors scheme"
        )
    return spec


def _ct_ignore_entry(pattern: str) -> str:
    """A ModelOpt wildcard (``*.mlp.gate``) becomes a compressed-tensors ``re:`` pattern."""
    if "*" not in pattern:
        return pattern
    return "re:" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"


def write_configs(
    model: Any,
    directory: Path,
    dtype: torch.dtype | None,
    quant: dict[str, Any] | None,
    format: str,
) -> None:
    """config.json (+ quantization_config), generation_config.json, hf_quant_config.json."""
    config: Any = copy.deepcopy(
        model.config
    )  # save_pretrained mutates the model's config; we do not
    model_dtype = dtype or _floating_dtype(model)
    config.dtype = str(model_dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    if quant is not None:
        config.quantization_config = (
            compressed_tensors_quantization_config(quant)
            if format == "compressed-tensors"
            else modelopt_quantization_config(quant)
        )
        if format == "modelopt":
            hf_quant = {"producer": _producer(), "quantization": quant}
            (directory / HF_QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant, indent=4) + "\n")
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    generation_config = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(directory)


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
