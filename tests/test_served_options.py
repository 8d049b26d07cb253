"""The served check's options: ``--export-engine NAME=PATH`` (and its ini key) and
``--export-require-engines``; a bad value is refused before any engine starts."""

from __future__ import annotations

import pytest

SUITE = ["--export-targets=torch_export", "--export-only", "-p", "no:cacheprovider", "-n", "0"]


def test_an_engine_option_without_a_path_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*SUITE, "--export-engine", "vllm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-engine takes NAME=PATH, got 'vllm'*"])


def test_an_engine_named_twice_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nexport_engine =\n    vllm=/a/python\n    vllm=/b/python\n")
    result = pytester.runpytest(*SUITE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*names engine 'vllm' twice*"])


def test_an_unknown_engine_fails_the_served_item_naming_the_registered_ones(
    pytester: pytest.Pytester,
) -> None:
    # in-process: tests/conftest.py keeps the transformers model classes an earlier run
    # imported (dropped, they were broken for this one: "transformers is not installed")
    result = pytester.runpytest(
        *SUITE[1:],
        "--export-targets=hf_checkpoint",
        "--export-checks=served",
        "--export-models=llama",
        "--export-engine=nope=/x",
    )
    result.assert_outcomes(passed=1, failed=2)  # plugin_loads; each engine's item fails
    result.stdout.fnmatch_lines(["*--export-engine: *unknown engine 'nope'*vllm*"])


def test_the_options_are_in_the_header(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        *SUITE,
        "--export-checks=plugin_loads",
        "--export-engine=vllm=/x",
        "--export-require-engines",
    )
    result.stdout.fnmatch_lines(["*engines=[[]'vllm=/x'[]] require_engines=True*"])
