"""``generation_parity``: greedy decoding through the artifact's KV cache gives the eager tokens.

Only for targets declaring ``kv_cache``. The artifact is the family's export with
``kv_cache=True`` (shared through the plugin's artifact cache); its runtime must
be a :class:`~exportlm.export.GenerationRuntime`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from exportlm.export import (
    GenerationResult,
    GenerationRuntime,
    TargetInfo,
    greedy_generate,
    kv_cache_refusal,
)
from exportlm.export.roundtrip import Tolerance, compare_within
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import aborts_to_result, attempt
from pytest_exportcheck.checks._support import (
    IDS_SEED,
    build_case_model,
    default_model_name,
    input_ids_for,
    load_shared_runtime,
    require_device,
    shared_artifact,
    target_info,
)

__all__ = ["NEW_TOKENS", "PROMPT_SHAPE", "PROMPT_TRIES", "generation_parity"]

#: New tokens greedily decoded after each prompt.
NEW_TOKENS = 8
#: ``(batch, seq)`` of the prompts.
PROMPT_SHAPE = (2, 5)
#: Prompts (seeds) tried, in order, for one whose eager decoding has no near-tie.
PROMPT_TRIES = 4


def _tie_slack(eager: GenerationResult, info: TargetInfo) -> torch.Tensor:
    """Per step and row: the eager top-2 margin minus the most the tolerance lets it shrink.

    Logits within ``atol + rtol * |expected|`` of the eager ones can swap the top two
    only where the margin is at most ``2 * atol + rtol * (|top1| + |top2|)``: a negative
    slack is a near-tie that float error alone may flip.
    """
    top = torch.stack([logits.topk(2, dim=-1).values for logits in eager.step_logits])
    bound = 2 * info.atol + info.rtol * top.abs().sum(dim=-1)
    return eager.top2_margins() - bound


@dataclass
class _Prompt:
    ids: torch.Tensor
    eager: GenerationResult
    slack: torch.Tensor
    seed: int


def _choose_prompt(case: TargetCase, info: TargetInfo, model: nn.Module) -> _Prompt:
    """The first of :data:`PROMPT_TRIES` prompts without a near-tie, else the one with the most slack.

    Chosen from the eager model alone, so the choice does not depend on the artifact.
    """
    tried: list[_Prompt] = []
    for offset in range(PROMPT_TRIES):
        seed = case.seed + IDS_SEED + offset
        ids = input_ids_for(model, *PROMPT_SHAPE, seed=seed, device=case.device)
        eager = attempt(
            "greedy decoding with the eager model", greedy_generate, model, ids, NEW_TOKENS
        )
        prompt = _Prompt(ids, eager, _tie_slack(eager, info), seed)
        if float(prompt.slack.min()) > 0:
            return prompt
        tried.append(prompt)
    return max(tried, key=lambda p: float(p.slack.min()))


@check("generation_parity")
@aborts_to_result
def generation_parity(case: TargetCase) -> CheckResult:
    """Greedy decoding through the artifact's KV cache gives the eager model's tokens and logits.

    Only for targets declaring ``kv_cache``. The family is exported with
    ``kv_cache=True``; its runtime must be a ``GenerationRuntime``. A prompt
    ``[2, 5]`` of deterministic ids is decoded greedily for 8 new tokens: one
    ``prefill``, then ``decode`` steps each fed the past the previous step
    returned. The reference is the eager model decoding with its own cache
    (``use_cache=True``). Every step's logits must be within the target's
    ``atol`` / ``rtol`` of the eager ones (no NaN / inf), and the tokens equal.

    Near-ties: the prompt is the first of 4 seeds whose eager decoding has, at
    every step, a top-2 margin that logits within tolerance cannot swap
    (``> 2 * atol + rtol * (|top1| + |top2|)``), chosen from the eager model alone.
    Then any token difference is a failure. Only when all 4 prompts have such a
    near-tie, and the tokens part exactly there with every logit within
    tolerance, is the result a counted skip naming the step. A model with no KV
    cache the targets can carry is a counted skip with the reason.
    """
    info = target_info(case)
    if not info.has("kv_cache"):
        return CheckResult.skipped(f"target {case.target_id!r} does not declare 'kv_cache'")
    require_device(case, info)
    name = default_model_name(case)
    model = build_case_model(case, name)
    refusal = kv_cache_refusal(model)
    if refusal:
        return CheckResult.skipped(f"model {name!r} cannot be exported with kv_cache: {refusal}")
    prompt = _choose_prompt(case, info, model)
    runtime = load_shared_runtime(case, shared_artifact(case, name, kv_cache=True))
    if not isinstance(runtime, GenerationRuntime):
        return CheckResult.failed(
            f"target {case.target_id!r} declares 'kv_cache', but its runtime of a kv_cache=True "
            f"artifact is a {type(runtime).__name__} without prefill / decode steps"
        )
    got = attempt(
        f"greedy decoding through the {case.target_id} runtime",
        greedy_generate,
        runtime,
        prompt.ids,
        NEW_TOKENS,
    )
    return _compare(case, info, prompt, got)


def _compare(
    case: TargetCase, info: TargetInfo, prompt: _Prompt, got: GenerationResult
) -> CheckResult:
    """Step by step: logits within tolerance, then the same tokens (see the check's docstring)."""
    eager = prompt.eager
    worst = 0.0
    for step, (actual, expected) in enumerate(zip(got.step_logits, eager.step_logits, strict=True)):
        result = compare_within(actual, expected, Tolerance.of(info))
        where = f"step {step} ({'prefill' if step == 0 else 'decode'})"
        if not result.passed:
            return CheckResult.failed(
                f"{case.target_id}: generation logits differ from the eager model at {where}: "
                f"{result.summary()}; tokens so far {got.tokens[:, : step + 1].tolist()} vs "
                f"eager {eager.tokens[:, : step + 1].tolist()}",
                step=step,
                **result.details(),
            )
        worst = max(worst, result.max_abs)
        differs = (got.tokens[:, step] != eager.tokens[:, step]).nonzero().flatten().tolist()
        if differs:
            row = differs[0]
            slack = float(prompt.slack[step, row])
            text = (
                f"token {int(got.tokens[row, step])} instead of the eager "
                f"{int(eager.tokens[row, step])} at {where}, row {row}, with every logit within "
                f"atol={info.atol:g} rtol={info.rtol:g}; the eager top-2 margin there is "
                f"{float(eager.top2_margins()[step, row]):.3g}"
            )
            if slack <= 0:
                return CheckResult.skipped(
                    f"{case.target_id}: near-tie on every prompt tried: {text}, which the "
                    "tolerance allows to flip; tokens before it were equal",
                    step=step,
                )
            return CheckResult.failed(f"{case.target_id}: {text}", step=step)
    return CheckResult.passed(
        f"{NEW_TOKENS} greedy tokens x {PROMPT_SHAPE[0]} prompts equal to the eager model's "
        f"(prompt seed {prompt.seed}); step logits max abs {worst:.3g} within "
        f"atol={info.atol:g} rtol={info.rtol:g}; min eager top-2 margin "
        f"{float(eager.top2_margins().min()):.3g}",
        tokens=got.tokens.tolist(),
        max_abs=worst,
        prompt_seed=prompt.seed,
    )
