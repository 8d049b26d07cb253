"""Failing generated checks are fast and leave something to rerun: a shrink budget and a kept file.

Hypothesis' own bound on shrinking is five minutes; an exportcheck item gets
``SHRINK_BUDGET_SECONDS`` (``EXPORTCHECK_SHRINK_SECONDS`` overrides it). The shrunk
structure of a failed item is kept in ``.exportcheck/failures/`` under the rootdir,
and the item's report prints a command that reproduces the failure from that file.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import hypothesis
import pytest
from hypothesis.internal.conjecture import engine

from exportlm.models import ModelSpec
from pytest_exportcheck.run._hypothesis import (
    SHRINK_BUDGET_SECONDS,
    hypothesis_profile,
    register_profiles,
)
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed
from tests.test_generated import CONFTEST, ENTRY_POINTS, GEN_PLUGIN


@pytest.fixture
def default_profile() -> object:
    before = hypothesis.settings.get_current_profile_name()
    hypothesis.settings.load_profile("default")
    register_profiles()
    yield
    hypothesis.settings.load_profile(before)


@pytest.mark.usefixtures("default_profile")
@pytest.mark.parametrize(("env", "bound"), [(None, SHRINK_BUDGET_SECONDS), ("4.5", 4.5)])
def test_an_item_shrinks_within_the_budget_and_the_bound_is_restored(
    monkeypatch: pytest.MonkeyPatch, env: str | None, bound: float
) -> None:
    if env is None:
        monkeypatch.delenv("EXPORTCHECK_SHRINK_SECONDS", raising=False)
    else:
        monkeypatch.setenv("EXPORTCHECK_SHRINK_SECONDS", env)
    before = engine.MAX_SHRINKING_SECONDS
    assert before > bound
    with hypothesis_profile():
        assert bound == engine.MAX_SHRINKING_SECONDS
    assert before == engine.MAX_SHRINKING_SECONDS


@pytest.mark.usefixtures("default_profile")
def test_a_stopped_shrink_reports_the_budget_not_five_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXPORTCHECK_SHRINK_SECONDS", "0.5")
    seen: list[str] = []
    monkeypatch.setattr(engine, "report", seen.append)
    with hypothesis_profile():
        engine.report("WARNING: Hypothesis has spent more than five minutes working to shrink x")
        engine.report("another line")
    assert engine.report == seen.append  # restored
    assert seen[1] == "another line"
    assert "five minutes" not in seen[0]
    assert "budget of 0.5 s (EXPORTCHECK_SHRINK_SECONDS)" in seen[0]


@pytest.mark.usefixtures("default_profile")
def test_a_profile_the_user_chose_keeps_hypothesis_own_bound() -> None:
    hypothesis.settings.register_profile("user-shrinks", max_examples=3)
    hypothesis.settings.load_profile("user-shrinks")
    before = engine.MAX_SHRINKING_SECONDS
    with hypothesis_profile():
        assert before == engine.MAX_SHRINKING_SECONDS


def test_a_ci_run_is_derandomized_and_a_failed_item_keeps_its_shrunk_structure_and_a_repro(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One CI run (in this process, the fake targets installed for it alone) shows both
    facets: items run derandomized under exportcheck-ci with no database and the default
    budget catches vocabpad; its shrunk structure is kept with a repro that works. No
    .hypothesis directory appears."""
    site = pytester.path / "site"
    make_distribution(site, "genplugin", ENTRY_POINTS, {"genplugin.py": GEN_PLUGIN})
    monkeypatch.setenv("CI", "true")  # derandomized: the default budget catches vocabpad
    # Shrinking for the default 15 s only repeats what the tests above prove in process;
    # a 1 s budget still shrinks (what is kept is the best structure by then).
    monkeypatch.setenv("EXPORTCHECK_SHRINK_SECONDS", "1")
    pytester.makeini("[pytest]\n")  # the rootdir is the test's directory
    pytester.makeconftest(CONFTEST)  # the profile_probe check
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=plain,vocabpad",
        "--export-checks=profile_probe,roundtrip_generated",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = json.loads((pytester.path / "report.json").read_text())
    items = {item["id"]: item for item in report["items"]}
    assert items["profile_probe[plain-cpu]"]["details"] == {
        "profile": "exportcheck-ci",
        "derandomize": True,
        "database": "None",
    }
    assert items["roundtrip_generated[plain-cpu]"]["outcome"] == "pass"
    assert items["roundtrip_generated[vocabpad-cpu]"]["outcome"] == "fail"
    assert not (pytester.path / ".hypothesis").exists()

    kept = pytester.path / ".exportcheck" / "failures" / "roundtrip_generated.vocabpad-cpu.json"
    assert ModelSpec.from_dict(json.loads(kept.read_text())).vocab_size % 64 != 0
    result.stdout.fnmatch_lines(
        [
            "*exportcheck: shrunk failure*",
            f"shrunk structure kept in {kept}",
            "reproduce outside pytest:",
            f"  exportlm export --target vocabpad --model {shlex.quote(str(kept))} *",
        ]
    )
    lines = result.stdout.lines
    command = lines[
        lines.index("reproduce outside pytest:", lines.index(f"shrunk structure kept in {kept}"))
        + 1
    ]
    argv = shlex.split(command)
    assert argv[0] == "exportlm"
    assert (
        str(pytester.path / ".exportcheck" / "failures" / "repro") in argv[argv.index("--out") + 1]
    )
    # The repro rebuilds the kept structure and exports it; vocabpad's fault is in its runtime,
    # so run it against a correct target: what fails is the runtime, not the file.
    argv[argv.index("--target") + 1] = "torch_export"
    cli = [sys.executable, "-m", "exportlm", *argv[1:]]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
