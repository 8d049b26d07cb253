"""Serving engines, run out of process (``docs/engines.md``).

- :class:`Engine` / :class:`Support`: an engine and its support table, as data;
  :meth:`Engine.support` says what it does with one kind of artifact, and why.
- :data:`ENGINE_REGISTRY`, :func:`get_engine`, :func:`engine_names`: the built-in
  engines (:func:`builtin_engines`) and third-party ones from the
  ``exportlm.engines`` entry-point group.
- :func:`find_interpreter`, :func:`parse_engine_options`: which Python runs an engine
  (``--export-engine NAME=PATH``, ``EXPORTLM_ENGINE_<NAME>``, or this one).
- :func:`artifact_kind`: a checkpoint directory or ONNX file in the tables' terms.
- :func:`engines_taking`, :func:`resolve_engine`: which engines take what a target
  writes, and an engine's interpreter and installed version, found before any export.
- :func:`run_engine`: an :class:`EngineRequest` served from an artifact by the
  engine's worker in a subprocess; an :class:`EngineResult`, or a specific
  :class:`~exportlm.errors.EngineError`.
- :func:`serve_and_compare`: the served comparison (prompts without near-ties, the
  eager reference, the engine's answer, its stated :meth:`Engine.tolerance`) as one
  :class:`Served` result naming engine, version, artifact, gap and divergence.

Importing this package imports no engine and no torch.
"""

from exportlm.engines.artifact import ArtifactKind, artifact_kind
from exportlm.engines.builtin import builtin_engines
from exportlm.engines.compare import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    Outcome,
    Reference,
    Served,
    choose_prompts,
    compare_result,
    eager_reference,
    serve_and_compare,
)
from exportlm.engines.interpreter import (
    ENGINE_ENV_PREFIX,
    Interpreter,
    engine_env_var,
    find_interpreter,
    parse_engine_options,
)
from exportlm.engines.protocol import PROTOCOL, DecodeSteps, EngineRequest, EngineResult
from exportlm.engines.reference import MIN_MARGIN
from exportlm.engines.registry import (
    ENGINE_REGISTRY,
    ENGINES_GROUP,
    engine_names,
    ensure_engines_registered,
    get_engine,
    validate_engine,
)
from exportlm.engines.resolve import (
    Resolved,
    engines_taking,
    installed_version,
    resolve_engine,
)
from exportlm.engines.run import probe_engine, run_engine
from exportlm.engines.spec import WORKERS_DIR, Engine, Match, Support, Tolerance, Verdict
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
    "MIN_MARGIN",
    "NEW_TOKENS",
    "PROMPT_LENGTHS",
    "PROTOCOL",
    "WORKERS_DIR",
    "ArtifactKind",
    "DecodeSteps",
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
    "Outcome",
    "Reference",
    "Resolved",
    "Served",
    "Support",
    "Tolerance",
    "Verdict",
    "artifact_kind",
    "builtin_engines",
    "choose_prompts",
    "compare_result",
    "eager_reference",
    "engine_env_var",
    "engine_names",
    "engines_taking",
    "ensure_engines_registered",
    "find_interpreter",
    "get_engine",
    "installed_version",
    "parse_engine_options",
    "probe_engine",
    "resolve_engine",
    "run_engine",
    "serve_and_compare",
    "validate_engine",
]
