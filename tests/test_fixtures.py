"""The fixtures the exportcheck plugin gives plugin authors, used from generated test modules."""

from __future__ import annotations

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the runs load once here, so they reuse it (and its registries).
import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401


def test_pytest_fixtures_lists_them_without_importing_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    open('heavy.txt', 'w').write(repr(sorted(\n"
        "        m for m in ('torch', 'exportlm') if m in sys.modules)))\n"
    )
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*fixtures defined from pytest_exportcheck.fixtures*",
            "exportcheck_toy_model -- *fixtures.py:*",
            "    Build toy models: ``exportcheck_toy_model(family=*, seed=0, **overrides)`` -> nn.Module.",
            "exportcheck_workdir -- *fixtures.py:*",
            "    An empty directory for export artifacts, kept with the test's ``tmp_path``.",
            "exportcheck_run -- *fixtures.py:*",
            "    Run one check by id, return its CheckResult: ``exportcheck_run(*roundtrip_logits*",
        ]
    )
    assert (pytester.path / "heavy.txt").read_text() == "[]"


USER_TESTS = """
import pytest
import torch

from exportlm.errors import UnknownOptionError


def test_toy_models_are_seeded(exportcheck_toy_model):
    first, again = exportcheck_toy_model(), exportcheck_toy_model("decoder", seed=0)
    other = exportcheck_toy_model(seed=1)
    weights = dict(first.named_parameters())
    for name, value in again.named_parameters():  # seeded init: the same bytes, no arithmetic
        assert torch.equal(value, weights[name]), name
    assert not all(torch.equal(v, weights[n]) for n, v in other.named_parameters())
    assert not first.training


def test_toy_model_overrides(exportcheck_toy_model):
    small = exportcheck_toy_model("decoder", vocab_size=64)
    assert small.lm_head.out_features == 64
    with pytest.raises(UnknownOptionError, match="vocab_sise"):
        exportcheck_toy_model("decoder", vocab_sise=64)


def test_workdir_is_empty_and_under_tmp_path(exportcheck_workdir, tmp_path):
    assert exportcheck_workdir.parent == tmp_path
    assert list(exportcheck_workdir.iterdir()) == []


def test_run_a_target_check(exportcheck_run, tmp_path):
    result = exportcheck_run("roundtrip_logits", target="torchscript:trace", model="decoder")
    assert result.status == "pass", result.message
    assert result.details["max_abs"] <= 1e-5
    assert any(p.suffix == ".pt" for p in tmp_path.rglob("*"))  # kept for inspection


def test_run_reports_a_failure_without_raising(exportcheck_run):
    result = exportcheck_run("roundtrip_logits", target="offset_logits", model="decoder")
    assert result.status == "fail"
    assert "logits differ" in result.message and result.details["max_abs"] >= 0.4


def test_run_an_exporter_check(exportcheck_run):
    result = exportcheck_run("name_match", exporter="quant_linear", model="decoder")
    assert result.status == "pass", result.message


def test_run_an_unknown_check(exportcheck_run):
    with pytest.raises(ValueError, match="unknown check 'roundtrip'.*roundtrip_logits"):
        exportcheck_run("roundtrip", target="torch_export", model="decoder")
"""


def test_the_fixtures_work_in_a_user_test(pytester: pytest.Pytester) -> None:
    from tests.test_api import OFFSET_TARGET

    pytester.makeconftest(OFFSET_TARGET)
    pytester.makepyfile(test_mine=USER_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=7)
