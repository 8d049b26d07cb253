"""The legacy TorchScript-based ONNX exporter (``dynamo=False``): its quirks, contained.

* It may bake shape-dependent Python values into the graph: one
  :class:`LegacyTraceWarning` per export says so when the trace recorded any.
* It ignores ``external_data=True`` below 2 GiB and writes one file per tensor
  above it; :func:`consolidate_external_data` gives its artifacts the dynamo
  exporter's one ``<file>.data`` layout.
* torch 2.13 leaves its C++ graph log switched on for the rest of the process;
  :func:`legacy_graph_log_captured` routes it into the captured noise and
  restores the switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from exportlm.export._quiet import CapturedNoise, warn_caller
from exportlm.export.job import ExportJob

__all__ = [
    "LegacyTraceWarning",
    "consolidate_external_data",
    "legacy_graph_log_captured",
    "warn_legacy_trace",
]


class LegacyTraceWarning(UserWarning):
    """The legacy ONNX exporter baked shape-dependent values into the graph (one per export)."""


@contextlib.contextmanager
def legacy_graph_log_captured(noise: CapturedNoise) -> Iterator[None]:
    """Route the legacy exporter's C++ graph log into ``noise`` and undo its global switch.

    torch 2.13's ``setup_onnx_logging`` tests ``_C._jit_is_onnx_log_enabled`` without
    calling it, so every legacy export turns the ONNX log on for the rest of the process
    and a failing export dumps the whole TorchScript graph to stderr from C++, past any
    Python-level redirection. Private hooks, because torch has no public API for this
    log (the bug is in torch's own use of it); where they are absent this does nothing.
    """
    c_api: Any = torch._C
    log = getattr(c_api, "_jit_onnx_log", None)
    is_enabled = getattr(c_api, "_jit_is_onnx_log_enabled", None)
    set_enabled = getattr(c_api, "_jit_set_onnx_log_enabled", None)
    if not (callable(log) and callable(is_enabled) and callable(set_enabled)):
        yield
        return
    was_enabled = bool(is_enabled())

    def capture(*parts: Any) -> None:
        noise.stderr += "".join(str(part) for part in parts) + "\n"

    c_api._jit_onnx_log = capture
    try:
        yield
    finally:
        c_api._jit_onnx_log = log
        set_enabled(was_enabled)


def consolidate_external_data(path: Path) -> None:
    """Store every weight of ``path`` in one ``<file>.data`` beside it.

    ``path`` is the staged file, alone in its staging directory, so every other
    file there is one of its tensors. Needs the ``onnx`` package (checked by the
    caller before the export starts).
    """
    import onnx

    proto = onnx.load(str(path), load_external_data=True)
    for stray in path.parent.iterdir():
        if stray != path:
            stray.unlink()
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
        size_threshold=0,
    )


def warn_legacy_trace(job: ExportJob, dynamic: bool) -> None:
    """One :class:`LegacyTraceWarning` when a dynamic legacy export traced Python values."""
    tracer = [w for w in job.noise.warnings if w.category.__name__ == "TracerWarning"]
    if not (dynamic and tracer):
        return
    first = tracer[0]
    warn_caller(
        LegacyTraceWarning(
            f"the legacy ONNX exporter (dynamo=False) recorded {len(tracer)} shape-dependent "
            f"Python value(s) as constants (first at {first.filename}:{first.lineno}: "
            f"{str(first.message).splitlines()[0]}); the graph may only run at the traced shape "
            f"{tuple(job.inputs[0].shape)}. Use dynamo=True (the default) for dynamic batch and "
            "sequence, or check other shapes with verify_onnx(..., example_inputs=...)."
        )
    )
