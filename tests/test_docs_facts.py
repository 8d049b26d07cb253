"""Facts the README states about the code are read back from the code.

``tests/test_docs.py`` runs the documentation's commands; this module checks the
statements no command prints: the built-in targets table against each target's
``TargetInfo``, every mention of what ``.ci/run`` runs against ``.ci/run``, and the
names (targets, checks, model families) of the sample conformance matrix against
the live catalogue and registries. Counts of passed and skipped items vary with
the machine and are not compared; the totals of a cell (how many items a check
has in a column) do not, and are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from exportlm.export import get_target_info
from exportlm.inventory import plugin_inventory
from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS
from tests._docblocks import ROOT, Block, parse_blocks

README = ROOT / "README.md"


def _built_in(kind: str) -> list[str]:
    """Names exportlm itself registers of ``kind`` (installed plugins left out)."""
    return sorted(
        record.name
        for record in plugin_inventory()
        if record.kind == kind
        and record.status == "loaded"
        and (record.provider == "exportlm (built in)" or record.provider.startswith("exportlm "))
    )


def _target_columns() -> list[str]:
    """The matrix columns of the built-in targets: ``target`` or ``target:variant``."""
    columns = []
    for name in _built_in("export target"):
        variants = sorted(get_target_info(name).variants)
        columns += [f"{name}:{variant}" for variant in variants] or [name]
    return sorted(columns)


# ----------------------------------------------------------------------------- targets table


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _documented_targets() -> dict[str, list[str]]:
    rows = _table_rows(README.read_text(encoding="utf-8"), "| target | registered |")
    return {row[0].strip("`"): row for row in rows}


def test_the_built_in_targets_table_lists_every_built_in_target() -> None:
    assert sorted(_documented_targets()) == _built_in("export target")


@pytest.mark.parametrize("name", sorted(_documented_targets()))
def test_the_built_in_targets_table_matches_the_declarations(name: str) -> None:
    _, _, artifact, _, capabilities, tolerance = _documented_targets()[name]
    info = get_target_info(name)
    # "cuda (with onnxruntime-gpu installed)": declared only where that holds
    tokens = [token.strip() for token in capabilities.split(",")]
    always = {token for token in tokens if "(" not in token}
    conditional = {token.split(" (")[0] for token in tokens if "(" in token}
    assert always <= info.capabilities, f"{name}: documented but not declared"
    assert info.capabilities <= always | conditional, f"{name}: declared but not documented"
    numbers = dict(re.findall(r"(atol|rtol) ([0-9.e-]+)", tolerance))
    assert (float(numbers["atol"]), float(numbers["rtol"])) == (info.atol, info.rtol)
    if info.artifact == "directory":
        assert artifact.startswith("directory")
    else:
        assert artifact.startswith(f"`{info.suffix}`")


# ----------------------------------------------------------------------------- .ci/run


def _ci_run_targets() -> str:
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return "make " + " ".join(re.findall(r"^make ([\w-]+)$", script, flags=re.MULTILINE))


def test_every_mention_of_ci_run_names_what_it_runs() -> None:
    expected = _ci_run_targets()
    assert expected == "make lint test conformance test-wheel test-lowest"
    pages = [README, ROOT / ".ci" / "run", *sorted((ROOT / "docs").glob("*.md"))]
    mentions = [
        (page.name, command)
        for page in pages
        for line in page.read_text(encoding="utf-8").splitlines()
        if ".ci/run" in line or "(CI:" in line or "CI entry point" in line
        for command in re.findall(r"`(make [\w -]+)`", line)
        if len(command.split()) > 2  # a list of targets, not one `make x` named in passing
    ]
    assert len(mentions) >= 3, mentions  # README (twice) and the script's own header
    assert [m for m in mentions if m[1] != expected] == []


# ----------------------------------------------------------------------------- sample matrix


@dataclass
class SampleSection:
    """One matrix of the sample: its scope, column names and ``{check: cell totals}``."""

    scope: str
    columns: list[str]
    abridged_columns: bool
    rows: dict[str, list[int | None]]


def _sample_block() -> Block:
    blocks = [b for b in parse_blocks(README) if "check \\ target" in b.source]
    assert len(blocks) == 1, "expected one sample matrix in README.md"
    return blocks[0]


def _sections(source: str) -> list[SampleSection]:
    sections: list[SampleSection] = []
    for line in source.splitlines():
        header = re.match(r"check \\ (target|exporter)\s+(.*)$", line)
        if header:
            names = header.group(2).split()
            abridged = names[-1:] == ["..."]
            sections.append(
                SampleSection(header.group(1), names[: len(names) - abridged], abridged, {})
            )
        elif sections and re.match(r"[a-z]\w* ", line):
            check, _, cells = line.partition(" ")
            totals = re.findall(r"\d+/(\d+)|·", cells)  # ·: a cell that cannot apply
            sections[-1].rows[check] = [int(total) if total else None for total in totals]
    return sections


def test_the_sample_matrix_names_the_live_targets_checks_and_families() -> None:
    block = _sample_block()
    sections = {s.scope: s for s in _sections(block.source)}
    assert set(sections) == {"target", "exporter"}
    families = len(_built_in("model family"))
    catalogue = {spec.id: spec for spec in BUILTIN_CHECKS}
    targets = sections["target"]
    assert targets.columns == _target_columns()
    exporters = sections["exporter"]
    assert exporters.columns == sorted(exporters.columns)
    assert set(exporters.columns) <= set(_built_in("module exporter"))
    for section in (targets, exporters):
        order = [spec.id for spec in BUILTIN_CHECKS if spec.scope == section.scope]
        assert list(section.rows) == [c for c in order if c in section.rows], section.scope
        live = _live_cells(section.scope)
        for check, totals in section.rows.items():
            spec = catalogue[check]
            assert spec.scope == section.scope, check
            assert len(totals) == len(section.columns), check
            # one device (cpu): each cell holds the items the planner plans there, · none
            cells = [live.get((column, check)) for column in section.columns]
            assert totals == cells, check
            if section.scope == "target" and not spec.per_engine and not spec.models:
                assert set(totals) <= {families if spec.per_model else 1, None}, check


def _live_cells(scope: str) -> dict[tuple[str, str], int]:
    """``{(column, check): items}`` the planner plans for the built-in rows on the CPU."""
    from pytest_exportcheck.checks import CHECKS
    from pytest_exportcheck.plan import NameSelection, Planner, PlanRequest, discover, plan

    request = PlanRequest(
        NameSelection.of(_built_in("export target")),
        NameSelection.of(_built_in("module exporter")),
        NameSelection.of(_built_in("model family")),
    )
    counts: dict[tuple[str, str], int] = {}
    for spec in plan(Planner(discover(), CHECKS).plan(request)):
        if spec.scope == scope:
            counts[(spec.column, spec.check)] = counts.get((spec.column, spec.check), 0) + 1
    return counts


def test_the_sample_totals_line_has_the_live_number_of_items() -> None:
    """``N items: ...``: N is what ``pytest --export-targets=all`` collects."""
    line = next(x for x in _sample_block().source.splitlines() if re.match(r"\d+ items: ", x))
    documented = int(line.split()[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-n", "0", "--export-targets=all", "--export-only"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    collected = re.search(r"(\d+) tests? collected", done.stdout)
    assert collected, done.stdout[-2000:] + done.stderr[-2000:]
    assert documented == int(collected.group(1))
