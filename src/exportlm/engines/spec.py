"""What an engine is, as data: :class:`Engine` and the rows of its support table.

An engine's support table says, per artifact kind, what that engine does with it
in the version the table was read from: it runs it (on which devices), or it
refuses it (and which layout it takes instead). Every row carries its evidence:
the engine's own message where one was measured, else the engine source file and
version the row was read from. :meth:`Engine.support` answers one question
(this artifact, this dtype, this device) with the row and the reason in one call.

An engine also states its tolerances (:class:`Tolerance`): how far its teacher-forced
log-probabilities may be from the eager model's, per compute dtype and, where a
quantized scheme is computed apart from the fake-quant reference, per scheme; each
with the measurement it rests on. :meth:`Engine.tolerance` looks one up.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

__all__ = [
    "CPU_FEATURES",
    "F32_ATOL",
    "WORKERS_DIR",
    "Engine",
    "Match",
    "Support",
    "Tolerance",
    "Verdict",
    "host_cpu_features",
]

#: The folder of the built-in worker scripts (package data: shipped in the wheel).
WORKERS_DIR = Path(__file__).resolve().parent / "workers"

ALL_DTYPES = ("float32", "bfloat16", "float16")

#: The float32 tolerance of the built-in engines: measured gaps are 1e-6..1.3e-5
#: (reordered reductions), so it leaves about 8x headroom over the largest.
F32_ATOL = 1e-4

#: The CPU features a support row may need, as torch names them (``torch.cpu._is_<name>_supported``:
#: the checks engines such as vLLM-CPU make to choose a kernel library and kernels), with
#: the ``/proc/cpuinfo`` flag that stands in where torch lacks the check.
CPU_FEATURES: Mapping[str, str] = {
    "avx2": "avx2",
    "avx512": "avx512f",
    "avx512_bf16": "avx512_bf16",
    "vnni": "avx512_vnni",
    "amx_tile": "amx_tile",
}


@functools.cache
def host_cpu_features() -> frozenset[str]:
    """The :data:`CPU_FEATURES` this machine's CPU has (torch's checks; else ``/proc/cpuinfo``)."""
    import importlib

    try:
        tcpu: object = importlib.import_module("torch.cpu")
    except ImportError:  # pragma: no cover - torch is a dependency
        tcpu = None
    found: set[str] = set()
    flags: set[str] | None = None
    for name, flag in CPU_FEATURES.items():
        probe = getattr(tcpu, f"_is_{name}_supported", None)
        if probe is not None:
            if probe():
                found.add(name)
            continue
        if flags is None:
            try:
                text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            flags = {
                f for line in text.splitlines() if line.startswith("flags") for f in line.split()
            }
        if flag in flags:
            found.add(name)
    return frozenset(found)


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
        cpu_features: on a CPU, the row holds only where the CPU has at least one of these
            :data:`CPU_FEATURES` (the engine picks its kernels by them); empty: any CPU.
            Elsewhere the verdict is ``cpu_otherwise``, with ``limit`` and ``message``.
        cpu_otherwise: what the engine does on a CPU without ``cpu_features``:
            :attr:`Verdict.ENGINE_LIMIT` (an error, ``message``) or :attr:`Verdict.MISREADS`
            (it runs and computes something else).
        computes: the scheme the engine computes the artifact as, where its kernel is not
            the artifact's own scheme (vLLM CPU's int4 experts quantize their inputs to
            int8: a ``W4A16`` checkpoint computed as ``W4A8``); the comparison then takes
            that scheme's stated tolerance. ``None``: the artifact's scheme.
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
    cpu_features: tuple[str, ...] = ()
    cpu_otherwise: Verdict = Verdict.ENGINE_LIMIT
    computes: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.cpu_features) - set(CPU_FEATURES))
        if unknown:
            raise ValueError(
                f"Support row {self.target}/{self.layout}/{self.scheme}: unknown cpu_features "
                f"{unknown}; expected some of {sorted(CPU_FEATURES)}"
            )
        if self.cpu_otherwise not in (Verdict.ENGINE_LIMIT, Verdict.MISREADS):
            raise ValueError(
                f"Support row {self.target}/{self.layout}/{self.scheme}: cpu_otherwise must be "
                f"engine_limit or misreads, not {self.cpu_otherwise.value}"
            )

    def holds_on_cpu(self, features: frozenset[str]) -> bool:
        """Whether the row holds on a CPU with ``features`` (:attr:`cpu_features`)."""
        return not self.cpu_features or bool(features & set(self.cpu_features))

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
class Tolerance:
    """Max |engine - eager| of a teacher-forced log-probability, and where it comes from.

    Attributes:
        atol: the bound. It also bounds which greedy token may swap: the engine may
            choose a token eager ranks up to ``2 * atol`` below its own (a near-tie, with
            both tokens' logprobs within ``atol``), and prompts are chosen above it.
        evidence: the measurement it rests on (what was served, the gap seen, where).
        dtype: the compute dtype it holds for.
        scheme: the quantized scheme it holds for, as the support tables name it
            (``"W8A8"``); ``None``: any artifact in that dtype without a row of its own.
    """

    atol: float
    evidence: str
    dtype: str = "float32"
    scheme: str | None = None

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.atol != float("inf")):
            raise ValueError(f"Tolerance atol must be a finite number >= 0, got {self.atol!r}")
        if not self.evidence.strip():
            raise ValueError(
                f"Tolerance {self.dtype}/{self.scheme}: state the measurement it rests on "
                "(evidence='measured ... with <engine> <version>')"
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
        tolerances: the stated :class:`Tolerance` per compute dtype (``scheme=None``) and
            per quantized scheme and dtype; :meth:`tolerance` reads them.
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
    tolerances: tuple[Tolerance, ...] = ()

    def __post_init__(self) -> None:
        keys = [(t.dtype, t.scheme) for t in self.tolerances]
        twice = sorted({f"{d}/{s}" for d, s in keys if keys.count((d, s)) > 1})
        if twice:
            raise ValueError(f"engine {self.name!r} states two tolerances for {twice}")

    def tolerance(self, dtype: str, scheme: str | None = None) -> Tolerance | None:
        """The stated tolerance at ``dtype`` for ``scheme`` where one is stated apart, else
        the dtype's own; ``None`` when none is stated (the comparison says so)."""
        rows = {(t.dtype, t.scheme): t for t in self.tolerances}
        if scheme is not None and (dtype, scheme) in rows:
            return rows[dtype, scheme]
        return rows.get((dtype, None))

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
        cpu_features: frozenset[str] | None = None,
    ) -> Match:
        """What this engine does with that artifact, dtype and device (and the checkpoint's
        ``model_type``, for rows limited to some), and why. On a CPU, a row that needs some
        :data:`CPU_FEATURES` is read for ``cpu_features`` (default: this machine's,
        :func:`host_cpu_features`)."""
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
        if device == "cpu" and row.cpu_features:
            features = host_cpu_features() if cpu_features is None else cpu_features
            if not row.holds_on_cpu(features):
                needs = " or ".join(row.cpu_features)
                has = ", ".join(sorted(features)) or "none of them"
                does = "has no path" if row.cpu_otherwise is Verdict.ENGINE_LIMIT else "misreads"
                return Match(
                    row.cpu_otherwise,
                    row,
                    f"{self.name} {does} for {what} on a CPU without {needs} (this one: "
                    f"{has}): {row.limit or row.evidence}",
                )
        return Match(Verdict.RUNS, row, f"{self.name} runs {what} on {device}: {row.evidence}")
