"""The gaps the served comparison measures: prompt scores, tokens and each decode step.

:func:`prompt_gap`: the largest teacher-forced log-probability gap (a separate scoring
pass). :func:`divergence`: the first new token that differs. :func:`decode_gap`: each
generation step's own log-probability (the engine's decode path on its cache, padded
rows included) against the eager full recompute at that position: the chosen token's at
every step up to and including a row's first divergence (after it the contexts differ),
and, where the engine gives its top-k, the eager token's at a divergence.
:func:`swap_margin`: how far below eager's token the engine's choice was there.
:func:`cache_problem`: a KV cache that does not hold the prompt then one entry more per
step. No torch, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from exportlm.engines.protocol import DecodeSteps, EngineResult
from exportlm.engines.reference import Reference

__all__ = [
    "DecodeGap",
    "cache_problem",
    "decode_gap",
    "describe_gaps",
    "divergence",
    "prompt_gap",
    "swap_margin",
]

Where = tuple[int, int]


def _off(got: float, want: float) -> float:
    return abs(got - want) if got == got else float("inf")  # NaN is as far off as it gets


def prompt_gap(result: EngineResult, ref: Reference) -> tuple[float, Where | None]:
    """The largest |engine - eager| teacher-forced logprob and its ``(row, position)``."""
    worst, where = 0.0, None
    for r, (got, want) in enumerate(zip(result.logprobs, ref.logprobs)):
        for i, (g, w) in enumerate(zip(got, want)):
            gap = _off(g, w)
            if where is None or gap > worst:
                worst, where = gap, (r, i)
    return worst, where


def divergence(result: EngineResult, ref: Reference) -> Where | None:
    """``(row, new-token position)`` of the first engine token that is not eager's."""
    for r, (got, want) in enumerate(zip(result.tokens, ref.tokens)):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                return (r, i)
    return None


@dataclass(frozen=True)
class DecodeGap:
    """The largest decode-step gap: ``gap`` at ``(row, step)`` ``at``, and what it compared."""

    gap: float
    at: Where | None
    steps: int
    detail: str


def _step_pairs(
    steps: DecodeSteps, ref: Reference, r: int, s: int, token: int
) -> list[tuple[float, float, str]]:
    """(engine, eager, what) logprob pairs of row ``r``'s step ``s``, engine token ``token``."""
    eager = dict(ref.top[r][s])
    pairs = []
    if token in eager:
        pairs.append((steps.logprobs[r][s], eager[token], f"token {token}"))
    else:  # further below eager's best than any near-tie: no tolerance makes it
        pairs.append((float("inf"), 0.0, f"token {token} not among eager's {_best(ref.top[r][s])}"))
    want = ref.tokens[r][s]
    if token != want and steps.top is not None:
        given = dict(steps.top[r][s])
        if want in given:
            pairs.append((given[want], eager[want], f"eager's token {want}"))
    return pairs


def _best(top: list[tuple[int, float]]) -> str:
    """Eager's candidates at a step, as a message names them (the first few)."""
    shown = ", ".join(f"({t}, {lp:.4g})" for t, lp in top[:4])
    more = f", ... {len(top) - 4} more" if len(top) > 4 else ""
    return f"{len(top)} best [{shown}{more}]"


def swap_margin(ref: Reference, r: int, s: int, token: int) -> float:
    """Eager's logprob margin, at row ``r``'s step ``s``, from its greedy token to
    ``token`` (what an engine chose instead): ``inf`` where ``token`` is not among the
    step's candidates (further than the reference's window), the top-2 margin where the
    reference kept none."""
    if not ref.top:
        return ref.margins[r][s]
    eager = dict(ref.top[r][s])
    if token not in eager:
        return float("inf")
    return eager[ref.tokens[r][s]] - eager[token]


def decode_gap(result: EngineResult, ref: Reference) -> DecodeGap | None:
    """Each decode step's logprob against eager's (``None``: the engine gives none)."""
    steps = result.decode
    if steps is None or not ref.top:
        return None
    worst, where, detail, count = 0.0, None, "", 0
    for r, tokens in enumerate(result.tokens):
        for s, token in enumerate(tokens):
            count += 1
            for got, want, what in _step_pairs(steps, ref, r, s, token):
                gap = _off(got, want)
                if where is None or gap > worst:
                    worst, where = gap, (r, s)
                    detail = f"{what}: engine {got:.6g}, eager {want:.6g}"
            if token != ref.tokens[r][s]:
                break  # after a divergence the contexts differ
    return DecodeGap(worst, where, count, detail)


def describe_gaps(gap: float, at: Where | None, steps: DecodeGap | None, atol: float) -> str:
    """The measured gaps as one clause of a served message."""
    text = f"max |logprob gap| {gap:.3g} (tolerance {atol:g}, at row/position {at})"
    if steps is None:
        return f"{text}; decode steps not reported by the engine"
    return (
        f"{text}; decode steps: max gap {steps.gap:.3g} over {steps.steps} steps "
        f"(at row/step {steps.at}: {steps.detail})"
    )


def cache_problem(result: EngineResult, ref: Reference) -> str | None:
    """What is wrong with the reported KV-cache lengths, or ``None``.

    After the prefill a row's cache holds its prompt (with or without the batch's
    padding), then exactly one entry more per generation step.
    """
    steps = result.decode
    if steps is None or steps.cache_lengths is None:
        return None
    width = max(len(p) for p in ref.prompts)
    for r, lengths in enumerate(steps.cache_lengths):
        prompt = len(ref.prompts[r])
        if lengths and lengths[0] not in (prompt, width):
            return (
                f"row {r}: KV cache holds {lengths[0]} entries after the prefill, expected "
                f"the prompt's {prompt} (or {width} with the batch's padding)"
            )
        for s in range(1, len(lengths)):
            if lengths[s] != lengths[0] + s:
                return (
                    f"row {r}: KV cache holds {lengths[s]} entries after decode step {s}, "
                    f"expected {lengths[0] + s} (one more per step)"
                )
    return None
