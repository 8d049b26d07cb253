"""Which engines take what a target writes, and whether one is usable here, before any export.

:func:`engines_taking` answers from the support tables alone (``"hf_checkpoint"``:
the engines with a checkpoint row; a target says what it writes in its declaration,
``TargetInfo.artifact_kind`` and ``scheme``); :func:`resolve_engine` finds an engine's
interpreter and its installed version without importing the engine (a
``importlib.metadata`` lookup, in a subprocess for another interpreter: ~50 ms,
against 10-60 s for an engine start). The ``served`` check calls both first, so an
item whose engine is missing or is another version than its table's costs no export.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from exportlm.engines.interpreter import find_interpreter
from exportlm.engines.registry import engine_names, get_engine
from exportlm.engines.spec import Engine

__all__ = ["Resolved", "engines_taking", "installed_version", "resolve_engine"]


def engines_taking(
    target: str, scheme: str | None = None, *, engines: Iterable[Engine] | None = None
) -> list[str]:
    """The registered engines whose support table has a row for artifacts of ``target``
    (a target's declared ``TargetInfo.artifact_kind``: ``"hf_checkpoint"``, ``"onnx"``);
    with ``scheme`` (a target whose every artifact is quantized so), a row for that scheme.
    ``engines``: the records to choose from (default: every registered engine)."""
    records = [get_engine(n) for n in engine_names()] if engines is None else list(engines)
    return [
        e.name
        for e in records
        if any(r.target == target and (scheme is None or r.scheme == scheme) for r in e.table)
    ]


_PROBE = (
    "import importlib.metadata as m, sys\n"
    "for d in sys.argv[1:]:\n"
    "    try:\n"
    "        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
)


@functools.lru_cache(maxsize=64)
def _version_in(python: str, distributions: tuple[str, ...]) -> str | None:
    # Not resolved: every venv's python links to the same binary, with other packages.
    if Path(python).absolute() == Path(sys.executable).absolute():
        for dist in distributions:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None
    try:
        done = subprocess.run(
            [python, "-E", "-s", "-c", _PROBE, *distributions],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def installed_version(engine: str | Engine, python: str | os.PathLike[str]) -> str | None:
    """The engine's installed distribution version in ``python``, without importing it."""
    eng = get_engine(engine)
    return _version_in(str(python), tuple(eng.distributions))


@dataclass(frozen=True)
class Resolved:
    """An engine as found here: its interpreter and version, or why it cannot be used.

    ``status`` is ``"ready"`` (the table's version), ``"unverified"`` (another version
    than the one its table was read from: what the table says is not known to hold) or
    ``"unavailable"`` (no interpreter); ``reason`` says it in a line.
    """

    engine: str
    status: str
    python: Path | None
    version: str | None
    reason: str


def resolve_engine(
    engine: str | Engine, overrides: Mapping[str, str | os.PathLike[str]] | None = None
) -> Resolved:
    """Find ``engine``'s interpreter and installed version (raises as :func:`find_interpreter`)."""
    eng = get_engine(engine)
    found = find_interpreter(eng, overrides)
    if found.path is None:
        return Resolved(eng.name, "unavailable", None, None, found.reason)
    version = installed_version(eng, found.path)
    where = f"{found.path} ({found.reason})"
    if eng.table_version and version != eng.table_version:
        return Resolved(
            eng.name,
            "unverified",
            found.path,
            version,
            f"unverified: {eng.name} {version or '(version unknown)'} in {where}, but its "
            f"support table was read from {eng.table_version} (make engines pins it)",
        )
    return Resolved(eng.name, "ready", found.path, version, f"{eng.name} {version} in {where}")
