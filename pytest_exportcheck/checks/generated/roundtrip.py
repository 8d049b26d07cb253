"""``roundtrip_generated``: drawn decoder structures roundtrip through a target."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import given
from hypothesis.errors import HypothesisException
from torch import nn

from exportlm.export import TargetInfo
from exportlm.models import ModelSpec, build_from_spec
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import CheckAbort, aborts_to_result, error_text
from pytest_exportcheck.checks._support import (
    TRACED_SHAPE,
    accepts_reason,
    artifact_name,
    export_instance,
    load_runtime,
    require_device,
    roundtrip,
    target_info,
)
from pytest_exportcheck.checks.generated._shared import (
    GeneratedFailure,
    Tally,
    failure_result,
    generated_budget,
    repro_command,
    run,
    write_spec,
)
from pytest_exportcheck.strategies import input_shapes, model_settings, model_specs

__all__ = ["roundtrip_generated"]


def _build(spec: ModelSpec, seed: int, device: str) -> nn.Module:
    model: nn.Module = build_from_spec(spec, seed=seed)
    return model.to(device)


@dataclass
class _Memo:
    """Outcomes by structure within one check run.

    The shrinker replays many choice sequences that draw an equal structure (and
    shape); each outcome is a pure function of them, so a replay costs nothing
    instead of a model build and an export. A few loaded runtimes are kept for
    the other shapes of a structure.
    """

    traced: dict[ModelSpec, GeneratedFailure | str | None] = field(default_factory=dict)
    shapes: dict[tuple[ModelSpec, tuple[int, int]], GeneratedFailure | None] = field(
        default_factory=dict
    )
    loaded: dict[ModelSpec, tuple[nn.Module, Callable[[torch.Tensor], Any]]] = field(
        default_factory=dict
    )
    kept: int = 4

    def keep(self, spec: ModelSpec, model: nn.Module, runtime: Callable[..., Any]) -> None:
        """Keep the loaded runtime of ``spec`` (dropping the oldest beyond :attr:`kept`)."""
        self.loaded[spec] = (model, runtime)
        while len(self.loaded) > self.kept:
            del self.loaded[next(iter(self.loaded))]


def _compare(
    case: TargetCase,
    info: TargetInfo,
    spec: ModelSpec,
    model: nn.Module,
    runtime: Callable[[torch.Tensor], Any],
    shape: tuple[int, int],
) -> GeneratedFailure | None:
    try:
        result = roundtrip(case, info, model, runtime, shape)
    except CheckAbort as abort:
        return GeneratedFailure(spec, abort.result.message, shape, exception=abort.result.exception)
    if not result.ok:
        return GeneratedFailure(
            spec, result.message, shape, exception=result.exception, **dict(result.details)
        )
    return None


def _export_traced(
    case: TargetCase, info: TargetInfo, spec: ModelSpec, memo: _Memo, counter: Iterator[int]
) -> GeneratedFailure | str | None:
    """Build, export, load and compare at the traced shape: a failure, a refusal or ``None``."""
    try:
        model = _build(spec, case.seed, case.device)
    except Exception as err:  # a structure the builder cannot take is a bug of the strategy
        return GeneratedFailure(spec, f"building the model raised {error_text(err)}", exception=err)
    reason = accepts_reason(case, model)
    if reason:
        return reason
    try:
        artifact = export_instance(case, model, case.workdir / f"generated-{next(counter)}")
        runtime = load_runtime(case, artifact)
    except CheckAbort as abort:
        return GeneratedFailure(spec, abort.result.message, exception=abort.result.exception)
    except HypothesisException:
        raise
    except Exception as err:
        return GeneratedFailure(spec, f"the export raised {error_text(err)}", exception=err)
    memo.keep(spec, model, runtime)
    return _compare(case, info, spec, model, runtime, TRACED_SHAPE)


def _roundtrip_one(
    case: TargetCase,
    info: TargetInfo,
    spec: ModelSpec,
    shape: tuple[int, int],
    tally: Tally,
    memo: _Memo,
    counter: Iterator[int],
) -> None:
    """Export one structure and compare its logits; raises :class:`GeneratedFailure`."""
    if spec not in memo.traced:
        outcome = _export_traced(case, info, spec, memo, counter)
        memo.traced[spec] = outcome
        if isinstance(outcome, str):
            tally.refused[outcome] += 1
        else:
            tally.accepted += 1
            tally.families[spec.family] += 1
            tally.vocab_sizes.append(spec.vocab_size)
    outcome = memo.traced[spec]
    if isinstance(outcome, GeneratedFailure):
        raise outcome.again()
    if isinstance(outcome, str) or not info.has("dynamic_shapes"):
        return
    key = (spec, shape)
    if key not in memo.shapes:
        if spec not in memo.loaded:  # evicted: the artifact cache serves the export again
            memo.traced.pop(spec)
            _roundtrip_one(case, info, spec, shape, tally, memo, counter)
            return
        model, runtime = memo.loaded[spec]
        memo.shapes[key] = _compare(case, info, spec, model, runtime, shape)
        tally.shapes.append(list(shape))
    failure = memo.shapes[key]
    if failure is not None:
        raise failure.again()


def _phases(case: TargetCase) -> dict[str, Any]:
    """No shrinking for an item declared as an expected failure: its first failure is enough."""
    if not case.options.get("expected_failure"):
        return {}
    from hypothesis import Phase

    return {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}


@check("roundtrip_generated")
@aborts_to_result
def roundtrip_generated(case: TargetCase) -> CheckResult:
    """Generated structures roundtrip through the target within its declared tolerance.

    Hypothesis draws :data:`~pytest_exportcheck.checks.generated.GENERATED_EXAMPLES` decoder structures (or the
    ``max_examples`` of a profile chosen with ``--hypothesis-profile``)
    (:func:`~pytest_exportcheck.strategies.model_specs`: 1-4 layers, hidden
    16-64, GQA / MQA heads, tied or untied ``lm_head``, dense Llama or Mixtral /
    Qwen3-MoE, vocabulary 97-400 never a multiple of 64) and, for targets
    declaring ``dynamic_shapes``, an input shape other than the traced ``[2, 8]``
    (:func:`~pytest_exportcheck.strategies.input_shapes`: batch 1-4, sequence
    1-16). Each structure is built with ``build_from_spec`` (seed ``case.seed``);
    structures the target's ``accepts`` refuses are counted and skipped (a
    counted skip when it refuses all). The rest are exported (cached by model
    through ``case.export_instance``), loaded in the target's runtime and
    compared with the eager model as ``roundtrip_logits`` does: every element
    within ``atol + rtol * |expected|`` of the target's declared ``atol`` /
    ``rtol`` (no exact float comparison), no NaN / inf, at ``[2, 8]`` and at the
    drawn shape. An export or runtime error fails too. A failure shrinks to the
    smallest structure, which the message prints as JSON (also written to a
    file) with the ``exportlm export --model FILE.json ... --verify`` command
    that reproduces it. An item declared as an expected failure is not shrunk:
    its first failing structure is reported.
    """
    info = target_info(case)
    require_device(case, info)
    tally = Tally()
    budget = generated_budget()
    counter = iter(range(1_000_000))
    memo = _Memo()
    start = time.perf_counter()

    @model_settings(max_examples=budget, database=None, **_phases(case))
    @given(spec=model_specs(), shape=input_shapes())
    def prop(spec: ModelSpec, shape: tuple[int, int]) -> None:
        _roundtrip_one(case, info, spec, shape, tally, memo, counter)

    failure = run(prop)
    seconds = round(time.perf_counter() - start, 2)
    if failure is not None:
        return _failed(case, info, failure)
    return _outcome(case, info, tally, seconds)


def _failed(case: TargetCase, info: TargetInfo, failure: GeneratedFailure) -> CheckResult:
    """The failure with the shrunk structure, written to a file, and the repro command."""
    spec_file = write_spec(case.workdir, f"roundtrip_generated-{case.target_id}", failure.spec)
    out = case.workdir / "repro" / artifact_name(info)
    # The item compares at the traced shape, then at the drawn one: the command does too.
    shapes = [TRACED_SHAPE]
    if failure.shape is not None and tuple(failure.shape) != TRACED_SHAPE:
        shapes.append((int(failure.shape[0]), int(failure.shape[1])))
    command = repro_command(
        case.target,
        spec_file,
        out,
        seed=case.seed,
        options=dict(case.export_kwargs),
        shapes=shapes,
    )
    return failure_result(
        failure,
        f"{case.target_id} fails on a generated model structure "
        f"(tolerance atol={info.atol:g} rtol={info.rtol:g}):",
        spec_file,
        command,
    )


def _outcome(case: TargetCase, info: TargetInfo, tally: Tally, seconds: float) -> CheckResult:
    """A pass with what was drawn, or a counted skip when the target refused every structure."""
    refused = dict(tally.refused)
    if tally.accepted == 0:
        return CheckResult.skipped(
            f"target {case.target_id!r} refused every generated structure: "
            + "; ".join(f"{reason} ({n}x)" for reason, n in refused.items()),
            refused=sum(refused.values()),
        )
    return CheckResult.passed(
        f"{tally.accepted} generated structure(s) within atol={info.atol:g} rtol={info.rtol:g} "
        f"(families {dict(tally.families)}, vocab {tally.vocab_sizes}, "
        f"other shapes {tally.shapes or 'not checked (no dynamic_shapes)'}); "
        f"{sum(refused.values())} refused by accepts; {seconds} s",
        accepted=tally.accepted,
        refused=sum(refused.values()),
        seconds=seconds,
    )
