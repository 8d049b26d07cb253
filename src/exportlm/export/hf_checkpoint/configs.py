"""The checkpoint's configuration files, in the two supported layouts, from one builder.

:class:`CheckpointQuantization` is built once from the layer facts the module
exporters recorded (:class:`~exportlm.module_exporters.LayerFacts`: each layer's
:class:`~exportlm.quant.formats.FormatSpec` and group size) and writes:

* ModelOpt (``format="modelopt"``; vLLM, TensorRT-LLM, SGLang):
  ``hf_quant_config.json`` ``{"producer", "quantization": {quant_algo,
  kv_cache_quant_algo, exclude_modules, ...}}`` (:meth:`~CheckpointQuantization.hf_quant_config`)
  and the same information as ``config.json``'s ``quantization_config``
  (``quant_method: "modelopt"``, :meth:`~CheckpointQuantization.modelopt_config`).
* compressed-tensors (``format="compressed-tensors"``; transformers, vLLM): one
  ``config_groups`` group in ``config.json``'s ``quantization_config``
  (:meth:`~CheckpointQuantization.compressed_tensors_config`; of the built-ins FP8
  ``float-quantized``, INT4 group and INT8 channel ``pack-quantized``, NVFP4
  ``nvfp4-pack-quantized``).
* finegrained-fp8 (``format="finegrained-fp8"``; transformers' ``FineGrainedFP8Config``,
  vLLM's ``Fp8Config``): ``quant_method: "fp8"`` with ``weight_block_size``
  (:meth:`~CheckpointQuantization.finegrained_fp8_config`, the spec's
  ``finegrained_fp8`` fields).

The layout's ``scheme`` picks the builder (:meth:`~CheckpointQuantization.quantization_config`)
and its ``hf_quant_config`` whether ModelOpt's file is written too.

Every format-specific field comes from the format's spec: a layer's ModelOpt entry
is :meth:`FormatSpec.modelopt_layer_config`, a ModelOpt ``config_groups`` group
:meth:`FormatSpec.modelopt_group`, a compressed-tensors group
``spec.compressed_tensors.group``, the KV cache ``spec.kv_cache``; so a registered
format is written like a built-in one.

Module names in every list are the saved ones (:func:`~exportlm.export.hf_checkpoint.naming.module_namer`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm._version import __version__
from exportlm.checkpoint import HF_QUANT_CONFIG_NAME
from exportlm.errors import UnsupportedFormatError
from exportlm.module_exporters import LayerFacts, QuantExportSummary
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    MIXED_PRECISION,
    CheckpointLayout,
    CompressedTensorsScheme,
    FormatSpec,
    KVCacheScheme,
    checkpoint_layout,
)
from exportlm.quant.formats import formats as registered_formats

__all__ = [
    "CHECKPOINT_FORMATS",
    "HF_QUANT_CONFIG_NAME",
    "MIXED_PRECISION",
    "CheckpointQuantization",
    "quantization_section",
    "write_configs",
]

#: ``format=`` values: the ModelOpt layout, compressed-tensors', finegrained-fp8.
CHECKPOINT_FORMATS = tuple(CHECKPOINT_LAYOUTS)

SavedModule = Callable[[str], "str | None"]


def _same(module: str) -> str | None:
    return module


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's configs declare about its quantization, under saved names.

    Attributes:
        formats: the distinct layer facts (format, group size) of every quantized
            layer, first seen first: one (or none) writes that format's fields,
            several ``MIXED_PRECISION``.
        layers: ``{saved layer: facts}`` in the model's module order; split
            stacked experts as one entry, their experts module (as ModelOpt lists
            them, and as serving engines name a fused-MoE layer).
        kv_cache: the format of the KV-cache scales, or ``None``.
        exclude_modules: the saved unquantized linear-like modules (sorted).
    """

    formats: tuple[LayerFacts, ...]
    layers: Mapping[str, LayerFacts]
    kv_cache: FormatSpec | None
    exclude_modules: tuple[str, ...]

    @classmethod
    def of(
        cls, summary: QuantExportSummary, saved_module: SavedModule = _same
    ) -> CheckpointQuantization:
        """The quantization of ``summary``, its module names mapped with ``saved_module``.

        ``saved_module`` maps to the prefixes of the tensors the checkpoint saves
        (modules it does not save are left out, except a tied module such as
        ``lm_head``: ModelOpt lists it as excluded under its own name too).
        """
        excluded = {saved_module(m) for m in summary.exclude_modules}
        # A tied module (lm_head) saves its weight under its source's name; ModelOpt lists the
        # tied module itself as excluded too, and so do we (``tied_aliases`` of the namer).
        aliases: frozenset[str] = getattr(saved_module, "tied_aliases", frozenset())
        excluded.update(m for m in summary.exclude_modules if m in aliases)
        split = summary.canonical_modules
        layers: dict[str, LayerFacts] = {}
        for layer, facts in summary.quantized_layers.items():
            name = saved_module(split[layer].module if layer in split else layer)
            if name:
                layers.setdefault(name, facts)
        return cls(
            formats=summary.layer_formats,
            layers=layers,
            kv_cache=summary.kv_cache,
            exclude_modules=tuple(sorted(m for m in excluded if m is not None)),
        )

    @property
    def quantized(self) -> bool:
        """Anything is quantized: weights or the KV cache."""
        return bool(self.formats) or self.kv_cache is not None

    @property
    def mixed(self) -> bool:
        """The layers use more than one format (or group size)."""
        return len(self.formats) > 1

    @property
    def quant_algo(self) -> str | None:
        """ModelOpt's ``quant_algo``: the one format's, ``MIXED_PRECISION``, or ``None``."""
        if not self.formats:
            return None
        if self.mixed:
            return MIXED_PRECISION
        return str(_layer_config(self.formats[0])["quant_algo"])

    @property
    def kv_cache_quant_algo(self) -> str | None:
        """ModelOpt's ``kv_cache_quant_algo``, or ``None``."""
        return None if self.kv_cache is None else _kv_scheme(self.kv_cache).quant_algo

    def hf_quant_config(self) -> dict[str, Any]:
        """The ``quantization`` section of ModelOpt's ``hf_quant_config.json``.

        One format: its layer config (``quant_algo``, ``group_size``, the spec's
        layer fields) with ``kv_cache_quant_algo`` and ``exclude_modules``. Several:
        ``quant_algo: MIXED_PRECISION`` and ``quantized_layers`` in the model's
        module order, and no ``exclude_modules`` (a layer not listed is
        unquantized), as ModelOpt 0.47 writes it (``process_layer_quant_config``).
        """
        section: dict[str, Any] = {
            "quant_algo": self.quant_algo,
            "kv_cache_quant_algo": self.kv_cache_quant_algo,
        }
        if self.mixed:
            section["quantized_layers"] = {n: _layer_config(f) for n, f in self.layers.items()}
            return section
        section["exclude_modules"] = list(self.exclude_modules)
        if self.formats:
            layer = _layer_config(self.formats[0])
            section.update((k, v) for k, v in layer.items() if k != "quant_algo")
        return section

    def modelopt_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` for the ModelOpt layout (as ModelOpt writes it).

        ``config_groups``: mixed precision one group per distinct layer config,
        numbered by first appearance, targets the layer names (plus
        ``quantized_layers``); one format a ``Linear`` group when its spec says
        ModelOpt writes one (``ModelOptScheme.config_groups``).
        """
        config: dict[str, Any] = {}
        if self.mixed:
            by_facts: dict[LayerFacts, list[str]] = {}
            for layer, facts in self.layers.items():
                by_facts.setdefault(facts, []).append(layer)
            config["config_groups"] = {
                f"group_{i}": {**_group_config(facts), "targets": sorted(layers)}
                for i, (facts, layers) in enumerate(by_facts.items())
            }
            config["quantized_layers"] = self.hf_quant_config()["quantized_layers"]
        elif self.formats and _writes_config_groups(self.formats[0].spec):
            config["config_groups"] = {
                "group_0": {**_group_config(self.formats[0]), "targets": ["Linear"]}
            }
        config["ignore"] = [] if self.mixed else list(self.exclude_modules)
        if self.quant_algo:
            config["quant_algo"] = self.quant_algo
        if self.kv_cache is not None:
            config["kv_cache_scheme"] = dict(_kv_scheme(self.kv_cache).modelopt)
        config["producer"] = _producer()
        config["quant_method"] = "modelopt"
        return config

    def compressed_tensors_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` in compressed-tensors' layout.

        The weight format (and the KV-cache format) must declare a compressed-tensors
        scheme (:class:`~exportlm.quant.formats.CompressedTensorsScheme`); one group
        targets every ``Linear``, with the layers' group size.
        """
        weights = self._compressed_tensors_weights()
        kv_args: Mapping[str, Any] | None = None
        top_format = weights.format if weights is not None else None
        if self.kv_cache is not None:
            kv_spec = self.kv_cache
            kv_args = _kv_scheme(kv_spec).compressed_tensors
            if kv_args is None or kv_spec.compressed_tensors is None:
                raise UnsupportedFormatError(
                    f"format='compressed-tensors' cannot hold kv_cache_quant_algo "
                    f"{self.kv_cache_quant_algo!r}: its format {kv_spec.name!r} declares no "
                    "compressed-tensors KV-cache scheme; use format='modelopt'"
                )
            top_format = top_format or kv_spec.compressed_tensors.format
        group_size = self.formats[0].group_size if self.formats else None
        groups = {"group_0": weights.group(["Linear"], group_size)} if weights is not None else {}
        return {
            "quant_method": "compressed-tensors",
            "format": top_format,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": [_ct_ignore_entry(m) for m in self.exclude_modules],
            "kv_cache_scheme": None if kv_args is None else dict(kv_args),
        }

    def finegrained_fp8_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` in DeepSeek-V3's / Qwen3-FP8's layout.

        ``quant_method: "fp8"``, ``activation_scheme: "dynamic"``, ``weight_block_size``
        the layers' tiles and ``modules_to_not_convert`` the unquantized linears
        (:meth:`FineGrainedFP8Scheme.config`). One format with that scheme for every
        quantized layer (``fp8_block`` of the built-ins), and no KV-cache scales.
        """
        scheme, block = self._sole_scheme(
            CHECKPOINT_LAYOUTS["finegrained-fp8"],
            "(quant_method 'fp8' with weight_block_size) holds one block-wise format for every "
            "quantized layer ({})",
            "format='compressed-tensors' or format='modelopt'",
            needs_block=True,
        )
        not_converted = [_transformers_pattern(m) for m in self.exclude_modules]
        return dict(scheme.config(block, not_converted))

    def gpt_oss_mxfp4_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` as openai/gpt-oss ships it.

        ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``: one format with a
        ``gpt_oss_mxfp4`` scheme (``mxfp4``) for every quantized layer, no KV-cache scales.
        """
        scheme, _ = self._sole_scheme(
            CHECKPOINT_LAYOUTS["gpt-oss-mxfp4"],
            "(quant_method 'mxfp4') holds the experts in {}",
            "format='modelopt'",
        )
        return dict(scheme.config([_transformers_pattern(m) for m in self.exclude_modules]))

    def _sole_scheme(
        self, layout: CheckpointLayout, holds: str, instead: str, needs_block: bool = False
    ) -> tuple[Any, int | None]:
        """The ``layout.scheme`` scheme of the one format of every quantized layer and its block
        (group size, else the format's): a layout of one format and no KV cache. Else refused
        (also without a block where ``needs_block``), saying what the layout ``holds`` (``{}``:
        the formats it holds) and the layouts to use ``instead``."""
        spec = self.formats[0].spec if len(self.formats) == 1 else None
        scheme = getattr(spec, layout.scheme) if spec is not None and layout.scheme else None
        block = (self.formats[0].group_size or spec.block_size) if spec is not None else None
        if scheme is None or (needs_block and not block) or self.kv_cache is not None:
            holders = " / ".join(s.name for s in registered_formats() if layout.holds(s))
            what = f"the KV cache as {self.kv_cache.name!r}" if self.kv_cache else None
            raise UnsupportedFormatError(
                f"format={layout.name!r} {holds.format(holders)} and no KV-cache scales, but the "
                f"model quantizes {what or repr(self.quant_algo)}; use {instead}"
            )
        return scheme, block

    def quantization_config(self, layout: CheckpointLayout) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` in ``layout`` (by its ``scheme``)."""
        build = {
            None: self.modelopt_config,
            "compressed_tensors": self.compressed_tensors_config,
            "finegrained_fp8": self.finegrained_fp8_config,
            "gpt_oss_mxfp4": self.gpt_oss_mxfp4_config,
        }[layout.scheme]
        return build()

    def _compressed_tensors_weights(self) -> CompressedTensorsScheme | None:
        """The weight format's compressed-tensors scheme; refused when the layout cannot hold it."""
        if not self.formats:
            return None
        spec = None if self.mixed else self.formats[0].spec
        if spec is None or spec.compressed_tensors is None:
            writable = " / ".join(
                s.name.upper() for s in registered_formats() if s.compressed_tensors is not None
            )
            raise UnsupportedFormatError(
                f"format='compressed-tensors' writes {writable} only (one format for every "
                f"quantized layer), but the model is quantized as {self.quant_algo!r}; use "
                "format='modelopt' or quantize with a format that declares a compressed-tensors "
                "scheme"
            )
        return spec.compressed_tensors


def quantization_section(
    summary: QuantExportSummary, saved_module: SavedModule = _same
) -> CheckpointQuantization | None:
    """The checkpoint's :class:`CheckpointQuantization`; ``None`` for an unquantized model."""
    quant = CheckpointQuantization.of(summary, saved_module)
    return quant if quant.quantized else None


def _writes_config_groups(spec: FormatSpec) -> bool:
    """ModelOpt writes ``config_groups`` for a single-format checkpoint of ``spec``."""
    return spec.modelopt is not None and spec.modelopt.config_groups


def _layer_config(facts: LayerFacts) -> dict[str, Any]:
    """A layer's ``hf_quant_config.json`` entry: the spec's, the one source of its fields."""
    return facts.spec.modelopt_layer_config(facts.group_size)


def _group_config(facts: LayerFacts) -> dict[str, Any]:
    """A ``config_groups`` group (without ``targets``) as ModelOpt writes it (the spec's fields)."""
    return facts.spec.modelopt_group(facts.group_size)


def _kv_scheme(spec: FormatSpec) -> KVCacheScheme:
    if spec.kv_cache is None:
        raise UnsupportedFormatError(
            f"the KV cache is quantized as {spec.name!r}, a format without a KV-cache scheme; "
            "register its FormatSpec with a KVCacheScheme"
        )
    return spec.kv_cache


def _producer() -> dict[str, str]:
    return {"name": "exportlm", "version": __version__}


def _ct_ignore_entry(pattern: str) -> str:
    """A ModelOpt wildcard (``*.mlp.gate``) becomes a compressed-tensors ``re:`` pattern."""
    if "*" not in pattern:
        return pattern
    return "re:" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"


def _transformers_pattern(pattern: str) -> str:
    """A ModelOpt wildcard (``*.mlp.gate``) as the regular expression transformers matches."""
    if "*" not in pattern:
        return pattern
    return ".*".join(re.escape(part) for part in pattern.split("*"))


def write_configs(
    model: Any,
    directory: Path,
    dtype: torch.dtype | None,
    quant: CheckpointQuantization | None,
    format: str,
) -> None:
    """config.json (+ quantization_config), generation_config.json, hf_quant_config.json."""
    config: Any = copy.deepcopy(
        model.config
    )  # save_pretrained mutates the model's config; we do not
    model_dtype = dtype or _floating_dtype(model)
    config.dtype = str(model_dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    layout = checkpoint_layout(format)
    if quant is not None:
        config.quantization_config = quant.quantization_config(layout)
        if layout.hf_quant_config:
            hf_quant = {"producer": _producer(), "quantization": quant.hf_quant_config()}
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
