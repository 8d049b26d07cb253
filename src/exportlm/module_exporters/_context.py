"""Per-export state: ``ExportContext``, the quant config being collected, the summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from exportlm.errors import DuplicateTensorError, ExportError
from exportlm.module_exporters._ties import TieBook
from exportlm.quant import TensorQuantizer
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    DEFAULT_LAYOUT,
    CheckpointLayout,
    ExportFormat,
    FormatSpec,
    checkpoint_layout,
    format_for_quant_algo,
)

if TYPE_CHECKING:
    from exportlm.module_exporters._base import ModuleExporter

__all__ = [
    "EXPORT_FORMATS",
    "DictSink",
    "ExpertSlice",
    "ExportContext",
    "ExportFormat",
    "LayerFacts",
    "QuantConfigCollector",
    "QuantExportSummary",
    "TensorSink",
    "qlora_saved_name",
]

#: Checkpoint layouts ``export_quantized_state`` can write (their ``format=`` names).
EXPORT_FORMATS: tuple[str, ...] = tuple(CHECKPOINT_LAYOUTS)

_LORA_PREFIX = "lora_"
_BASE_LAYER = "base_layer"


def qlora_saved_name(name: str) -> str | None:
    """The name a tensor or module is saved under in a QLoRA export, or ``None`` (dropped).

    ModelOpt's QLoRA rule: LoRA adapters (a path part starting with ``lora_``)
    are not saved, and a ``base_layer`` is saved as the module it wraps
    (``q_proj.base_layer.weight`` -> ``q_proj.weight``, ``q_proj.base_layer`` ->
    ``q_proj``). Applying it twice changes nothing.
    """
    parts = name.split(".")
    if any(part.startswith(_LORA_PREFIX) for part in parts):
        return None
    return ".".join(part for part in parts if part != _BASE_LAYER)


class TensorSink(Protocol):
    """Where exported tensors go: anything with ``add(name, tensor)``."""

    def add(self, name: str, tensor: torch.Tensor) -> None: ...


class DictSink:
    """A :class:`TensorSink` that keeps every tensor in an ordered dict (tests, small models)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``name``."""
        self.tensors[name] = tensor


@dataclass(frozen=True)
class ExpertSlice:
    """Where a canonical per-expert linear (``...experts.{e}.gate_proj``) comes from.

    Attributes:
        module: the stacked-experts module's path (``model.layers.0.mlp.experts``).
        expert: the expert index ``e``.
        projection: ``"gate_proj"``, ``"up_proj"`` or ``"down_proj"``.
    """

    module: str
    expert: int
    projection: str


@dataclass(frozen=True)
class LayerFacts:
    """What an exporter records about one quantized layer: neutral facts, no config text.

    The checkpoint writer turns them into each layout's config fields (the
    :class:`~exportlm.quant.formats.FormatSpec` holds those fields).

    Attributes:
        spec: the format of the layer's weights.
        group_size: the block / group size the weights are quantized in, ``None``
            for per-tensor and per-row formats.
    """

    spec: FormatSpec
    group_size: int | None = None


def _spec_of(format: FormatSpec | str) -> FormatSpec:
    """``format`` as a spec; a string is a module's ``quant_algo`` (what exporters passed)."""
    return format if isinstance(format, FormatSpec) else format_for_quant_algo(format)


@dataclass(frozen=True)
class QuantExportSummary:
    """What an export wrote, and the facts its quantization config is built from.

    Attributes:
        exclude_modules: every linear-like module left unquantized (sorted).
        quantized_layers: ``{layer: LayerFacts}`` per quantized linear, in the
            order they were exported (canonical names for split experts).
        kv_cache: the format of the KV-cache scales, or ``None``.
        canonical_modules: ``{canonical expert linear: ExpertSlice}`` for split experts.
        tensor_names: every tensor name written, in order.
        num_bytes: total bytes written.
        tied_weights: ``{name not written: name written}`` for every tied tensor
            written once (under the tie's source name).

    Every name is the name in the checkpoint: under QLoRA, adapters are absent
    and ``base_layer`` is dropped from paths (:func:`qlora_saved_name`). The
    checkpoint configs are built from this by
    :class:`~exportlm.export.hf_checkpoint.configs.CheckpointQuantization`.
    """

    exclude_modules: tuple[str, ...]
    quantized_layers: Mapping[str, LayerFacts]
    kv_cache: FormatSpec | None
    canonical_modules: Mapping[str, ExpertSlice]
    tensor_names: tuple[str, ...]
    num_bytes: int
    tied_weights: Mapping[str, str] = field(default_factory=dict)

    @property
    def layer_formats(self) -> tuple[LayerFacts, ...]:
        """The distinct ``(format, group size)`` of the quantized layers, first seen first.

        None: nothing quantized; one: every layer alike; several: mixed precision.
        """
        return tuple(dict.fromkeys(self.quantized_layers.values()))


@dataclass
class QuantConfigCollector:
    """The quantization facts gathered while exporting (exporters record into it)."""

    layers: dict[str, LayerFacts] = field(default_factory=dict)
    kv_cache: dict[str, FormatSpec] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)
    canonical: dict[str, ExpertSlice] = field(default_factory=dict)

    def add_layer(self, name: str, format: FormatSpec | str, group_size: int | None = None) -> None:
        """Record that linear ``name`` is quantized in ``format`` (in groups of ``group_size``).

        ``format``: the weight quantizer's spec (``module.weight_quantizer.spec``);
        a string is read as the module's ``quant_algo``, which exporters written
        before :class:`LayerFacts` pass.
        """
        self.layers[name] = LayerFacts(_spec_of(format), group_size or None)

    def add_kv_cache(self, name: str, format: FormatSpec | str) -> None:
        """Record a KV-cache scale written under ``name`` in ``format``."""
        self.kv_cache[name] = _spec_of(format)

    def exclude(self, name: str) -> None:
        """Record that linear-like module ``name`` stays unquantized."""
        if name not in self.excluded:
            self.excluded.append(name)

    def summary(
        self,
        tensor_names: tuple[str, ...],
        num_bytes: int,
        *,
        saved_name: Callable[[str], str | None] = lambda name: name,
        tied_weights: Mapping[str, str] | None = None,
    ) -> QuantExportSummary:
        """Freeze the collected facts into a :class:`QuantExportSummary`.

        ``saved_name`` maps the module names exporters recorded to the names
        they are saved under (``None``: not saved, left out); ``tensor_names``
        and ``tied_weights`` are saved names already.
        """
        kv_formats = list(dict.fromkeys(_saved_keys(self.kv_cache, saved_name).values()))
        if len(kv_formats) > 1:
            names = sorted(spec.name for spec in kv_formats)
            raise ExportError(f"mixed KV-cache formats {names} cannot be exported")
        excluded = {saved_name(name) for name in self.excluded} - {None}
        return QuantExportSummary(
            exclude_modules=tuple(sorted(n for n in excluded if n is not None)),
            quantized_layers=_saved_keys(self.layers, saved_name),
            kv_cache=kv_formats[0] if kv_formats else None,
            canonical_modules=_saved_keys(self.canonical, saved_name),
            tensor_names=tensor_names,
            num_bytes=num_bytes,
            tied_weights=dict(tied_weights or {}),
        )


def _saved_keys(
    collected: Mapping[str, Any], saved_name: Callable[[str], str | None]
) -> dict[str, Any]:
    """``collected`` under saved names; entries whose module is not saved are left out."""
    saved: dict[str, Any] = {}
    for name, value in collected.items():
        new = saved_name(name)
        if new is not None:
            saved[new] = value
    return saved


@dataclass
class ExportContext:
    """The state of one export (never global).

    Every tensor goes through :meth:`emit`, which applies the checkpoint's naming
    once (:meth:`saved_name`: QLoRA adapters dropped, ``base_layer`` removed)
    and writes each tied tensor once (:attr:`ties`); :attr:`written` and the
    :meth:`summary` list the names actually written.

    Attributes:
        model: the model being exported (read, never modified).
        sink: the output being built.
        dtype: dtype of unquantized floating tensors (``None`` keeps theirs).
            Scales are always float32.
        is_qlora: the model carries LoRA adapters (dropped) around ``base_layer``s.
        format: the checkpoint layout's name (:data:`EXPORT_FORMATS`); what it
            means for the tensors is :attr:`layout`.
        quant_config: the quantization facts collected so far (in-memory module
            names; :meth:`summary` maps them to saved names).
        amax_overrides: amax values an exporter's ``prepare_moe_inputs`` decided
            (e.g. one input amax for all experts of a block), used instead of the
            quantizer's own without modifying the model.
        ties: the model's tied tensors (default: none), see
            :func:`~exportlm.module_exporters.resolve_tied_weights`.
        warned: the warnings an exporter gave once for this export (by key).
    """

    model: nn.Module
    sink: TensorSink
    dtype: torch.dtype | None = None
    is_qlora: bool = False
    format: ExportFormat = DEFAULT_LAYOUT
    quant_config: QuantConfigCollector = field(default_factory=QuantConfigCollector)
    amax_overrides: dict[TensorQuantizer, torch.Tensor] = field(default_factory=dict)
    ties: TieBook = field(default_factory=TieBook)
    warned: set[str] = field(default_factory=set)
    _written: dict[str, str] = field(default_factory=dict, repr=False)
    _num_bytes: int = field(default=0, repr=False)
    _writer: str = field(default="the export driver (a plain tensor)", repr=False)

    @contextlib.contextmanager
    def exporting(self, exporter: ModuleExporter, name: str, module: nn.Module) -> Iterator[None]:
        """Attribute every tensor emitted inside to ``exporter`` exporting ``module`` (``name``).

        The driver wraps each ``export`` call in it, so a duplicate name can say
        who wrote it the second time.
        """
        previous = self._writer
        self._writer = (
            f"module exporter {exporter.display_name!r} on {name!r} ({type(module).__name__})"
        )
        try:
            yield
        finally:
            self._writer = previous

    @property
    def layout(self) -> CheckpointLayout:
        """The checkpoint layout written (:attr:`format`): scale shapes, formats it holds."""
        return checkpoint_layout(self.format)

    def saved_name(self, name: str) -> str | None:
        """The checkpoint name of in-memory tensor or module ``name``; ``None``: not saved."""
        return qlora_saved_name(name) if self.is_qlora else name

    def emit(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (as is) under the saved name of ``name``.

        A QLoRA adapter tensor and the dropped copy of a tied quantized tensor
        are not written; a saved name written twice raises
        :class:`~exportlm.errors.DuplicateTensorError` naming both writers.
        """
        saved = self.saved_name(name)
        if saved is None:
            return
        tensor = tensor.detach()
        if self.ties.absorbs(name, tensor):
            return
        if saved in self._written:
            first = self._written[saved]
            who = (
                f"by {first}, which emits it twice: emit each name once"
                if first == self._writer
                else f"first by {first}, again by {self._writer}: when two exporters claim "
                "the same name, narrow one of them (keys, predicate)"
            )
            raise DuplicateTensorError(
                f"tensor {saved!r} was written twice, {who}. Every checkpoint tensor is "
                "written exactly once."
            )
        try:
            self.sink.add(saved, tensor)
        except DuplicateTensorError as err:
            raise DuplicateTensorError(f"{err}; the second write came from {self._writer}") from err
        self._written[saved] = self._writer
        self._num_bytes += tensor.numel() * tensor.element_size()
        self.ties.wrote(name, tensor)

    def emit_plain(self, name: str, tensor: torch.Tensor) -> None:
        """Write an unquantized tensor, cast to :attr:`dtype` when it is floating point."""
        if self.saved_name(name) is None:
            return  # not written: no cast needed
        if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.detach().to(self.dtype)
        self.emit(name, tensor)

    def emit_scale(self, name: str, scale: torch.Tensor) -> None:
        """Write a float scale in the :attr:`layout`'s dtype and shape for it
        (:meth:`~exportlm.quant.formats.CheckpointLayout.stored_scale`)."""
        if scale.dtype not in (torch.bfloat16, torch.float16):
            scale = scale.detach().to(torch.float32)
        self.emit(name, self.layout.stored_scale(scale))

    def amax_of(self, quantizer: TensorQuantizer) -> torch.Tensor | None:
        """The amax to export for ``quantizer``: an override, else its calibrated amax."""
        return self.amax_overrides.get(quantizer, quantizer.amax)

    def summary(self) -> QuantExportSummary:
        """Finish the export: check the ties, freeze what was written and the quant config."""
        self.ties.finish()
        tied: dict[str, str] = {}
        for dropped, kept in self.ties.ties.items():
            saved_dropped, saved_kept = self.saved_name(dropped), self.saved_name(kept)
            if saved_dropped and saved_kept in self._written and saved_dropped not in self._written:
                tied[saved_dropped] = saved_kept
        return self.quant_config.summary(
            self.written, self.num_bytes, saved_name=self.saved_name, tied_weights=tied
        )

    @property
    def written(self) -> tuple[str, ...]:
        """Names written so far (checkpoint names), in order."""
        return tuple(self._written)

    @property
    def num_bytes(self) -> int:
        """Bytes written so far."""
        return self._num_bytes
