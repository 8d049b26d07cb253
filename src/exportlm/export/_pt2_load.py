"""``torch.export.load`` without two per-node costs that do not depend on the artifact.

Deserializing a ``.pt2`` turns its JSON into torch's schema dataclasses and parses every
symbolic size expression with sympy. Both steps redo, for each of thousands of values,
work whose result never changes within a process:

* ``_dict_to_dataclass`` calls ``typing.get_type_hints(cls, globalns=vars(schema))`` for
  every dataclass value (~6000 calls for a 2-layer toy); the hints of a schema class are
  fixed, so they are memoised per class.
* ``sympy.sympify`` calls ``parse_expr`` without a ``global_dict``, and ``parse_expr``
  then runs ``exec("from sympy import *", {})`` for every expression (~700 calls); the
  namespace that builds is the same each time, so it is built once and each call gets a
  fresh copy of it (the expression is still parsed and evaluated as before).

Nothing is skipped: the artifact is read and deserialized in full and the program is
the same. Measured (torch 2.13 CPU, sympy 1.14, one thread, ``torch.export.load`` +
``.module()`` of a toy's ``.pt2``, median of 8 loads in one process alternating with
the plain load, on a loaded 2-core machine): the 2-layer llama 1.40 s -> 0.84 s, its
past-key-values program 1.75 s -> 0.94 s. The patches are installed only while a load
runs, under a lock, and removed after it; with a torch that lacks these internals the
load runs unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import typing
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, BinaryIO

import torch

__all__ = ["load_program"]

_LOCK = threading.Lock()


class _MemoTyping:
    """``typing`` as seen by torch's serde module, with ``get_type_hints`` memoised per class."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self._hints: dict[tuple[Any, int], dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def get_type_hints(self, obj: Any, globalns: Any = None, **kwargs: Any) -> dict[str, Any]:
        if kwargs or not isinstance(obj, type) or not isinstance(globalns, dict):
            return typing.get_type_hints(obj, globalns, **kwargs)
        key = (obj, id(globalns))  # globalns: the schema module's namespace, which lives on
        if key not in self._hints:
            self._hints[key] = typing.get_type_hints(obj, globalns)
        return dict(self._hints[key])


_MEMO_TYPING = _MemoTyping(typing)
_SYMPY_NAMESPACE: dict[str, Any] = {}


def _with_sympy_namespace(parse_expr: Callable[..., Any]) -> Callable[..., Any]:
    """``parse_expr`` given a copy of the ``from sympy import *`` namespace it would build."""

    def parse(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 4 and kwargs.get("global_dict") is None:
            if not _SYMPY_NAMESPACE:
                exec("from sympy import *", _SYMPY_NAMESPACE)
            kwargs["global_dict"] = dict(_SYMPY_NAMESPACE)
        return parse_expr(*args, **kwargs)

    return parse


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _fast_deserialization() -> Iterator[None]:
    """Install both memos for the duration of one load (see the module docstring)."""
    try:
        import sympy.parsing.sympy_parser as sympy_parser
        import torch._export.serde.serialize as serialize
    except ImportError:  # pragma: no cover - other torch / sympy layouts load unchanged
        yield
        return
    with contextlib.ExitStack() as stack:
        if getattr(serialize, "typing", None) is typing:
            stack.enter_context(_patched(serialize, "typing", _MEMO_TYPING))
        parse_expr = getattr(sympy_parser, "parse_expr", None)
        if callable(parse_expr):
            stack.enter_context(
                _patched(sympy_parser, "parse_expr", _with_sympy_namespace(parse_expr))
            )
        yield


def load_program(file: BinaryIO) -> torch.export.ExportedProgram:
    """``torch.export.load(file)``, with the per-process memos of the module docstring."""
    with _LOCK, _fast_deserialization():
        return torch.export.load(file)
