"""``quantized_generated``: drawn structures, quantized, are exported completely and exactly."""

from __future__ import annotations

import shlex
import time
from collections import defaultdict
from typing import Any

import torch
from hypothesis import given
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.models import ModelSpec, build_from_spec
from exportlm.module_exporters import ExportFormat
from exportlm.quant import QuantExperts, QuantFormat, QuantLinear, is_quantized_module, quantize
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import aborts_to_result, error_text, listed
from pytest_exportcheck.checks._recipes import layout_recipe
from pytest_exportcheck.checks._survey import (
    QuantizedModel,
    exporter_entry,
    exporter_names,
    registry_state,
    survey_for,
    survey_one,
    survey_recipes,
    tie_groups,
)
from pytest_exportcheck.checks._survey_quantize import recipe_label, survey_layout
from pytest_exportcheck.checks.exporters.values import (
    conformance_export,
    conformance_problems,
    toy_claims,
    uncovered,
)
from pytest_exportcheck.checks.generated._shared import (
    GeneratedFailure,
    Tally,
    failure_result,
    generated_budget,
    repro_command,
    run,
    shared_seed,
    write_spec,
)
from pytest_exportcheck.strategies import model_settings, model_specs

__all__ = ["generated_recipes", "quantized_generated"]


def generated_recipes(case: ExporterCase) -> tuple[str, ...]:
    """Recipes ``quantized_generated`` tries on each structure: the survey's,
    ``--export-quantize``'s or every registered one (those that do not fit a structure are
    skipped)."""
    return tuple(recipe_label(r) for r in survey_recipes(case.services, case.options))


def _quantize_spec(spec: ModelSpec, recipe: str, seed: int) -> tuple[nn.Module, ExportFormat] | str:
    """``spec`` quantized for ``recipe``'s own layout, and that layout; or why it does not fit."""
    try:
        layout = survey_layout(recipe, None)
        return quantize(build_from_spec(spec, seed=seed), layout_recipe(recipe, layout)), layout
    except UnsupportedFormatError as err:
        return f"{recipe} does not fit: {err}"


def _generated_survey(
    case: ExporterCase, spec: ModelSpec, recipe: str, state: tuple[Any, ...]
) -> QuantizedModel | str:
    """The recorded export of ``spec`` quantized with ``recipe`` (or why it does not fit).

    Remembered per registry state in ``case.services``, so the exporter rows of one
    process share it (under the derandomized CI profile they draw the same structures).
    """

    def compute() -> QuantizedModel | str:
        built = _quantize_spec(spec, recipe, case.seed)
        if isinstance(built, str):
            return built
        model, layout = built
        registry = case.services.registries.module_exporters
        label = f"generated:{spec.family}"
        names = exporter_names(registry)
        return survey_one(label, recipe, model, names, layout, registry=registry)

    return case.services.memo(("generated", spec, recipe, case.seed, state), compute)


def _expected_fp8(q: QuantizedModel) -> dict[str, tuple[str, torch.Tensor]]:
    """Exported weight prefix -> (module name, fake-quantized weight) of every FP8 weight.

    ``QuantLinear``: ``{name}`` -> ``weight_quantizer.fake_quant(effective_weight())``;
    stacked experts: ``{name}.{e}.{gate,up,down}_proj`` -> expert ``e``'s rows of the
    projection's fake-quantized weight (gate/up split as the experts store them).
    """
    expected: dict[str, tuple[str, torch.Tensor]] = {}
    with torch.no_grad():
        for claim in q.claims:
            module = claim.module
            if isinstance(module, QuantLinear):
                quantizer = module.weight_quantizer
                if quantizer.enabled and quantizer.format is QuantFormat.FP8:
                    fq = quantizer.fake_quant(module.effective_weight())
                    expected[claim.name] = (claim.name, fq)
            elif isinstance(module, QuantExperts):
                for projection in module.PROJECTIONS:
                    quantizer = module.weight_quantizer_of(projection)
                    if not (quantizer.enabled and quantizer.format is QuantFormat.FP8):
                        continue
                    fq = quantizer.fake_quant(module.effective_weight(projection))
                    for e in range(fq.shape[0]):
                        if projection == "down_proj":
                            parts = {"down_proj": fq[e]}
                        else:
                            gate, up = module.split_gate_up(fq[e], dim=-2)
                            parts = {"gate_proj": gate, "up_proj": up}
                        for linear, weight in parts.items():
                            expected[f"{claim.name}.{e}.{linear}"] = (claim.name, weight)
    return expected


#: ``(exporter responsible, or None for the registry / driver; what is wrong)``.
_Problem = tuple[str | None, str]


def _fp8_problems(
    q: QuantizedModel, owner_of: dict[str, str], tally: Tally, exporter: str
) -> list[_Problem]:
    """Exported FP8 weights whose dequantization differs from the fake-quant weight (exact)."""
    problems: list[_Problem] = []
    for prefix, (module_name, fake) in _expected_fp8(q).items():
        data = q.tensors.get(f"{prefix}.weight")
        scale = q.tensors.get(f"{prefix}.weight_scale")
        who = owner_of.get(module_name)
        if data is None or scale is None:
            continue  # reported as a dropped weight
        if data.dtype != torch.float8_e4m3fn or scale.numel() != 1:
            problems.append(
                (
                    who,
                    f"{prefix}.weight is {data.dtype} with a weight_scale of shape "
                    f"{list(scale.shape)}; the FP8 recipe exports float8_e4m3fn with one scale",
                )
            )
            continue
        tally.fp8_weights += who == exporter
        # Elementwise on identical inputs (the same FP8 codes, the same float32 scale):
        # a loader's dequantization and fake_quant are the same pure function, so exact.
        dequantized = (data.to(torch.float32) * scale.to(torch.float32).reshape(())).to(fake.dtype)
        if dequantized.shape != fake.shape:
            problems.append(
                (
                    who,
                    f"{prefix}.weight has shape {list(data.shape)}, the fake-quantized "
                    f"weight {list(fake.shape)}",
                )
            )
        elif not torch.equal(dequantized, fake):
            diff = (dequantized - fake).abs()
            problems.append(
                (
                    who,
                    f"{prefix}.weight * weight_scale differs from the fake-quantized weight in "
                    f"{int((diff != 0).sum())} of {fake.numel()} elements (max abs "
                    f"{float(diff.max()):.3g}); they must be bit-identical",
                )
            )
    return problems


def _expected_names(owner: str, leaf: str, module: nn.Module) -> list[str] | None:
    """The tensor names a built-in quantized module's parameter is exported under (None: unknown)."""
    if isinstance(module, QuantLinear):
        return [f"{owner}.{leaf}"]
    if isinstance(module, QuantExperts):
        projection = leaf.removesuffix("_bias")
        kind = "bias" if leaf.endswith("_bias") else "weight"
        if projection not in module.PROJECTIONS:
            return None
        linears = ("down_proj",) if projection == "down_proj" else ("gate_proj", "up_proj")
        experts = int(getattr(module, projection).shape[0])
        return [f"{owner}.{e}.{linear}.{kind}" for e in range(experts) for linear in linears]
    return None


def _dropped_problems(q: QuantizedModel, owner_of: dict[str, str]) -> list[_Problem]:
    """Parameters (ties aside) that reach the checkpoint under no name."""
    problems: list[_Problem] = []
    tied = {name for group in tie_groups(q.model) for name in group}
    modules = dict(q.model.named_modules())
    for name, _ in q.model.named_parameters():
        if name in tied or name in q.tensors:
            continue
        owner, _, leaf = name.rpartition(".")
        who = owner_of.get(owner)
        if who is None:
            problems.append((None, f"weight {name} was dropped (no exporter claims {owner!r})"))
            continue
        expected = _expected_names(owner, leaf, modules[owner])
        if expected is None:  # a module type the check does not know: anything under it
            if not any(n.startswith(f"{owner}.") for n in q.tensors):
                problems.append((who, f"weight {name} was dropped: nothing written under {owner}"))
            continue
        missing = [n for n in expected if n not in q.tensors]
        if missing:
            problems.append(
                (who, f"weight {name} was dropped: {listed(missing)} not written by {who}")
            )
    return problems


def _quantized_problems(q: QuantizedModel, tally: Tally, exporter: str) -> list[_Problem]:
    """Every problem of one recorded export (see :func:`quantized_generated`)."""
    owner_of = {c.name: c.exporter for c in q.claims if c.exporter is not None}
    if q.error is not None:
        failing = [c.exporter for c in q.calls if c.error is not None]
        return [(failing[0] if failing else None, f"the export raised {q.error.splitlines()[0]}")]
    problems: list[_Problem] = []
    calls: defaultdict[str, list[str]] = defaultdict(list)
    for call in q.calls:
        calls[call.module_name].append(call.exporter)
    for name, module in q.model.named_modules():
        if not is_quantized_module(module):
            continue
        by = calls.get(name, [])
        if not by:
            problems.append(
                (None, f"quantized module {name} ({type(module).__name__}) is not exported")
            )
        elif len(by) > 1:
            problems.append(
                (by[0], f"quantized module {name} is exported {len(by)} times (by {by})")
            )
    for group in tie_groups(q.model):
        written = [n for n in group if n in q.tensors]
        if len(written) != 1:
            problems.append((None, f"tied {group} written {len(written)} time(s) ({written})"))
    problems.extend(_dropped_problems(q, owner_of))
    problems.extend(_fp8_problems(q, owner_of, tally, exporter))
    return problems


def _involves(q: QuantizedModel, exporter: str) -> int:
    """How many modules of ``q`` are claimed by (or exported with) ``exporter``."""
    return len(
        {c.name for c in q.claims if c.exporter == exporter}
        | {c.module_name for c in q.calls if c.exporter == exporter}
    )


def _check_spec(case: ExporterCase, spec: ModelSpec, state: tuple[Any, ...], tally: Tally) -> None:
    """Quantize ``spec`` with each recipe and check the export; raises :class:`GeneratedFailure`."""
    for recipe in generated_recipes(case):
        try:
            q = _generated_survey(case, spec, recipe, state)
        except Exception as err:
            raise GeneratedFailure(
                spec,
                f"quantizing with {recipe} raised {error_text(err)}",
                exception=err,
                recipe=recipe,
            ) from err
        if isinstance(q, str):
            tally.not_fitting[recipe] += 1
            tally.refusals.setdefault(recipe, q)
            continue
        tally.quantized_models += 1
        involved = _involves(q, case.name)
        if not involved:
            continue
        tally.claimed += involved
        mine = [
            text
            for who, text in _quantized_problems(q, tally, case.name)
            if who in (None, case.name)
        ]
        if mine:
            cause = next((c.exception for c in q.calls if c.exception is not None), q.exception)
            raise GeneratedFailure(
                spec,
                f"{case.name} with recipe {recipe}: {listed(mine)}",
                exception=cause,
                recipe=recipe,
            )


@check("quantized_generated")
@aborts_to_result
def quantized_generated(case: ExporterCase) -> CheckResult:
    """Generated structures, quantized, are exported completely and exactly.

    Hypothesis draws :data:`~pytest_exportcheck.checks.generated.GENERATED_EXAMPLES` structures (or the ``max_examples``
    of a profile chosen with ``--hypothesis-profile``;
    :func:`~pytest_exportcheck.strategies.model_specs`), each quantized with
    every registered recipe that fits (:func:`generated_recipes`: ``fp8``, ``nvfp4``,
    ``int4_awq``, ``int8_wo``, ``fp8+fp8_kv``, the MX and block formats, a plugin's)
    and exported with ``export_quantized_state``, in a layout the recipe's formats
    have, through a recording copy of the registry (as the survey does). Where this exporter claims a module:

    - every quantized module is exported exactly once (registry-wide);
    - every parameter reaches the checkpoint: under its own name, or for a module
      an exporter claims, under the names the built-in layout gives it
      (``QuantLinear``: ``{name}.weight``; stacked experts:
      ``{name}.{e}.{gate,up,down}_proj.weight``), or (other types) something under
      the module's prefix;
    - each tied group (one ``Parameter`` under several names) is written once;
    - FP8 weights: the exported ``weight`` (float8_e4m3fn) times ``weight_scale``,
      in float32, equals ``TensorQuantizer.fake_quant`` of the module's weight
      **bit for bit** (tolerance 0). That comparison is exact on purpose: both are
      the same elementwise function (FP8 code times the same float32 scale) of
      identical inputs, with no matmul or reduction in between.

    Then the exporter's own ``conformance_model(seed)``, when it has one, is
    exported and checked the same way, and read back: every module it claims,
    rebuilt by ``dequantized_module()``, reproduces the fake-quant forward
    within ``1e-6 + 1e-4 * max|fake_quant|``
    (:mod:`pytest_exportcheck.checks.exporters.values`). An exporter that claims
    nothing in the generated models and has no conformance model fails
    (``value_coverage``); one that claims toy-model modules skips. A failure shrinks to the smallest structure, printed as JSON (and
    written to a file) with an ``exportlm export --target hf_checkpoint
    --quantize RECIPE --model FILE.json`` command that rebuilds and exports it.
    """
    exporter, _, _ = exporter_entry(case)
    own = conformance_export(case, exporter)
    problems = [] if own is None else conformance_problems(own, exporter, case.name)
    if own is not None and problems:
        return CheckResult.failed(
            f"module exporter {case.name!r}: {listed(problems)}", exception=own.exception
        )
    state = registry_state(case.services.registries.module_exporters)
    tally = Tally()
    budget = generated_budget()
    start = time.perf_counter()

    @model_settings(max_examples=budget, database=None)
    @given(spec=model_specs())
    def prop(spec: ModelSpec) -> None:
        _check_spec(case, spec, state, tally)

    failure = run(shared_seed(prop))
    seconds = round(time.perf_counter() - start, 2)
    if failure is not None:
        return _failed(case, failure)
    if not tally.claimed and own is None:
        what = (
            f"the generated models ({tally.quantized_models} quantized models from {budget} "
            f"drawn structures x {', '.join(generated_recipes(case))})"
        )
        claims = toy_claims(case.name, survey_for(case))
        if claims:
            return CheckResult.skipped(
                f"module exporter {case.name!r} claims no module of {what} (it claims "
                f"{claims} module(s) of the toy models, which the other exporter checks cover)"
            )
        return uncovered(case.name, f"the toy models nor of {what}")
    if own is not None:
        tally.claimed += sum(1 for c in own.claims if c.exporter == case.name)
    refused = "".join(
        f"; {recipe} refused {tally.not_fitting[recipe]} structure(s) ({why})"
        for recipe, why in sorted(tally.refusals.items())
    )
    return CheckResult.passed(
        f"{tally.claimed} module(s) claimed by {case.name} in {tally.quantized_models} quantized "
        f"generated models; {tally.fp8_weights} of its FP8 weights bit-identical to fake quant; "
        f"{seconds} s{refused}",
        claimed=tally.claimed,
        fp8_weights=tally.fp8_weights,
        seconds=seconds,
        not_fitting=dict(tally.not_fitting),
        recipes=list(generated_recipes(case)),
    )


def _failed(case: ExporterCase, failure: GeneratedFailure) -> CheckResult:
    """The failure with the shrunk structure, written to a file, and the repro command."""
    spec_file = write_spec(case.workdir, f"quantized_generated-{case.name}", failure.spec)
    recipe = str(failure.details.get("recipe", "fp8"))
    command = repro_command(
        "hf_checkpoint", spec_file, case.workdir / "repro" / "checkpoint", seed=case.seed
    ).replace(" --verify", f" --quantize {shlex.quote(recipe)} --verify")
    return failure_result(
        failure,
        f"module exporter {case.name!r} on a generated quantized model:",
        spec_file,
        command,
    )
