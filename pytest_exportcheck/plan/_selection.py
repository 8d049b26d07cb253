"""What a run asks for: a name selection per axis, and the request the planner resolves.

:class:`NameSelection` is one axis (``all``, a list of names, or nothing);
:class:`PlanRequest` holds one per axis plus the devices. The suite builds a
request from its ``--export-*`` options, ``parametrize_with_checks`` from its
arguments; :class:`~pytest_exportcheck.plan.Planner` resolves both the same way.
Imports only pytest (for the usage error of a bad value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pytest

__all__ = ["DEVICES", "NameSelection", "PlanRequest", "UnknownNames", "usage_error"]

#: Devices an item can run on.
DEVICES = ("cpu", "cuda")

#: ``(what, option, unknown names, known names) -> the exception to raise``.
UnknownNames = Callable[[str, str, Sequence[str], Sequence[str]], Exception]


def usage_error(what: str, option: str, unknown: Sequence[str], known: Sequence[str]) -> Exception:
    """The suite's error for unknown names: a usage error naming the option."""
    return pytest.UsageError(
        f"{option}: unknown {what} {', '.join(map(repr, unknown))}; "
        f"available: {', '.join(known) or '(none)'}, or 'all'"
    )


@dataclass(frozen=True)
class NameSelection:
    """A name selection: ``all``, an explicit list, or nothing."""

    all: bool = False
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, option: str = "the selection") -> NameSelection:
        """``"all"`` -> every name; ``"none"`` -> nothing; ``"a,b"`` -> those names.

        An empty value (``--export-targets=``) is a usage error naming ``option``."""
        parts = sorted({p.strip() for p in text.split(",") if p.strip()})
        if parts == ["all"]:
            return cls(all=True)
        if not parts:
            raise pytest.UsageError(
                f"{option}: the value is empty ({text!r}), so nothing would be selected; "
                f"pass 'all', a comma-separated list of names (e.g. {option}=a,b), "
                "or 'none' to select nothing on purpose"
            )
        if parts == ["none"]:
            return cls()
        if "all" in parts or "none" in parts:
            raise pytest.UsageError(
                f"'all' and 'none' cannot be combined with names, got {text!r}; "
                "pass either 'all', 'none' or a comma-separated list of names"
            )
        return cls(names=tuple(parts))

    @classmethod
    def of(cls, value: str | Iterable[str]) -> NameSelection:
        """``"all"``, one name or several names (the API's arguments); ``()`` selects nothing."""
        names = [value] if isinstance(value, str) else list(value)
        if names == ["all"]:
            return cls(all=True)
        return cls(names=tuple(sorted(set(names))))

    def resolve(
        self,
        available: Iterable[str],
        *,
        what: str,
        option: str,
        unknown: UnknownNames = usage_error,
    ) -> list[str]:
        """The selected names, sorted; an unknown name raises ``unknown(...)`` (a usage error)."""
        known = sorted(set(available))
        if self.all:
            return known
        missing = [n for n in self.names if n not in known]
        if missing:
            raise unknown(what, option, missing, known)
        return list(self.names)

    def __str__(self) -> str:
        return "all" if self.all else (",".join(self.names) or "none")


#: Selects every name.
EVERYTHING = NameSelection(all=True)


@dataclass(frozen=True)
class PlanRequest:
    """A name selection for each axis of the plan, and the devices."""

    targets: NameSelection = NameSelection()
    exporters: NameSelection = NameSelection()
    models: NameSelection = EVERYTHING
    checks: NameSelection = EVERYTHING
    devices: tuple[str, ...] = ("cpu",)

    @classmethod
    def everything(cls) -> PlanRequest:
        """Every name of every axis, on every device."""
        return cls(EVERYTHING, EVERYTHING, EVERYTHING, EVERYTHING, DEVICES)
