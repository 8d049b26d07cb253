"""``loadable`` (scope ``"target"``): a quantized checkpoint passes the serving loaders' rules.

For a target declaring ``quantized`` and ``artifact="directory"``, the toy model
is quantized with each of :data:`LOADABLE_RECIPES` (FP8 with an FP8 KV cache,
NVFP4, INT4 AWQ, INT8 weight-only: one recipe per built-in format), exported
(``case.export_instance``, cached) and inspected with
:func:`exportlm.inspection.inspect_checkpoint`, the rules of ``exportlm inspect``
(``docs/checkpoint-rules.md``). Any error-level finding fails the check with the
rule id and the tensor. A recipe that does not fit the toy model (DBRX's fused
experts take FP8 only, and its fused ``Wqkv`` no KV-cache scales) is skipped and
counted in the details; when FP8 with the KV cache does not fit, plain FP8
(:data:`FALLBACK_RECIPE`) is tried in its place. The check skips when none fits. Every recipe on every toy family costs about 0.05 s per export.

A recipe whose format has no ModelOpt scheme is exported in the layout that holds it
(:func:`~pytest_exportcheck.checks._recipes.recipe_layout`, read off its formats:
``w8a8`` is compressed-tensors' ``int-quantized`` W8A8, the scheme vLLM serves), passed
to the target as its ``format=`` option.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from exportlm.errors import UnsupportedFormatError
from exportlm.export import accepted_kwargs
from exportlm.inspection import InspectionReport, inspect_checkpoint
from exportlm.quant.formats import DEFAULT_LAYOUT
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import CheckAbort, aborts_to_result
from pytest_exportcheck.checks._recipes import recipe_layout
from pytest_exportcheck.checks._support import (
    build_case_model,
    default_model_name,
    export_instance,
    target_info,
)
from pytest_exportcheck.checks.targets.checkpoint import quantized_toy, require_checkpoint_target

__all__ = ["FALLBACK_RECIPE", "LOADABLE_RECIPES", "layout_options", "loadable"]

#: The recipes each toy model is exported with: one per built-in format (+ the FP8 KV cache).
LOADABLE_RECIPES = ("fp8+fp8_kv", "nvfp4", "int4_awq", "int8_wo", "int8_sq", "w8a8")
#: Tried when ``fp8+fp8_kv`` does not fit the model (a fused QKV projection).
FALLBACK_RECIPE = "fp8"
_SHOWN = 5


def _errors_text(report: InspectionReport) -> list[str]:
    return [f"[{f.rule}] {f.subject}: {f.message}" for f in report.errors]


def layout_options(case: TargetCase, recipe: str) -> dict[str, Any] | str:
    """The export options that put ``recipe`` in its checkpoint layout (``recipe_layout``:
    ``format=`` when that is not the default one), or why the case's target cannot write
    it (a checkpoint target without ``format=``; no layout holds the recipe).

    A layout is a checkpoint directory's: a file target (ONNX) gets no option.
    """
    if target_info(case).artifact != "directory":
        return {}
    try:
        layout = recipe_layout(recipe)
    except UnsupportedFormatError as err:
        return str(err)
    if layout == DEFAULT_LAYOUT:
        return {}
    names, var_kw = accepted_kwargs(case.services.registries.target_factory(case.target), skip=2)
    if "format" in names or var_kw:
        return {"format": layout}
    return (
        f"{recipe} is written in the {layout} layout (format={layout!r}), and target "
        f"{case.target_id!r} takes no format= option"
    )


def _recipes(case: TargetCase, skipped: dict[str, str]) -> Iterator[str]:
    """``--export-quantize``'s recipes; else :data:`LOADABLE_RECIPES`, then
    :data:`FALLBACK_RECIPE` if ``fp8+fp8_kv`` was skipped."""
    chosen = tuple(case.options.get("quantize") or ())
    if chosen:
        yield from chosen
        return
    yield from LOADABLE_RECIPES
    if LOADABLE_RECIPES[0] in skipped:
        yield FALLBACK_RECIPE


@check("loadable")
@aborts_to_result
def loadable(case: TargetCase) -> CheckResult:
    """Quantized checkpoints (FP8 + FP8 KV, NVFP4, INT4 AWQ, INT8) pass every error-level rule
    of ``exportlm inspect``.

    See the module docstring for the recipes; a file-artifact target is a counted skip.
    """
    require_checkpoint_target(case, "loadable")
    name = default_model_name(case)
    build_case_model(case, name)  # the target's refusal of the family: one skip, its reason
    problems: list[str] = []
    checked: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    for recipe in _recipes(case, skipped):
        try:
            model = quantized_toy(case, name, recipe)
        except CheckAbort as abort:
            if abort.result.status != "skip":
                raise
            skipped[recipe] = abort.result.message
            continue
        options = layout_options(case, recipe)
        if isinstance(options, str):
            skipped[recipe] = options
            continue
        path = export_instance(case, model, case.workdir / f"loadable-{recipe}", **options)
        report = inspect_checkpoint(path)
        checked[recipe] = report.to_json()["counts"]
        problems += [f"{recipe}: {text}" for text in _errors_text(report)]
    if problems:
        shown = "; ".join(problems[:_SHOWN])
        more = f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        return CheckResult.failed(
            f"{case.target_id} checkpoints of {name!r} break {len(problems)} loader rule(s) "
            f"(docs/checkpoint-rules.md): {shown}{more}",
            problems=problems,
            checked=checked,
        )
    if not checked:
        return CheckResult.skipped(
            f"no recipe of {', '.join(LOADABLE_RECIPES)} fits toy model {name!r}: "
            + "; ".join(skipped.values())
        )
    return CheckResult.passed(
        f"{len(checked)} checkpoint(s) of {name!r} ({', '.join(checked)}) pass every "
        "error-level loader rule",
        checked=checked,
        skipped=skipped,
    )
