"""The one reader of a checkpoint's quantization configs.

* ModelOpt layout: ``hf_quant_config.json`` ``{"producer", "quantization": {quant_algo,
  group_size, kv_cache_quant_algo, exclude_modules, quantized_layers}}``, or
  ``config.json``'s ``quantization_config`` with ``quant_method: "modelopt"``
  (``quant_algo``, ``quantized_layers``, ``config_groups``, ``ignore``, ``kv_cache_scheme``).
* compressed-tensors: ``config.json``'s ``quantization_config`` with ``config_groups``
  (``weights`` / ``input_activations`` / ``output_activations`` args, ``format``,
  ``targets``), ``format``, ``ignore`` and ``kv_cache_scheme``.
* finegrained-fp8 (DeepSeek-V3, Qwen3-FP8): ``config.json``'s ``quantization_config``
  with ``quant_method: "fp8"``: ``weight_block_size``, ``activation_scheme``,
  ``scale_fmt``, ``modules_to_not_convert`` / ``ignored_layers`` (:class:`FineGrainedFP8`).
* gpt-oss-mxfp4 (openai/gpt-oss): ``config.json``'s ``quantization_config`` with
  ``quant_method: "mxfp4"``: ``modules_to_not_convert`` (``Section.not_converted``).

Both files are read as untrusted input (:func:`exportlm.hfdir.read_json_object`: a
regular file, bounded, a JSON object, else :class:`~exportlm.errors.MalformedCheckpointError`
naming it). What is read is never trusted further: a value of the wrong kind is kept
as written in the model (:mod:`exportlm.checkpoint._model`) for the rules to judge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exportlm.checkpoint._model import (
    ConfigGroup,
    FineGrainedFP8,
    Listed,
    ModelOptLayer,
    QuantArgs,
    QuantizationDeclaration,
    Section,
)
from exportlm.errors import InvalidConfigError, MalformedCheckpointError
from exportlm.hfdir import CONFIG_NAME, read_config, read_json_object

__all__ = [
    "HF_QUANT_CONFIG_NAME",
    "config_group",
    "declaration_of",
    "quant_args",
    "read_declaration",
]

#: ModelOpt's quantization config beside ``config.json``.
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
_CONFIG_WHERE = "config.json quantization_config"


def quant_args(value: Any) -> QuantArgs | None:
    """A ``QuantizationArgs`` object as :class:`QuantArgs` (``None``: not an object)."""
    if not isinstance(value, Mapping):
        return None
    fields = (
        "num_bits",
        "type",
        "symmetric",
        "strategy",
        "group_size",
        "dynamic",
        "actorder",
        "block_structure",
    )
    return QuantArgs(**{name: value.get(name) for name in fields}, written=dict(value))


def config_group(name: str, value: Any, default_format: Any = None) -> ConfigGroup:
    """One ``config_groups`` entry as :class:`ConfigGroup` (its format else ``default_format``)."""
    if not isinstance(value, Mapping):
        return ConfigGroup(name, False, written=value)
    weights = value.get("weights")
    targets = value.get("targets")
    return ConfigGroup(
        name,
        True,
        format=value.get("format") or default_format,
        weights=quant_args(weights),
        input_activations=quant_args(value.get("input_activations")),
        output_activations=quant_args(value.get("output_activations")),
        weights_invalid=None if isinstance(weights, Mapping) else weights,
        targets=tuple(t for t in targets if isinstance(t, str))
        if isinstance(targets, list)
        else (),
        written=dict(value),
    )


def _names(value: Any, where: str, excluded: bool) -> tuple[Listed, ...]:
    """A JSON list (or an object's keys) of module names."""
    if isinstance(value, dict):
        value = list(value)
    if not isinstance(value, list):
        return ()
    return tuple(Listed(str(entry), where, excluded) for entry in value)


def _layers(value: Any) -> tuple[ModelOptLayer, ...]:
    if not isinstance(value, dict):
        return ()
    return tuple(
        ModelOptLayer(str(name), cfg.get("quant_algo"), cfg.get("group_size"))
        if isinstance(cfg, dict)
        else ModelOptLayer(str(name), cfg, None, is_object=False)
        for name, cfg in value.items()
    )


def _listed(
    section: Mapping[str, Any], where: str, groups: tuple[ConfigGroup, ...] | None
) -> tuple[Listed, ...]:
    """The names listed: ``exclude_modules`` and ``quantized_layers``; in ``config.json``
    also ``ignore`` and the groups' ``targets`` (``groups``: ``None`` in ``hf_quant_config.json``)."""
    in_config = groups is not None
    listed = _names(section.get("ignore"), f"{where}.ignore", True) if in_config else ()
    if in_config and section.get("quant_method") == "fp8":  # transformers' and vLLM's names
        for key in ("modules_to_not_convert", "ignored_layers"):
            listed += _names(section.get(key), f"{where}.{key}", True)
    listed += _names(section.get("exclude_modules"), f"{where}.exclude_modules", True)
    listed += _names(section.get("quantized_layers"), f"{where}.quantized_layers", False)
    for group in groups or ():
        at = f"{where}.config_groups.{group.name}.targets"
        listed += tuple(Listed(t, at, False, target=True) for t in group.targets)
    return listed


def _lists_invalid(
    section: Mapping[str, Any], where: str, file: str
) -> tuple[tuple[str, Any], ...]:
    """The name lists that are not JSON lists of strings (:attr:`Section.lists_invalid`):
    the ones the layout's loaders read, where written: ModelOpt's ``exclude_modules``
    (``hf_quant_config.json``) or ``ignore`` (``config.json``); compressed-tensors'
    ``ignore``, and each group's ``targets`` always (its ``QuantizationScheme`` requires them)."""
    method = section.get("quant_method") if file == CONFIG_NAME else "modelopt"
    keys: tuple[str, ...] = ()
    if file != CONFIG_NAME:
        keys = ("exclude_modules",)
    elif method in ("modelopt", "compressed-tensors"):
        keys = ("ignore",)
    found = [(f"{where}.{k}", section[k]) for k in keys if section.get(k) is not None]
    groups = section.get("config_groups")
    if method == "compressed-tensors" and isinstance(groups, dict):
        found += [
            (f"{where}.config_groups.{name}.targets", group.get("targets"))
            for name, group in groups.items()
            if isinstance(group, dict)
        ]
    return tuple(
        (key, value)
        for key, value in found
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value))
    )


def _finegrained(section: Mapping[str, Any], file: str) -> FineGrainedFP8 | None:
    """``quant_method: "fp8"``'s fields (``None`` for another method or file)."""
    if file != CONFIG_NAME or section.get("quant_method") != "fp8":
        return None
    return FineGrainedFP8(
        weight_block_size=section.get("weight_block_size"),
        activation_scheme=section.get("activation_scheme"),
        scale_fmt=section.get("scale_fmt"),
        expert_dtype=section.get("expert_dtype"),
        store_dtype=section.get("store_dtype"),
        modules_to_convert=section.get("modules_to_convert"),
        modules_to_not_convert=section.get("modules_to_not_convert"),
        ignored_layers=section.get("ignored_layers"),
        has_block_size="weight_block_size" in section,
    )


def _section(section: Mapping[str, Any], file: str, source: str, where: str) -> Section:
    """One file's section (``where``: its file and key as the listed names cite them)."""
    layers = section.get("quantized_layers")
    groups = section.get("config_groups")
    default_format = section.get("format")
    parsed = (
        tuple(config_group(str(name), group, default_format) for name, group in groups.items())
        if isinstance(groups, dict)
        else None
    )
    kv_scheme = section.get("kv_cache_scheme")
    return Section(
        file=file,
        source=source,
        empty=not section,
        quant_method=section.get("quant_method") if file == CONFIG_NAME else None,
        quant_algo=section.get("quant_algo"),
        group_size=section.get("group_size"),
        format=default_format,
        quantized_layers=_layers(layers),
        quantized_layers_invalid=None if isinstance(layers, dict) else layers,
        config_groups=parsed,
        config_groups_invalid=None if isinstance(groups, dict) else groups,
        kv_cache_quant_algo=section.get("kv_cache_quant_algo"),
        kv_cache_scheme=quant_args(kv_scheme) if kv_scheme else None,
        kv_cache_scheme_invalid=None if isinstance(kv_scheme, dict) else kv_scheme,
        listed=_listed(section, where, (parsed or ()) if file == CONFIG_NAME else None),
        finegrained=_finegrained(section, file),
        not_converted=section.get("modules_to_not_convert")
        if file == CONFIG_NAME and section.get("quant_method") == "mxfp4"
        else None,
        lists_invalid=_lists_invalid(section, where, file),
    )


def _producer(*sections: Any) -> str | None:
    for section in sections:
        producer = section.get("producer") if isinstance(section, dict) else None
        if isinstance(producer, dict) and isinstance(producer.get("name"), str):
            return str(producer["name"])
    return None


def declaration_of(
    config: Mapping[str, Any], hf_quant_config: Mapping[str, Any] | None = None
) -> QuantizationDeclaration:
    """The declaration of an already-read ``config.json`` and ``hf_quant_config.json``
    (``None`` or ``{}``: no such file)."""
    hf = hf_quant_config or {}
    quantization = hf.get("quantization")
    found = config.get("quantization_config")
    return QuantizationDeclaration(
        hf_quant=_section(
            quantization,
            HF_QUANT_CONFIG_NAME,
            HF_QUANT_CONFIG_NAME,
            f"{HF_QUANT_CONFIG_NAME}: quantization",
        )
        if isinstance(quantization, dict)
        else None,
        config=_section(found, CONFIG_NAME, _CONFIG_WHERE, "config.json: quantization_config")
        if isinstance(found, dict)
        else None,
        hf_quant_present=bool(hf),
        hf_quant_invalid=None if isinstance(quantization, dict) else quantization,
        config_invalid=None if isinstance(found, dict) else found,
        producer=_producer(hf, found),
    )


def read_declaration(
    directory: str | os.PathLike[str], config: Mapping[str, Any] | None = None
) -> QuantizationDeclaration:
    """The declaration of ``directory``'s ``config.json`` (or ``config``, already read from
    it) and ``hf_quant_config.json``.

    Raises :class:`~exportlm.errors.MalformedCheckpointError` naming the file when
    ``config.json`` is missing or either file is not a bounded JSON object, and
    :class:`~exportlm.errors.NotRegularFileError` for a FIFO, a device or a directory.
    """
    root = Path(directory)
    try:
        config = read_config(root) if config is None else config
    except FileNotFoundError as err:
        raise MalformedCheckpointError(
            f"{root} has no {CONFIG_NAME}: a checkpoint's quantization is declared in it; "
            "copy it along with the shards",
            path=root / CONFIG_NAME,
        ) from err
    hf_quant: dict[str, Any] = {}
    if os.path.lexists(root / HF_QUANT_CONFIG_NAME):
        hf_quant = read_json_object(
            root / HF_QUANT_CONFIG_NAME, what="ModelOpt quantization config"
        )
    return declaration_of(config, hf_quant)


def refuse_quantized_source(
    directory: str | os.PathLike[str], config: Mapping[str, Any], where: str
) -> None:
    """Refuse a quantized checkpoint where a float model's directory is the input.

    A quantized checkpoint (``quantization_config`` in ``config.json``, or ModelOpt's
    ``hf_quant_config.json``) is no model to export or quantize: transformers has no
    ModelOpt quantizer and reads its FP8 codes as plain weights without their scales
    (measured: the re-export of an exportlm FP8 checkpoint exported without an error,
    computing garbage), and compressed-tensors' modules fail inside ``quantize``.

    Raises:
        InvalidConfigError: ``where``, what declares the quantization, and what to pass.
    """
    declared = read_declaration(directory, config).declared_in
    if declared:
        raise InvalidConfigError(
            f"{where}: the model directory holds a quantized checkpoint "
            f"({' and '.join(declared)}); exportlm exports and quantizes a float model: pass "
            "the directory of the original bfloat16 / float16 / float32 model. To check or run "
            f"this checkpoint instead: `exportlm inspect {directory}`, `exportlm verify --engine "
            f"ENGINE {directory}` or exportlm.load_exported({str(directory)!r})"
        )
