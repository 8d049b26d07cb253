"""The eager side of the served comparison: prompts without near-ties and the reference.

:func:`choose_prompts` draws one prompt per length from a seeded generator and keeps
the first whose eager greedy decoding has no near-tie; :func:`eager_reference` runs
each prompt alone and unpadded through the eager model, recomputing the whole row at
each step (no cache): greedy tokens, teacher-forced log-probabilities, and at every
step the top-2 margin and the log-probabilities of eager's best tokens (the two best and
every other token a tolerance could make the engine choose: what each decode step of an
engine is compared with). Torch and numpy are imported by the functions that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FIRST_ID",
    "MIN_MARGIN",
    "NEW_TOKENS",
    "PROMPT_LENGTHS",
    "PROMPT_SEED",
    "PROMPT_TRIES",
    "Reference",
    "TOP_CAP",
    "choose_prompts",
    "eager_reference",
]

#: The smallest eager top-2 logit margin a chosen prompt's greedy steps may have (at
#: least twice the tolerance is used): below it, engine rounding could swap the top two.
MIN_MARGIN = 0.2
#: Greedy tokens decoded after each prompt.
NEW_TOKENS = 8
#: One prompt of each length, left-padded to the longest in the engine's batch.
PROMPT_LENGTHS = (3, 7, 12)
#: The seed of the prompt draws, and how many draws one length may take.
PROMPT_SEED = 19
PROMPT_TRIES = 100
#: At most this many candidates a step of :func:`eager_reference` keeps (its ``window``).
TOP_CAP = 1024
#: Prompt ids start here: 0-2 are the pad / bos / eos ids the engines and configs use.
FIRST_ID = 3


@dataclass(frozen=True)
class Reference:
    """The eager model on the prompts, each alone and unpadded.

    ``tokens[r]``: greedy tokens after prompt ``r``; ``logprobs[r][i]``: log p(prompt
    token ``i + 1`` | tokens ``0..i``); ``margins[r][s]``: the eager top-2 logit margin
    at greedy step ``s``; ``top[r][s]``: that step's candidates as ``(token, logprob)``
    pairs, best first (the greedy token first): the two best, and every other token
    within the reference's ``window`` of the best (at most :data:`TOP_CAP`); empty when
    not computed. A token an engine chose that is not among them is further from
    eager's choice than any near-tie the comparison allows.
    """

    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    margins: list[list[float]]
    top: list[list[list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def min_margin(self) -> float:
        """The smallest top-2 margin of any greedy step (``inf`` with no new tokens)."""
        return min((m for row in self.margins for m in row), default=float("inf"))


def _device(model: Any) -> Any:
    """Where ``model`` takes its ids: its parameters' device, else its ``device`` (a loaded
    runtime such as :func:`exportlm.load_exported`'s), else the CPU."""
    import torch

    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        return next((p.device for p in parameters()), torch.device("cpu"))
    return torch.device(getattr(model, "device", None) or "cpu")


def _logits(model: Any, ids: Any) -> Any:
    out = model(ids)
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits


def eager_reference(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = NEW_TOKENS,
    *,
    window: float = 0.0,
) -> Reference:
    """The eager model's greedy tokens, teacher-forced logprobs and top-2 margins.

    Each greedy step keeps its two best tokens and every token whose logprob is within
    ``window`` of the best (at most :data:`TOP_CAP`): the served comparison passes twice
    its tolerance, the largest eager margin a greedy swap may have and still be a
    near-tie, so the engine's token at a swap is found there with eager's logprob.

    ``model(ids)`` must return logits ``[1, seq, vocab]`` (or an object with
    ``.logits``, as a transformers model does): a module, or a loaded runtime
    (``exportlm.load_exported``: a quantized checkpoint read back with its stored scales). Each prompt runs alone and unpadded,
    recomputing the whole row at each step (no cache): the plainest reference there is.
    """
    import torch

    device = _device(model)
    if not window >= 0:
        raise ValueError(f"eager_reference: window must be a number >= 0, got {window!r}")
    tokens, logprobs, margins, top = [], [], [], []
    with torch.no_grad():
        for prompt in prompts:
            row = [int(t) for t in prompt]
            ids = torch.tensor([row], device=device)
            lp = torch.log_softmax(_logits(model, ids)[0].double(), dim=-1)
            logprobs.append([float(lp[i, row[i + 1]]) for i in range(len(row) - 1)])
            steps: list[float] = []
            best: list[list[tuple[int, float]]] = []
            for _ in range(new_tokens):
                last = _logits(model, torch.tensor([row], device=device))[0, -1].double()
                ranked = torch.topk(torch.log_softmax(last, dim=-1), min(TOP_CAP, last.numel()))
                values, order = ranked.values.tolist(), ranked.indices.tolist()
                steps.append(values[0] - values[1])  # = the logit margin
                keep = max(2, sum(1 for v in values if v >= values[0] - window))
                best.append([(int(i), float(v)) for i, v in zip(order[:keep], values[:keep])])
                row.append(int(last.argmax()))
            tokens.append(row[len(prompt) :])
            margins.append(steps)
            top.append(best)
    return Reference([list(map(int, p)) for p in prompts], tokens, logprobs, margins, top)


def _vocab(model: Any) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > FIRST_ID:
        return size
    import torch

    device = _device(model)
    with torch.no_grad():
        return int(_logits(model, torch.tensor([[FIRST_ID]], device=device)).shape[-1])


def _greedy_margin(model: Any, prompt: Sequence[int], new_tokens: int, floor: float) -> float:
    """The smallest top-2 margin of ``prompt``'s greedy steps, as :func:`eager_reference`
    computes it, but it stops at the first step at or below ``floor`` (the best draw's so
    far: this one can no longer be chosen) and returns the smallest margin up to there.
    The choice is the same as from full references; most draws stop early, and a
    fake-quantized forward is slow (W8A8's 2.0 margin took minutes of draws)."""
    import torch

    device = _device(model)
    row = [int(t) for t in prompt]
    smallest = float("inf")
    with torch.no_grad():
        for _ in range(new_tokens):
            last = _logits(model, torch.tensor([row], device=device))[0, -1].double()
            top = torch.topk(last, 2).values
            smallest = min(smallest, float(top[0] - top[1]))
            if smallest <= floor:
                break
            row.append(int(last.argmax()))
    return smallest


def choose_prompts(
    model: Any,
    *,
    lengths: Sequence[int] = PROMPT_LENGTHS,
    min_margin: float = MIN_MARGIN,
    seed: int = PROMPT_SEED,
    tries: int = PROMPT_TRIES,
    new_tokens: int = NEW_TOKENS,
) -> list[list[int]]:
    """One prompt per length: the first seeded draw whose greedy decoding has no near-tie.

    A near-tie is an eager top-2 margin at or below ``min_margin`` at some greedy step.
    Chosen from the eager model alone (never from an engine's answer). When no draw of
    a length clears ``min_margin`` the one with the largest margin is taken; the
    comparison then reports a token difference at such a step as a near-tie.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = _vocab(model)
    chosen: list[list[int]] = []
    for length in lengths:
        best: tuple[float, list[int]] | None = None
        for _ in range(tries):
            prompt = [int(t) for t in rng.integers(FIRST_ID, vocab, size=length)]
            floor = float("-inf") if best is None else best[0]  # below it: never chosen
            margin = _greedy_margin(model, prompt, new_tokens, floor)
            if best is None or margin > best[0]:
                best = (margin, prompt)
            if margin > min_margin:
                break
        assert best is not None
        chosen.append(best[1])
    return chosen
