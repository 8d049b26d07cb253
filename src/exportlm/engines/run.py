"""Run an engine's worker in a subprocess, with a timeout, and read its answer.

Nothing of the engine runs in this process: the worker is started as
``<python> -E -s <worker> REQUEST.json RESPONSE.json --more`` in a fresh temporary
directory, in a session of its own (so a timeout kills the engine's helper
processes too), and kept for the engine's next request (:mod:`exportlm.engines.session`). Each way it can go wrong is a specific
:class:`~exportlm.errors.EngineError` carrying the engine's name, version and
its own error text, trimmed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exportlm.engines import session
from exportlm.engines.interpreter import find_interpreter
from exportlm.engines.protocol import PROTOCOL, EngineRequest, EngineResult, parse_result
from exportlm.engines.registry import get_engine
from exportlm.engines.spec import Engine
from exportlm.engines.untrusted import vet_artifact
from exportlm.errors import (
    EngineCrashedError,
    EngineOutputLimitError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from exportlm.hfdir import vet_model_directory

__all__ = ["probe_engine", "run_engine", "trim"]

logger = logging.getLogger(__name__)

#: What an engine's own error text is trimmed to: its last lines, at most this many characters.
TRIM_LINES = 25
TRIM_CHARS = 4000
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def trim(text: str, lines: int = TRIM_LINES, chars: int = TRIM_CHARS) -> str:
    """The last ``lines`` non-empty lines of ``text``, at most ``chars`` characters.

    A longer text keeps its first quarter and its end: an engine's one-line error often
    names the culprit first and then lists what it would take (vLLM's architectures).
    """
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    out = "\n".join(kept)
    if len(out) <= chars:
        return out
    head = chars // 4
    return out[:head] + " ... " + out[-(chars - head) :]


def _worker_env(engine: Engine) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(_OFFLINE)
    env.update(engine.env)
    return env


def _read_response(
    engine: Engine, resp: Path, tail: str, limit: int = session.MAX_OUTPUT
) -> dict[str, Any] | None:
    if not resp.is_file():
        return None
    if resp.stat().st_size > limit:
        raise EngineOutputLimitError(engine.name, None, "response", limit, tail)
    try:
        loaded = json.loads(resp.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise EngineProtocolError(
            engine.name, None, f"the response is not JSON ({err})", tail
        ) from None
    if not isinstance(loaded, dict) or loaded.get("protocol") != PROTOCOL:
        raise EngineProtocolError(
            engine.name, None, f"the response is not protocol {PROTOCOL}", trim(str(loaded))
        )
    return loaded


def _version(response: Mapping[str, Any] | None) -> str | None:
    version = None if response is None else response.get("engine_version")
    return str(version) if version else None


def _run_worker(
    engine: Engine, python: Path, payload: Mapping[str, Any], timeout: float, max_output: int
) -> dict[str, Any]:
    """Run the request in the engine's worker to its final response; a crash or a timeout raises.

    The worker's stdout and stderr go to a file of which only the end is read back;
    past ``max_output`` bytes (or a response file larger than that) the worker is
    killed and :class:`~exportlm.errors.EngineOutputLimitError` names the cap.

    The worker is one kept from an earlier request with the same engine, interpreter
    and environment where it said it can serve another (:mod:`exportlm.engines.session`).
    """
    cmd = [str(python), "-E", "-s", str(engine.worker_path())]
    logger.debug("engine %s: %s", engine.name, " ".join(cmd))

    def read(resp: Path, log: str) -> dict[str, Any] | None:
        return _read_response(engine, resp, trim(log), max_output)

    ended, response = session.exchange(
        engine.name, cmd, _worker_env(engine), payload, timeout, read, max_output
    )
    tail = trim(ended.log)
    if ended.flooded:
        raise EngineOutputLimitError(engine.name, None, "output", max_output, tail)
    if ended.timed_out:
        raise EngineTimeoutError(engine.name, _version(response), timeout, tail)
    # A worker writes "running" (with its version) once the engine imports, the answer last.
    if response is None or response.get("status") == "running":
        code = -1 if ended.code is None else ended.code  # None: it never exited (not seen)
        raise EngineCrashedError(engine.name, _version(response), code, tail)
    return response


def _exchange(
    engine: Engine,
    payload: Mapping[str, Any],
    python: str | os.PathLike[str] | None,
    overrides: Mapping[str, str | os.PathLike[str]] | None,
    timeout: float | None,
    max_output: int = session.MAX_OUTPUT,
) -> dict[str, Any]:
    """One request/response round with ``engine``'s worker; non-``ok`` answers raise."""
    if python is None:
        found = find_interpreter(engine, overrides)
        if found.path is None:
            raise EngineUnavailableError(engine.name, None, found.reason)
        python = found.path
    limit = engine.timeout if timeout is None else timeout
    response = _run_worker(engine, Path(python), payload, limit, max_output)
    version = _version(response)
    status = response.get("status")
    error = trim(str(response.get("error") or ""))
    if status == "unavailable":
        raise EngineUnavailableError(engine.name, version, f"does not import in {python}", error)
    if status == "refused":
        raise EngineRefusedError(engine.name, version, str(response.get("stage")), error)
    if status != "ok":
        raise EngineProtocolError(engine.name, version, f"unknown status {status!r}", error)
    return response


def run_engine(
    engine: str | Engine,
    artifact: str | os.PathLike[str],
    request: EngineRequest,
    *,
    python: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, str | os.PathLike[str]] | None = None,
    timeout: float | None = None,
    max_output: int = session.MAX_OUTPUT,
) -> EngineResult:
    """Serve ``request`` from ``artifact`` (a checkpoint directory or a file) in ``engine``.

    ``python`` is the interpreter to run the worker with; by default
    :func:`~exportlm.engines.find_interpreter` picks it (``overrides`` are the
    plugin's ``--export-engine`` paths). ``timeout`` defaults to the engine's own;
    ``max_output`` is the cap on the worker's output (and response) in bytes.
    Before any worker starts, the artifact's folder is checked to hold nothing an
    engine would run (:func:`~exportlm.engines.untrusted.vet_artifact`:
    :class:`~exportlm.errors.EngineArtifactRefusedError`).

    Raises :class:`~exportlm.errors.EngineUnavailableError`,
    :class:`~exportlm.errors.EngineRefusedError`,
    :class:`~exportlm.errors.EngineCrashedError`,
    :class:`~exportlm.errors.EngineTimeoutError` or
    :class:`~exportlm.errors.EngineProtocolError` (its subclass
    :class:`~exportlm.errors.EngineOutputLimitError` past ``max_output``;
    ``docs/engines.md``).
    """
    eng = get_engine(engine)
    path = Path(artifact).absolute()
    # The artifact is data: its folder holds no library, no Python, no custom_generate/,
    # no auto_map and no genai_config.json naming a library, checked before any worker starts.
    vet_artifact(path, eng.name)
    if path.is_dir():
        vet_model_directory(path, what=f"artifact for engine {eng.name!r}")
    payload = request.payload(str(path), eng.hints)
    response = _exchange(eng, payload, python, overrides, timeout, max_output)
    result = parse_result(eng.name, response, request)
    if isinstance(result, str):
        raise EngineProtocolError(eng.name, _version(response), f"malformed response: {result}")
    return result


def probe_engine(
    engine: str | Engine,
    *,
    python: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, str | os.PathLike[str]] | None = None,
    timeout: float = 120.0,
) -> str:
    """The version of ``engine`` its interpreter imports; raises as :func:`run_engine` does."""
    eng = get_engine(engine)
    response = _exchange(eng, {"protocol": PROTOCOL, "action": "probe"}, python, overrides, timeout)
    return str(response.get("engine_version") or "unknown")
