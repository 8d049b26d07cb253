"""Which Python interpreter runs an engine.

In order: an explicit path (what the plugin's ``--export-engine NAME=PATH`` hands
over), the environment variable ``EXPORTLM_ENGINE_<NAME>``, else the current
interpreter when the engine's module is importable there. A path may name the
interpreter or a virtual environment (``bin/python`` inside it); it must be absolute
(or start with ``~``): a relative one is refused, never resolved against the current
directory.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from exportlm.engines.registry import get_engine
from exportlm.engines.spec import Engine
from exportlm.errors import EngineInterpreterError

__all__ = [
    "ENGINE_ENV_PREFIX",
    "Interpreter",
    "engine_env_var",
    "find_interpreter",
    "parse_engine_options",
]

ENGINE_ENV_PREFIX = "EXPORTLM_ENGINE_"


@dataclass(frozen=True)
class Interpreter:
    """The answer of :func:`find_interpreter`: a path and where it came from, or why none.

    ``source`` is ``"option"``, ``"env"``, ``"current"`` or ``None`` (no interpreter:
    ``path`` is ``None`` and ``reason`` says what to do).
    """

    path: Path | None
    source: str | None
    reason: str


def engine_env_var(name: str) -> str:
    """The environment variable naming an engine's interpreter: ``EXPORTLM_ENGINE_VLLM``."""
    return ENGINE_ENV_PREFIX + name.upper().replace("-", "_").replace(".", "_")


def _resolve(engine: Engine, given: str | os.PathLike[str], where: str) -> Path:
    path = Path(given).expanduser()
    if not path.is_absolute():
        # Resolved against the current directory, which may be shared (a CI workspace,
        # /tmp), a relative path would run whatever interpreter is planted there.
        raise EngineInterpreterError(
            engine.name,
            None,
            f"{where} names {str(given)!r}, a relative path: it would be looked up in the "
            "current directory, whatever that holds. Give the interpreter's absolute path "
            "(or ~/...), e.g. /opt/venvs/vllm/bin/python",
        )
    if path.is_dir():
        path = path / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineInterpreterError(
            engine.name,
            None,
            f"{where} names {str(given)!r}, which is not an executable Python interpreter "
            "(give .../bin/python or the virtual environment's directory)",
        )
    return path.absolute()


def find_interpreter(
    engine: str | Engine,
    overrides: Mapping[str, str | os.PathLike[str]] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    option: str | None = None,
) -> Interpreter:
    """The interpreter that runs ``engine``, or ``path=None`` with the reason.

    ``option``: how messages name the override (``exportlm verify``'s ``--python``;
    default the plugin's ``--export-engine NAME=``).

    Raises :class:`~exportlm.errors.EngineInterpreterError` when a path was given
    (``overrides`` or the environment variable) but is not an executable: a
    given path never falls back silently.
    """
    eng = get_engine(engine)
    env = os.environ if environ is None else environ
    var = engine_env_var(eng.name)
    option = option or f"--export-engine {eng.name}="
    if overrides and eng.name in overrides:
        where = option
        return Interpreter(_resolve(eng, overrides[eng.name], where), "option", where)
    if env.get(var):
        return Interpreter(_resolve(eng, env[var], var), "env", var)
    if _importable(eng.module):
        return Interpreter(Path(sys.executable), "current", f"{eng.module} imports here")
    hint = f"; {eng.notes}" if eng.notes else ""
    return Interpreter(
        None,
        None,
        f"{eng.module} does not import in {sys.executable} and neither {var} nor "
        f"{option.rstrip('=')}{'=' if option.endswith('=') else ' '}PATH names an "
        f"interpreter{hint}",
    )


def _importable(module: str) -> bool:
    """Whether ``module`` is found here, without importing it (a missing parent is no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # find_spec("a.b") imports "a", which may be absent
        return False


def parse_engine_options(values: Iterable[str]) -> dict[str, str]:
    """``["vllm=/opt/vllm/bin/python", ...]`` as ``{"vllm": "/opt/vllm/bin/python"}``.

    Raises ``ValueError`` for an item without ``NAME=PATH`` or a name given twice,
    and :class:`~exportlm.errors.UnknownNameError` for an engine nobody registered.
    """
    parsed: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        name = name.strip()
        if not sep or not name or not path.strip():
            raise ValueError(f"--export-engine takes NAME=PATH, got {value!r}")
        get_engine(name)
        if name in parsed:
            raise ValueError(f"--export-engine names engine {name!r} twice")
        parsed[name] = path.strip()
    return parsed
