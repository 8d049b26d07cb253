"""Exporter checks of what an export call may do: claim every quantized module once,
write only under its prefix, leave the module unchanged, and emit sane tensors."""

from __future__ import annotations

import copy

import torch
from torch import nn

from exportlm.errors import DuplicateTensorError, ExportLMError
from exportlm.module_exporters import DictSink, ExportContext, ModuleExporter
from exportlm.quant import is_quantized_module
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import aborts_to_result, listed
from pytest_exportcheck.checks._survey import (
    SCALE_LEAVES,
    ExportCall,
    QuantizedModel,
    exporter_entry,
    survey_for,
)
from pytest_exportcheck.checks.exporters._examples import (
    claimed_examples,
    hook_examples,
    no_examples,
)
from pytest_exportcheck.checks.exporters.values import conformance_export

__all__ = ["claims_all_quantized", "export_contract", "tensor_problems"]


@check("claims_all_quantized")
@aborts_to_result
def claims_all_quantized(case: ExporterCase) -> CheckResult:
    """Every quantized module of every toy model is claimed by exactly one exporter.

    Registry-wide (the same verdict in every exporter's row): each toy model is
    quantized with each recipe that fits it and exported by the driver; no
    quantized module may be left unclaimed and no tensor may be written twice
    (two exporters claiming the same weights). The row also fails when this
    exporter claims a quantized module and writes nothing for it.
    """
    exporter_entry(case)
    survey = survey_for(case)
    unclaimed = [
        f"{c.model}/{c.recipe}: {c.name} ({type(c.module).__name__})"
        for q in survey.quantized
        for c in q.claims
        if c.quantized and c.exporter is None
    ]
    driver_errors = [
        f"{q.model_name}/{q.recipe}: {q.error.splitlines()[0]}"
        for q in survey.quantized
        if q.error and "written twice" in q.error
    ]
    dropped = [
        f"{c.model}/{c.recipe}: {c.module_name}"
        for c in survey.calls_of(case.name)
        if c.quantized and not c.names and c.error is None
    ]
    problems = []
    if unclaimed:
        problems.append(
            f"registry-wide: {len(unclaimed)} quantized module(s) unclaimed: {listed(unclaimed)}"
        )
    if driver_errors:
        problems.append(f"registry-wide: {listed(driver_errors)}")
    if dropped:
        problems.append(
            f"{case.name} claims quantized modules but writes nothing: {listed(dropped)}"
        )
    total = sum(1 for q in survey.quantized for c in q.claims if c.quantized)
    if problems:
        cause = next(
            (q.exception for q in survey.quantized if q.error and "written twice" in q.error), None
        )
        return CheckResult.failed("; ".join(problems), exception=cause, unclaimed=len(unclaimed))
    return CheckResult.passed(
        f"{total} quantized modules in {len(survey.quantized)} quantized models, each claimed once; "
        f"{len(survey.claims_of(case.name))} by {case.name}",
        quantized_modules=total,
    )


def tensor_problems(name: str, tensor: torch.Tensor) -> list[str]:
    """NaN/inf in any floating tensor (FP8 included); a zero in a scale tensor."""
    problems: list[str] = []
    if tensor.is_floating_point():
        values = tensor.detach().float()
        if not bool(torch.isfinite(values).all()):
            problems.append(f"{name} holds NaN/inf")
        if name.rsplit(".", 1)[-1] in SCALE_LEAVES and bool((values == 0).any()):
            problems.append(f"{name} holds a zero scale")
    return problems


def _call_problems(call: ExportCall, q: QuantizedModel) -> list[str]:
    where = f"{call.model}/{call.recipe}: {call.module_name} ({call.module_type})"
    if call.error is not None:
        return [f"{where}: export raised {call.error.splitlines()[0]}"]
    problems: list[str] = []
    prefix = f"{call.module_name}." if call.module_name else ""
    outside = [n for n in call.names if not n.startswith(prefix)]
    if outside:
        problems.append(f"{where}: wrote outside its prefix {prefix!r}: {outside[:4]}")
    if call.mutated:
        problems.append(f"{where}: modified the module ({list(call.mutated)[:4]})")
    for name in call.names:
        problems.extend(f"{where}: {p}" for p in tensor_problems(name, q.tensors[name]))
    return problems


def _zeroed(module: nn.Module) -> nn.Module:
    """A deep copy whose float weights and calibrated amax are all zero."""
    clone = copy.deepcopy(module)
    with torch.no_grad():
        for param in clone.parameters():
            if param.is_floating_point():
                param.zero_()
        for name, buf in clone.named_buffers():
            if name.rsplit(".", 1)[-1] == "amax" and buf.is_floating_point():
                buf.zero_()
    return clone


def _direct_export(
    exporter: ModuleExporter, name: str, module: nn.Module
) -> tuple[list[str], BaseException | None]:
    """Export ``module`` alone in a fresh context: problems of its tensors, and the exception
    the exporter raised (other than a clear ``ExportLMError`` refusal)."""
    sink = DictSink()
    ctx = ExportContext(model=module, sink=sink)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        exporter.prepare_moe_inputs(name, module, ctx)
        with ctx.exporting(exporter, name, module):
            exporter.export(name, module, ctx)
    except DuplicateTensorError as err:  # not a refusal: a name written twice is a bug
        return [f"{name}: {err}"], err
    except ExportLMError:
        return [], None  # a clear refusal (e.g. of a zero amax) is allowed
    except Exception as err:
        return [f"{name}: export raised {type(err).__name__}: {err}"], err
    problems = [p for n, t in sink.tensors.items() for p in tensor_problems(n, t)]
    outside = [n for n in sink.tensors if not n.startswith(f"{name}.")]
    if outside:
        problems.append(f"{name}: wrote outside its prefix: {outside[:4]}")
    after = module.state_dict()
    if set(after) != set(before) or any(not torch.equal(before[k], after[k]) for k in before):
        problems.append(f"{name}: modified the module")
    return problems, None


@check("export_contract")
@aborts_to_result
def export_contract(case: ExporterCase) -> CheckResult:
    """Exports write only under the module's prefix, leave it unchanged, and emit sane tensors.

    Over every export call the driver makes to this exporter on the quantized toy
    models: no exception; every tensor name starts with ``<module name>.``; the
    module's parameters and buffers are unchanged afterwards; no NaN/inf in any
    floating tensor; no zero in a scale (``weight_scale``, ``weight_scale_2``,
    ``input_scale``, ``k_scale``, ``v_scale``); the calls of the exporter's
    ``conformance_model(seed)`` export count too. Then once per claimed type (and
    ``conformance_examples()``) on a copy with all-zero weights and amax: a zero
    amax must give a safe scale or a clear ``ExportLMError``, never a zero or
    NaN scale.
    """
    exporter, _, _ = exporter_entry(case)
    survey = survey_for(case)
    examples = claimed_examples(case, exporter, survey)
    by_model = {(q.model_name, q.recipe): q for q in survey.quantized}
    calls = survey.calls_of(case.name)
    own = conformance_export(case, exporter)
    if own is not None:  # the exporter's conformance_model(seed), exported by the driver
        by_model[(own.model_name, own.recipe)] = own
        calls += [c for c in own.calls if c.exporter == case.name]
    if not calls and not examples:
        return no_examples(case, survey)
    problems = [p for c in calls for p in _call_problems(c, by_model[(c.model, c.recipe)])]
    causes = [c.exception for c in calls]
    hooks = hook_examples(case, exporter)
    direct = [(f"example{i}", "", module) for i, module in enumerate(hooks)]
    direct += [
        ("zeroed", f"zero amax, {where}: ", _zeroed(m))
        for where, m in examples
        if is_quantized_module(m)
    ]
    for name, prefix, module in direct:
        found, raised = _direct_export(exporter, name, module)
        problems.extend(prefix + p for p in found)
        causes.append(raised)
    if problems:
        return CheckResult.failed(
            f"{case.name}: {listed(problems)}",
            exception=next((c for c in causes if c is not None), None),
            problems=len(problems),
        )
    written = sum(len(c.names) for c in calls)
    return CheckResult.passed(
        f"{len(calls)} export call(s), {written} tensors, {len(hooks)} example(s)"
    )
