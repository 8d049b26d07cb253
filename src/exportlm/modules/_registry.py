"""``ModuleExporter`` and the ordered, first-match ``ExportModuleRegistry``.

Matching rules (each has a test named after it in ``tests/test_module_registry.py``):

1. Entries are tried in order; the first entry that matches wins.
2. A class key matches when it is in ``type(module).__mro__``.
3. A string key equals the ``__name__`` of a class in the MRO (never a substring:
   ``"MoELinear"`` matches nothing, ``"QuantMoELinear"`` does not match a plain
   ``QuantLinear``; ``"QuantLinear"`` matches ``QuantMoELinear``, which subclasses
   it, exactly as the class key ``QuantLinear`` does).
4. An entry with keys and a predicate matches only when both do; an entry with a
   predicate alone asks only the predicate.
5. Registering an exporter again (the same instance, or another instance of the
   same class) replaces its entry in place, keeping its position.
6. ``prepend=True`` puts a new entry first.
7. No match is ``None`` (``explain`` says why).
8. The keys-only part of matching is cached per module type; the cache is
   cleared whenever an entry is registered or removed.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from exportlm.modules._context import ExportContext

__all__ = [
    "ExportModuleRegistry",
    "ExporterEntry",
    "MatchExplanation",
    "MatchKey",
    "ModuleExporter",
    "ModulePredicate",
]

MatchKey = type | str
ModulePredicate = Callable[[nn.Module], bool]


class ModuleExporter(abc.ABC):
    """Exports one kind of (quantized) module into the checkpoint being built.

    Subclasses implement :meth:`export`; MoE exporters also
    :meth:`prepare_moe_inputs`. Class attributes describe the exporter to
    reports and to entry-point loading:

    Attributes:
        name: the exporter's name in reports (default: the class name).
        keys: match keys (classes or exact class names) used when the exporter is
            loaded from the ``exportlm.module_exporters`` entry-point group.
        predicate: optional ``module -> bool`` used likewise (a method or staticmethod).
        prepend: an entry-point exporter goes before the built-ins when true.
        exports_unquantized: the driver also calls :meth:`export` on matching modules
            that are not quantized themselves (containers such as expert lists);
            otherwise those are written as plain tensors by the driver.
    """

    name: ClassVar[str] = ""
    keys: ClassVar[tuple[MatchKey, ...]] = ()
    # A ``module -> bool`` callable (staticmethod or method), or None; typed Any
    # because a method and a staticmethod have different class-level signatures.
    predicate: ClassVar[Any] = None
    prepend: ClassVar[bool] = False
    exports_unquantized: ClassVar[bool] = False

    @property
    def display_name(self) -> str:
        """``name``, or the class name when ``name`` is empty."""
        return self.name or type(self).__name__

    def prepare_moe_inputs(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Before any tensor is written: decide shared values (default: nothing).

        MoE exporters unify the input amax of a block's experts here (into
        ``ctx.amax_overrides``) so they share one ``input_scale``. Must not modify
        ``module``.
        """
        return None

    @abc.abstractmethod
    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write ``module``'s tensors under the prefix ``name`` through ``ctx.emit*``.

        For a quantized module the exporter owns the whole subtree (its children
        are not visited). Must not modify ``module``.
        """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.display_name!r}>"


def _key_label(key: MatchKey) -> str:
    return key if isinstance(key, str) else f"{key.__module__}.{key.__qualname__}"


def _key_matches(key: MatchKey, mro: tuple[type, ...]) -> bool:
    if isinstance(key, str):
        return any(cls.__name__ == key for cls in mro)
    return key in mro


@dataclass(frozen=True)
class ExporterEntry:
    """One registration: the exporter, its keys (any may match) and its predicate."""

    exporter: ModuleExporter
    keys: tuple[MatchKey, ...]
    predicate: ModulePredicate | None

    def keys_match(self, module_type: type) -> bool:
        """True when any key matches ``module_type`` (or there are no keys)."""
        return not self.keys or any(_key_matches(k, module_type.__mro__) for k in self.keys)

    def describe(self) -> str:
        """``name [keys] + predicate`` for messages."""
        parts = [self.exporter.display_name]
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


class ExportModuleRegistry:
    """Ordered module-exporter dispatch; see the module docstring for the rules."""

    def __init__(self) -> None:
        self._entries: list[ExporterEntry] = []
        self._cache: dict[type, tuple[ExporterEntry, ...]] = {}
        self._lock = threading.RLock()

    def register(
        self,
        exporter: ModuleExporter,
        *keys: MatchKey,
        predicate: ModulePredicate | None = None,
        prepend: bool = False,
    ) -> ModuleExporter:
        """Add ``exporter`` matched by ``keys`` (classes or exact class names) and/or ``predicate``.

        Re-registering the same exporter (same instance or same class) replaces
        its entry in place; otherwise ``prepend`` puts it first, else last.
        Returns ``exporter``.
        """
        if not isinstance(exporter, ModuleExporter):
            raise TypeError(
                f"expected a ModuleExporter instance, got {type(exporter).__name__}; "
                "register an instance (e.g. MyExporter())"
            )
        for key in keys:
            if not isinstance(key, (type, str)) or (isinstance(key, str) and not key):
                raise TypeError(f"match keys are classes or class names, got {key!r}")
        if not keys and predicate is None:
            raise ValueError(
                f"{exporter!r} needs match keys or a predicate; an exporter that matches "
                "every module would shadow all later entries"
            )
        if predicate is not None and not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        entry = ExporterEntry(exporter, tuple(keys), predicate)
        with self._lock:
            for i, old in enumerate(self._entries):
                if old.exporter is exporter or type(old.exporter) is type(exporter):
                    self._entries[i] = entry
                    break
            else:
                if prepend:
                    self._entries.insert(0, entry)
                else:
                    self._entries.append(entry)
            self._cache.clear()
        return exporter

    def unregister(self, exporter: ModuleExporter | type[ModuleExporter]) -> None:
        """Remove the entry of ``exporter`` (an instance or its class); unknown raises ``KeyError``."""
        with self._lock:
            for i, entry in enumerate(self._entries):
                if entry.exporter is exporter or type(entry.exporter) is exporter:
                    del self._entries[i]
                    self._cache.clear()
                    return
        raise KeyError(f"{exporter!r} is not registered")

    def entries(self) -> list[ExporterEntry]:
        """The entries in match order (a copy)."""
        with self._lock:
            return list(self._entries)

    def exporters(self) -> list[ModuleExporter]:
        """The exporters in match order."""
        return [e.exporter for e in self.entries()]

    def _candidates(self, module_type: type) -> tuple[ExporterEntry, ...]:
        """Entries whose keys match ``module_type``, up to the first one without a predicate."""
        with self._lock:
            cached = self._cache.get(module_type)
            if cached is not None:
                return cached
            candidates: list[ExporterEntry] = []
            for entry in self._entries:
                if entry.keys_match(module_type):
                    candidates.append(entry)
                    if entry.predicate is None:
                        break
            result = tuple(candidates)
            self._cache[module_type] = result
            return result

    def match(self, module: nn.Module) -> ModuleExporter | None:
        """The exporter of the first matching entry, or ``None``."""
        for entry in self._candidates(type(module)):
            if entry.predicate is None or entry.predicate(module):
                return entry.exporter
        return None

    def explain(self, module: nn.Module) -> MatchExplanation:
        """Which entry matches ``module`` and why the earlier ones did not."""
        module_type = type(module)
        rejected: list[str] = []
        for index, entry in enumerate(self.entries()):
            if not entry.keys_match(module_type):
                rejected.append(f"{entry.describe()}: no key in the MRO of {module_type.__name__}")
                continue
            if entry.predicate is not None and not entry.predicate(module):
                rejected.append(f"{entry.describe()}: predicate returned False")
                continue
            how = "its predicate" if not entry.keys else "a key in its MRO"
            if entry.keys and entry.predicate is not None:
                how = "a key in its MRO and its predicate"
            return MatchExplanation(
                module_type.__name__,
                entry.exporter,
                index,
                f"{module_type.__name__} matched entry {index} ({entry.describe()}) by {how}",
                tuple(rejected),
            )
        return MatchExplanation(
            module_type.__name__,
            None,
            None,
            f"no exporter matches {module_type.__name__} (MRO: "
            f"{', '.join(c.__name__ for c in module_type.__mro__)}); "
            f"{len(rejected)} entr{'y' if len(rejected) == 1 else 'ies'} tried",
            tuple(rejected),
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ModuleExporter]:
        return iter(self.exporters())

    def __repr__(self) -> str:
        return f"ExportModuleRegistry({[e.describe() for e in self.entries()]!r})"


def exporter_attributes(exporter: ModuleExporter) -> tuple[tuple[MatchKey, ...], Any, bool]:
    """``(keys, predicate, prepend)`` an exporter declares as attributes."""
    predicate = getattr(exporter, "predicate", None)
    return (
        tuple(getattr(exporter, "keys", ()) or ()),
        predicate,
        bool(getattr(exporter, "prepend", False)),
    )
