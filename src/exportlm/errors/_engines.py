"""Errors of serving engines run out of process."""

from __future__ import annotations

from exportlm.errors._base import ExportLMError
from exportlm.errors._inputs import CustomCodeRefusedError

__all__ = [
    "EngineArtifactRefusedError",
    "EngineCrashedError",
    "EngineError",
    "EngineInterpreterError",
    "EngineOutputLimitError",
    "EngineProtocolError",
    "EngineRefusedError",
    "EngineTimeoutError",
    "EngineUnavailableError",
]


class EngineError(ExportLMError):
    """A serving engine (run out of process by :mod:`exportlm.engines`) did not serve an artifact.

    Attributes:
        engine: the engine's registered name (``"vllm"``).
        version: the engine's version where the worker got far enough to read it, else ``None``.
        detail: the engine's own error text (its exception type and message, or the tail
            of the worker's stderr), trimmed to its last lines; never our traceback.
    """

    def __init__(self, engine: str, version: str | None, summary: str, detail: str = "") -> None:
        self.engine = engine
        self.version = version
        self.detail = detail
        label = f"{engine} {version}" if version else engine
        text = f"{label}: {summary}"
        super().__init__(f"{text}\n{detail}" if detail else text)


class EngineUnavailableError(EngineError):
    """No interpreter runs the engine here: none was given, or the engine does not import in it."""


class EngineInterpreterError(EngineError, ValueError):
    """An interpreter given for an engine (option or environment variable) is not an executable."""


class EngineRefusedError(EngineError):
    """The engine refused to load or run the artifact; ``stage`` says where (``load``, ...)."""

    def __init__(self, engine: str, version: str | None, stage: str, detail: str) -> None:
        self.stage = stage
        super().__init__(engine, version, f"refused the artifact at stage {stage!r}", detail)


class EngineCrashedError(EngineError):
    """The engine's worker exited without a response (a crash); ``returncode`` is its status."""

    def __init__(self, engine: str, version: str | None, returncode: int, detail: str) -> None:
        self.returncode = returncode
        summary = f"the worker exited with status {returncode} without a response"
        super().__init__(engine, version, summary, detail)


class EngineTimeoutError(EngineError, TimeoutError):
    """The engine's worker ran past its timeout and was killed with its process group."""

    def __init__(self, engine: str, version: str | None, timeout: float, detail: str) -> None:
        self.timeout = timeout
        summary = f"the worker ran past its {timeout:g} s timeout and was killed"
        super().__init__(engine, version, summary, detail)


class EngineProtocolError(EngineError):
    """The worker's response is not the JSON the worker protocol describes (``docs/engines.md``)."""


class EngineArtifactRefusedError(CustomCodeRefusedError):
    """An artifact would make a serving engine load a library or run Python of its own
    (``*.so``, ``*.py``, ``custom_generate/``, ``auto_map``, ``custom_ops_library``);
    refused before any worker starts. Attributes: ``path``, ``reasons``, ``engine``."""

    def __init__(self, path: object, reasons: list[str], engine: str) -> None:
        self.path, self.reasons, self.engine = path, list(reasons), engine
        ExportLMError.__init__(
            self,
            f"{path}: refused before engine {engine!r} saw it, as it would run the artifact's "
            f"own code ({'; '.join(self.reasons)}); an artifact is data. Serve one exportlm "
            "wrote, from a folder holding only it, or remove what is named if you reviewed it.",
        )


class EngineOutputLimitError(EngineProtocolError):
    """A worker wrote more than ``limit`` bytes of ``what`` (output or response); it was killed."""

    def __init__(self, engine: str, version: str | None, what: str, limit: int, detail: str):
        self.limit, self.what = limit, what
        summary = f"the worker wrote more than {limit} bytes ({limit / 2**20:g} MiB) of {what}"
        super().__init__(engine, version, summary + ", the cap; it was killed", detail)
