"""Exporter checks of what the checkpoint holds: shared MoE scales, and tied weights once."""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from exportlm.errors import TiedWeightsError
from exportlm.module_exporters import DictSink, export_quantized_state, resolve_tied_weights
from exportlm.quant import TensorQuantizer
from exportlm.quant.formats import get_format
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import aborts_to_result, listed
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.checks._survey import (
    ExportCall,
    QuantizedModel,
    exporter_entry,
    survey_for,
    tie_groups,
)
from pytest_exportcheck.checks.exporters.values import CONFORMANCE_LABEL, conformance_export

__all__ = ["moe_inputs", "tied_weights"]

_EXPERT_SCALE = re.compile(
    r"^(?P<block>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(?P<leaf>input_scale|weight_scale|weight_scale_2)$"
)
_GATE_UP = (("gate_proj", "up_proj"), ("w1", "w3"))


def _owned_names(q: QuantizedModel, calls: list[ExportCall]) -> set[str]:
    """Names written by the calls, or under the expert containers (``*experts``) they exported."""
    names: set[str] = set()
    for call in calls:
        names.update(call.names)
        if call.module_name.rsplit(".", 1)[-1].endswith("experts"):
            prefix = f"{call.module_name}."
            names.update(n for n in q.tensors if n.startswith(prefix))
    return names


def _moe_problems(q: QuantizedModel, names: set[str]) -> tuple[int, list[str]]:
    scales: dict[tuple[str, str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name in names:
        m = _EXPERT_SCALE.match(name)
        if m:
            scales[(m["block"], m["proj"], m["leaf"])][int(m["expert"])] = q.tensors[name]
    problems: list[str] = []
    where = f"{q.model_name}/{q.recipe}"
    for (block, proj, leaf), per_expert in sorted(scales.items()):
        values = list(per_expert.values())
        if leaf == "input_scale" and any(not torch.equal(values[0], v) for v in values[1:]):
            problems.append(f"{where}: experts of {block} have different {proj}.input_scale")
    for (block, gate, leaf), per_expert in sorted(scales.items()):
        for pair in _GATE_UP:
            if gate != pair[0] or leaf not in ("weight_scale", "weight_scale_2"):
                continue
            if leaf == "weight_scale" and not _per_tensor_weights(q.model, block):
                continue  # one block / tile of a small expert is one element, not one tensor
            up = scales.get((block, pair[1], leaf), {})
            for expert, g in per_expert.items():
                u = up.get(expert)
                if u is not None and g.numel() == 1 and u.numel() == 1 and not torch.equal(g, u):
                    problems.append(
                        f"{where}: {block}.{expert} {pair[0]}/{pair[1]} differ in {leaf}"
                    )
    return len(scales), problems


def _per_tensor_weights(model: nn.Module, block: str) -> bool:
    """Whether every weight quantizer under ``block`` has one scale per tensor (its
    format's granularity: a block or tile format's one-element scale on a small expert
    is one block, which gate and up need not share)."""
    try:
        root = model.get_submodule(block)
    except AttributeError:
        return True
    formats = [
        get_format(module.format)
        for name, module in root.named_modules()
        if isinstance(module, TensorQuantizer) and "weight" in name.rsplit(".", 1)[-1]
    ]
    return all(spec.granularity == "tensor" for spec in formats)


@check("moe_inputs")
@aborts_to_result
def moe_inputs(case: ExporterCase) -> CheckResult:
    """Experts of one block share ``input_scale``; gate and up of one expert share ``weight_scale``.

    Reads the per-expert scales (``<block>.<e>.<proj>.input_scale`` /
    ``weight_scale`` / ``weight_scale_2``) written by this exporter, or under an
    expert container (a module named ``*experts``) it claims, in the quantized MoE toy models. Per-tensor
    (one-element) weight scales of gate and up must be equal; for NVFP4 that is
    ``weight_scale_2``. Skips when the exporter writes no expert scales.
    """
    exporter_entry(case)
    survey = survey_for(case)
    groups = 0
    problems: list[str] = []
    for q in survey.quantized:
        calls = [c for c in q.calls if c.exporter == case.name]
        if calls:
            n, found = _moe_problems(q, _owned_names(q, calls))
            groups += n
            problems.extend(found)
    if not groups:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes no MoE expert scales in the toy models"
        )
    if problems:
        return CheckResult.failed(f"{case.name}: {listed(problems)}", problems=len(problems))
    return CheckResult.passed(f"{groups} expert scale groups consistent")


def _is_written(name: str, q: QuantizedModel) -> bool:
    if name in q.tensors:
        return True
    owner = name.rpartition(".")[0]
    return any(c.module_name and (owner + ".").startswith(c.module_name + ".") for c in q.calls)


def _tie_problems(q: QuantizedModel) -> list[str]:
    where = f"{q.model_name}/{q.recipe}"
    if q.error is not None:
        return [f"{where}: export raised {q.error.splitlines()[0]}"]
    problems: list[str] = []
    tied: set[str] = set()
    for group in tie_groups(q.model):
        tied.update(group)
        written = [n for n in group if n in q.tensors]
        if len(written) != 1:
            problems.append(f"{where}: tied {group} written {len(written)} time(s) ({written})")
    for name, _ in q.model.named_parameters():
        if name not in tied and not _is_written(name, q):
            problems.append(f"{where}: real weight {name} was dropped")
    return problems


def _untied_copy(
    registries: Registries, model_name: str, seed: int
) -> tuple[nn.Module, str] | None:
    model: nn.Module = registries.build_model(model_name, seed)
    groups = tie_groups(model)
    if not groups:
        return None
    target = groups[0][-1]
    owner, _, leaf = target.rpartition(".")
    param = model.get_submodule(owner).get_parameter(leaf)
    setattr(
        model.get_submodule(owner), leaf, nn.Parameter(param.detach() + 0.5, requires_grad=False)
    )
    return model, target


def _untied_problems(
    registries: Registries, model_name: str, seed: int
) -> tuple[list[str], BaseException | None]:
    """Exporting a copy whose declared tie was broken must raise ``TiedWeightsError``.

    The problem, and the exception raised instead of ``TiedWeightsError``, if any.
    """
    untied = _untied_copy(registries, model_name, seed)
    if untied is None or not resolve_tied_weights(registries.build_model(model_name, seed)):
        return [], None
    model, target = untied
    try:
        export_quantized_state(model, DictSink(), registry=registries.module_exporters)
    except TiedWeightsError:
        return [], None
    except Exception as err:
        return [
            f"{model_name} with {target} untied: raised {type(err).__name__}, not TiedWeightsError"
        ], err
    return [
        f"{model_name} with {target} changed but still declared tied: exported without error"
    ], None


@check("tied_weights")
@aborts_to_result
def tied_weights(case: ExporterCase) -> CheckResult:
    """Tied weights are written once, by name; no real weight is dropped; differing ties raise.

    For each quantized toy model with tied parameters in which this exporter
    exports something: each tied group (one ``Parameter`` under several names) is
    written exactly once, and every other parameter is written (or exported by an
    exporter that owns its module). Then a copy whose declared tie was broken
    (the tied target given other values) must make ``export_quantized_state``
    raise :class:`~exportlm.errors.TiedWeightsError`. The exporter's
    ``conformance_model(seed)`` counts as one more model when it has ties.
    """
    exporter, _, _ = exporter_entry(case)
    survey = survey_for(case)
    own = conformance_export(case, exporter)
    relevant = [
        q
        for q in [*survey.quantized, *([own] if own is not None else [])]
        if tie_groups(q.model) and any(c.exporter == case.name for c in q.calls)
    ]
    if not relevant:
        return CheckResult.skipped(
            f"module exporter {case.name!r} exports nothing in a tied toy model "
            f"(selected: {', '.join(survey.models)}) nor in a tied conformance_model()"
        )
    problems = [p for q in relevant for p in _tie_problems(q)]
    causes = [q.exception for q in relevant]
    for model_name in sorted({q.model_name for q in relevant} - {CONFORMANCE_LABEL}):
        found, raised = _untied_problems(case.services.registries, model_name, case.seed)
        problems += found
        causes.append(raised)
    if problems:
        return CheckResult.failed(
            f"{case.name}: {listed(problems)}",
            exception=next((c for c in causes if c is not None), None),
            problems=len(problems),
        )
    return CheckResult.passed(f"{len(relevant)} tied quantized model(s): one copy, nothing dropped")
