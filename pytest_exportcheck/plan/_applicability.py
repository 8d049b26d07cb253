"""Which (row, check) pairs can apply: a check's declared needs against a row's declaration.

A check declares, as data on its :class:`~pytest_exportcheck.checks.CheckSpec`, what
it needs: target capabilities (``needs``), the artifact kinds it reads
(``artifacts``), the devices an exporter check runs on (``devices``), the toy families
it runs on (``models``); a ``per_engine`` check needs an engine that takes what the
target writes. A pair that cannot apply given the target's (or the run's)
declarations is no item: the planner leaves it out and records it here, once per
(row, check), with the reason. What depends on the machine stays an item that
skips with a cause a user can act on: a GPU, an installed engine, a ``cuda``
capability that a target declares only where its runtime's GPU build is installed.
Pure: reads the specs' attributes, imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckSpec

__all__ = ["ENVIRONMENT_CAPABILITIES", "NotApplicable", "device_gap", "model_gap", "target_gap"]

#: Capabilities a target declares by what is installed (the built-in ``onnx`` declares
#: ``cuda`` only with onnxruntime-gpu): a gap in one is a counted skip, not a cell
#: that cannot apply.
ENVIRONMENT_CAPABILITIES = frozenset({"cuda"})


@dataclass(frozen=True)
class NotApplicable:
    """A (row, check) pair the planner left items out of, and why.

    ``items`` is how many items it left out (every model, device and engine of the
    pair, or only the families the check does not run on); ``check_index`` the
    check's catalogue position (the matrix's row order).
    """

    scope: str
    column: str
    check: str
    reason: str
    items: int = 1
    check_index: int = 0

    def as_json(self) -> dict[str, Any]:
        """The report's record (``not_applicable``)."""
        return {
            "scope": self.scope,
            "column": self.column,
            "check": self.check,
            "reason": self.reason,
            "items": self.items,
            "check_index": self.check_index,
        }


def target_gap(
    spec: CheckSpec, target: str, capabilities: frozenset[str], artifact: str, engines: int
) -> str | None:
    """Why ``spec`` cannot apply to any item of a row of ``target``; ``None`` when it can.

    ``artifact`` is the target's artifact kind (``""``: undeclared, any check reads
    it); ``engines`` how many serving engines take what it writes.
    """
    missing = sorted(set(spec.needs) - capabilities - ENVIRONMENT_CAPABILITIES)
    if missing:
        declared = ", ".join(sorted(capabilities)) or "none"
        return (
            f"target {target!r} does not declare {', '.join(map(repr, missing))} "
            f"(declared: {declared})"
        )
    kinds: frozenset[str] = getattr(spec, "artifacts", frozenset())
    if artifact and kinds and artifact not in kinds:
        return (
            f"target {target!r} writes a {artifact} artifact; {spec.id} reads "
            f"{' or '.join(sorted(kinds))} artifacts"
        )
    if getattr(spec, "per_engine", False) and not engines:
        return f"no serving engine's support table takes what target {target!r} writes"
    return None


def model_gap(spec: CheckSpec, models: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """``(families the check runs on, why the others are left out or None)``."""
    runs: frozenset[str] = getattr(spec, "models", frozenset())
    if not runs:
        return tuple(models), None
    kept = tuple(m for m in models if m in runs)
    left = [m for m in models if m not in runs]
    if not left:
        return kept, None
    return (
        kept,
        f"{spec.id} runs the families {', '.join(sorted(runs))} only, not {', '.join(left)}",
    )


def device_gap(spec: CheckSpec, devices: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """``(devices an exporter check runs on in this run, why the others are left out)``."""
    runs: frozenset[str] = getattr(spec, "devices", frozenset())
    if not runs:
        return tuple(devices), None
    kept = tuple(d for d in devices if d.split(":")[0] in runs)
    left = [d for d in devices if d not in kept]
    if not left:
        return kept, None
    wanted = ", ".join(sorted(runs))
    return kept, (
        f"{spec.id} runs on {wanted} devices only, not {', '.join(left)} "
        f"(select one with --export-device={wanted})"
    )
