"""``precedence`` fails for broken dispatch; every check has a test that makes it fail.

``precedence`` checks what an exporter's registry entry does on copies of the
dispatch registry: re-registration keeps its position, ``prepend=True`` puts a
probe with the same keys first and lets it win, an appended probe wins nothing.
An exporter cannot move its own entry (the registry does that), so what can go
wrong is the registry the plugin hands out (``EXPORT_MODULE_REGISTRY`` replaced
by a subclass with another ordering rule) or the exporter's predicate (one that
answers differently depending on who asks first). Each is built here on purpose
and the check must fail, naming the rule that broke.

The last test keeps the catalogue honest: every check id maps to a test that
makes that check fail on a deliberately broken target or exporter.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.module_exporters import (
    EXPORT_MODULE_REGISTRY,
    ExportContext,
    ExportModuleRegistry,
    ModuleExporter,
)
from exportlm.quant import QuantModule, TensorQuantizer
from pytest_exportcheck.checks import CHECKS, CheckResult, CheckServices, ExporterCase, Registries
from tests._services import SERVICES


class ProbeQuant(QuantModule):
    """A quantized module type that no toy model contains (examples come from the hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.weight_quantizer = TensorQuantizer("fp8")


class ProbeQuantExporter(ModuleExporter):
    """A correct exporter for :class:`ProbeQuant`, with its own conformance examples."""

    name = "probe_quant"

    def conformance_examples(self) -> list[nn.Module]:
        return [ProbeQuant(), ProbeQuant()]

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        ctx.emit(f"{name}.weight", module.weight.detach())


def run_precedence(tmp_path: Path, name: str, services: CheckServices = SERVICES) -> CheckResult:
    # no toy model holds a ProbeQuant: the examples come from conformance_examples()
    case = ExporterCase(name, tmp_path, options={"models": "decoder"}, services=services)
    return CHECKS["precedence"].fn(case)


# ----------------------------------------------------------------------------- broken registries


class MovesOnReregister(ExportModuleRegistry):
    """Re-registering an exporter removes its entry and appends a new one (loses its place)."""

    def register(
        self,
        exporter: ModuleExporter,
        *keys: Any,
        predicate: Any = None,
        prepend: bool = False,
        **named: Any,
    ) -> ModuleExporter:
        if any(e.exporter is exporter for e in self.entries()):
            self.unregister(exporter)
        return super().register(exporter, *keys, predicate=predicate, prepend=prepend, **named)


class IgnoresPrepend(ExportModuleRegistry):
    """``prepend=True`` is accepted and ignored: the new entry goes last."""

    def register(
        self,
        exporter: ModuleExporter,
        *keys: Any,
        predicate: Any = None,
        prepend: bool = False,
        **named: Any,
    ) -> ModuleExporter:
        return super().register(exporter, *keys, predicate=predicate, **named)


class LastMatchWins(ExportModuleRegistry):
    """Dispatch asks the entries from the last one back."""

    def match(self, module: nn.Module) -> ModuleExporter | None:
        for entry in reversed(self.entries()):
            if entry.keys_match(type(module)) and (
                entry.predicate is None or entry.predicate(module)
            ):
                return entry.exporter
        return None


def _services_with(registry_class: type[ExportModuleRegistry]) -> CheckServices:
    """Services whose dispatch registry is a ``registry_class`` with the global entries."""
    broken = registry_class()
    for entry in EXPORT_MODULE_REGISTRY.entries():
        broken.register(entry.exporter, *entry.keys, predicate=entry.predicate, name=entry.name)
    assert broken.entries() == EXPORT_MODULE_REGISTRY.entries()  # same entries, other rules
    registries = dataclasses.replace(Registries.installed(), module_exporters=broken)
    return CheckServices(registries=registries)


def test_a_correct_exporter_passes_precedence(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    """The baseline of the tests below: the same exporter on the real registry passes."""
    name = register_exporter(ProbeQuantExporter(), "ProbeQuant", prepend=True)
    result = run_precedence(tmp_path, name)
    assert result.status == "pass", result.message
    assert "on 2 claimed type(s)" in result.message


@pytest.mark.parametrize(
    ("registry_class", "expected"),
    [
        (MovesOnReregister, "registering <ProbeQuantExporter 'probe_quant'> again moved it"),
        (IgnoresPrepend, "prepend=True did not put the new entry first, before all others"),
        (LastMatchWins, "a prepended entry with the same keys did not win ['ProbeQuant'"),
        (LastMatchWins, "an appended entry with the same keys took ['ProbeQuant'"),
    ],
)
def test_a_registry_with_other_ordering_rules_fails_precedence(
    tmp_path: Path,
    register_exporter: Callable[..., str],
    registry_class: type[ExportModuleRegistry],
    expected: str,
) -> None:
    # prepended, so that an entry moved to the end has really moved
    name = register_exporter(ProbeQuantExporter(), "ProbeQuant", prepend=True)
    result = run_precedence(tmp_path, name, _services_with(registry_class))
    assert result.status == "fail", result.message
    assert f"{name} [ProbeQuant]" in result.message  # names the entry as registered
    assert expected in result.message


# ----------------------------------------------------------------------------- a stateful predicate


class ClaimsOnce:
    """A predicate that accepts each module only the first time it is asked about it.

    A plausible mistake (an exporter "remembering" what it has claimed): who wins
    then depends on which entry happens to ask first, so first-match order breaks.
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __call__(self, module: nn.Module) -> bool:
        first = id(module) not in self.seen
        self.seen.add(id(module))
        return first


def test_a_predicate_that_claims_once_fails_precedence(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    name = register_exporter(ProbeQuantExporter(), "ProbeQuant", predicate=ClaimsOnce())
    result = run_precedence(tmp_path, name)
    assert result.status == "fail", result.message
    # the prepended probe asks first and wins; after that nobody claims the examples
    expected = "an appended entry with the same keys took ['ProbeQuant', 'ProbeQuant'] away"
    assert expected in result.message


# ----------------------------------------------------------------------------- every check can fail

#: check id -> tests (``module::function``) in which a deliberately broken target or
#: module exporter makes that check fail. Keep one per check: a check that no
#: broken input ever fails could be returning "pass" unconditionally.
BREAKING_TESTS: dict[str, list[str]] = {
    # target checks
    "plugin_loads": ["test_checks_targets::test_conflicting_entry_point_fails_plugin_loads"],
    "registered": [
        "test_checks_targets::test_unregistered_runtime_fails_registered",
        "test_checks_targets::test_variant_with_refused_options_fails_registered",
    ],
    "artifact_contract": [
        "test_checks_targets::test_files_next_to_the_artifact_fail_artifact_contract"
    ],
    "roundtrip_logits": [
        "test_checks_targets::test_perturbed_logits_fail_roundtrip_with_the_numbers",
        "test_checks_targets::test_nan_in_the_runtime_output_fails_roundtrip",
    ],
    "dynamic_shapes": [
        "test_checks_targets::test_a_runtime_bound_to_the_traced_shape_fails_dynamic_shapes"
    ],
    "cache_wrapper": ["test_checks_targets::test_tuple_output_fails_cache_wrapper"],
    "deterministic": ["test_checks_targets::test_salted_exports_fail_deterministic"],
    "atomic_failure": [
        "test_checks_targets::test_in_place_writer_fails_atomic_failure",
        "test_checks_targets::test_a_multi_file_writer_that_mixes_old_and_new_fails_atomic_failure",
    ],
    "unknown_kwargs": ["test_checks_targets::test_swallowed_kwargs_fail_unknown_kwargs"],
    "trust": [
        "test_checks_targets::test_an_undeclared_torchscript_target_fails_trust",
        "test_checks_targets::test_an_undeclared_pickle_target_fails_trust",
    ],
    # module-exporter checks
    "mro_match": ["test_checks_exporters::test_exact_type_predicate_fails_mro_match"],
    "name_match": ["test_checks_exporters::test_substring_matcher_fails_name_match"],
    "predicate_match": ["test_checks_exporters::test_raising_predicate_fails_predicate_match"],
    "precedence": [
        "test_checks_broken::test_a_registry_with_other_ordering_rules_fails_precedence",
        "test_checks_broken::test_a_predicate_that_claims_once_fails_precedence",
    ],
    "reachable": ["test_checks_exporters::test_fully_shadowed_exporter_fails_reachable"],
    "claims_all_quantized": [
        "test_checks_exporters::test_unclaimed_quantized_module_fails_claims_all_quantized"
    ],
    "export_contract": [
        "test_checks_exporters::test_broken_exports_fail_export_contract",
        "test_checks_exporters::test_conformance_examples_are_checked",
    ],
    "moe_inputs": ["test_checks_exporters::test_unshared_expert_input_scales_fail_moe_inputs"],
    "tied_weights": ["test_checks_exporters::test_writing_a_tied_copy_fails_tied_weights"],
    "golden_checkpoint": [
        "test_golden_checks::"
        "test_a_scale_one_ulp_off_fails_its_golden_naming_the_tensor_and_both_values"
    ],
    "golden_calibration": [
        "test_golden_checks::"
        "test_real_calibration_changes_no_checkpoint_golden_but_shows_in_the_calibration_one"
    ],
    "roundtrip_generated": ["test_generated::test_generated_checks_catch_what_the_toy_models_miss"],
    "quantized_generated": ["test_generated::test_generated_checks_catch_what_the_toy_models_miss"],
    "checkpoint_names": [
        "test_checkpoint_names::test_wrong_ignore_entries_fail_checkpoint_names",
        "test_checkpoint_names::test_stale_exclude_name_fails_checkpoint_names",
    ],
    "loadable": ["test_inspect_cli::test_a_target_writing_a_stray_lm_head_scale_fails_loadable"],
    "generation_parity": [
        "test_generation_check::test_a_decode_that_ignores_the_past_fails",
        "test_generation_check::test_through_the_plugin_the_past_ignoring_target_fails",
    ],
    "fp8_gemm": ["test_gpu_fp8_gemm::test_a_scale_off_by_two_percent_fails"],
    "roundtrip_quantized": [
        "test_onnx_quantized::test_a_target_writing_wrong_weight_scales_fails_roundtrip_quantized"
    ],
    "served": [
        "test_served_broken::test_a_kv_graph_that_ignores_the_mask_fails_served_in_optimum",
        "test_served_broken::test_a_checkpoint_layout_vllm_refuses_fails_served_with_vllms_message",
    ],
}

#: Checks whose failing input lives in no test, with the reason (none today).
COVERED_ELSEWHERE: dict[str, str] = {}


def _covered_elsewhere(check_id: str) -> str | None:
    return COVERED_ELSEWHERE.get(check_id)


@pytest.mark.parametrize("check_id", sorted(CHECKS))
def test_every_check_has_a_test_that_makes_it_fail(check_id: str) -> None:
    elsewhere = _covered_elsewhere(check_id)
    if elsewhere:
        pytest.skip(f"{check_id}: {elsewhere}")
    tests = BREAKING_TESTS.get(check_id)
    assert tests, (
        f"check {check_id!r} has no test in which a deliberately broken target or exporter "
        "makes it fail; write one and list it in BREAKING_TESTS"
    )
    for ref in tests:
        module_name, _, function = ref.partition("::")
        module = importlib.import_module(f"tests.{module_name}")
        assert callable(getattr(module, function, None)), f"{ref} does not exist"


def test_breaking_tests_name_only_existing_checks() -> None:
    assert set(BREAKING_TESTS) <= set(CHECKS)
    assert not [c for c in BREAKING_TESTS if _covered_elsewhere(c)]
