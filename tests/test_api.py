"""``parametrize_with_checks`` and ``run_check``: the conformance checks in a user's own test module.

The pytester runs generate a test module (and a conftest registering a deliberately
wrong target, ``offset_logits``, whose runtime adds 0.5 to every logit) and check
the outcome pytest reports for each node id. Every run selects a few cheap checks
on the toy ``decoder`` so it takes seconds.
"""

from __future__ import annotations

import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the runs load once here, so they reuse it (and its registries).
import pytest_exportcheck.checks  # noqa: F401
import pytest_exportcheck.run._runner as run_runner
from exportlm.errors import UnknownNameError
from exportlm.export import get_target_info
from pytest_exportcheck import ExportCheckWarning
from pytest_exportcheck.api import CheckFailedError, ExportCheck, parametrize_with_checks, run_check
from pytest_exportcheck.checks import CheckResult
from pytest_exportcheck.plan import CaseOptions

#: A conftest registering ``offset_logits``: a correct export with a wrong runtime.
OFFSET_TARGET = """
from pathlib import Path

import torch

from exportlm.export import (
    EXPORT_REGISTRY, RUNTIME_REGISTRY, ExportCacheWrapper, atomic_output, export_target,
)


@export_target("offset_logits", atol=1e-5, rtol=1e-5, suffix=".pt", capabilities={"dynamic_shapes"})
def export_offset(model, output_path, *, example_inputs=None):
    with atomic_output(output_path) as tmp:
        torch.save(ExportCacheWrapper(model).eval(), tmp)
    return Path(output_path)


def load_offset(artifact, *, device="cpu"):
    module = torch.load(artifact, weights_only=False, map_location=device)

    def run(input_ids):
        with torch.no_grad():
            return module(input_ids) + 0.5  # wrong on purpose

    return run


def pytest_configure(config):
    EXPORT_REGISTRY.register("offset_logits", export_offset)
    RUNTIME_REGISTRY.register("offset_logits", load_offset)


def pytest_unconfigure(config):
    EXPORT_REGISTRY.unregister("offset_logits")
    RUNTIME_REGISTRY.unregister("offset_logits")
"""

#: Cheap checks: no export (``registered``), one trace (``roundtrip_logits``), and one
#: that cannot apply to torchscript (``checkpoint_names`` needs ``quantized``): no item.
CHEAP = '["registered", "roundtrip_logits", "checkpoint_names"]'

USER_MODULE = f"""
from pytest_exportcheck import parametrize_with_checks


@parametrize_with_checks(targets=["torchscript"], models=["decoder"], checks={CHEAP})
def test_conformance(check, tmp_path):
    check(tmp_path)


def test_unrelated():
    pass
"""


def _literal(*patterns: str) -> list[str]:
    """fnmatch patterns whose ``[`` are literal (node ids hold brackets); ``*`` stays a wildcard."""
    return [p.replace("[", "[[]") for p in patterns]


def test_checks_run_as_parameters_of_a_user_test(pytester: pytest.Pytester) -> None:
    """Passes, the target's declared xfail, no item of a check the target's capabilities exclude;
    readable node ids; -m exportcheck."""
    pytester.makepyfile(test_mine=USER_MODULE)
    result = pytester.runpytest("-p", "no:cacheprovider", "--strict-markers", "-rs", "-v")
    result.assert_outcomes(passed=6, xfailed=1)
    assert "checkpoint_names" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        _literal(
            "*test_mine.py::test_conformance[roundtrip_logits-torchscript:script-decoder-cpu] XFAIL*",
            "*test_mine.py::test_conformance[plugin_loads-torchscript:trace] PASSED*",
            "*test_mine.py::test_conformance[registered-torchscript:trace-cpu] PASSED*",
            "*test_mine.py::test_conformance[roundtrip_logits-torchscript:trace-decoder-cpu] PASSED*",
        )
    )
    selected = pytester.runpytest("-p", "no:cacheprovider", "-m", "exportcheck", "--co", "-q")
    assert "test_mine.py::test_unrelated" not in selected.stdout.str()
    selected.stdout.fnmatch_lines(["*6/7 tests collected (1 deselected)*"])
    others = pytester.runpytest("-p", "no:cacheprovider", "-m", "not exportcheck", "--co", "-q")
    others.stdout.fnmatch_lines(["test_mine.py::test_unrelated", "*1/7 tests collected*"])


def test_a_node_id_reruns_one_check(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mine=USER_MODULE)
    node = "test_mine.py::test_conformance[roundtrip_logits-torchscript:trace-decoder-cpu]"
    result = pytester.runpytest("-p", "no:cacheprovider", node)
    result.assert_outcomes(passed=1)


def test_a_failing_export_fails_with_the_checks_message(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(OFFSET_TARGET)
    pytester.makepyfile(
        test_offset="""
from pytest_exportcheck import parametrize_with_checks


@parametrize_with_checks(targets="offset_logits", models="decoder", checks=["roundtrip_logits"])
def test_conformance(check):
    check()
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)  # plugin_loads passes
    result.stdout.fnmatch_lines(
        _literal(
            "*CheckFailedError: roundtrip_logits[offset_logits-decoder-cpu]: *beyond atol*",
            "*max_abs: 0.5*",
            "FAILED test_offset.py::test_conformance[roundtrip_logits-offset_logits-decoder-cpu]*",
        )
    )


EXPECTED_FAILURES = """
from pytest_exportcheck import parametrize_with_checks

KNOWN = {
    "offset_logits": {
        "roundtrip_logits": "the runtime adds 0.5 on purpose",
        # Claimed broken but passing: a strict xfail makes this an error.
        "registered": "wrongly claimed",
        "no_such_check": "matches nothing",
    },
}


@parametrize_with_checks(
    targets=["offset_logits"],
    models=["decoder"],
    checks=["registered", "roundtrip_logits"],
    expected_failed_checks=lambda name: KNOWN[name],
)
def test_conformance(check):
    check()
"""


def test_expected_failures_are_strict_and_unmatched_entries_warn(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(OFFSET_TARGET)
    pytester.makepyfile(test_known=EXPECTED_FAILURES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rfxX")
    result.assert_outcomes(passed=1, failed=1, xfailed=1)
    result.stdout.fnmatch_lines_random(
        _literal(
            "FAILED test_known.py::test_conformance[registered-offset_logits-cpu]*",
            "*XPASS(strict)*wrongly claimed*",
            "XFAIL test_known.py::test_conformance[roundtrip_logits-offset_logits-decoder-cpu]*"
            "on purpose*",
            "*ExportCheckWarning: expected failure 'no_such_check'*offset_logits*matches no item*",
        )
    )


def test_the_same_items_under_xdist(pytester: pytest.Pytester) -> None:
    """Each worker parametrizes identically: outcomes equal the serial run's."""
    pytester.makeconftest(OFFSET_TARGET)
    pytester.makepyfile(test_known=EXPECTED_FAILURES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=1, failed=1, xfailed=1)


def test_an_unknown_name_is_a_collection_error_listing_the_known_ones(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_typo="""
from pytest_exportcheck import parametrize_with_checks


@parametrize_with_checks(targets=["onxx"])
def test_conformance(check):
    check()
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*UnknownNameError: unknown export target 'onxx'; available: *onnx*torchscript*"]
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "select at least one export target or module exporter"),
        ({"exporters": ["quant_linaer"]}, UnknownNameError, "available: .*quant_linear"),
        ({"targets": "onnx", "models": ["llamma"]}, UnknownNameError, "model family 'llamma'"),
        ({"targets": "onnx", "checks": ["roundtrip"]}, UnknownNameError, "check 'roundtrip'"),
        ({"targets": "onnx", "device": "gpu"}, ValueError, "device must be one of cpu, cuda"),
        (
            {"targets": "onnx", "expected_failed_checks": lambda name: ["roundtrip_logits"]},
            TypeError,
            r"expected_failed_checks\('onnx'\) returned \['roundtrip_logits'\]",
        ),
    ],
)
def test_invalid_arguments_raise_when_the_decorator_is_built(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        parametrize_with_checks(**kwargs)  # type: ignore[arg-type]


def test_the_decorator_holds_one_parameter_per_planned_item() -> None:
    mark = parametrize_with_checks(
        exporters=["quant_linear"], targets="torch_export", checks=["registered", "name_match"]
    )
    assert mark.args[0] == "check"
    ids = [param.id for param in mark.args[1]]
    assert ids == [
        "plugin_loads-torch_export",
        "registered-torch_export-cpu",
        "name_match-quant_linear",
    ]
    for param in mark.args[1]:
        assert [m.name for m in param.marks] == ["exportcheck"]
        (check,) = param.values
        assert isinstance(check, ExportCheck)
        assert check.id == param.id
    unmatched = {"roundtrip_logitz": "typo"}
    with pytest.warns(ExportCheckWarning, match="'roundtrip_logitz'"):
        parametrize_with_checks(targets="torch_export", expected_failed_checks=lambda _: unmatched)


@pytest.fixture
def raising_target() -> Iterator[str]:
    """A target whose export raises (registered in this process for one test)."""
    from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, export_target

    @export_target("raising_target", suffix=".pt")
    def export_raising(model: object, output_path: Path, *, example_inputs: object = None) -> Path:
        raise RuntimeError("boom in the exporter under test")

    def load_raising(artifact: Path) -> object:
        raise AssertionError("never loaded: the export fails first")

    EXPORT_REGISTRY.register("raising_target", export_raising)
    RUNTIME_REGISTRY.register("raising_target", load_raising)
    yield "raising_target"
    EXPORT_REGISTRY.unregister("raising_target")
    RUNTIME_REGISTRY.unregister("raising_target")


def test_a_failure_raised_by_the_code_under_test_is_chained(raising_target: str) -> None:
    mark = parametrize_with_checks(
        targets=raising_target, models="decoder", checks=["roundtrip_logits"]
    )
    (check,) = [p.values[0] for p in mark.args[1] if p.id.startswith("roundtrip_logits-")]
    with pytest.raises(CheckFailedError, match="boom in the exporter under test") as info:
        check()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.result.status == "fail"
    assert check.result().status == "fail"  # the same, without raising
    # as in the suite (one outcome function for both fronts), the failure carries the
    # traceback of what the code under test raised: --pdb starts in the exporter's frame
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(info.value.__traceback__)]
    assert "export_raising" in frames


def test_run_check_returns_the_result_and_writes_into_workdir(tmp_path: Path) -> None:
    result = run_check(
        "roundtrip_logits", target="torchscript:trace", model="decoder", workdir=tmp_path
    )
    assert result.status == "pass", result.message
    assert result.details["max_abs"] <= 1e-5
    assert any(p.suffix == ".pt" for p in tmp_path.rglob("*"))
    again = run_check(
        "roundtrip_logits", target="torchscript:trace", model="decoder", workdir=tmp_path
    )
    assert again.status == "pass"  # a non-empty workdir gets a fresh subdirectory
    assert len(list(tmp_path.iterdir())) == 2


def test_run_check_reports_a_check_that_cannot_apply_as_a_skip_with_the_reason() -> None:
    result = run_check("checkpoint_names", target="torch_export", model="decoder")
    assert result.status == "skip"
    assert "not applicable: target 'torch_export' does not declare" in result.message
    assert "'quantized'" in result.message


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": "onnx"}, ValueError, "runs per model: pass model=<family>"),
        ({"exporter": "quant_linear", "model": "decoder"}, ValueError, "is a target check"),
        ({"target": "onnx:fast", "model": "decoder"}, UnknownNameError, "variant of target"),
        ({"target": "torchscript:trace", "model": "nope"}, UnknownNameError, "model family"),
    ],
)
def test_run_check_refuses_arguments_that_do_not_fit_the_check(
    kwargs: dict[str, str], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        run_check("roundtrip_logits", **kwargs)  # type: ignore[arg-type]


def test_importing_the_api_imports_no_torch() -> None:
    code = (
        "import sys, pytest_exportcheck, pytest_exportcheck.api, pytest_exportcheck.fixtures\n"
        "heavy = sorted(m for m in ('torch', 'exportlm', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- one engine

#: The item both fronts run in the tests below (a per-model target check).
SAME_ITEM = "roundtrip_logits[torchscript:trace-decoder-cpu]"


def _case_facts(case: Any) -> tuple[Any, ...]:
    """What a check sees of its case, but the directory and the export callables."""
    return (
        type(case).__name__,
        case.target,
        case.variant,
        dict(case.export_kwargs),
        case.model_name,
        case.device,
        case.seed,
        case.options,
    )


def test_the_suite_and_the_api_hand_a_check_the_same_case(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both run the item through ``run_item``; the case (but its workdir) is the same."""
    seen: list[Any] = []
    real = run_runner.build_case

    def recording(*args: Any) -> Any:
        seen.append(real(*args))
        return CheckResult.skipped("recorded, not run")

    monkeypatch.setattr(run_runner, "build_case", recording)
    suite = pytester.runpytest(
        "-p", "no:cacheprovider", "--export-models=decoder", f"exportcheck::{SAME_ITEM}"
    )
    assert suite.parseoutcomes() == {"skipped": 1}, suite.stdout.str()
    api = run_check("roundtrip_logits", target="torchscript:trace", model="decoder")
    assert api.message == "recorded, not run"
    suite_case, api_case = seen
    assert _case_facts(suite_case) == _case_facts(api_case)
    assert suite_case.options == CaseOptions("decoder", "cpu", False, None)
    assert suite_case.export is not None  # the suite's cached exports ...
    assert api_case.export is None  # ... the API exports afresh


def test_one_toy_model_build_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's ``accepts``, and the export, use the one build of the item's model."""
    from pytest_exportcheck.checks._registries import Registries

    builds: list[str] = []
    real = Registries.build_model

    def counting(self: Registries, name: str, *args: Any, **kwargs: Any) -> Any:
        builds.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Registries, "build_model", counting)  # the one way the run builds
    assert get_target_info("onnx").accepts is not None  # the build is shared with accepts
    result = run_check("roundtrip_logits", target="onnx", model="decoder")
    assert result.status == "pass", result.message
    assert builds == ["decoder"]


def test_the_plugin_version_is_the_distribution_version() -> None:
    import exportlm
    import pytest_exportcheck

    assert pytest_exportcheck.__version__ == exportlm.__version__
