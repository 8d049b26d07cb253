"""What a run was made of: options, library versions, CUDA and every discovered plugin.

One :func:`environment` mapping feeds the terminal header (:func:`header_lines`),
the JSON report and the JUnit XML suite properties, so they always agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest_exportcheck
from pytest_exportcheck.plan._discovery import Discovery
from pytest_exportcheck.run._cache import library_versions
from pytest_exportcheck.session.options._options import Options

__all__ = ["cuda_status", "environment", "header_lines"]

_PLURAL = {
    "target": "targets",
    "runtime": "runtimes",
    "module exporter": "module exporters",
    "model family": "model families",
    "engine": "engines",
    "quantization format": "quantization formats",
}


def cuda_status() -> str:
    """``CUDA available (Nx <device>)`` or ``CUDA not available``."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA not available"
    return f"CUDA available ({torch.cuda.device_count()}x {torch.cuda.get_device_name(0)})"


def environment(options: Options, discovery: Discovery, goldens_dir: Path) -> dict[str, Any]:
    """Options, versions, plugins and plugin failures of the run (JSON-compatible)."""
    return {
        "options": {**options.as_dict(), "goldens_dir": str(goldens_dir)},
        "environment": {
            **{n: v for n, v in library_versions()},
            "pytest_exportcheck": pytest_exportcheck.__version__,
            "cuda": cuda_status(),
        },
        "plugins": [
            {"kind": r.kind, "name": r.name, "provider": r.provider} for r in discovery.plugins
        ],
        "plugin_failures": [
            {"kind": f.kind, "name": f.name, "distribution": f.distribution, "message": f.message}
            for f in discovery.failures
        ],
    }


def header_lines(env: Mapping[str, Any], discovery: Discovery) -> list[str]:
    """The report header: options, versions and CUDA, plugins by kind and provider, failures."""
    options = " ".join(f"{k}={v}" for k, v in env["options"].items())
    versions = ", ".join(f"{n} {v or '-'}" for n, v in library_versions())
    lines = [f"exportcheck: {options}", f"exportcheck versions: {versions}; {cuda_status()}"]
    by_kind: dict[str, dict[str, list[str]]] = {}
    for record in discovery.plugins:
        by_kind.setdefault(record.kind, {}).setdefault(record.provider, []).append(record.name)
    for kind, providers in by_kind.items():
        listed = "; ".join(f"{p}: {', '.join(ns)}" for p, ns in sorted(providers.items()))
        lines.append(f"exportcheck {_PLURAL.get(kind, kind)}: {listed}")
    for failure in discovery.failures:
        what = "claims a taken name" if failure.conflict else "FAILED to load"
        lines.append(
            f"exportcheck {failure.kind} {failure.name!r} from "
            f"{failure.distribution} {what}: see plugin_loads"
        )
    return lines
