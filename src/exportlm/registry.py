"""One generic name -> object registry, and entry-point discovery.

Every extension surface of exportlm (export targets, runtimes, module
exporters, toy model families) is a :class:`Registry`. Built-ins are registered
in code; third parties add entries through ``importlib.metadata`` entry points,
loaded by :func:`load_entry_point_registry` (find -> load -> validate, sorted by
name, idempotent).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar

from exportlm.errors import PluginLoadError, RegistryConflictError, UnknownNameError

__all__ = [
    "DISABLE_PLUGINS_ENV",
    "PluginRecord",
    "PluginWarning",
    "once",
    "Registry",
    "RegistryEntry",
    "load_entry_point_registry",
    "plugins_disabled",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DISABLE_PLUGINS_ENV = "EXPORTLM_DISABLE_PLUGINS"

BUILTIN_PROVIDER = "exportlm (built in)"


class PluginWarning(UserWarning):
    """A third-party plugin could not be loaded; the others were."""


class _Once:
    """What :func:`once` returns: ``fn`` run at most once, and :meth:`reset`."""

    def __init__(self, fn: Callable[[], None]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        with self._lock:
            if self._done:
                return
            self._fn()
            self._done = True

    def reset(self) -> None:
        """Forget the call: the next one runs ``fn`` again.

        For tests that load the entry points of another set of installed
        distributions in the same process: reset the registration function after
        putting the registries back to their built-in entries (their loaded groups
        cleared), and the next call loads the entry points found then.
        """
        with self._lock:
            self._done = False


def once(fn: Callable[[], None]) -> _Once:
    """Make a zero-argument registration function idempotent and thread-safe.

    The first call runs ``fn`` under a lock; later calls return at once. If ``fn``
    raises, the next call tries again. The returned callable's ``reset()`` makes the
    next call run ``fn`` again.
    """
    return _Once(fn)


def plugins_disabled() -> bool:
    """True when ``EXPORTLM_DISABLE_PLUGINS`` is set to a true value.

    The kill switch turns off every entry point. exportlm declares none of its own:
    the built-in targets, module exporters and model families are registered in code,
    so they stay.
    """
    return os.environ.get(DISABLE_PLUGINS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class RegistryEntry(Generic[T]):
    """One registered object and where it came from."""

    name: str
    obj: T
    builtin: bool = False
    distribution: str | None = None
    entry_point: str | None = None

    @property
    def provider(self) -> str:
        """Human-readable owner: the distribution (with version) or ``exportlm (built in)``."""
        if self.builtin:
            return BUILTIN_PROVIDER
        if self.distribution:
            return self.distribution
        return "registered in code"


@dataclass(frozen=True)
class PluginRecord:
    """One line of the plugin inventory: a registered entry, or an entry point that failed.

    Attributes:
        kind: the registry's kind (``"export target"``, ``"runtime"``, ...).
        name: the registered (or entry-point) name.
        status: ``"loaded"`` (registered from an entry point or in code),
            ``"failed"`` (the entry point did not import or validate) or
            ``"conflict"`` (it claimed a name already taken; the existing entry stays).
        provider: who provides it: ``exportlm (built in)``, a distribution with its
            version, or ``registered in code``.
        group: the entry-point group, ``None`` for an entry registered in code.
        value: the entry point's ``module:attr``, ``None`` for one registered in code.
        error: the :class:`PluginLoadError` / :class:`RegistryConflictError` of a
            failed or conflicting entry, else ``None``.
    """

    kind: str
    name: str
    status: str
    provider: str
    group: str | None = None
    value: str | None = None
    error: BaseException | None = None

    @property
    def message(self) -> str:
        """The error's text, or ``""`` for a loaded entry."""
        return "" if self.error is None else str(self.error)


class Registry(Generic[T]):
    """An ordered name -> object mapping with conflict detection.

    ``validate`` (optional) turns what a plugin provides into the object stored
    (e.g. a class into an instance) and raises ``TypeError``/``ValueError`` when
    the object is not acceptable.
    """

    def __init__(self, kind: str, validate: Callable[[str, Any], T] | None = None) -> None:
        self.kind = kind
        self._validate = validate
        self._entries: dict[str, RegistryEntry[T]] = {}
        self._failed: dict[str, BaseException] = {}
        self._loaded_groups: set[str] = set()
        self._groups: dict[str, str] = {}
        self._problems: list[PluginRecord] = []
        self._lock = threading.RLock()
        self.plugin_errors: list[BaseException] = []

    # -- registration -------------------------------------------------------
    def validate(self, name: str, obj: Any) -> T:
        """Validate/convert ``obj`` for this registry (identity when no validator)."""
        if self._validate is None:
            return obj  # type: ignore[no-any-return]
        return self._validate(name, obj)

    def register(
        self,
        name: str,
        obj: T,
        *,
        builtin: bool = False,
        distribution: str | None = None,
        entry_point: str | None = None,
    ) -> T:
        """Register ``obj`` under ``name``; returns ``obj`` (usable as a decorator helper).

        Registering the *same* object again is a no-op. A different object under
        a taken name raises :class:`RegistryConflictError` naming both owners.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        new = RegistryEntry(name, obj, builtin, distribution, entry_point)
        with self._lock:
            old = self._entries.get(name)
            if old is not None:
                if old.obj is obj or old.obj == obj:
                    return old.obj
                raise RegistryConflictError(self.kind, name, old.provider, new.provider)
            self._entries[name] = new
            self._failed.pop(name, None)
        return obj

    def unregister(self, name: str) -> None:
        """Remove ``name`` (mainly for tests); unknown names raise :class:`UnknownNameError`."""
        with self._lock:
            if name not in self._entries:
                raise UnknownNameError(self.kind, name, list(self._entries))
            del self._entries[name]

    # -- lookup ------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object registered under ``name``.

        Raises :class:`UnknownNameError` (a ``ValueError``) listing the available
        names, or the :class:`PluginLoadError` of the plugin that should have
        provided ``name`` but failed to load.
        """
        return self.entry(name).obj

    def entry(self, name: str) -> RegistryEntry[T]:
        """The full :class:`RegistryEntry` of ``name`` (object and provenance)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                return entry
            failed = self._failed.get(name)
        if failed is not None:
            raise failed
        raise UnknownNameError(self.kind, name, self.names())

    def names(self) -> list[str]:
        """Registered names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def entries(self) -> list[RegistryEntry[T]]:
        """Registered entries, sorted by name."""
        with self._lock:
            return [self._entries[n] for n in sorted(self._entries)]

    def failed(self) -> dict[str, BaseException]:
        """Names whose plugin failed to load, with the error (sorted by name)."""
        with self._lock:
            return dict(sorted(self._failed.items()))

    def records(self) -> list[PluginRecord]:
        """This registry's part of the plugin inventory: every entry, then every problem.

        Entries are sorted by name; failed and conflicting entry points follow in
        the order they were found. ``exportlm list``, the pytest plugin's header
        and its ``plugin_loads`` check all read this (see
        :func:`exportlm.inventory.plugin_inventory`).
        """
        with self._lock:
            entries = [self._entries[n] for n in sorted(self._entries)]
            loaded = [
                PluginRecord(
                    self.kind,
                    e.name,
                    "loaded",
                    e.provider,
                    self._groups.get(e.name),
                    e.entry_point,
                )
                for e in entries
            ]
            return [*loaded, *self._problems]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()!r})"

    def _record_problem(
        self, ep: metadata.EntryPoint, group: str, dist: str | None, error: BaseException
    ) -> None:
        conflict = isinstance(error, RegistryConflictError)
        record = PluginRecord(
            self.kind,
            ep.name,
            "conflict" if conflict else "failed",
            dist or "<unknown distribution>",
            group,
            ep.value,
            error,
        )
        with self._lock:
            if not conflict:
                self._failed[ep.name] = error
            self.plugin_errors.append(error)
            self._problems.append(record)


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    eps = metadata.entry_points(group=group)
    # One entry per (name, value): the same distribution can be visible twice
    # on sys.path (e.g. an editable install plus a build dir).
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in eps:
        seen.setdefault((ep.name, ep.value), ep)
    return sorted(seen.values(), key=lambda ep: (ep.name, ep.value))


def _selected_entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points of ``group`` to load: all of them, or none under the kill switch."""
    eps = _entry_points(group)
    if not plugins_disabled():
        return eps
    if eps:
        logger.info(
            "%s=1: not loading the entry points of %s: %s",
            DISABLE_PLUGINS_ENV,
            group,
            "; ".join(f"{ep.name} = {ep.value}" for ep in eps),
        )
    return []


def _distribution_label(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    try:
        return f"{dist.metadata['Name']} {dist.version}"
    except Exception:  # pragma: no cover - broken metadata
        return None


def load_entry_point_registry(
    group: str, registry: Registry[T], *, raise_errors: bool = True
) -> list[str]:
    """Load every entry point of ``group`` into ``registry``.

    Find -> load -> validate, sorted by entry-point name; idempotent (a second
    call for the same group is a no-op). A plugin that fails to import or to
    validate is wrapped as :class:`PluginLoadError` naming the distribution and
    never hides the other plugins: all of them are loaded first. An entry point
    that claims a taken (e.g. built-in) name is a :class:`RegistryConflictError`.

    With ``raise_errors=True`` (default) the first error is raised after every
    other plugin was loaded; with ``False`` errors are only recorded in
    ``registry.plugin_errors`` / ``registry.failed()`` and issued as
    :class:`PluginWarning`. With ``EXPORTLM_DISABLE_PLUGINS=1`` no entry point is
    loaded (exportlm's own entries are registered in code and stay).

    Returns the names registered by this call.
    """
    with registry._lock:
        if group in registry._loaded_groups:
            return []
        registry._loaded_groups.add(group)
    loaded: list[str] = []
    errors: list[BaseException] = []
    for ep in _selected_entry_points(group):
        dist = _distribution_label(ep)
        try:
            obj = ep.load()
            obj = registry.validate(ep.name, obj)
        except Exception as err:
            error: BaseException = PluginLoadError(
                group, f"{ep.name} = {ep.value}", dist, err, name=ep.name
            )
            error.__cause__ = err
            registry._record_problem(ep, group, dist, error)
            errors.append(error)
            continue
        try:
            registry.register(ep.name, obj, distribution=dist, entry_point=ep.value)
        except RegistryConflictError as err:
            # Keep the existing (e.g. built-in) entry usable; report the claim.
            registry._record_problem(ep, group, dist, err)
            errors.append(err)
            continue
        with registry._lock:
            registry._groups[ep.name] = group
        loaded.append(ep.name)
    if errors:
        for error in errors:
            logger.warning("%s", error)
        if raise_errors:
            raise errors[0]
        for error in errors:
            warnings.warn(str(error), PluginWarning, stacklevel=2)
    return loaded
