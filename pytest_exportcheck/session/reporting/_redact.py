"""The JSON report without this machine's paths: what a CI job uploads names no home or user.

Every string of the report (options, messages, tracebacks, details) is rewritten:
a path under the rootdir becomes relative to it, pytest's base temporary directory
``<pytest-tmp>``, the home directory ``~``, and pytest's ``pytest-of-<user>``
directory loses the user name. Only whole path prefixes are rewritten (``/home/al``
leaves ``/home/alice`` alone). Imports only pytest and the standard library.
"""

from __future__ import annotations

import getpass
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest

__all__ = ["report_paths_redacted"]

#: A path prefix starts and ends where a path component does.
_START = r"(?<![\w.\-/])"
_END = r"(?![\w.\-])"


def _prefixes(config: pytest.Config) -> list[tuple[str, str]]:
    """``(absolute path, replacement)``, longest first; ``"/"`` and empty paths never."""
    pairs = [(str(config.rootpath), ".")]
    factory = getattr(config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None) if factory is not None else None
    if basetemp is not None:
        pairs.append((str(basetemp), "<pytest-tmp>"))
    pairs.append((os.path.expanduser("~"), "~"))
    kept = [(p.rstrip(os.sep), r) for p, r in pairs if len(p.rstrip(os.sep)) > 1]
    return sorted(kept, key=lambda pair: -len(pair[0]))


def _user() -> str | None:
    try:
        return getpass.getuser() or None
    except (KeyError, OSError):  # no passwd entry, no login name
        return None


def _rewriter(config: pytest.Config) -> Callable[[str], str]:
    rules: list[tuple[re.Pattern[str], str]] = []
    for prefix, replacement in _prefixes(config):
        if replacement == ".":  # a path under the rootdir becomes relative to it
            rules.append((re.compile(_START + re.escape(prefix + os.sep)), ""))
        rules.append((re.compile(_START + re.escape(prefix) + _END), replacement))
        real = os.path.realpath(prefix)
        if real != prefix:  # /tmp -> /private/tmp and the like
            rules.append((re.compile(_START + re.escape(real) + _END), replacement))
    user = _user()
    if user:
        rules.append((re.compile("pytest-of-" + re.escape(user) + _END), "pytest-of-<user>"))

    def rewrite(text: str) -> str:
        for pattern, replacement in rules:
            text = pattern.sub(replacement, text)
        return text

    return rewrite


def _walk(value: Any, rewrite: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return rewrite(value)
    if isinstance(value, Mapping):
        return {rewrite(str(k)): _walk(v, rewrite) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, rewrite) for v in value]
    return value


def report_paths_redacted(data: Mapping[str, Any], config: pytest.Config) -> dict[str, Any]:
    """``data`` (the JSON report) with every local path rewritten as the module says."""
    result: dict[str, Any] = _walk(data, _rewriter(config))
    return result
