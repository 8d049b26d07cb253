"""Keyword options of export factories and runtime loaders: what a callable accepts, and the check.

Options are named keyword parameters (``opset=20``, ``device="cuda"``). A
misspelled option must fail loudly instead of being ignored, so every call
through :func:`~exportlm.export.export_model` / :func:`~exportlm.export.load_exported`
is checked against the callable's signature first. A callable that takes
``**kwargs`` checks its own options (the conformance suite's ``unknown_kwargs``
check holds plugins to that).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from exportlm.errors import UnknownOptionError, UnsupportedDtypeError

__all__ = ["accepted_kwargs", "check_kwargs", "resolve_dtype"]


def accepted_kwargs(fn: Callable[..., Any], skip: int = 2) -> tuple[list[str], bool]:
    """(keyword names ``fn`` accepts after its first ``skip`` positionals, has ``**kwargs``).

    ``skip`` is 2 for an export factory ``(model, output_path, ...)`` and 1 for a
    runtime loader ``(artifact, ...)``. Positional-only parameters past ``skip``
    and ``*args`` are not keyword options and are left out.
    """
    sig = inspect.signature(fn)
    names: list[str] = []
    var_kw = False
    positional_seen = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and positional_seen < skip:
            positional_seen += 1
        elif p.kind is not p.POSITIONAL_ONLY:
            names.append(p.name)
    return names, var_kw


def check_kwargs(
    where: str, fn: Callable[..., Any], kwargs: Mapping[str, Any], skip: int = 2
) -> None:
    """Raise :class:`~exportlm.errors.UnknownOptionError` (a ``TypeError``) for kwargs ``fn`` does not accept.

    ``where`` names the callable in the message (``"export target 'onnx'"``).
    Functions with ``**kwargs`` are responsible for their own checking.
    """
    names, var_kw = accepted_kwargs(fn, skip)
    if var_kw:
        return
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise UnknownOptionError(where, unknown, names)


def resolve_dtype(value: Any, *, where: str, supported: Iterable[Any] | None = None) -> Any:
    """``value`` as a ``torch.dtype``: a dtype, or its name (``"bfloat16"``, ``"torch.float16"``).

    ``supported`` (dtypes) limits what is accepted; the error lists them.

    Raises:
        UnsupportedDtypeError: not a dtype name, or not among ``supported``.
    """
    import torch

    allowed = sorted(supported or (), key=str)
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.strip().removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedDtypeError(
            f"{where}: {value!r} is not a torch dtype; pass one such as torch.bfloat16 or its "
            f"name 'bfloat16'{f' (supported: {names})' if names else ''}"
        )
    if allowed and dtype not in allowed:
        raise UnsupportedDtypeError(f"{where}: dtype {dtype} is not supported; supported: {names}")
    return dtype
