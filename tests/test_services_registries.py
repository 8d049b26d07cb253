"""Checks and the run read the registries they are handed, never exportlm's globals (issue 40).

A run handed a :class:`~pytest_exportcheck.checks.Registries` whose targets are not
the process's sees only those: a target registered there alone is planned, exported,
loaded and judged, and the process's targets are not planned at all.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from exportlm.errors import UnknownNameError
from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY
from exportlm.registry import Registry
from pytest_exportcheck.api import parametrize_with_checks, run_check
from pytest_exportcheck.checks import CHECKS, CheckServices, Registries, TargetCase

#: A target known only to the scoped registries: the built-in ONNX factory under another name.
SCOPED = "scoped_onnx"


def scoped_registries() -> Registries:
    """The process's registries, but with one target, ``scoped_onnx``, and its runtime."""
    installed = Registries.installed()
    targets: Registry[object] = Registry("export target")
    targets.register(SCOPED, EXPORT_REGISTRY.get("onnx"))
    runtimes: Registry[object] = Registry("runtime")
    runtimes.register("onnx", RUNTIME_REGISTRY.get("onnx"))
    return dataclasses.replace(installed, targets=targets, runtimes=runtimes)


def test_the_process_does_not_know_the_scoped_target() -> None:
    assert SCOPED not in EXPORT_REGISTRY
    with pytest.raises(UnknownNameError):
        run_check("registered", target=SCOPED)


def test_a_check_run_through_handed_registries_exports_and_loads_from_them(
    tmp_path: Path,
) -> None:
    scoped = scoped_registries()
    registered = run_check("registered", target=SCOPED, registries=scoped)
    assert registered.status == "pass", registered.message
    assert registered.details["runtime"] == "onnx"
    result = run_check(
        "roundtrip_logits", target=SCOPED, model="decoder", registries=scoped, workdir=tmp_path
    )
    assert result.status == "pass", result.message
    assert list(tmp_path.rglob("model.onnx"))  # exported by the scoped target, loaded back


def test_a_case_built_by_hand_reads_the_services_registries(tmp_path: Path) -> None:
    services = CheckServices(registries=scoped_registries())
    case = TargetCase(SCOPED, None, {}, None, "cpu", tmp_path, services=services)
    assert CHECKS["registered"].fn(case).status == "pass"
    unscoped = TargetCase(SCOPED, None, {}, None, "cpu", tmp_path / "other")
    result = CHECKS["registered"].fn(unscoped)  # a fresh services: the process's registries
    assert result.status == "fail"
    assert "scoped_onnx" in result.message


def test_parametrize_with_checks_plans_only_the_handed_targets() -> None:
    mark = parametrize_with_checks(
        targets="all", models=["decoder"], checks=["registered"], registries=scoped_registries()
    )
    ids = [param.id for param in mark.args[1]]
    assert ids == [f"plugin_loads-{SCOPED}", f"registered-{SCOPED}-cpu"]


def test_a_suite_of_scoped_checks_runs_under_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_scoped=textwrap.dedent(
            f"""
            from tests.test_services_registries import scoped_registries
            from pytest_exportcheck import parametrize_with_checks

            @parametrize_with_checks(
                targets="all",
                models=["decoder"],
                checks=["plugin_loads", "registered", "roundtrip_logits"],
                registries=scoped_registries(),
            )
            def test_conformance(check, tmp_path):
                assert {SCOPED!r} in check.name
                check(tmp_path)
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)  # plugin_loads, registered, roundtrip_logits[decoder]
