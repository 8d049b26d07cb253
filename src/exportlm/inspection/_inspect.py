"""``inspect_checkpoint``: run every rule on a checkpoint directory or an ONNX file."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from exportlm.errors import InvalidInputError
from exportlm.inspection._declared import read_declared
from exportlm.inspection._e8m0 import e8m0_findings
from exportlm.inspection._files import read_checkpoint
from exportlm.inspection._fused_rows import fused_rows_findings, fused_rows_refusals
from exportlm.inspection._gpt_oss import gpt_oss_findings
from exportlm.inspection._layers import layer_findings, quantized_layers
from exportlm.inspection._onnx import onnx_findings
from exportlm.inspection._rules import RULES, Finding, Severity
from exportlm.inspection._structure import (
    config_file_findings,
    config_findings,
    file_findings,
    kv_findings,
)
from exportlm.inspection._tile_sizes import tile_size_findings, tile_size_refusals
from exportlm.inspection._values import value_findings
from exportlm.inspection._w4a8 import w4a8_findings
from exportlm.inspection._w4afp8 import w4afp8_findings, w4afp8_refusals

__all__ = ["InspectionReport", "inspect_checkpoint"]

_ORDER = {rule_id: i for i, rule_id in enumerate(RULES)}


@dataclass(frozen=True)
class InspectionReport:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: the inspected directory or file.
        kind: ``"checkpoint"`` (a Hugging Face directory) or ``"onnx"``.
        findings: every violated rule, errors first, in rule order.
        summary: what was read (tensors, shards, layout, formats; ONNX: opset, bytes).
    """

    path: Path
    kind: str
    findings: tuple[Finding, ...]
    summary: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def by_severity(self, severity: Severity) -> list[Finding]:
        """The findings of one severity."""
        return [f for f in self.findings if f.severity is severity]

    @property
    def errors(self) -> list[Finding]:
        """Error-level findings: a loader fails, or loads wrong values."""
        return self.by_severity(Severity.ERROR)

    @property
    def ok(self) -> bool:
        """No error-level finding (``exportlm inspect`` exits 0)."""
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: path, kind, ok, counts per severity, summary, findings."""
        counts = Counter(f.severity.value for f in self.findings)
        return {
            "path": str(self.path),
            "kind": self.kind,
            "ok": self.ok,
            "counts": {s.value: counts.get(s.value, 0) for s in Severity},
            "summary": dict(self.summary),
            "findings": [f.to_json() for f in self.findings],
        }


def _sorted(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    return tuple(
        sorted(findings, key=lambda f: (f.severity.rank, _ORDER.get(f.rule, 99), f.subject))
    )


def inspect_checkpoint(path: str | Path) -> InspectionReport:
    """Check ``path`` against the serving loaders' rules (:data:`RULES`).

    ``path`` is a Hugging Face checkpoint directory (safetensors shards, index,
    ``config.json``, ``hf_quant_config.json``; from any producer) or an ``.onnx``
    file. Only headers and configs are read, plus the values of scales. Every
    violated rule is a :class:`Finding`; nothing is raised for a defect of the
    checkpoint itself.

    Raises :class:`~exportlm.errors.InvalidInputError` when ``path`` does not
    exist or is neither a checkpoint directory nor an ONNX file, and
    :class:`~exportlm.errors.MissingDependencyError` for an ONNX file when
    ``onnx`` is not installed.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        findings, summary = onnx_findings(path)
        return InspectionReport(path, "onnx", _sorted(findings), MappingProxyType(summary))
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is neither a directory nor an .onnx file"
        raise InvalidInputError(
            f"{path} {what}; expected a Hugging Face checkpoint directory or an .onnx file"
        )
    checkpoint = read_checkpoint(path)
    declared = read_declared(checkpoint)
    layers = quantized_layers(checkpoint, declared)
    shapes = [
        *tile_size_refusals(layers, declared),
        *fused_rows_refusals(layers, declared),
        *w4afp8_refusals(layers),
    ]
    findings = [
        *file_findings(checkpoint),
        *config_file_findings(checkpoint),
        *config_findings(checkpoint, declared, len(layers), shapes),
        *layer_findings(checkpoint, declared),
        *kv_findings(checkpoint, declared),
        *value_findings(checkpoint, layers),
        *e8m0_findings(checkpoint, layers),
        *w4a8_findings(checkpoint, layers),
        *w4afp8_findings(layers),
        *tile_size_findings(layers, declared),
        *fused_rows_findings(layers, declared),
        *gpt_oss_findings(checkpoint, declared),
    ]
    formats = Counter(
        layer.spec.name if layer.spec else (layer.scheme.label if layer.scheme else "?")
        for layer in layers
    )
    summary = {
        "tensors": len(checkpoint.tensors),
        "shards": len(checkpoint.shards),
        "layout": declared.layout,
        "quant_method": declared.quant_method,
        "quantized_layers": dict(sorted(formats.items())),
        "kv_cache": declared.kv_cache,
    }
    return InspectionReport(path, "checkpoint", _sorted(findings), MappingProxyType(summary))
