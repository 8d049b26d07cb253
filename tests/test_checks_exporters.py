"""Module-exporter checks called directly: built-ins pass, deliberately broken exporters fail.

Broken exporters are registered for one test in the real registries (by name
and for dispatch) and removed afterwards; the checks themselves only ever
experiment on copies of the dispatch registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.module_exporters import (
    EXPORT_MODULE_REGISTRY,
    ExportContext,
    ModuleExporter,
    QuantLinearExporter,
    ensure_module_exporters_registered,
)
from exportlm.quant import QuantModule, TensorQuantizer
from pytest_exportcheck.checks import CHECKS, CheckResult, ExporterCase
from tests._services import SERVICES


def run(
    check_id: str, name: str, tmp_path: Path, models: str = "decoder", **kwargs: Any
) -> CheckResult:
    kwargs.setdefault("services", SERVICES)
    case = ExporterCase(name, tmp_path, options={"models": models}, **kwargs)
    return CHECKS[check_id].fn(case)


# ----------------------------------------------------------------------------- built-ins pass


@pytest.mark.parametrize(
    ("check_id", "exporter"),
    [
        ("mro_match", "quant_linear"),
        ("name_match", "quant_linear"),
        ("precedence", "quant_linear"),
        ("reachable", "quant_linear"),
        ("claims_all_quantized", "quant_linear"),
        ("export_contract", "quant_linear"),
        ("tied_weights", "quant_linear"),
        ("predicate_match", "iterable_experts"),
        ("moe_inputs", "quant_moe_linear"),
        ("mro_match", "iterable_experts"),
        ("export_contract", "quant_moe_linear"),
        ("reachable", "quant_embedding"),
    ],
)
def test_builtin_exporters_pass(tmp_path: Path, check_id: str, exporter: str) -> None:
    result = run(check_id, exporter, tmp_path, models="decoder,decoder_tied,iterable_moe")
    assert result.status == "pass", result.message


def test_checks_leave_the_global_registry_alone(tmp_path: Path) -> None:
    ensure_module_exporters_registered()
    before = EXPORT_MODULE_REGISTRY.entries()
    for check_id in ("precedence", "mro_match", "name_match", "predicate_match"):
        run(check_id, "iterable_experts", tmp_path)
    assert EXPORT_MODULE_REGISTRY.entries() == before


class ClaimsNothing(ModuleExporter):
    name = "claims_nothing"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        raise AssertionError("never dispatched: no toy model has a NoSuchQuantModule")


def test_an_exporter_claiming_nothing_skips_with_the_reason(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    name = register_exporter(ClaimsNothing(), "NoSuchQuantModule")
    result = run("export_contract", name, tmp_path)
    assert result.status == "skip"
    assert "claims no module of the toy models" in result.message
    assert "conformance_examples()" in result.message


def test_quant_embedding_is_checked_through_its_conformance_examples(tmp_path: Path) -> None:
    for check_id in ("export_contract", "mro_match"):
        result = run(check_id, "quant_embedding", tmp_path)
        assert result.status == "pass", result.message


# ----------------------------------------------------------------------------- broken exporters fail


class NoOpExporter(ModuleExporter):
    name = "noop"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        return None


def test_fully_shadowed_exporter_fails_reachable(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    name = register_exporter(NoOpExporter(), "QuantLinear")
    result = run("reachable", name, tmp_path)
    assert result.status == "fail"
    assert "unreachable" in result.message
    assert "quant_linear" in result.message


def test_substring_matcher_fails_name_match(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    class SubstringExporter(QuantLinearExporter):
        name = "substring"

    name = register_exporter(
        SubstringExporter(), predicate=lambda m: "QuantLinear" in type(m).__name__, prepend=True
    )
    result = run("name_match", name, tmp_path)
    assert result.status == "fail"
    assert "as a substring" in result.message
    assert "QuantLinear" in result.message


def test_exact_type_predicate_fails_mro_match(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    from exportlm.quant import QuantLinear

    class ExactTypeExporter(QuantLinearExporter):
        name = "exact_type"

    name = register_exporter(
        ExactTypeExporter(), "QuantLinear", predicate=lambda m: type(m) is QuantLinear, prepend=True
    )
    result = run("mro_match", name, tmp_path)
    assert result.status == "fail"
    assert "is dispatched to" in result.message


def test_raising_predicate_fails_predicate_match(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    def predicate(module: nn.Module) -> bool:
        return bool(module[0].weight_quantizer.enabled)  # type: ignore[index]

    name = register_exporter(NoOpExporter(), nn.ModuleList, predicate=predicate)
    result = run("predicate_match", name, tmp_path)
    assert result.status == "fail"
    assert "the predicate raised" in result.message
    assert result.exception is not None  # the predicate's own exception, for --pdb
    assert result.exception.__traceback__ is not None
    assert "predicate" in _frames(result.exception)


def _frames(err: BaseException) -> list[str]:
    names = []
    tb = err.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


class ExporterBug(RuntimeError):
    """Raised by :class:`RaisingExporter`: a bug in the code under test."""


class RaisingExporter(QuantLinearExporter):
    name = "raising"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        raise ExporterBug(f"cannot export {name}")


def test_an_exporter_exception_is_carried_by_the_failure(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    name = register_exporter(RaisingExporter(), "QuantLinear", prepend=True)
    result = run("export_contract", name, tmp_path)
    assert result.status == "fail"
    assert "export raised ExporterBug" in result.message
    assert isinstance(result.exception, ExporterBug)
    assert "export" in _frames(result.exception)  # RaisingExporter.export, for --pdb


class StrayExporter(QuantLinearExporter):
    name = "stray"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        super().export(name, module, ctx)
        ctx.emit(f"stray.{name}.weight", module.weight.detach())


class ZeroScaleExporter(QuantLinearExporter):
    name = "zero_scale"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        ctx.emit(f"{name}.weight", module.weight.detach())
        ctx.emit_scale(f"{name}.weight_scale", torch.zeros(()))


class MutatingExporter(QuantLinearExporter):
    name = "mutating"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        super().export(name, module, ctx)
        with torch.no_grad():
            module.weight.mul_(2.0)


@pytest.mark.parametrize(
    ("exporter", "expected"),
    [
        (StrayExporter(), "wrote outside its prefix"),
        (ZeroScaleExporter(), "holds a zero scale"),
        (MutatingExporter(), "modified the module"),
    ],
)
def test_broken_exports_fail_export_contract(
    tmp_path: Path, register_exporter: Callable[..., str], exporter: ModuleExporter, expected: str
) -> None:
    name = register_exporter(exporter, "QuantLinear", prepend=True)
    result = run("export_contract", name, tmp_path)
    assert result.status == "fail"
    assert expected in result.message


def test_unshared_expert_input_scales_fail_moe_inputs(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    class PerExpertInputScale(QuantLinearExporter):
        name = "per_expert_input"

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            ctx.emit(f"{name}.weight", module.weight.detach())
            expert = int(name.split(".experts.")[1].split(".")[0])
            ctx.emit_scale(f"{name}.input_scale", torch.tensor(1.0 + expert))

    name = register_exporter(PerExpertInputScale(), "QuantMoELinear", prepend=True)
    result = run("moe_inputs", name, tmp_path, models="iterable_moe")
    assert result.status == "fail"
    assert "different" in result.message
    assert "input_scale" in result.message


def test_writing_a_tied_copy_fails_tied_weights(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    class HeadExporter(NoOpExporter):
        name = "head"
        exports_unquantized = True

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            ctx.emit(f"{name}.weight", module.weight.detach())

    name = register_exporter(HeadExporter(), nn.Linear, predicate=lambda m: m.out_features == 256)
    result = run("tied_weights", name, tmp_path, models="decoder_tied")
    assert result.status == "fail"
    assert "written 2 time(s)" in result.message


@pytest.fixture
def without_quant_linear() -> Iterator[None]:
    """Take the built-in QuantLinear exporter out of dispatch for one test, then restore the order."""
    ensure_module_exporters_registered()
    snapshot = EXPORT_MODULE_REGISTRY.entries()
    EXPORT_MODULE_REGISTRY.unregister(EXPORT_MODULE_REGISTRY.get("quant_linear"))
    yield
    EXPORT_MODULE_REGISTRY.restore(snapshot)
    assert EXPORT_MODULE_REGISTRY.entries() == snapshot


@pytest.mark.usefixtures("without_quant_linear")
def test_unclaimed_quantized_module_fails_claims_all_quantized(tmp_path: Path) -> None:
    result = run("claims_all_quantized", "quant_moe_linear", tmp_path)
    assert result.status == "fail"
    assert "unclaimed" in result.message
    assert "layers.0.self_attn.q_proj (QuantLinear)" in result.message


class OddQuant(QuantModule):
    """A quantized module type that no toy model contains."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.weight_quantizer = TensorQuantizer("fp8")


class OddExporter(ModuleExporter):
    name = "odd"

    def conformance_examples(self) -> list[nn.Module]:
        return [OddQuant()]

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        ctx.emit(f"{name}.weight", module.weight.detach())
        ctx.emit_scale(f"{name}.weight_scale", torch.tensor(float("nan")))


def test_conformance_examples_are_checked(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    name = register_exporter(OddExporter(), "OddQuant")
    result = run("export_contract", name, tmp_path)
    assert result.status == "fail"
    assert "example0.weight_scale holds NaN/inf" in result.message
    assert run("mro_match", name, tmp_path).status == "pass"


def test_the_survey_memo_key_holds_the_registry_objects_not_their_ids() -> None:
    from pytest_exportcheck.checks._registries import Registries
    from pytest_exportcheck.checks._survey import registry_state

    state = registry_state(Registries.installed().module_exporters)
    assert state
    assert not any(isinstance(part, int) for entry in state for part in entry)


def test_the_survey_quantizes_each_model_once_per_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_exportcheck.checks import _survey_quantize
    from pytest_exportcheck.checks._services import CheckServices
    from pytest_exportcheck.checks._survey import survey_of

    models, recipes = ("llama", "decoder_tied"), ("fp8", "int8_wo")
    seen: list[str] = []
    real = _survey_quantize.quantize

    def counting(model: Any, recipe: Any, calibrate: Any = None, **kwargs: Any) -> Any:
        seen.append(f"{type(model).__name__}/{recipe}")
        return real(model, recipe, calibrate, **kwargs)

    monkeypatch.setattr(_survey_quantize, "quantize", counting)
    services = CheckServices()
    survey_of(models, 0, recipes, services=services)
    survey_of(models, 0, recipes, services=services)  # remembered by the same services
    assert len(seen) == len(models) * len(recipes)
    survey_of(models, 0, recipes, services=CheckServices())  # a new services quantizes again
    assert len(seen) == 2 * len(models) * len(recipes)
