"""The value checks' model of an exporter: its ``conformance_model(seed)``, exported and read back.

An exporter whose modules no toy model holds (a third party's ``QuantScaledLinear``)
still gets its values checked: ``conformance_model(seed)`` (see
:class:`exportlm.module_exporters.ModuleExporter`) builds a small quantized model holding
its modules, which is exported through a recording copy of the registry like a
surveyed toy model. ``quantized_generated``, ``golden_checkpoint`` and
``export_contract`` read that export (:func:`conformance_export`), and the
problems of :func:`conformance_problems`:

- the export raises nothing (a tensor written twice raises
  :class:`~exportlm.errors.DuplicateTensorError` naming it);
- every quantized module is exported exactly once, every parameter reaches the
  checkpoint, each tied group is written once;
- every quantized module the exporter claims records its quantization config
  (``ctx.quant_config.add_layer``) when it has a ``quant_algo``;
- **dequantized equals fake quant**: ``exporter.dequantized_module(module,
  tensors)`` run on seeded inputs gives the fake-quantized module's output within
  ``|dequantized - fake_quant| <= VALUE_ATOL + VALUE_RTOL * max|fake_quant|``.

An exporter that claims no module of the toy models and has no conformance
model fails those checks with :func:`uncovered` (how to provide one), never a
silent skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from exportlm.module_exporters import ExportModuleRegistry, ModuleExporter
from exportlm.quant import is_quantized_module
from pytest_exportcheck.checks._api import CheckResult, ExporterCase
from pytest_exportcheck.checks._common import CheckAbort, error_text, golden_result
from pytest_exportcheck.checks._survey import (
    QuantizedModel,
    Survey,
    exporter_entry,
    exporter_names,
    registry_state,
    survey_for,
    survey_one,
    tie_groups,
)
from pytest_exportcheck.goldens import GoldenStore, tensors_digest

__all__ = [
    "CONFORMANCE_LABEL",
    "VALUE_ATOL",
    "VALUE_RTOL",
    "conformance_export",
    "conformance_golden",
    "conformance_problems",
    "toy_claims",
    "no_golden_case",
    "uncovered",
    "written_by",
    "written_ties",
]

#: The model label of the conformance export in messages and goldens.
CONFORMANCE_LABEL = "conformance_model"
#: Dequantized-vs-fake-quant tolerance: ``|d - f| <= VALUE_ATOL + VALUE_RTOL * max|f|``.
#: Both sides multiply the same dequantized values by the same inputs, but the
#: reference may sum in another order or dtype (float32 vs the module's); a wrong
#: scale or code moves the output by percents.
VALUE_RTOL = 1e-4
VALUE_ATOL = 1e-6


def conformance_export(case: ExporterCase, exporter: ModuleExporter) -> QuantizedModel | None:
    """The recorded export of the exporter's ``conformance_model(case.seed)`` (``None``:
    it has none); a failed check when the method raises or returns no module."""
    registry = case.services.registries.module_exporters
    key = ("conformance", case.name, exporter, case.seed, case.device, registry_state(registry))
    return case.services.memo(
        key, lambda: _export(case.name, exporter, case.seed, case.device, registry)
    )


def _export(
    name: str, exporter: ModuleExporter, seed: int, device: str, registry: ExportModuleRegistry
) -> QuantizedModel | None:
    try:
        model = exporter.conformance_model(seed)
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(
                f"{name}.conformance_model({seed}) raised {error_text(err)}", exception=err
            )
        ) from err
    if model is None:
        return None
    if not isinstance(model, nn.Module):
        raise CheckAbort(
            CheckResult.failed(
                f"{name}.conformance_model({seed}) returned {type(model).__name__}, "
                "expected an nn.Module holding the modules it exports"
            )
        )
    names = exporter_names(registry)
    return survey_one(CONFORMANCE_LABEL, "own", model.to(device), names, registry=registry)


def toy_claims(name: str, survey: Survey) -> int:
    """How many modules of the toy models the exporter claims (the survey's checks cover
    those; only an exporter with none needs a conformance model to be value-checked)."""
    return len(survey.claims_of(name))


def written_by(q: QuantizedModel, exporter: str) -> list[str]:
    """The tensor names ``exporter``'s export calls wrote in ``q``, in order."""
    return [n for c in q.calls if c.exporter == exporter for n in c.names]


def written_ties(q: QuantizedModel) -> dict[str, list[str]]:
    """Per tied group (one Parameter under several names): the names written."""
    return {
        "=".join(group): sorted(n for n in group if n in q.tensors) for group in tie_groups(q.model)
    }


def conformance_golden(
    case: ExporterCase, store: GoldenStore, owner: str | None
) -> CheckResult | None:
    """The exporter's conformance export against ``checkpoint/conformance/<exporter>.json``
    (exact, as every checkpoint golden); ``None`` when it has no conformance model."""
    exporter, _, _ = exporter_entry(case)
    q = conformance_export(case, exporter)
    if q is None:
        return None
    if q.error:
        return CheckResult.failed(
            f"{CONFORMANCE_LABEL}: the export raised {q.error}", exception=q.exception
        )
    from exportlm.export.hf_checkpoint.configs import CheckpointQuantization

    # the hf_quant_config.json section the checkpoint writer's one builder makes of it
    quantization = (
        CheckpointQuantization.of(q.summary).hf_quant_config() if q.summary is not None else {}
    )
    data: dict[str, Any] = {
        "case": "conformance",
        "model": f"{case.name}.{CONFORMANCE_LABEL}({case.seed})",
        "seed": case.seed,
        "exporter": case.name,
        "tensors": tensors_digest({n: q.tensors[n] for n in written_by(q, case.name)}),
        "quantization": quantization,
    }
    ties = written_ties(q)
    if ties:
        data["ties"] = dict(sorted(ties.items()))
    return golden_result(store.check(f"checkpoint/conformance/{case.name}", data, owner=owner))


def no_golden_case(case: ExporterCase, case_ids: list[str], claims: int = 0) -> CheckResult:
    """Why an exporter has no checkpoint golden: toy-model claims skip, none fails.

    ``claims``: the modules it claims in the golden cases' models; only when there
    are none is the (larger) survey of the selected toy models consulted.
    """
    what = f"the {len(case_ids)} golden cases ({', '.join(case_ids)})"
    claims = claims or toy_claims(case.name, survey_for(case))
    if claims:
        return CheckResult.skipped(
            f"module exporter {case.name!r} writes nothing in any of {what} (it claims "
            f"{claims} module(s) of the toy models, which the other exporter checks cover)"
        )
    return uncovered(case.name, f"the toy models nor writes anything in {what}")


def uncovered(name: str, what: str) -> CheckResult:
    """The failure of a value check for an exporter nothing gives values to check."""
    return CheckResult.failed(
        f"value_coverage[{name}]: module exporter {name!r} claims no module of {what} and has "
        "no conformance model, so its written values are unchecked. Give its class a method "
        "conformance_model(self, seed: int) -> nn.Module returning a small model that holds "
        "at least one module it exports, quantized and calibrated from the seed only "
        "(exportlm.quant.synthetic_calibration); see docs/custom-quantized-module.md",
        value_coverage=False,
    )


def conformance_problems(q: QuantizedModel, exporter: ModuleExporter, name: str) -> list[str]:
    """Every problem of the conformance export (see the module docstring)."""
    where = f"{name}.conformance_model()"
    if q.error is not None:
        return [f"{where}: the export raised {q.error}"]
    claimed = [c for c in q.claims if c.exporter == name]
    if not claimed:
        return [f"{where} holds no module that {name} claims (its keys/predicate match none)"]
    problems = _coverage_problems(q, where)
    calls = {c.module_name: c for c in q.calls if c.exporter == name}
    layers = q.summary.quantized_layers if q.summary is not None else {}
    for claim in claimed:
        call = calls.get(claim.name)
        if not claim.quantized or call is None:
            continue
        algo = getattr(claim.module, "quant_algo", None)
        if algo and claim.name not in layers:
            problems.append(
                f"{where}: {claim.name} has quant_algo {algo!r} but no quantization config was "
                f"recorded for it (call ctx.quant_config.add_layer({claim.name!r}, ...))"
            )
        tensors = {n[len(claim.name) + 1 :]: q.tensors[n] for n in call.names}
        problems.extend(_forward_problems(exporter, claim.name, claim.module, tensors, where))
    return problems


def _coverage_problems(q: QuantizedModel, where: str) -> list[str]:
    """Quantized modules not exported once, parameters not written, ties written twice."""
    problems: list[str] = []
    counts: dict[str, int] = {}
    for call in q.calls:
        counts[call.module_name] = counts.get(call.module_name, 0) + 1
    for mname, module in q.model.named_modules():
        if is_quantized_module(module) and counts.get(mname, 0) != 1:
            problems.append(f"{where}: quantized module {mname} exported {counts.get(mname, 0)}x")
    tied = {n for group in tie_groups(q.model) for n in group}
    for group in tie_groups(q.model):
        written = [n for n in group if n in q.tensors]
        if len(written) != 1:
            problems.append(f"{where}: tied {group} written {len(written)} time(s)")
    for pname, _ in q.model.named_parameters():
        owner = pname.rpartition(".")[0]
        if pname in tied or pname in q.tensors:
            continue
        if not any(n.startswith(f"{owner}.") for n in q.tensors):
            problems.append(f"{where}: parameter {pname} reached the checkpoint under no name")
    return problems


def _inputs(module: nn.Module, generator: torch.Generator) -> torch.Tensor | None:
    """Seeded inputs of a linear-like (``in_features``) or embedding-like module."""
    weight = getattr(module, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    vocab, features = getattr(module, "num_embeddings", None), getattr(module, "in_features", None)
    if isinstance(vocab, int):
        return torch.randint(0, vocab, (2, 8), generator=generator).to(device)
    if isinstance(features, int):
        x = torch.randn(8, features, generator=generator)
        return x.to(device=device, dtype=weight.dtype if isinstance(weight, torch.Tensor) else None)
    return None


def _forward_problems(
    exporter: ModuleExporter,
    mname: str,
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    where: str,
) -> list[str]:
    """The exporter's dequantized module against the fake-quantized one, on seeded inputs."""
    kind = type(module).__name__
    try:
        reference = exporter.dequantized_module(module, tensors)
    except Exception as err:
        return [f"{where}: {mname} ({kind}): dequantized_module() raised {error_text(err)}"]
    x = _inputs(module, torch.Generator().manual_seed(0))
    if reference is None or x is None:
        return [
            f"{where}: {mname} ({kind}): no dequantized reference for this module type; "
            "override dequantized_module(module, tensors) to rebuild it from what you write "
            "(and give it in_features / num_embeddings so the check can draw inputs)"
        ]
    with torch.no_grad():
        expected = module(x).float()
        obtained = reference(x).float()
    if obtained.shape != expected.shape:
        return [
            f"{where}: {mname}: dequantized output {list(obtained.shape)}, fake quant "
            f"{list(expected.shape)}"
        ]
    diff = float((obtained - expected).abs().max())
    bound = VALUE_ATOL + VALUE_RTOL * float(expected.abs().max())
    if not diff <= bound:
        return [
            f"{where}: {mname} ({kind}): the written tensors {sorted(tensors)}, dequantized, "
            f"give max abs {diff:.3g} off the fake-quant forward, beyond {VALUE_ATOL:g} + "
            f"{VALUE_RTOL:g} * max|fake_quant| = {bound:.3g} (a wrong scale, code or layout?)"
        ]
    return []
