"""Which quantization format each stored tensor is in, as the checkpoint's configs declare it.

* ModelOpt layout: ``hf_quant_config.json`` (or, without it, ``config.json``'s
  ``quantization_config`` with ``quant_method: "modelopt"``) names one
  ``quant_algo``, or ``MIXED_PRECISION`` with ``quantized_layers`` (layer ->
  ``quant_algo``), and the KV cache's ``kv_cache_quant_algo`` (``config.json``:
  ``kv_cache_scheme``).
* compressed-tensors: ``config.json``'s ``quantization_config`` holds
  ``config_groups`` and a ``kv_cache_scheme``.
* finegrained-fp8 (DeepSeek-V3, Qwen3-FP8): ``quant_method: "fp8"`` with square
  ``weight_block_size`` tiles: the one registered format with a ``finegrained_fp8``
  scheme, its tile scales checked against that size (:meth:`StoredFormats.check_tiles`).

The configs are read by the checkpoint room's one reader
(:func:`exportlm.checkpoint.read_declaration`); this module maps its declaration to
formats, strictly (an unknown name is an error). Each name maps to a registered
:class:`~exportlm.quant.formats.FormatSpec` (``format_for_quant_algo``, or the spec
whose scheme means what the stored one does), so a
format registered with :func:`~exportlm.quant.register_format` is read like a
built-in one. Where a checkpoint declares nothing for a layer, the format is the
one registered spec whose stored dtype and weight leaves match what is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exportlm.checkpoint import (
    HF_QUANT_CONFIG_NAME,
    ConfigGroup,
    FineGrainedFP8,
    QuantArgs,
    Section,
    config_group,
    quant_args,
    read_declaration,
)
from exportlm.errors import MalformedCheckpointError, UnknownNameError, UnsupportedFormatError
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    CheckpointLayout,
    FormatSpec,
    format_for_kv_cache_algo,
    format_for_quant_algo,
    formats,
)

__all__ = ["StoredFormats"]

_CONFIG_WHERE = "config.json quantization_config"


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
        tile: the tile edge the configs declare for tile-granular scales
            (``weight_block_size``), ``None``: read from the scales' shape.
    """

    weights: FormatSpec | None = None
    layers: Mapping[str, FormatSpec] = field(default_factory=dict)
    kv_cache: FormatSpec | None = None
    source: str = "the checkpoint"
    layout: CheckpointLayout = CHECKPOINT_LAYOUTS["modelopt"]
    tile: int | None = None

    @classmethod
    def read(cls, directory: Path) -> StoredFormats:
        """What ``directory``'s ``hf_quant_config.json`` / ``config.json`` declare
        (read by :func:`exportlm.checkpoint.read_declaration`)."""
        declared = read_declaration(directory)
        if declared.hf_quant is not None:
            section = declared.hf_quant
            kv = section.kv_cache_quant_algo
            return cls._modelopt(section, _kv_by_algo(str(kv)) if kv else None)
        config = declared.config
        if config is None or config.quant_method is None:
            return cls(source=_CONFIG_WHERE)
        if config.layout == "modelopt":
            return cls._modelopt(config, _kv_by_scheme(config, "modelopt"))
        if config.layout == "compressed-tensors":
            return cls._compressed_tensors(config)
        if config.layout == "finegrained-fp8" and config.finegrained is not None:
            return cls._finegrained(config, config.finegrained)
        if config.layout == "gpt-oss-mxfp4":
            return cls._one_holder(config, CHECKPOINT_LAYOUTS["gpt-oss-mxfp4"])
        raise UnsupportedFormatError(
            f"{directory / 'config.json'}: quant_method {config.quant_method!r} cannot be read; "
            "the hf_checkpoint runtime reads 'modelopt', 'compressed-tensors', 'fp8' "
            "(block-wise) and 'mxfp4' (gpt-oss) checkpoints"
        )

    @classmethod
    def _one_holder(cls, config: Section, layout: CheckpointLayout) -> StoredFormats:
        """A layout of one format (gpt-oss-mxfp4's ``mxfp4``): the one registered format it holds."""
        holders = [spec for spec in formats() if layout.holds(spec)]
        if len(holders) != 1:
            raise UnsupportedFormatError(
                f"{config.source}: quant_method {config.quant_method!r} is stored by "
                f"{len(holders)} registered formats ({', '.join(s.name for s in holders) or 'none'})"
                f"; exactly one must declare a {layout.scheme} scheme"
            )
        return cls(weights=holders[0], source=config.source, layout=layout)

    @classmethod
    def _finegrained(cls, config: Section, fields: FineGrainedFP8) -> StoredFormats:
        """``quant_method: "fp8"``: the format whose ``finegrained_fp8`` scheme it is.

        Its fields passed the loaders' rules already (``exportlm.inspection``'s
        ``config-field-invalid``); what they allow but the format does not store is
        refused here, naming the field.
        """
        layout, source = CHECKPOINT_LAYOUTS["finegrained-fp8"], config.source
        holders = [spec for spec in formats() if layout.holds(spec)]
        if len(holders) != 1:
            raise UnsupportedFormatError(
                f"{source}: quant_method 'fp8' is stored by {len(holders)} registered formats "
                f"({', '.join(s.name for s in holders) or 'none'}); exactly one must declare "
                "a FineGrainedFP8Scheme"
            )
        spec = holders[0]
        scheme = spec.finegrained_fp8
        unread = {
            "weight_block_size": "null (per-tensor scales)" if fields.block_size_null else None,
            "activation_scheme": None
            if scheme is None or fields.activation_scheme == scheme.activation_scheme
            else fields.activation_scheme,
            "scale_fmt": None if fields.scale_fmt in (None, "float") else fields.scale_fmt,
            "expert_dtype": None if fields.expert_dtype in (None, "fp8") else fields.expert_dtype,
            "store_dtype": fields.store_dtype,
            "modules_to_convert": fields.modules_to_convert or None,
        }
        for key, value in unread.items():
            if value is not None:
                raise UnsupportedFormatError(
                    f"{source}: quant_method 'fp8' with {key} {value!r} is a checkpoint the "
                    f"hf_checkpoint runtime does not read (it reads {spec.name}: float32 "
                    "weight_scale_inv per square tile of FP8 weights, inputs quantized per "
                    "group at run time)"
                )
        if fields.block is None:
            raise UnsupportedFormatError(
                f"{source}: weight_block_size {fields.weight_block_size!r} is not square; "
                f"{spec.name} stores square tiles"
            )
        return cls(weights=spec, source=source, layout=layout, tile=fields.block)

    def check_tiles(self, where: str, spec: FormatSpec, leaves: Mapping[str, torch.Tensor]) -> None:
        """Refuse tile scales that are not ``[ceil(out / b), in / b]`` for the declared edge ``b``.

        ``leaves``: one weight's stored leaves (stored names); ``where``: its codes'
        tensor name. Read per another tile, every scale would multiply the wrong block.
        """
        if self.tile is None or spec.granularity != "tile":
            return
        stored = self.layout.weight_leaves(spec)
        codes = leaves.get(next(leaf.name for leaf in stored if leaf.kind == "codes"))
        scales = [leaf.name for leaf in stored if leaf.kind == "scale" and leaf.name in leaves]
        if codes is None or not scales:
            return  # a missing leaf is the format's own refusal
        *lead, rows, cols = codes.shape
        want = (*lead, -(-rows // self.tile), -(-cols // self.tile))
        got = tuple(leaves[scales[0]].shape)
        if got != want or cols % self.tile:
            name = where.rpartition(".")[0] + "." + scales[0]
            raise MalformedCheckpointError(
                f"{name} has shape {list(got)}, but {self.source} declares weight_block_size "
                f"[{self.tile}, {self.tile}], which for a weight of shape {list(codes.shape)} "
                f"needs {list(want)} (one scale per tile, input features a multiple of "
                f"{self.tile}); the scales or the config are wrong",
                field=name,
            )

    @classmethod
    def _modelopt(cls, section: Section, kv_cache: FormatSpec | None) -> StoredFormats:
        source = section.source
        if section.mixed:
            layers = {
                layer.name: _by_algo(str(layer.quant_algo), source)
                for layer in section.quantized_layers
            }
            return cls(layers=layers, kv_cache=kv_cache, source=source)
        algo = section.quant_algo
        weights = _by_algo(str(algo), source) if algo else None
        return cls(weights=weights, kv_cache=kv_cache, source=source)

    @classmethod
    def _compressed_tensors(cls, config: Section) -> StoredFormats:
        specs = [_by_group(group, config.source) for group in config.config_groups or ()]
        # one group: every quantized layer is in its format; several: read by stored leaves
        weights = specs[0] if len(specs) == 1 else None
        return cls(
            weights=weights,
            kv_cache=_kv_by_scheme(config, "compressed_tensors"),
            source=config.source,
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


def _kv_by_scheme(config: Section, layout: str) -> FormatSpec | None:
    """The format whose ``kv_cache.<layout>`` scheme means what ``kv_cache_scheme`` does."""
    scheme = config.kv_cache_scheme
    if scheme is None and not config.kv_cache_scheme_invalid:
        return None
    for spec in formats():
        own = getattr(spec.kv_cache, layout, None) if spec.kv_cache else None
        args = quant_args(own)
        if scheme is not None and args is not None and args.meaning() == scheme.meaning():
            return spec
    written = scheme.written if scheme is not None else config.kv_cache_scheme_invalid
    raise UnsupportedFormatError(
        f"{config.source}: kv_cache_scheme {written!r} is no registered format's KV-cache "
        "scheme; register its FormatSpec (with a KVCacheScheme) before loading"
    )


#: ``actorder`` values under which the codes are stored in column order (no ``g_idx``).
_PLAIN_ORDER = frozenset({None, False, "static"})


def _by_group(group: ConfigGroup, source: str) -> FormatSpec:
    """The format whose compressed-tensors scheme writes what ``group`` means.

    Compared by meaning (:meth:`ConfigGroup.meaning`: the weight, input and output
    args with compressed-tensors' defaults, and the group's format, else the config's),
    so another producer's defaults (llm-compressor's ``observer``, ``scale_dtype``...)
    read as ours do. An ``actorder`` that stores a ``g_idx`` permutation is refused:
    the codes would be read out of order.
    """
    weights = group.weights or QuantArgs()
    if weights.actorder not in _PLAIN_ORDER:
        raise UnsupportedFormatError(
            f"{source}: config group {group.written!r} stores its weights with "
            f"actorder={weights.actorder!r} (a weight_g_idx permutation), which the "
            "hf_checkpoint runtime does not read; export with actorder='static' or None"
        )
    wanted = group.meaning()
    for spec in formats():
        scheme = spec.compressed_tensors
        if scheme is None:
            continue
        own = config_group(group.name, scheme.group(list(group.targets), _group_size(group)))
        if own.meaning() == wanted:
            return spec
    raise UnsupportedFormatError(
        f"{source}: config group {group.written!r} is no registered format's compressed-tensors "
        "scheme; register its FormatSpec (with a CompressedTensorsScheme) before loading"
    )


def _group_size(group: ConfigGroup) -> int | None:
    """The block a group declares: its weights' group size, else (a ``block`` strategy's
    tiles, FP8_BLOCK) its inputs' group size, which the tiles' edge must equal."""
    size = (group.weights or QuantArgs()).group_size
    if size is None and group.input_activations is not None:
        size = group.input_activations.group_size
    return size if isinstance(size, int) and not isinstance(size, bool) else None
