"""``-o KEY=VALUE`` target options: parsed by the type the target's factory declares.

A value is read as the annotation of the factory's keyword parameter says:
``bool`` (``true/false/yes/no/on/off/1/0``), ``int``, ``float``, ``str``, a
``Literal`` (one of its values), ``torch.dtype`` (:data:`DTYPE_NAMES`), a
union of those (tried in order; ``none`` for an optional one). A parameter
without a usable annotation (a third-party factory taking ``**kwargs``) gets a
Python literal when the value is one (``19``, ``False``, ``[1, 2]``), a dtype
when the option is named ``dtype`` or ``*_dtype``, and the string otherwise.
A value that does not parse is a :class:`~exportlm.cli._errors.UsageError`
naming the option and what it accepts.
"""

from __future__ import annotations

import ast
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from exportlm.cli._errors import UsageError
from exportlm.errors import UnknownOptionError

__all__ = ["DTYPE_NAMES", "coerce_option", "parse_target_options"]

#: Spellings accepted for a dtype option, and the torch dtype each names.
DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_NONE = ("none", "null")


class _BadValue(ValueError):
    """A value that does not parse as one annotation; the message says what would."""


def parse_target_options(
    target: str, factory: Callable[..., Any], pairs: Sequence[str]
) -> dict[str, Any]:
    """``{name: value}`` of the ``-o KEY=VALUE`` ``pairs`` for the export ``factory`` of ``target``.

    Raises:
        UsageError: a pair without ``=``, a key given twice, or a value that does not parse.
        UnknownOptionError: a key the factory does not accept (when it has no ``**kwargs``).
    """
    accepted, takes_any = _keyword_parameters(factory)
    hints = _type_hints(factory)
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"-o expects KEY=VALUE, got {pair!r}")
        if key not in accepted and not takes_any:
            raise UnknownOptionError(f"export target {target!r}", [key], sorted(accepted))
        if key in options:  # the last one won, silently
            raise UsageError(
                f"-o {key} is given twice ({options[key]!r}, then {raw!r}); give it once"
            )
        options[key] = coerce_option(key, raw, hints.get(key, Any))
    return options


def coerce_option(key: str, raw: str, annotation: Any) -> Any:
    """``raw`` read as ``annotation`` (see the module docstring); raises :class:`UsageError`."""
    try:
        return _coerce(key, raw.strip(), annotation)
    except _BadValue as err:
        raise UsageError(f"-o {key}={raw}: {err}") from None


def _coerce(key: str, raw: str, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return _coerce_union(key, raw, typing.get_args(annotation))
    if origin is typing.Literal:
        values = typing.get_args(annotation)
        for value in values:
            if raw == str(value) or raw == repr(value):
                return value
        raise _BadValue(f"expected one of {', '.join(map(str, values))}")
    if annotation is bool:
        return _coerce_bool(raw)
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            kind = "an integer" if annotation is int else "a number"
            raise _BadValue(f"expected {kind}") from None
    if annotation is str:
        return _unquote(raw)
    if _is_dtype(annotation) or (annotation is Any and (key == "dtype" or key.endswith("_dtype"))):
        return _coerce_dtype(raw)
    return _literal_or_string(raw)


def _coerce_union(key: str, raw: str, members: tuple[Any, ...]) -> Any:
    if type(None) in members and raw.lower() in _NONE:
        return None
    if any(_is_dtype(m) for m in members):
        # `torch.dtype | str`: the string form is a dtype's name, so it is checked as one.
        try:
            return _coerce_dtype(raw)
        except _BadValue as err:
            none = " or none" if type(None) in members else ""
            raise _BadValue(f"{err}{none}") from None
    problems: list[str] = []
    for member in (m for m in members if m is not type(None)):
        try:
            return _coerce(key, raw, member)
        except _BadValue as err:
            problems.append(str(err).removeprefix("expected "))
    if type(None) in members:
        problems.append("none")
    raise _BadValue(f"expected {' or '.join(problems)}")


def _coerce_bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _BadValue("expected a boolean (true/false, yes/no, on/off, 1/0)")


def _coerce_dtype(raw: str) -> Any:
    import torch

    name = DTYPE_NAMES.get(raw.lower().removeprefix("torch."))
    if name is None:
        raise _BadValue(f"expected a dtype ({', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)


def _is_dtype(annotation: Any) -> bool:
    return (
        getattr(annotation, "__module__", "") == "torch"
        and getattr(annotation, "__name__", "") == "dtype"
    )


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def _literal_or_string(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        lowered = raw.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return raw


def _keyword_parameters(factory: Callable[..., Any]) -> tuple[set[str], bool]:
    """(names passable by keyword after ``(model, output_path)``, takes ``**kwargs``)."""
    from exportlm.export.options import accepted_kwargs

    try:
        names, var_keyword = accepted_kwargs(factory, skip=2)
    except (TypeError, ValueError):  # no signature to read: accept anything
        return set(), True
    return set(names), var_keyword


def _type_hints(factory: Callable[..., Any]) -> dict[str, Any]:
    """The factory's resolved annotations; ``{}`` when they cannot be resolved."""
    # A callable instance keeps its annotations on its class's __call__.
    for candidate in (factory, type(factory).__call__):
        try:
            return typing.get_type_hints(candidate)
        except Exception:  # any failure to resolve (NameError, TypeError) means "unknown"
            continue
    return {}
