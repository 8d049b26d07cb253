"""Upgrades that keep a conforming plugin green: failures by cause x capture, a pinned catalogue.

A third-party target that captures with ``torch.export`` inherits the ``dbrx``
family's declared failure (its expert loop is data-dependent) from the family's
cause and its own ``capture``, with no name of either in the other; pinning the
catalogue version hides the checks and families added after it and reports them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from pytest_exportcheck.checks.versions import CATALOGUE_VERSION
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed

PT2_PLUGIN = '''
"""A third-party target written against the documented contract, on torch.export."""
from pathlib import Path

import torch

from exportlm.export import (
    ExportCacheWrapper, atomic_output, export_target, resolve_example_inputs,
)
from exportlm.export.guard import open_artifact

CAPTURE = {capture!r}


@export_target(
    "pt2like", runtime="pt2like", atol=1e-4, rtol=1e-3, suffix=".pt2",
    executes_code=True, capture=CAPTURE,
)
def export_pt2like(model, output_path, *, example_inputs=None):
    inputs = resolve_example_inputs(model, example_inputs)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.no_grad():
        program = torch.export.export(ExportCacheWrapper(model).eval(), args)
    with atomic_output(output_path) as staged:
        torch.export.save(program, str(staged))
    return Path(output_path)


def load_pt2like(artifact, *, device="cpu"):
    with open_artifact(artifact) as file:
        module = torch.export.load(file).module()

    def run(input_ids):
        with torch.no_grad():
            return module(input_ids.to(device))

    return run
'''

ENTRY_POINTS = {
    "exportlm.export_backends": {"pt2like": "pt2plugin:export_pt2like"},
    "exportlm.export_runtimes": {"pt2like": "pt2plugin:load_pt2like"},
}


def _install(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capture: str) -> Path:
    site = pytester.path / "site"
    modules = {"pt2plugin.py": PT2_PLUGIN.format(capture=capture)}
    make_distribution(site, "pt2plugin", ENTRY_POINTS, modules)
    monkeypatch.delenv("CI", raising=False)
    return site


def _items(report: Path) -> dict[str, dict[str, Any]]:
    return {item["id"]: item for item in json.loads(report.read_text())["items"]}


@pytest.mark.parametrize("capture", ["torch.export", ""])
def test_a_torch_export_target_inherits_dbrx_declared_failure_from_its_cause(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capture: str
) -> None:
    """Declared ``capture="torch.export"``: dbrx is an expected failure naming the cause and the
    family, decoder passes, the run is green. Undeclared: the same dbrx item is red."""
    site = _install(pytester, monkeypatch, capture)
    monkeypatch.setenv("COLUMNS", "1000")  # the -rx line whole: reason, then its source
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=pt2like",
        "--export-models=decoder,dbrx",
        "--export-checks=roundtrip_logits",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
        "-rxf",
    )
    items = _items(pytester.path / "report.json")
    assert items["roundtrip_logits[pt2like-decoder-cpu]"]["outcome"] == "pass"
    dbrx = items["roundtrip_logits[pt2like-dbrx-cpu]"]
    if not capture:
        assert dbrx["outcome"] == "fail"
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        return
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert dbrx["outcome"] == "xfail"
    assert "GuardOnDataDependentSymNode" in dbrx["message"]  # it fails for the declared cause
    result.stdout.fnmatch_lines(
        [
            "XFAIL *roundtrip_logits[[]pt2like-dbrx-cpu[]]*data-dependent control flow in the "
            "expert loop (fails under torch.export capture)*model family 'dbrx'*"
        ]
    )


# ------------------------------------------------------------------ the pinned catalogue

PINNED = [
    "--export-targets=torch_export",
    "--export-checks=registered,trust,roundtrip_logits",
    "--export-report=report.json",
]


def test_pinning_the_catalogue_hides_newer_checks_and_families(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nexportcheck_catalogue = 2\n")
    result = pytester.runpytest(*PINNED, "--co", "-q")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    collected = {line.rsplit("::", 1)[-1] for line in result.outlines if "::" in line}
    assert "registered[torch_export-cpu]" in collected
    assert "roundtrip_logits[torch_export-llama-cpu]" in collected
    # trust and the families llama4 / dbrx are new in v3
    assert not any("trust[" in c or "llama4" in c or "dbrx" in c for c in collected)
    header = json.loads((pytester.path / "report.json").read_text())
    assert header["catalogue"] == {
        "version": 2,
        "current": CATALOGUE_VERSION,
        "pinned": True,
        "newer_items": {"3": 3},  # trust[torch_export-cpu], two roundtrip_logits items
    }
    assert header["options"]["catalogue"] == 2

    unpinned = pytester.runpytest(*PINNED, "--co", "-q", "--export-catalogue=current")
    every = {line.rsplit("::", 1)[-1] for line in unpinned.outlines if "::" in line}
    assert every - collected == {
        "trust[torch_export-cpu]",
        "roundtrip_logits[torch_export-llama4-cpu]",
        "roundtrip_logits[torch_export-dbrx-cpu]",
    }


def test_a_pinned_run_reports_the_newer_items_in_its_summary(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--export-targets=torch_export", "--export-checks=registered,trust", "--export-catalogue=2"
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "exportcheck catalogue: v2 (pinned), current v*",
            "*exportcheck catalogue v2: 1 items new in v3 not run: "
            "pin exportcheck_catalogue = 3 to adopt*",
        ]
    )


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (["--export-catalogue=0"], "", "*expected a catalogue version (1, 2, ...)*got '0'*"),
        ([], "exportcheck_catalogue = two", "*expected a catalogue version*got 'two'*"),
        (["--export-catalogue=99"], "", "*no catalogue version 99; the versions are 1 to *"),
    ],
)
def test_a_bad_catalogue_version_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], ini: str, message: str
) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest("--export-targets=torch_export", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# ------------------------------------------------------------------ a bare --sw

SUITE = ["--export-targets=torch_export,torchscript", "--export-checks=plugin_loads,registered"]
FAILING = "exportcheck::plugin_loads::plugin_loads[torchscript:trace]"


def test_a_bare_stepwise_reruns_the_failed_suite_items(pytester: pytest.Pytester) -> None:
    """``pytest --sw`` with no --export-* option plans the suite items the last run failed."""
    (pytester.path / "xfails.txt").write_text(
        "exportcheck::plugin_loads[torchscript:trace]  # passes, so this strict xfail fails\n"
    )
    pytester.makeini("[pytest]\nexport_xfails_file = xfails.txt\n")  # what makes FAILING fail
    pytester.runpytest(*SUITE).assert_outcomes(passed=5, failed=1)

    bare = pytester.runpytest("--sw", "-v")
    ran = [line.split()[0] for line in bare.outlines if line.startswith("exportcheck::")]
    assert ran == [FAILING], bare.stdout.str()
    bare.stdout.fnmatch_lines(["*Interrupted: Test failed, continuing from this test next run*"])
    assert bare.ret == pytest.ExitCode.INTERRUPTED  # what --sw returns when it stops

    nothing = pytester.runpytest("-v")  # no --sw, no --lf: the suite is not asked for
    assert not any(line.startswith("exportcheck::") for line in nothing.outlines)


# ------------------------------------------------------------------ the version table


def _documented_versions() -> dict[int, tuple[set[str], set[str]]]:
    """``version -> (checks, families)`` of the table in docs/checks.md."""
    text = (Path(__file__).parents[1] / "docs" / "checks.md").read_text(encoding="utf-8")
    table = text.split("| version | added on | checks added | families added |", 1)[1]
    rows: dict[int, tuple[set[str], set[str]]] = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        version, _, checks, families = (cell.strip() for cell in line.strip("|").split("|"))
        names = [set(re.findall(r"`(\w+)`", cell)) for cell in (checks, families)]
        rows[int(version)] = (names[0], names[1])
    return rows


def test_every_built_in_check_and_family_carries_its_documented_version() -> None:
    from exportlm.models import model_names, model_since
    from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS
    from pytest_exportcheck.checks.versions import CATALOGUE_HISTORY, CHECKS_SINCE

    assert set(CATALOGUE_HISTORY) == set(range(1, CATALOGUE_VERSION + 1))
    # a new built-in check is placed in a version on purpose, not by a default
    assert {spec.id for spec in BUILTIN_CHECKS} == set(CHECKS_SINCE)
    documented = _documented_versions()
    assert set(documented) == set(CATALOGUE_HISTORY)
    for spec in BUILTIN_CHECKS:
        assert spec.since is not None, spec.id
        assert spec.id in documented[spec.since][0], spec.id
    builtin = [m for m in model_names() if model_since(m) is not None]
    assert {"dbrx", "llama4", "decoder"} <= set(builtin)
    for family in builtin:
        assert family in documented[model_since(family) or 0][1], family
