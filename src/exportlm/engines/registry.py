"""The engine registry: the built-in engines plus the ``exportlm.engines`` entry-point group."""

from __future__ import annotations

from typing import Any

from exportlm.engines.builtin import builtin_engines
from exportlm.engines.spec import Engine
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "ENGINES_GROUP",
    "ENGINE_REGISTRY",
    "engine_names",
    "ensure_engines_registered",
    "get_engine",
    "validate_engine",
]

#: The entry-point group third-party engines register under (value: an :class:`Engine`).
ENGINES_GROUP = "exportlm.engines"


def validate_engine(name: str, obj: Any) -> Engine:
    """An entry point's object must be an :class:`Engine` of that name with a worker on disk."""
    if not isinstance(obj, Engine):
        raise TypeError(
            f"engine entry point {name!r} must point at an exportlm.engines.Engine, "
            f"got {type(obj).__name__}"
        )
    if obj.name != name:
        raise ValueError(
            f"engine entry point {name!r} points at an Engine named {obj.name!r}; "
            "the entry point's name and the Engine's name must be the same"
        )
    if not obj.worker_path().is_file():
        raise ValueError(
            f"engine {name!r}: its worker script {obj.worker_path()} is not a file "
            "(a third-party engine names its worker by absolute path; docs/engines.md)"
        )
    return obj


ENGINE_REGISTRY: Registry[Engine] = Registry("engine", validate=validate_engine)


@once
def _register() -> None:
    for engine in builtin_engines():
        ENGINE_REGISTRY.register(engine.name, validate_engine(engine.name, engine), builtin=True)
    load_entry_point_registry(ENGINES_GROUP, ENGINE_REGISTRY, raise_errors=False)


def ensure_engines_registered() -> None:
    """Register the built-in engines, then load third-party ones (idempotent).

    A third-party engine that fails to load is recorded (``ENGINE_REGISTRY.failed()``)
    and warned about; it never hides the others.
    """
    _register()


def get_engine(name: str | Engine) -> Engine:
    """The engine registered under ``name`` (an :class:`Engine` is returned as it is).

    Raises :class:`~exportlm.errors.UnknownNameError` listing the registered engines.
    """
    if isinstance(name, Engine):
        return name
    ensure_engines_registered()
    return ENGINE_REGISTRY.get(name)


def engine_names() -> list[str]:
    """Every registered engine's name, sorted."""
    ensure_engines_registered()
    return ENGINE_REGISTRY.names()
