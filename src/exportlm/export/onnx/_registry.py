"""torch.onnx's table of ONNX functions, built once per process instead of once per export.

Every ``torch.onnx.export(dynamo=True)`` builds an ``ONNXRegistry`` from torchlib
(``ONNXRegistry.from_torchlib``): hundreds of ``OnnxDecompMeta`` records (560 of them
kept for opset 20, over 505 operators), each of which infers its function's ONNX signature from the function's Python signature and
annotations. The result depends only on the opset and on the torchlib functions, which
are fixed once ``onnxscript`` is imported, yet it is rebuilt for every export. Here the
first build for an opset is kept, and each later call gets a new registry whose
per-operator lists are copies of it, so what an export registers on its own registry
(``custom_translation_table``, e.g. the QDQ translations of :mod:`._qdq`) never reaches
another export. The records themselves are shared: the exporter only reads them.

Nothing else changes: the same records, in the same order, dispatch the same functions,
so the graph is the same (``tests/test_plugin_timing.py`` compares the serialized
models). Measured (torch 2.13 CPU, onnxscript 0.7, the 2-layer toy llama, median CPU
seconds, ``python benchmarks/bench_trace_cost.py --only registry --repeats 3`` on the
shared 2-core machine): plain 11.64 s -> 10.55 s, ``kv_cache=True`` 13.40 s -> 11.84 s.
The memo is installed only while an export runs
(reference-counted, so concurrent exports in threads share it) and removed after the
last one; with a torch that lacks these internals the export runs unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["torchlib_registry_reused"]

_LOCK = threading.Lock()
_USERS = 0
_ORIGINAL: Any = None
_BUILT: dict[tuple[type, Any], Any] = {}


def _copy(built: Any, cls: type) -> Any:
    """A new registry with ``built``'s opset and copies of its per-operator lists."""
    registry = cls()
    registry._opset_version = built._opset_version
    registry.functions = {target: list(decomps) for target, decomps in built.functions.items()}
    return registry


def _memoised(original: Any) -> Any:
    """``from_torchlib`` that builds once per (class, opset) and hands out copies."""
    build = original.__func__

    def from_torchlib(cls: type, *args: Any, **kwargs: Any) -> Any:
        opset = kwargs.get("opset_version", args[0] if args else None)
        key = (cls, opset)
        if len(args) + len(kwargs) > 1 or opset is None:
            return build(cls, *args, **kwargs)  # a call this memo does not know: as it was
        with _LOCK:
            built = _BUILT.get(key)
        if built is None:
            built = build(cls, *args, **kwargs)
            with _LOCK:
                built = _BUILT.setdefault(key, built)
        return _copy(built, cls)

    return classmethod(from_torchlib)


def _registry_class() -> Any:
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:  # pragma: no cover - another torch layout exports unchanged
        return None
    cls: Any = getattr(_registration, "ONNXRegistry", None)
    original = None if cls is None else cls.__dict__.get("from_torchlib")
    if not isinstance(original, classmethod) or not hasattr(cls(), "functions"):
        return None  # pragma: no cover - not the registry this memo knows
    return cls


@contextlib.contextmanager
def torchlib_registry_reused() -> Iterator[None]:
    """A context in which ``ONNXRegistry.from_torchlib`` reuses this process's first build."""
    global _USERS, _ORIGINAL
    cls = _registry_class()
    if cls is None:  # pragma: no cover
        yield
        return
    with _LOCK:
        if _USERS == 0:
            _ORIGINAL = cls.__dict__["from_torchlib"]
            cls.from_torchlib = _memoised(_ORIGINAL)
        _USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                cls.from_torchlib = _ORIGINAL
                _ORIGINAL = None
