"""The served comparison: an engine's answer against the eager model's, as one result.

:func:`serve_and_compare` takes an artifact, its eager reference model (the
fake-quantized model for a quantized artifact) and an engine; it chooses prompts
without near-ties (:func:`choose_prompts`), computes the eager reference
(:func:`eager_reference`: each prompt alone, unpadded, full recompute), sends the
prompts to the engine as one left-padded batch (:func:`~exportlm.engines.run_engine`)
and compares: greedy tokens equal row by row, teacher-forced log-probabilities and
each decode step's log-probabilities (the engine's cache path, :mod:`~exportlm.engines.steps`),
and the KV-cache length where the engine reports it, within the engine's stated
tolerance for the dtype (:meth:`Engine.tolerance <exportlm.engines.Engine.tolerance>`:
on the engine's record, per dtype and per quantized scheme).

What the support table declares decides what an outcome means
(:class:`Outcome`): a row that ``runs`` must match; a ``refused`` / ``engine_limit``
row must fail with the table's message (else the table is out of date: a failure);
a ``misreads`` row must differ (a near-tie confirms nothing: it stays a near-tie). A
declared limit is reported as such (:attr:`Served.declared` is true), never as a pass.

Torch is imported by the functions that need it: importing this imports no torch, no engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from exportlm.engines.artifact import ArtifactKind, artifact_kind
from exportlm.engines.protocol import EngineRequest, EngineResult
from exportlm.engines.reference import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    Reference,
    choose_prompts,
    eager_reference,
)
from exportlm.engines.registry import get_engine
from exportlm.engines.run import run_engine
from exportlm.engines.spec import Engine, Match, Tolerance, Verdict
from exportlm.engines.steps import (
    cache_problem,
    decode_gap,
    describe_gaps,
    divergence,
    prompt_gap,
    swap_margin,
)
from exportlm.errors import EngineError, EngineUnavailableError

__all__ = [
    "NEW_TOKENS",
    "PROMPT_LENGTHS",
    "Outcome",
    "Reference",
    "Served",
    "choose_prompts",
    "compare_result",
    "eager_reference",
    "serve_and_compare",
]


class Outcome(str, Enum):
    """What one served comparison came to."""

    #: the engine ran it and matched the eager model
    PASSED = "passed"
    #: the artifact's fault (or an outdated table): tokens, logprobs, or an undeclared refusal
    FAILED = "failed"
    #: declared in the table and confirmed: the engine refuses this layout
    REFUSED = "refused"
    #: declared and confirmed: the engine loads it but computes something else
    MISREADS = "misreads"
    #: declared and confirmed: no kernel here / a known engine bug (not the artifact's fault)
    ENGINE_LIMIT = "engine_limit"
    #: no interpreter imports the engine
    UNAVAILABLE = "unavailable"
    #: tokens parted only where eager's margin from its token to the engine's is within
    #: what the tolerance can swap (twice it), every logprob compared within it
    NEAR_TIE = "near_tie"


#: Outcomes that are the table's declared verdicts, confirmed by the engine.
DECLARED = (Outcome.REFUSED, Outcome.MISREADS, Outcome.ENGINE_LIMIT)


@dataclass(frozen=True)
class Served:
    """One served comparison, everything a report or a failure message names.

    Attributes:
        engine, engine_version: the engine and the version its worker imported
            (``None`` when it never got that far).
        artifact: the artifact's path; ``kind``: it in the support tables' terms.
        dtype: the compute dtype asked for.
        outcome: see :class:`Outcome`; ``verdict``: what the table declares.
        message: one line saying what happened (the engine's own error included).
        max_gap: the largest |engine - eager| teacher-forced logprob; ``atol``: its bound.
        gap_at: ``(row, position)`` of ``max_gap``.
        tokens_equal: whether every row's greedy tokens equal the eager ones.
        diverges: ``(row, new-token position)`` of the first token that differs.
        decode_gap: the largest |engine - eager| logprob of a decode step, as the
            engine computed it while generating (``None``: it reports none);
            ``decode_gap_at``: its ``(row, step)``.
        engine_error: the engine's own error text when it refused, crashed or timed out.
        tolerance_evidence: where the tolerance comes from (a measurement).
        seconds: the worker's load / generate / score times.
        table_version: the engine version its support table was read from.
    """

    engine: str
    engine_version: str | None
    artifact: str
    kind: ArtifactKind | None
    dtype: str
    outcome: Outcome
    verdict: Verdict
    message: str
    max_gap: float | None = None
    atol: float | None = None
    gap_at: tuple[int, int] | None = None
    tokens_equal: bool | None = None
    diverges: tuple[int, int] | None = None
    decode_gap: float | None = None
    decode_gap_at: tuple[int, int] | None = None
    engine_error: str = ""
    tolerance_evidence: str = ""
    seconds: Mapping[str, float] = field(default_factory=dict)
    table_version: str = ""

    @property
    def off_table(self) -> bool:
        """Whether the engine that answered is not the version its support table was read from."""
        found = self.engine_version
        return bool(self.table_version and found and found != self.table_version)

    @property
    def ok(self) -> bool:
        """Not a failure: passed, a confirmed declared verdict, unavailable or a near-tie."""
        return self.outcome is not Outcome.FAILED

    @property
    def declared(self) -> bool:
        """Whether the outcome is a declared table verdict the engine confirmed."""
        return self.outcome in DECLARED

    def row(self) -> dict[str, Any]:
        """The result as JSON-compatible data (one row of an engine x artifact table)."""
        kind = self.kind
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "artifact": self.artifact,
            "layout": kind.layout if kind else None,
            "scheme": kind.scheme if kind else None,
            "target": kind.target if kind else None,
            "dtype": self.dtype,
            "outcome": self.outcome.value,
            "verdict": self.verdict.value,
            "max_gap": self.max_gap,
            "atol": self.atol,
            "gap_at": list(self.gap_at) if self.gap_at else None,
            "tokens_equal": self.tokens_equal,
            "diverges": list(self.diverges) if self.diverges else None,
            "decode_gap": self.decode_gap,
            "decode_gap_at": list(self.decode_gap_at) if self.decode_gap_at else None,
            "table_version": self.table_version,
            "message": self.message,
        }


def compare_result(
    served: Served, result: EngineResult, ref: Reference, tolerance: Tolerance
) -> Served:
    """``served`` completed with the engine's ``result`` against ``ref``: tokens, the
    teacher-forced logprobs, each decode step's logprobs, the KV-cache lengths."""
    gap, gap_at = prompt_gap(result, ref)
    steps = decode_gap(result, ref)
    diverges = divergence(result, ref)
    name = f"{result.engine} {result.engine_version}"
    base = replace(
        served,
        engine_version=result.engine_version,
        max_gap=gap,
        atol=tolerance.atol,
        gap_at=gap_at,
        tokens_equal=diverges is None,
        diverges=diverges,
        decode_gap=steps.gap if steps else None,
        decode_gap_at=steps.at if steps else None,
        tolerance_evidence=tolerance.evidence,
        seconds=dict(result.seconds),
    )
    numbers = describe_gaps(gap, gap_at, steps, tolerance.atol)
    worst = max(gap, steps.gap if steps else 0.0)
    if diverges is not None:
        r, i = diverges
        margin = swap_margin(ref, r, i, result.tokens[r][i])
        text = (
            f"{name}: row {r} diverges at new token {i}: {result.tokens[r]} != eager "
            f"{ref.tokens[r]} (eager margin there to the engine's token {margin:.3g}, "
            f"top-2 {ref.margins[r][i]:.3g}); {numbers}"
        )
        if margin <= 2 * tolerance.atol and worst <= tolerance.atol:
            return replace(base, outcome=Outcome.NEAR_TIE, message=f"near-tie: {text}")
        return replace(base, outcome=Outcome.FAILED, message=text)
    cache = cache_problem(result, ref)
    if worst > tolerance.atol or cache is not None:
        why = f"KV cache: {cache}; {numbers}" if cache else numbers
        return replace(base, outcome=Outcome.FAILED, message=f"{name}: tokens equal, but {why}")
    rows = len(ref.prompts)
    return replace(
        base,
        outcome=Outcome.PASSED,
        message=(
            f"{name}: greedy tokens equal on {rows} left-padded prompts x "
            f"{len(ref.tokens[0]) if ref.tokens else 0} new tokens; {numbers}"
        ),
    )


def _declared(served: Served, match: Match, err: EngineError | None, got: Served | None) -> Served:
    """A declared refused / misreads / engine-limit row, checked against what happened."""
    row = match.row
    if match.verdict is Verdict.MISREADS:
        assert got is not None or err is not None
        if got is not None and got.outcome is Outcome.FAILED:
            return replace(got, outcome=Outcome.MISREADS, message=f"{match.reason}; {got.message}")
        if got is not None and got.outcome is Outcome.NEAR_TIE:
            # within tolerance but for a near-tie: it neither confirms the misread (these
            # prompts may miss it) nor shows the engine right; named, never a match
            return replace(
                got,
                message=f"the table says {match.reason}; these prompts neither confirm nor "
                f"refute it: {got.message}",
            )
        said = got.message if got is not None else str(err)
        return replace(
            got or served,
            outcome=Outcome.FAILED,
            message=f"the table says {served.engine} misreads this, but: {said}; update the table",
        )
    if err is None:
        assert got is not None
        return replace(
            got,
            outcome=Outcome.FAILED,
            message=f"the table says {match.reason}, but the engine served it ({got.message}); "
            "update the table",
        )
    outcome = Outcome.REFUSED if match.verdict is Verdict.REFUSED else Outcome.ENGINE_LIMIT
    detail = _error_detail(err)
    expected = row.message if row is not None else ""
    if expected and expected not in detail:
        return replace(
            served,
            outcome=Outcome.FAILED,
            engine_version=err.version,
            engine_error=detail,
            message=f"the table says {match.reason} (message {expected!r}), but "
            f"{served.engine} {err.version} says: {detail}",
        )
    return replace(
        served,
        outcome=outcome,
        engine_version=err.version,
        engine_error=detail,
        message=f"{outcome.value}: {match.reason}; {served.engine} {err.version} says: {detail}",
    )


def _error_detail(err: EngineError) -> str:
    return str(getattr(err, "detail", "") or err)


@dataclass(frozen=True)
class _Job:
    engine: Engine
    artifact: Path
    kind: ArtifactKind | None
    dtype: str
    match: Match
    tolerance: Tolerance | None


def _job(
    engine: str | Engine, artifact: Path, dtype: str | None, device: str, kind: ArtifactKind | None
) -> _Job:
    eng = get_engine(engine)
    if kind is None:
        kind = artifact_kind(artifact)
    compute = dtype or kind.dtype
    match = eng.support(
        kind.target,
        kind.layout,
        kind.scheme,
        dtype=compute,
        device=device,
        model_type=kind.model_type,
    )
    scheme = (match.row and match.row.computes) or kind.scheme  # what the engine computes
    return _Job(eng, artifact, kind, compute, match, eng.tolerance(compute, scheme))


def serve_and_compare(
    engine: str | Engine,
    artifact: str | os.PathLike[str],
    model: Any,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    new_tokens: int = NEW_TOKENS,
    kind: ArtifactKind | None = None,
    tolerance: Tolerance | None = None,
    options: Mapping[str, str] | None = None,
    python: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, str | os.PathLike[str]] | None = None,
    timeout: float | None = None,
) -> Served:
    """Serve ``artifact`` in ``engine`` and compare it with the eager ``model``.

    ``model`` is the artifact's eager reference (the fake-quantized model for a
    quantized artifact; for a reduced-precision checkpoint, its rounded weights in
    float32). ``prompts`` default to :func:`choose_prompts`; ``dtype`` to the
    artifact's own; ``tolerance`` to the engine's stated one for that dtype;
    ``options`` to the matching table row's hints, else the engine's; ``kind`` to
    :func:`~exportlm.engines.artifact_kind`. Never raises for what the engine does
    (the :class:`Served` says it); raises ``ValueError`` for an artifact it cannot
    name and :class:`~exportlm.errors.UnknownNameError` for an unknown engine.
    """
    job = _job(engine, Path(artifact), dtype, device, kind)
    tol = tolerance or job.tolerance
    served = Served(
        job.engine.name,
        None,
        str(artifact),
        job.kind,
        job.dtype,
        Outcome.FAILED,
        job.match.verdict,
        "",
        table_version=job.engine.table_version,
    )
    if tol is None:
        return replace(
            served,
            message=f"no tolerance stated for {job.engine.name} at {job.dtype}"
            f"{f' for {job.kind.scheme}' if job.kind and job.kind.scheme else ''} (its Engine "
            "record's tolerances=, docs/engines.md); pass tolerance=",
        )
    if prompts is None:
        prompts = choose_prompts(model, min_margin=2 * tol.atol)
    ref = eager_reference(model, prompts, new_tokens, window=2 * tol.atol)
    hints = options
    if hints is None and job.match.row is not None and job.match.row.hints:
        hints = job.match.row.hints
    request = EngineRequest.left_padded(
        ref.prompts, max_new_tokens=new_tokens, dtype=job.dtype, options=hints
    )
    got, err = _run(job, request, ref, tol, served, python, overrides, timeout)
    if isinstance(err, EngineUnavailableError):
        return replace(served, outcome=Outcome.UNAVAILABLE, message=str(err))
    if job.match.verdict in (Verdict.REFUSED, Verdict.MISREADS, Verdict.ENGINE_LIMIT):
        return _declared(served, job.match, err, got)
    if err is not None:
        detail = _error_detail(err)
        return replace(
            served,
            engine_version=err.version,
            engine_error=detail,
            message=f"{job.engine.name} {err.version or ''} {type(err).__name__} serving "
            f"{artifact} ({job.match.reason}): {detail}",
        )
    assert got is not None
    return got


def _run(
    job: _Job,
    request: EngineRequest,
    ref: Reference,
    tol: Tolerance,
    served: Served,
    python: str | os.PathLike[str] | None,
    overrides: Mapping[str, str | os.PathLike[str]] | None,
    timeout: float | None,
) -> tuple[Served | None, EngineError | None]:
    try:
        result = run_engine(
            job.engine, job.artifact, request, python=python, overrides=overrides, timeout=timeout
        )
    except EngineError as err:  # refused, crashed, timed out, unavailable, protocol
        return None, err
    return compare_result(served, result, ref, tol), None
