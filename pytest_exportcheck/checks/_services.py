"""What the checks of one process share, passed in explicitly: ``case.services``.

A :class:`CheckServices` is created by whoever builds the cases: the plugin's
runner makes one per pytest process and hands it to every case, so the items of a
worker build each toy model once, load a shared artifact's runtime once and time
what each item spent; a script that builds a :class:`~pytest_exportcheck.checks.TargetCase`
itself gets a fresh one per case (nothing shared, nothing cached).

It holds:

* the registries the checks read (:attr:`CheckServices.registries`, a
  :class:`~pytest_exportcheck.checks._registries.Registries`): a target's record,
  factory and runtime, exports and loads through them, the module-exporter
  registry, the toy families, the serving engines. The plugin hands in the one its
  discovery built; a services built without one reads the process's registries;
* the toy models: each ``(family, seed)`` is built once (:meth:`pristine_model`,
  for read-only uses such as a target's ``accepts``, asked once per target and family:
  :meth:`refusal`) and every caller that may change or export the model gets its own
  deep copy (:meth:`model`);
* the runtimes of shared (read-only, cached) artifacts, the last few kept
  (:meth:`shared_runtime`);
* what the checks compute once per process and read many times (the quantization
  survey, the recorded export of a conformance model, the configs a golden case
  writes): :meth:`memo`, keyed on values. A key holds the objects it names (a
  registry's exporters, a family's factory), never their ``id()``, so an entry
  cannot be served to another object that happens to reuse a collected one's address;
* the current item's :class:`ItemProfile`: seconds per phase (``build``,
  ``export``, ``cache``, ``load``, ``compare``) and counts (``builds``,
  ``exports``, ``cache_hits``, ``cache_misses``), for ``--export-durations`` and
  the JSON report.

This module imports neither torch nor Hypothesis (the model factory is called
lazily), so the case classes can default to a fresh instance.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pytest_exportcheck.checks._registries import Registries

__all__ = ["PHASES", "CheckServices", "ItemProfile"]

#: The phases an item's time is split into (besides ``other``), in report order.
PHASES = ("build", "export", "cache", "load", "compare")
_T = TypeVar("_T")
#: How many loaded runtimes of shared artifacts a process keeps.
RUNTIMES_KEPT = 4


@dataclass
class _Frame:
    """One open phase: ``name`` may still change before it closes (a cache hit)."""

    name: str
    start: float
    inner: float = 0.0


@dataclass
class ItemProfile:
    """Where one item's time went: exclusive seconds per phase, and event counts.

    Phases nest (an export builds its model): a phase's time excludes the time of
    the phases opened inside it, so the phases never add up to more than the item.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    _stack: list[_Frame] = field(default_factory=list, repr=False)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[_Frame]:
        """Time the block as ``name`` (the yielded frame's ``name`` may be changed inside)."""
        frame = _Frame(name, time.perf_counter())
        self._stack.append(frame)
        try:
            yield frame
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame.start
            self.seconds[frame.name] = self.seconds.get(frame.name, 0.0) + elapsed - frame.inner
            if self._stack:
                self._stack[-1].inner += elapsed

    def count(self, event: str, n: int = 1) -> None:
        """Count ``n`` occurrences of ``event`` (``builds``, ``cache_hits``, ...)."""
        self.counts[event] += n

    @property
    def artifact(self) -> str | None:
        """``"cached"`` (every shared artifact from the cache), ``"exported"`` (some were
        exported), or ``None`` (the item asked the cache for none)."""
        if self.counts["cache_misses"]:
            return "exported"
        return "cached" if self.counts["cache_hits"] else None

    def as_json(self, total: float) -> dict[str, Any]:
        """``{"total", "build", ..., "other", "artifact", counts...}`` in seconds (ms rounded)."""
        phases = {p: round(self.seconds.get(p, 0.0), 3) for p in PHASES}
        other = max(0.0, total - sum(self.seconds.get(p, 0.0) for p in PHASES))
        counts = {k: int(v) for k, v in sorted(self.counts.items()) if v}
        return {
            "total": round(total, 3),
            **phases,
            "other": round(other, 3),
            "artifact": self.artifact,
            **counts,
        }


class CheckServices:
    """The state the checks of one process share; see the module docstring.

    Args:
        build: ``(family, seed) -> nn.Module``; default: the family's factory in
            :attr:`registries`, in eval mode.
        registries: what the checks look targets, runtimes, module exporters,
            families and engines up in; default: the process's registries
            (:meth:`Registries.installed`, read on first use).
    """

    def __init__(
        self,
        build: Callable[[str, int], Any] | None = None,
        registries: Registries | None = None,
    ) -> None:
        self._build = build
        self._registries = registries
        self._models: dict[tuple[str, int], Any] = {}
        self._runtimes: OrderedDict[Hashable, Any] = OrderedDict()
        self._memo: dict[Hashable, Any] = {}
        self.profile = ItemProfile()

    @property
    def registries(self) -> Registries:
        """The registries the checks read (see the class docstring)."""
        if self._registries is None:
            self._registries = Registries.installed()
        return self._registries

    # -- the current item ---------------------------------------------------
    def begin_item(self) -> ItemProfile:
        """Start the profile of a new item (the previous one is dropped) and return it."""
        self.profile = ItemProfile()
        return self.profile

    def phase(self, name: str) -> contextlib.AbstractContextManager[_Frame]:
        """:meth:`ItemProfile.phase` of the current item."""
        return self.profile.phase(name)

    # -- toy models ---------------------------------------------------------
    def pristine_model(self, name: str, seed: int) -> Any:
        """Family ``name`` built with ``seed``, once per process; never change it."""
        key = (name, seed)
        if key not in self._models:
            with self.phase("build"):
                self._models[key] = self._construct(name, seed)
            self.profile.count("builds")
        return self._models[key]

    def model(self, name: str, seed: int) -> Any:
        """A copy of :meth:`pristine_model` of its own, which the caller may change or export."""
        pristine = self.pristine_model(name, seed)
        with self.phase("build"):
            try:
                return copy.deepcopy(pristine)
            except Exception:  # a family whose modules do not deep-copy: build it again
                self.profile.count("builds")
                return self._construct(name, seed)

    def _construct(self, name: str, seed: int) -> Any:
        if self._build is not None:
            return self._build(name, seed)
        return self.registries.build_model(name, seed).eval()

    def refusal(
        self, target: str, accepts: Callable[[Any], Any] | None, name: str, seed: int
    ) -> str | None:
        """Why ``target``'s ``accepts`` refuses family ``name`` (its :meth:`pristine_model`),
        or ``None``: asked once per process, so the runner's gate and the check that builds
        the model share one call."""
        if accepts is None:
            return None

        def ask() -> str | None:
            reason = accepts(self.pristine_model(name, seed))
            return str(reason) if reason else None

        return self.memo(("accepts", target, accepts, name, seed), ask)

    # -- values computed once per process ---------------------------------------
    def memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()`` the first time ``key`` is asked for, the same value afterwards.

        ``key`` is compared by value: a tuple of names, numbers and the objects
        the value depends on (held by the key, so never confused with a later
        object at the same address). An exception is not remembered.
        """
        if key not in self._memo:
            self._memo[key] = compute()  # an exception leaves the key unknown
        value: _T = self._memo[key]
        return value

    def known(self, key: Hashable) -> bool:
        """Whether :meth:`memo` holds a value for ``key``."""
        return key in self._memo

    # -- runtimes of shared artifacts ----------------------------------------
    def shared_runtime(self, key: Hashable, load: Callable[[], Any]) -> Any:
        """The runtime loaded under ``key`` (``load()`` the first time); the last few are kept."""
        runtime = self._runtimes.pop(key, None)
        if runtime is None:
            runtime = load()
        self._runtimes[key] = runtime
        while len(self._runtimes) > RUNTIMES_KEPT:
            self._runtimes.popitem(last=False)
        return runtime
