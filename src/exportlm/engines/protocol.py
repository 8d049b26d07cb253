"""The worker protocol (version 1, ``docs/engines.md``): the request we write, the result we read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROTOCOL", "DecodeSteps", "EngineRequest", "EngineResult", "parse_result"]

PROTOCOL = 1


def _mask_is_left_padded(mask: Sequence[int]) -> bool:
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    return all(m == 0 for m in mask[:first]) and all(m == 1 for m in mask[first:])


@dataclass(frozen=True)
class EngineRequest:
    """Prompts for an engine: left-padded ``input_ids`` with their attention masks.

    Build one with :meth:`left_padded` from unpadded prompts. ``options=None``
    sends the engine's own ``hints``; ``dtype=None`` lets the engine choose.
    """

    input_ids: tuple[tuple[int, ...], ...]
    attention_mask: tuple[tuple[int, ...], ...]
    max_new_tokens: int = 8
    dtype: str | None = None
    options: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("an EngineRequest needs at least one prompt")
        width = len(self.input_ids[0])
        shapes = {len(r) for r in (*self.input_ids, *self.attention_mask)}
        if len(self.input_ids) != len(self.attention_mask) or shapes != {width}:
            raise ValueError(
                "input_ids and attention_mask must be one rectangle of the same shape, "
                f"got {len(self.input_ids)} and {len(self.attention_mask)} rows of lengths {sorted(shapes)}"
            )
        for row, mask in enumerate(self.attention_mask):
            if not _mask_is_left_padded(mask) or not any(mask):
                raise ValueError(
                    f"attention_mask row {row} must be 0s then at least one 1 (left padding), got {list(mask)}"
                )
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @classmethod
    def left_padded(
        cls,
        prompts: Sequence[Sequence[int]],
        *,
        pad_token_id: int = 0,
        max_new_tokens: int = 8,
        dtype: str | None = None,
        options: Mapping[str, str] | None = None,
    ) -> EngineRequest:
        """The request for ``prompts`` (token ids), left-padded to the longest with ``pad_token_id``."""
        width = max((len(p) for p in prompts), default=0)
        ids = tuple((pad_token_id,) * (width - len(p)) + tuple(int(t) for t in p) for p in prompts)
        mask = tuple((0,) * (width - len(p)) + (1,) * len(p) for p in prompts)
        return cls(ids, mask, max_new_tokens, dtype, options)

    def prompts(self) -> list[list[int]]:
        """The real tokens of each row (its padding dropped)."""
        return [
            [t for t, m in zip(ids, mask) if m]
            for ids, mask in zip(self.input_ids, self.attention_mask)
        ]

    def payload(self, artifact: str, hints: Mapping[str, str]) -> dict[str, Any]:
        """The request as the worker reads it."""
        return {
            "protocol": PROTOCOL,
            "action": "run",
            "artifact": artifact,
            "input_ids": [list(r) for r in self.input_ids],
            "attention_mask": [list(r) for r in self.attention_mask],
            "max_new_tokens": self.max_new_tokens,
            "dtype": self.dtype,
            "options": dict(hints if self.options is None else self.options),
        }


@dataclass(frozen=True)
class DecodeSteps:
    """What an engine computed at each decode step, on its own cache (``docs/engines.md``).

    ``logprobs[r][s]``: the log-probability of row ``r``'s chosen token ``s``, from the
    logits of that generation step (step 0: the prefill); ``top[r][s]``: the step's top-k
    ``(token, logprob)`` pairs, best first (``None``: the engine does not give them);
    ``cache_lengths[r][s]``: the row's KV-cache length after step ``s``'s forward pass
    (``None``: the engine does not expose it).
    """

    logprobs: list[list[float]]
    top: list[list[list[tuple[int, float]]]] | None = None
    cache_lengths: list[list[int]] | None = None


@dataclass(frozen=True)
class EngineResult:
    """What an engine produced for an :class:`EngineRequest`.

    ``tokens[r]``: the greedy tokens after row ``r``'s prompt; ``logprobs[r][i]``: the
    engine's log-probability of real prompt token ``i + 1`` given tokens ``0..i``;
    ``decode``: each generation step's own numbers (``None``: the worker gives none).
    """

    engine: str
    engine_version: str
    tokens: list[list[int]]
    logprobs: list[list[float]]
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    decode: DecodeSteps | None = None


def _shape_problem(response: Mapping[str, Any], request: EngineRequest) -> str | None:
    tokens, logprobs = response.get("tokens"), response.get("logprobs")
    prompts = request.prompts()
    if not isinstance(tokens, list) or not isinstance(logprobs, list):
        return "tokens and logprobs must be lists"
    if len(tokens) != len(prompts) or len(logprobs) != len(prompts):
        return (
            f"{len(prompts)} prompts but {len(tokens)} token rows and {len(logprobs)} logprob rows"
        )
    for r, (row, lp, prompt) in enumerate(zip(tokens, logprobs, prompts)):
        if not isinstance(row, list) or len(row) != request.max_new_tokens:
            return f"row {r}: expected {request.max_new_tokens} new tokens, got {row!r}"
        if not isinstance(lp, list) or len(lp) != len(prompt) - 1:
            return f"row {r}: expected {len(prompt) - 1} logprobs, got {len(lp) if isinstance(lp, list) else lp!r}"
    return None


def parse_result(
    name: str, response: Mapping[str, Any], request: EngineRequest
) -> EngineResult | str:
    """An ``ok`` response as an :class:`EngineResult`, or what is wrong with it."""
    problem = _shape_problem(response, request)
    if problem is not None:
        return problem
    try:
        return EngineResult(
            engine=name,
            engine_version=str(response.get("engine_version") or "unknown"),
            tokens=[[int(t) for t in row] for row in response["tokens"]],
            logprobs=[[float(x) for x in row] for row in response["logprobs"]],
            notes=[str(n) for n in response.get("notes") or []],
            seconds={str(k): float(v) for k, v in (response.get("seconds") or {}).items()},
            decode=_decode(response.get("decode"), request),
        )
    except (TypeError, ValueError) as err:
        return f"a token or logprob is not a number (or a decode list has the wrong shape): {err}"


def _rows(value: Any, request: EngineRequest, what: str) -> list[Any]:
    """``value`` as one list per prompt of one entry per new token, or ``ValueError``."""
    want = (len(request.input_ids), request.max_new_tokens)
    if not isinstance(value, list) or len(value) != want[0]:
        raise ValueError(f"decode {what}: expected {want[0]} rows, got {value!r:.80}")
    for r, row in enumerate(value):
        if not isinstance(row, list) or len(row) != want[1]:
            raise ValueError(f"decode {what} row {r}: expected {want[1]} steps, got {row!r:.80}")
    return value


def _decode(value: Any, request: EngineRequest) -> DecodeSteps | None:
    """The response's ``decode`` object; ``ValueError`` for one of the wrong shape."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"decode must be an object, got {value!r:.80}")
    lps = [[float(x) for x in row] for row in _rows(value.get("logprobs"), request, "logprobs")]
    top, cache = value.get("top"), value.get("cache_lengths")
    return DecodeSteps(
        lps,
        None
        if top is None
        else [
            [[(int(t), float(lp)) for t, lp in step] for step in row]
            for row in _rows(top, request, "top")
        ],
        None
        if cache is None
        else [[int(n) for n in row] for row in _rows(cache, request, "cache_lengths")],
    )
