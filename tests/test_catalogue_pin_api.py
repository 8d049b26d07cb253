"""A pinned catalogue through the API and in node ids: the same items, and a message naming the version.

``parametrize_with_checks(catalogue=N)`` / ``run_check(..., catalogue=N)`` pin the
catalogue as the ini key ``exportcheck_catalogue`` does; a check, family or item
id that only a newer version has is refused with the version that added it, not
as an unknown name.
"""

from __future__ import annotations

import pytest

import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from exportlm.errors import UnknownNameError
from pytest_exportcheck.api import parametrize_with_checks, run_check


def _ids(mark: pytest.MarkDecorator) -> set[str]:
    return {p.id for p in mark.args[1]}


def test_the_api_pin_leaves_out_what_newer_catalogues_added() -> None:
    pinned = _ids(parametrize_with_checks(targets=["torch_export"], catalogue=2))
    current = _ids(parametrize_with_checks(targets=["torch_export"]))
    assert "roundtrip_logits-torch_export-llama-cpu" in pinned
    assert pinned < current
    # trust and the families llama4 / dbrx (v3) are newer than v2 (torch_export has no
    # served item: no engine takes its artifact)
    new = current - pinned
    assert any(i.startswith("trust-") for i in new)
    assert any("-dbrx-" in i for i in new)
    assert any("-llama4-" in i for i in new)
    assert not any(i.startswith(("trust-", "served-")) or "-dbrx-" in i for i in pinned)


def test_run_check_under_a_pin_names_the_version_of_a_newer_check_or_family() -> None:
    with pytest.raises(UnknownNameError, match=r"'trust' is new in catalogue v3.*pins v2"):
        run_check("trust", target="torch_export", catalogue=2)
    with pytest.raises(UnknownNameError, match=r"'dbrx' is new in catalogue v3.*pins v2"):
        run_check("roundtrip_logits", target="torch_export", model="dbrx", catalogue=2)
    with pytest.raises(UnknownNameError, match="unknown check 'no_such_check'"):
        run_check("no_such_check", target="torch_export", catalogue=2)


@pytest.mark.parametrize("bad", [0, 99, "2", True])
def test_a_bad_api_catalogue_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"catalogue=.*expected None or a catalogue version"):
        parametrize_with_checks(targets=["torch_export"], catalogue=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("exportcheck::trust", "*exportcheck::trust is new in catalogue v3, and this run pins v2*"),
        (
            "exportcheck::roundtrip_logits::roundtrip_logits[torch_export-dbrx-cpu]",
            "*roundtrip_logits[[]torch_export-dbrx-cpu[]] is new in catalogue v3, and this run "
            "pins v2*",
        ),
        ("exportcheck::nonesuch", "*exportcheck::nonesuch: no such check; available:*"),
    ],
)
def test_a_node_id_of_a_newer_catalogue_says_so(
    pytester: pytest.Pytester, arg: str, message: str
) -> None:
    result = pytester.runpytest("--export-targets=torch_export", "--export-catalogue=2", arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
