"""The id a FAILED line prints below the rootdir reruns from there.

Run from ``<rootdir>/sub/deeper``, pytest prints every node id relative to the
invocation directory, as it does a test file's: ``../../exportcheck::...``. Pasted
back, that id must select the item, not fail as a missing file (exit 4). The
failure comes from an xfails file declaring a passing item expected to fail, so
only ``plugin_loads`` runs (no export), in-process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from pytest_exportcheck.plan._nodeids import item_id_of

ITEM = "plugin_loads[torchscript:trace]"


def _failed(result: pytest.RunResult) -> list[str]:
    return [line.split()[1] for line in result.outlines if line.startswith("FAILED ")]


def _ran(result: pytest.RunResult) -> list[str]:
    pattern = re.compile(r"^(\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")
    return [m[1] for line in result.outlines if (m := pattern.match(line))]


@pytest.fixture
def below_rootdir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work in ``<rootdir>/sub/deeper``; ``xfails.txt`` at the rootdir makes ITEM fail."""
    pytester.makeini("[pytest]\n")
    xfails = pytester.path / "xfails.txt"
    xfails.write_text(f"exportcheck::{ITEM}  # passes, so this strict xfail fails\n")
    deeper = pytester.path / "sub" / "deeper"
    deeper.mkdir(parents=True)
    monkeypatch.chdir(deeper)
    return xfails


def test_the_printed_id_reruns_from_the_directory_it_was_printed_in(
    pytester: pytest.Pytester, below_rootdir: Path
) -> None:
    xfails = f"--export-xfails-file={below_rootdir}"
    first = pytester.runpytest(
        "--export-targets=torchscript", "--export-checks=plugin_loads", xfails
    )
    first.assert_outcomes(passed=1, failed=1)
    printed = _failed(first)
    assert printed == [f"../../exportcheck::plugin_loads::{ITEM}"]

    again = pytester.runpytest(printed[0], xfails, "-v")
    assert again.ret == pytest.ExitCode.TESTS_FAILED, again.stdout.str()
    assert _ran(again) == printed
    short = pytester.runpytest(f"../../exportcheck::{ITEM}", xfails, "-v")
    assert _ran(short) == printed


def test_a_real_directory_at_that_path_is_left_to_pytest(
    pytester: pytest.Pytester, below_rootdir: Path
) -> None:
    (pytester.path / "exportcheck").mkdir()
    result = pytester.runpytest("../../exportcheck::plugin_loads", "--export-targets=torchscript")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # pytest's "not found", not the suite


@pytest.mark.parametrize(
    ("text", "item"),
    [
        (f"../exportcheck::plugin_loads::{ITEM}", ITEM),
        (f"../../exportcheck::{ITEM}", ITEM),
        (f"..\\exportcheck::{ITEM}", ITEM),
        (f"sub/exportcheck::{ITEM}", None),
        (f"../exportcheck::registered::{ITEM}", None),
    ],
)
def test_item_ids_as_printed_below_the_rootdir(text: str, item: str | None) -> None:
    """What an xfails file copied from such a FAILED line holds."""
    assert item_id_of(text) == item
