"""Which suite items pytest-xdist hands to one worker together: one work unit per artifact.

Under ``-n N`` (xdist's default ``--dist load``) the suite's items go out in
collection order, which is check-major (every ``roundtrip_logits`` item, then every
``dynamic_shapes`` item, ...), and the first quarter round-robin. The items that
share a cached artifact then land on both workers: the second one waits on the
cache's lock while the first exports, then loads the same ``.pt2`` or ONNX session
again, and each worker computes the quantization survey once.

:func:`work_units` names a unit per item instead: every target item of one
(target row, toy model, device), the row's model-less checks (``deterministic``,
``atomic_failure``, ...) with the row's default model (:data:`DEFAULT_MODELS`,
which they export); every exporter item in one unit (they read one survey); any
other item (``plugin_loads``, a host project's own tests) alone.
:func:`artifact_scheduler` is xdist's ``loadscope`` scheduler over those units,
used only where xdist would use ``load``: an explicit other ``--dist`` wins.
Node ids, item order inside a unit and every verdict stay as they are; only which
worker runs an item, and when, changes.

Imports pytest-xdist only when xdist asks for a scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pytest_exportcheck.checks._support import DEFAULT_MODELS
from pytest_exportcheck.plan import ItemSpec
from pytest_exportcheck.plan._nodeids import item_nodeid

__all__ = ["EXPORTER_UNIT", "artifact_scheduler", "work_units"]

#: The one work unit of every exporter-scope item (they share the survey).
EXPORTER_UNIT = "exportcheck:exporters"


def _row_default(models: Iterable[str]) -> str | None:
    present = set(models)
    return next((m for m in DEFAULT_MODELS if m in present), None)


def work_units(specs: Iterable[ItemSpec]) -> dict[str, str]:
    """``node id -> work unit`` for the planned items that share work (see the module docstring)."""
    specs = list(specs)
    models: dict[str, list[str]] = {}
    for spec in specs:
        if spec.scope == "target" and spec.model is not None:
            models.setdefault(spec.column, []).append(spec.model)
    units: dict[str, str] = {}
    for spec in specs:
        nodeid = item_nodeid(spec.check, spec.name)
        if spec.check == "plugin_loads":
            continue
        if spec.scope == "exporter":
            units[nodeid] = EXPORTER_UNIT
            continue
        model = spec.model or _row_default(models.get(spec.column, ()))
        if model is not None:
            units[nodeid] = f"exportcheck:{spec.column}:{model}:{spec.device or 'cpu'}"
    return units


def artifact_scheduler(config: Any, log: Any, units: Mapping[str, str]) -> Any:
    """xdist's ``loadscope`` scheduling over :func:`work_units` (other node ids: one unit each).

    ``None`` (xdist picks its own) unless the run uses ``--dist load``.
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ArtifactScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """``loadscope`` whose scopes are the suite's work units."""

        def _split_scope(self, nodeid: str) -> str:
            return units.get(nodeid, nodeid)

    return ArtifactScheduling(config, log)
