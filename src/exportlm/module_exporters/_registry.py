"""``ExportModuleRegistry``: the one module-exporter registry, named and ordered.

It is a :class:`~exportlm.registry.Registry` (names, provenance, entry-point
loading, plugin failures) whose entries also carry their dispatch rule (match
keys, predicate) and whose order is the dispatch order.

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
9. Every entry has a name (default: the exporter's ``display_name``); another
   exporter under a taken name raises :class:`~exportlm.errors.RegistryConflictError`
   naming both owners.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast, overload

from torch import nn

from exportlm.errors import RegistryConflictError, UnknownNameError
from exportlm.module_exporters._base import (
    MatchKey,
    ModuleExporter,
    ModulePredicate,
    declared_match,
)
from exportlm.module_exporters._entry import ExporterEntry, MatchExplanation
from exportlm.registry import Registry

__all__ = [
    "ExportModuleRegistry",
    "ExporterEntry",
    "MatchExplanation",
    "MatchKey",
    "ModuleExporter",
    "ModulePredicate",
    "validate_module_exporter",
]

#: One step of a match: an entry's index, the entry, and whether its keys match the type.
_Step = tuple[int, ExporterEntry, bool]


def validate_module_exporter(name: str, obj: Any) -> ModuleExporter:
    """What an entry point provides, as a registrable exporter.

    Accepts a :class:`ModuleExporter` subclass (instantiated without arguments)
    or instance that declares match keys and/or a predicate; raises ``TypeError``
    otherwise.
    """
    if isinstance(obj, type) and issubclass(obj, ModuleExporter):
        obj = obj()
    if not isinstance(obj, ModuleExporter):
        raise TypeError(
            f"module exporter {name!r} must be a ModuleExporter subclass or instance, "
            f"got {type(obj).__name__}"
        )
    keys, predicate, _ = declared_match(obj)
    if not keys and predicate is None:
        raise TypeError(
            f"module exporter {name!r} ({type(obj).__name__}) declares no match keys and no "
            "predicate; set keys = ('MyQuantModule',) and/or a predicate on the class"
        )
    return obj


class ExportModuleRegistry(Registry[ModuleExporter]):
    """Named module exporters in dispatch order; see the module docstring for the rules.

    Besides dispatch (:meth:`match`, :meth:`explain`) it is a full
    :class:`~exportlm.registry.Registry`: :meth:`get` / :meth:`entry` by name,
    :meth:`names` (sorted), :meth:`failed` plugins. :meth:`entries` lists the
    entries in match order.
    """

    def __init__(self) -> None:
        super().__init__("module exporter", validate_module_exporter)
        self._cache: dict[type, tuple[_Step, ...]] = {}

    # -- registration -------------------------------------------------------
    @overload
    def register(
        self,
        exporter: str,
        obj: ModuleExporter,
        /,
        *,
        builtin: bool = False,
        distribution: str | None = None,
        entry_point: str | None = None,
    ) -> ModuleExporter: ...

    @overload
    def register(
        self,
        exporter: ModuleExporter,
        /,
        *keys: MatchKey,
        predicate: ModulePredicate | None = None,
        prepend: bool | None = None,
        name: str | None = None,
        builtin: bool = False,
        distribution: str | None = None,
        entry_point: str | None = None,
    ) -> ModuleExporter: ...

    def register(
        self,
        exporter: str | ModuleExporter,
        /,
        *keys: Any,
        predicate: ModulePredicate | None = None,
        prepend: bool | None = None,
        name: str | None = None,
        builtin: bool = False,
        distribution: str | None = None,
        entry_point: str | None = None,
    ) -> ModuleExporter:
        """Add an exporter; returns it.

        Two forms:

        - ``register(exporter, *keys, predicate=None, prepend=None, name=None)``:
          ``keys`` are classes or exact class names; with no keys and no
          predicate, the ones the exporter's class declares are used.
        - ``register(name, exporter)``: the :class:`~exportlm.registry.Registry`
          form (entry points use it); keys, predicate and ``prepend`` are the
          ones the exporter's class declares.

        The name defaults to the exporter's ``display_name`` (or, when it
        replaces an entry, that entry's name). Registering an exporter again
        (same instance or same class) replaces its entry in place; a new entry
        goes first with ``prepend`` (default: the class's ``prepend``), else last.

        Raises:
            TypeError: not a :class:`ModuleExporter` instance, or a key that is
                neither a class nor a non-empty class name.
            ValueError: no keys and no predicate, given or declared.
            RegistryConflictError: another exporter is registered under the name.
        """
        if isinstance(exporter, str):
            if len(keys) != 1 or name is not None or predicate is not None:
                raise TypeError(
                    "register(name, exporter) takes the exporter only; pass match keys "
                    "with register(exporter, *keys, name=name)"
                )
            name, exporter, keys = exporter, keys[0], ()
        entry, declared_prepend = _new_entry(
            exporter, keys, predicate, name, builtin, distribution, entry_point
        )
        with self._lock:
            self._insert(entry, declared_prepend if prepend is None else prepend, name)
        return cast(ModuleExporter, exporter)

    def _insert(self, entry: ExporterEntry, prepend: bool, name: str | None) -> None:
        entries = self.entries()
        same = next(
            (
                i
                for i, old in enumerate(entries)
                if old.obj is entry.obj or type(old.obj) is type(entry.obj)
            ),
            None,
        )
        if same is not None and name is None:
            entry = _renamed(entry, entries[same].name)
        taken = self._entries.get(entry.name)
        if taken is not None and (same is None or entries[same] is not taken):
            raise RegistryConflictError(self.kind, entry.name, taken.provider, entry.provider)
        if same is not None:
            entries[same] = entry
        elif prepend:
            entries.insert(0, entry)
        else:
            entries.append(entry)
        self._entries = {e.name: e for e in entries}
        self._failed.pop(entry.name, None)
        self._cache.clear()

    def unregister(self, name: str | ModuleExporter | type[ModuleExporter]) -> None:
        """Remove an entry by name, exporter instance or exporter class.

        An unknown name raises :class:`~exportlm.errors.UnknownNameError`; an
        unknown exporter or class raises ``KeyError``.
        """
        with self._lock:
            entries = self.entries()
            for i, entry in enumerate(entries):
                if entry.name == name or entry.obj is name or type(entry.obj) is name:
                    del entries[i]
                    self._entries = {e.name: e for e in entries}
                    self._cache.clear()
                    return
        if isinstance(name, str):
            raise UnknownNameError(self.kind, name, self.names())
        raise KeyError(f"{name!r} is not registered")

    def restore(self, entries: Iterable[ExporterEntry]) -> None:
        """Make ``entries`` (as :meth:`entries` returned them) the whole registry, in order.

        For tests and tools that change the registry for a while and put it back.
        """
        restored = list(entries)
        with self._lock:
            self._entries = {e.name: e for e in restored}
            self._cache.clear()

    # -- lookup ------------------------------------------------------------
    def entry(self, name: str) -> ExporterEntry:
        """The entry registered under ``name`` (see :meth:`Registry.entry`)."""
        return cast(ExporterEntry, super().entry(name))

    # The base class promises list[RegistryEntry]; these are ExporterEntry (a subclass).
    # A list is invariant, but the copy handed out is never put back into a registry
    # typed for the base entries, so the narrower element type is safe.
    def entries(self) -> list[ExporterEntry]:  # type: ignore[override]
        """The entries in match order (a copy), not sorted by name as other registries."""
        with self._lock:
            return [cast(ExporterEntry, e) for e in self._entries.values()]

    def exporters(self) -> list[ModuleExporter]:
        """The exporters in match order."""
        return [e.obj for e in self.entries()]

    def _steps(self, module_type: type) -> tuple[_Step, ...]:
        """The entries a module of ``module_type`` is tried against, in order, each with its
        index and whether its keys match: every entry up to the first whose keys match and
        that has no predicate (it takes every such module). Cached per type."""
        with self._lock:
            cached = self._cache.get(module_type)
            if cached is not None:
                return cached
            steps: list[_Step] = []
            for index, entry in enumerate(self.entries()):
                keyed = entry.keys_match(module_type)
                steps.append((index, entry, keyed))
                if keyed and entry.predicate is None:
                    break
            result = tuple(steps)
            self._cache[module_type] = result
            return result

    def _walk(self, module: nn.Module) -> tuple[_Step | None, list[_Step]]:
        """The one walk of the rules: the step that takes ``module`` (or ``None``) and the
        steps it passed over, which :meth:`explain` words and :meth:`match` ignores."""
        passed: list[_Step] = []
        for step in self._steps(type(module)):
            _, entry, keyed = step
            if keyed and (entry.predicate is None or entry.predicate(module)):
                return step, passed
            passed.append(step)
        return None, passed

    def match(self, module: nn.Module) -> ModuleExporter | None:
        """The exporter of the first matching entry, or ``None``."""
        taken, _ = self._walk(module)
        return None if taken is None else taken[1].obj

    def explain(self, module: nn.Module) -> MatchExplanation:
        """Which entry matches ``module`` and why the earlier ones did not (the walk of
        :meth:`match`, worded)."""
        name = type(module).__name__
        taken, passed = self._walk(module)
        rejected = tuple(
            f"{entry.describe()}: "
            + (f"no key in the MRO of {name}" if not keyed else "predicate returned False")
            for _, entry, keyed in passed
        )
        if taken is None:
            return MatchExplanation(
                name,
                None,
                None,
                f"no exporter matches {name} (MRO: "
                f"{', '.join(c.__name__ for c in type(module).__mro__)}); "
                f"{len(rejected)} entr{'y' if len(rejected) == 1 else 'ies'} tried",
                rejected,
            )
        index, entry, _ = taken
        how = "its predicate" if not entry.keys else "a key in its MRO"
        if entry.keys and entry.predicate is not None:
            how = "a key in its MRO and its predicate"
        reason = f"{name} matched entry {index} ({entry.describe()}) by {how}"
        return MatchExplanation(name, entry.obj, index, reason, rejected)

    def __contains__(self, item: object) -> bool:
        """A registered name, or a registered exporter instance."""
        if isinstance(item, ModuleExporter):
            return any(e.obj is item for e in self.entries())
        return super().__contains__(item)

    def __repr__(self) -> str:
        return f"ExportModuleRegistry({[e.describe() for e in self.entries()]!r})"


def _new_entry(
    exporter: Any,
    keys: tuple[Any, ...],
    predicate: ModulePredicate | None,
    name: str | None,
    builtin: bool,
    distribution: str | None,
    entry_point: str | None,
) -> tuple[ExporterEntry, bool]:
    """The entry to register (validated) and the prepend the exporter declares."""
    if not isinstance(exporter, ModuleExporter):
        raise TypeError(
            f"expected a ModuleExporter instance, got {type(exporter).__name__}; "
            "register an instance (e.g. MyExporter())"
        )
    for key in keys:
        if not isinstance(key, (type, str)) or (isinstance(key, str) and not key):
            raise TypeError(f"match keys are classes or class names, got {key!r}")
    declared_keys, declared_predicate, declared_prepend = declared_match(exporter)
    if not keys and predicate is None:
        keys, predicate = declared_keys, declared_predicate
    if not keys and predicate is None:
        raise ValueError(
            f"{exporter!r} needs match keys or a predicate; an exporter that matches "
            "every module would shadow all later entries"
        )
    if predicate is not None and not callable(predicate):
        raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"a module exporter name must be a non-empty string, got {name!r}")
    entry = ExporterEntry(
        name=name or exporter.display_name,
        obj=exporter,
        builtin=builtin,
        distribution=distribution,
        entry_point=entry_point,
        keys=tuple(keys),
        predicate=predicate,
    )
    return entry, declared_prepend


def _renamed(entry: ExporterEntry, name: str) -> ExporterEntry:
    return ExporterEntry(
        name=name,
        obj=entry.obj,
        builtin=entry.builtin,
        distribution=entry.distribution,
        entry_point=entry.entry_point,
        keys=entry.keys,
        predicate=entry.predicate,
    )
