"""``ExporterEntry`` (one registration) and ``MatchExplanation`` (why a module matched)."""

from __future__ import annotations

from dataclasses import dataclass, field

from exportlm.module_exporters._base import MatchKey, ModuleExporter, ModulePredicate
from exportlm.registry import RegistryEntry

__all__ = ["ExporterEntry", "MatchExplanation"]


def _key_label(key: MatchKey) -> str:
    return key if isinstance(key, str) else f"{key.__module__}.{key.__qualname__}"


def _key_matches(key: MatchKey, mro: tuple[type, ...]) -> bool:
    if isinstance(key, str):
        return any(cls.__name__ == key for cls in mro)
    return key in mro


@dataclass(frozen=True)
class ExporterEntry(RegistryEntry[ModuleExporter]):
    """One registration: name, exporter (``obj``), match keys, predicate and provenance.

    Two entries are equal when they dispatch alike (same exporter, keys and
    predicate); the name and the provenance label an entry and take no part.
    """

    name: str = field(compare=False)
    builtin: bool = field(default=False, compare=False)
    distribution: str | None = field(default=None, compare=False)
    entry_point: str | None = field(default=None, compare=False)
    keys: tuple[MatchKey, ...] = ()
    predicate: ModulePredicate | None = None

    @property
    def exporter(self) -> ModuleExporter:
        """The registered exporter (the same object as ``obj``)."""
        return self.obj

    def keys_match(self, module_type: type) -> bool:
        """True when any key matches ``module_type`` (or there are no keys)."""
        return not self.keys or any(_key_matches(k, module_type.__mro__) for k in self.keys)

    def describe(self) -> str:
        """``name [keys] if predicate`` for messages."""
        parts = [self.name]
        if self.keys:
            parts.append("[" + ", ".join(_key_label(k) for k in self.keys) + "]")
        if self.predicate is not None:
            parts.append(f"if {getattr(self.predicate, '__qualname__', repr(self.predicate))}")
        return " ".join(parts)


@dataclass(frozen=True)
class MatchExplanation:
    """Why a module matched an entry, or why none.

    Attributes:
        module_type: the module's class name.
        exporter: the matching exporter, or ``None``.
        index: the matching entry's position, or ``None``.
        reason: one sentence.
        rejected: ``"entry: why not"`` for every entry tried before the match.
    """

    module_type: str
    exporter: ModuleExporter | None
    index: int | None
    reason: str
    rejected: tuple[str, ...]

    def __str__(self) -> str:
        lines = [self.reason, *(f"  - {r}" for r in self.rejected)]
        return "\n".join(lines)
