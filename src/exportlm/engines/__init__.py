"""Serving engines, run out of process (``docs/engines.md``).

- :class:`Engine` / :class:`Support`: an engine and its support table, as data;
  :meth:`Engine.support` says what it does with one kind of artifact, and why.
- :data:`ENGINE_REGISTRY`, :func:`get_engine`, :func:`engine_names`: the built-in
  engines (:func:`builtin_engines`) and third-party ones from the
  ``exportlm.engines`` entry-point group.
- :func:`find_interpreter`, :func:`parse_engine_options`: which Python runs an engine
  (``--export-engine NAME=PATH``, ``EXPORTLM_ENGINE_<NAME>``, or this one).
- :func:`run_engine`: an :class:`EngineRequest` served from an artifact by the
  engine's worker in a subprocess; an :class:`EngineResult`, or a specific
  :class:`~exportlm.errors.EngineError`.

Importing this package imports no engine and no torch.
"""

from exportlm.engines.builtin import builtin_engines
from exportlm.engines.interpreter import (
    ENGINE_ENV_PREFIX,
    Interpreter,
    engine_env_var,
    find_interpreter,
    parse_engine_options,
)
from exportlm.engines.protocol import PROTOCOL, EngineRequest, EngineResult
from exportlm.engines.registry import (
    ENGINE_REGISTRY,
    ENGINES_GROUP,
    engine_names,
    ensure_engines_registered,
    get_engine,
    validate_engine,
)
from exportlm.engines.run import probe_engine, run_engine
from exportlm.engines.spec import WORKERS_DIR, Engine, Match, Support, Verdict
from exportlm.errors import (
    EngineCrashedError,
    EngineError,
    EngineInterpreterError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
)

__all__ = [
    "ENGINES_GROUP",
    "ENGINE_ENV_PREFIX",
    "ENGINE_REGISTRY",
    "PROTOCOL",
    "WORKERS_DIR",
    "Engine",
    "EngineCrashedError",
    "EngineError",
    "EngineInterpreterError",
    "EngineProtocolError",
    "EngineRefusedError",
    "EngineRequest",
    "EngineResult",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "Interpreter",
    "Match",
    "Support",
    "Verdict",
    "builtin_engines",
    "engine_env_var",
    "engine_names",
    "ensure_engines_registered",
    "find_interpreter",
    "get_engine",
    "parse_engine_options",
    "probe_engine",
    "run_engine",
    "validate_engine",
]
