"""One checkpoint from many exports: prefixed sinks and the merged export summary.

The streaming export runs the ordinary driver
(:func:`~exportlm.module_exporters.export_quantized_state`) once per decoder layer
(names relative to the layer) and twice on the model's shell (the modules around the
layers, once before them and once after). :class:`PrefixSink` and :class:`PhaseSink`
route those tensors into the one checkpoint sink under their full names, in the order
the in-memory export writes them; :func:`merge_summaries` puts the per-part
:class:`~exportlm.module_exporters.QuantExportSummary` records together, as the one
summary an in-memory export of the whole model returns.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from exportlm.module_exporters import ExpertSlice, QuantExportSummary, TensorSink

__all__ = ["PhaseSink", "PrefixSink", "SummaryPart", "merge_summaries"]


class PrefixSink:
    """A sink that writes every tensor under ``prefix + name`` into ``sink``."""

    def __init__(self, sink: TensorSink, prefix: str) -> None:
        self._sink = sink
        self._prefix = prefix

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Forward ``tensor`` under its full name."""
        self._sink.add(self._prefix + name, tensor)


class PhaseSink:
    """A sink for the shell's export: only the names of this phase reach ``sink``.

    The shell holds every module outside the decoder layers; the modules of the other
    phase are still on the ``meta`` device and their tensors are dropped here, unread.
    """

    def __init__(self, sink: TensorSink, names: Collection[str]) -> None:
        self._sink = sink
        self._names = frozenset(names)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Forward ``tensor`` when its name belongs to this phase."""
        if name in self._names:
            self._sink.add(name, tensor)


@dataclass
class SummaryPart:
    """One export of the driver: its summary and the module prefix its names lack."""

    summary: QuantExportSummary
    prefix: str = ""
    written: Collection[str] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """What resuming needs of a finished layer (formats by name)."""
        s = self.summary
        return {
            "prefix": self.prefix,
            "exclude": list(s.exclude_modules),
            "layers": [[n, f.spec.name, f.group_size] for n, f in s.quantized_layers.items()],
            "kv": s.kv_cache.name if s.kv_cache is not None else None,
            "tensors": list(s.tensor_names),
            "bytes": s.num_bytes,
            "tied": dict(s.tied_weights),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SummaryPart:
        """The part :meth:`to_json` wrote."""
        from exportlm.module_exporters import LayerFacts
        from exportlm.quant import get_format

        summary = QuantExportSummary(
            exclude_modules=tuple(data["exclude"]),
            quantized_layers={n: LayerFacts(get_format(f), g) for n, f, g in data["layers"]},
            kv_cache=get_format(data["kv"]) if data["kv"] else None,
            canonical_modules={},
            tensor_names=tuple(data["tensors"]),
            num_bytes=int(data["bytes"]),
            tied_weights=dict(data["tied"]),
        )
        return cls(summary, str(data["prefix"]))


def merge_summaries(
    head: SummaryPart, layers: Sequence[SummaryPart], tail: SummaryPart
) -> QuantExportSummary:
    """The summary of the whole model: the shell's facts (head and tail), the layers' prefixed.

    ``head`` and ``tail`` are exports of the same shell, so their excluded modules and
    ties are the same; the tensors each wrote are those its phase kept (``written``).
    """
    excluded = set(head.summary.exclude_modules)
    quantized: dict[str, Any] = {}
    canonical: dict[str, ExpertSlice] = {}
    names: list[str] = [n for n in head.summary.tensor_names if n in head.written]
    for part in layers:
        s, p = part.summary, part.prefix
        excluded.update(p + m for m in s.exclude_modules)
        quantized.update({p + n: facts for n, facts in s.quantized_layers.items()})
        canonical.update(
            {
                p + n: ExpertSlice(p + e.module, e.expert, e.projection)
                for n, e in s.canonical_modules.items()
            }
        )
        names.extend(p + n for n in s.tensor_names)
    names.extend(n for n in tail.summary.tensor_names if n in tail.written)
    kv = next((p.summary.kv_cache for p in layers if p.summary.kv_cache is not None), None)
    return QuantExportSummary(
        exclude_modules=tuple(sorted(excluded)),
        quantized_layers=quantized,
        kv_cache=kv,
        canonical_modules=canonical,
        tensor_names=tuple(names),
        num_bytes=sum(p.summary.num_bytes for p in layers),
        tied_weights=dict(head.summary.tied_weights),
    )
