"""The suite's items select like pytest's own: rerun by node id, --lf, --ff, --sw, -k, -m.

Failures come from an xfails file that declares passing items as expected failures
(strict: an unexpected pass fails), so every run only plans cheap checks
(``plugin_loads``, ``registered``: no export) and runs in-process in well under a
second. Only the xdist runs start processes (their workers).
"""

from __future__ import annotations

import re

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401

SUITE = [
    "--export-targets=torch_export,torchscript",
    "--export-checks=plugin_loads,registered",
    "--export-xfails-file=xfails.txt",
]
FAILING = "exportcheck::plugin_loads::plugin_loads[torchscript:trace]"
#: The suite's items in plan order; FAILING is the fifth.
ORDER = [
    "exportcheck::plugin_loads::plugin_loads[torch_export]",
    "exportcheck::registered::registered[torch_export-cpu]",
    "exportcheck::plugin_loads::plugin_loads[torchscript:script]",
    "exportcheck::registered::registered[torchscript:script-cpu]",
    FAILING,
    "exportcheck::registered::registered[torchscript:trace-cpu]",
]


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project with one test of its own and an xfails file making one item fail."""
    pytester.makepyfile(test_own="def test_own():\n    pass\n")
    (pytester.path / "xfails.txt").write_text(
        "exportcheck::plugin_loads[torchscript:trace]  # passes, so this strict xfail fails\n"
    )
    return pytester


def _failed(result: pytest.RunResult) -> list[str]:
    return [line.split()[1] for line in result.outlines if line.startswith("FAILED ")]


def _ran(result: pytest.RunResult) -> list[str]:
    """Node ids in the order ``-v`` reported them."""
    pattern = re.compile(r"^(\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")
    return [m[1] for line in result.outlines if (m := pattern.match(line))]


def test_the_id_on_a_failed_line_reruns_exactly_that_item(project: pytest.Pytester) -> None:
    first = project.runpytest(*SUITE, "-rf")
    first.assert_outcomes(passed=6, failed=1)
    assert _failed(first) == [FAILING]

    # no --export-* selection: the node id alone asks for the suite and that item
    again = project.runpytest(FAILING, "--export-xfails-file=xfails.txt", "-v")
    assert _ran(again) == [FAILING]
    again.assert_outcomes(failed=1)

    # the short form (the item id under exportcheck::), several ids, and a test path
    mixed = project.runpytest(
        "exportcheck::plugin_loads[torchscript:trace]",
        "test_own.py",
        "exportcheck::registered[torch_export-cpu]",
        "--export-xfails-file=xfails.txt",
        "-v",
    )
    assert sorted(_ran(mixed)) == sorted(
        [FAILING, "test_own.py::test_own", "exportcheck::registered::registered[torch_export-cpu]"]
    )
    mixed.assert_outcomes(passed=2, failed=1)


def test_a_check_or_the_whole_suite_as_an_argument(project: pytest.Pytester) -> None:
    """``exportcheck::<check>`` is every item of that check in the selection, like a test file."""
    one_check = project.runpytest("exportcheck::registered", "--export-targets=torchscript", "-v")
    assert _ran(one_check) == [
        "exportcheck::registered::registered[torchscript:script-cpu]",
        "exportcheck::registered::registered[torchscript:trace-cpu]",
    ]
    whole = project.runpytest("exportcheck", *SUITE, "-v")
    assert _ran(whole) == ORDER  # the repo's own test_own.py was not asked for


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (
            "exportcheck::registered[torchscrpt:trace-cpu]",
            "*no such exportcheck item*did you mean registered[[]torchscript:trace-cpu]*",
        ),
        ("exportcheck::no_such_check", "*exportcheck::no_such_check: no such check; available:*"),
        ("exportcheck::a::b::c", "*'exportcheck::a::b::c' is not a node id of the exportcheck*"),
    ],
)
def test_a_wrong_suite_node_id_is_a_usage_error(
    project: pytest.Pytester, arg: str, message: str
) -> None:
    result = project.runpytest(arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "INTERNALERROR" not in result.stderr.str()


def test_last_failed_and_failed_first(project: pytest.Pytester) -> None:
    project.runpytest(*SUITE).assert_outcomes(passed=6, failed=1)

    last_failed = project.runpytest(*SUITE, "--lf", "-v")
    last_failed.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*"])
    assert _ran(last_failed) == [FAILING]
    last_failed.assert_outcomes(failed=1, deselected=6)

    failed_first = project.runpytest(*SUITE, "--ff", "-v")
    ran = _ran(failed_first)
    assert ran[0] == FAILING
    assert sorted(ran) == sorted([*ORDER, "test_own.py::test_own"])


def test_a_bare_last_failed_reruns_the_failed_suite_items(project: pytest.Pytester) -> None:
    """``pytest --lf`` with no --export-* option plans the suite items pytest recorded as failed."""
    project.makeini("[pytest]\nexport_xfails_file = xfails.txt\n")  # what makes FAILING fail
    project.runpytest(*SUITE[:2]).assert_outcomes(passed=6, failed=1)

    bare = project.runpytest("--lf", "-v")
    assert _ran(bare) == [FAILING], bare.stdout.str()
    bare.assert_outcomes(failed=1)
    assert bare.ret == pytest.ExitCode.TESTS_FAILED


def test_stepwise_stops_at_the_failure_and_resumes_there(project: pytest.Pytester) -> None:
    first = project.runpytest(*SUITE, "--export-only", "--sw", "-v")
    assert _ran(first) == ORDER[:5]  # stopped at the failure
    first.assert_outcomes(passed=4, failed=1)

    resumed = project.runpytest(*SUITE, "--export-only", "--sw", "-v")
    resumed.stdout.fnmatch_lines(["stepwise: skipping 4 already passed items*"])
    assert _ran(resumed) == [FAILING]

    skipping = project.runpytest(*SUITE, "--export-only", "--sw", "--sw-skip", "-v")
    assert _ran(skipping) == ORDER[4:]  # the known failure no longer stops the run


def test_keyword_and_marker_selection(project: pytest.Pytester) -> None:
    keyword = project.runpytest(*SUITE, "-k", "registered and trace", "-v")
    assert _ran(keyword) == ["exportcheck::registered::registered[torchscript:trace-cpu]"]

    marked = project.runpytest(*SUITE, "-m", "exportcheck", "-v")
    assert _ran(marked) == ORDER
    unmarked = project.runpytest(*SUITE, "-m", "not exportcheck", "-v")
    assert _ran(unmarked) == ["test_own.py::test_own"]


def test_markers_are_registered_for_strict_hosts(project: pytest.Pytester) -> None:
    """``--markers`` lists them without the suite; ``-m hypothesis`` selects the generated checks."""
    listed = project.runpytest("--markers")
    listed.stdout.fnmatch_lines(["@pytest.mark.exportcheck:*", "@pytest.mark.hypothesis:*"])

    collected = project.runpytest(
        "--strict-markers",
        "--export-targets=torchscript",
        "--export-checks=registered,roundtrip_generated",
        "-m",
        "hypothesis",
        "--co",
        "-q",
    )
    assert collected.ret == pytest.ExitCode.OK
    assert [line for line in collected.outlines if line.startswith("exportcheck::")] == [
        "exportcheck::roundtrip_generated::roundtrip_generated[torchscript:script-cpu]",
        "exportcheck::roundtrip_generated::roundtrip_generated[torchscript:trace-cpu]",
    ]


def test_rerun_by_id_and_last_failed_under_xdist(project: pytest.Pytester) -> None:
    """Workers parse the command line themselves: they must collect the same items."""
    project.runpytest(*SUITE).assert_outcomes(passed=6, failed=1)

    last_failed = project.runpytest(*SUITE, "--lf", "-n", "2")
    last_failed.assert_outcomes(failed=1)
    assert _failed(last_failed) == [FAILING]

    by_id = project.runpytest(
        FAILING, "exportcheck::registered[torch_export-cpu]", SUITE[-1], "-n", "2"
    )
    by_id.assert_outcomes(passed=1, failed=1)
    assert _failed(by_id) == [FAILING]
