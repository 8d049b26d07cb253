"""``served`` has one item per target x engine x family, and resolves its engine before exporting.

Through the plugin (pytester, each run in a subprocess: in process, a run after one
that imported transformers' model classes finds them broken). Nothing here starts an
engine. Without an
engine's interpreter, or with another version of it than its support table's, an item
is a skip (``unavailable`` / ``unverified``) that costs no export; under
``--export-require-engines`` it is a failure.
"""

from __future__ import annotations

import sys

import pytest

from exportlm.engines import engines_taking, find_interpreter, installed_version

BASE = ["--export-only", "-p", "no:cacheprovider", "-n", "0", "--export-checks=served"]
ENGINE_VARS = ("TRANSFORMERS", "VLLM", "OPENVINO", "OPTIMUM_ONNXRUNTIME", "ONNXRUNTIME_GENAI")
NO_EXPORT = "*artifact cache: 0 items served from the cache, 0 exported (0 exports)*"


@pytest.fixture
def no_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENGINE_VARS:
        monkeypatch.delenv(f"EXPORTLM_ENGINE_{name}", raising=False)


def test_each_engine_that_takes_the_targets_output_is_an_item_coordinate(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_subprocess(
        *BASE,
        "--export-targets=hf_checkpoint,onnx,torch_export",
        "--export-models=llama",
        "--co",
        "-q",
    )
    served = sorted(line.split("::")[-1] for line in result.outlines if "::served[" in line)
    assert served == sorted(
        [f"served[hf_checkpoint-{e}-llama-cpu]" for e in engines_taking("hf_checkpoint")]
        + [f"served[onnx-{e}-llama-cpu]" for e in engines_taking("onnx")]
    )  # torch_export: no engine takes a .pt2 program, so no item
    assert engines_taking("hf_checkpoint") == ["transformers", "vllm"]
    assert set(engines_taking("onnx")) == {"openvino", "optimum-onnxruntime", "onnxruntime-genai"}


def test_an_item_without_its_engine_skips_before_exporting(
    pytester: pytest.Pytester, no_engines: None
) -> None:
    if find_interpreter("vllm").path is not None:
        pytest.skip("vllm imports in this interpreter")
    args = [*BASE, "--export-targets=hf_checkpoint", "--export-models=llama", "-rs"]
    result = pytester.runpytest_subprocess(
        *args, "exportcheck::served[hf_checkpoint-vllm-llama-cpu]"
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*hf_checkpoint: [[]vllm / unavailable[]] vllm does not import in*", NO_EXPORT]
    )
    required = pytester.runpytest_subprocess(
        *args, "--export-require-engines", "exportcheck::served[hf_checkpoint-vllm-llama-cpu]"
    )
    required.assert_outcomes(failed=1)
    required.stdout.fnmatch_lines(["*[[]vllm / unavailable[]]*(--export-require-engines)*"])


def test_another_engine_version_than_the_tables_is_unverified_and_exports_nothing(
    pytester: pytest.Pytester, no_engines: None
) -> None:
    """This interpreter's transformers (exportlm's pin) is not the 5.19.0 the table was read from."""
    here = installed_version("transformers", sys.executable)
    if here == "5.19.0":
        pytest.skip("this interpreter has the table's transformers")
    item = "exportcheck::served[hf_checkpoint-transformers-llama-cpu]"
    args = [*BASE, "--export-targets=hf_checkpoint", "--export-models=llama", "-rs", item]
    given = f"--export-engine=transformers={sys.executable}"
    result = pytester.runpytest_subprocess(*args, given)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"*[[]transformers / unverified[]] unverified: transformers {here} in *"
            "table was read from 5.19.0*",
            NO_EXPORT,
        ]
    )
    required = pytester.runpytest_subprocess(*args, given, "--export-require-engines")
    required.assert_outcomes(failed=1)
    required.stdout.fnmatch_lines(["*unverified: transformers*(--export-require-engines)*"])


def test_a_family_served_does_not_run_is_a_skip_that_exports_nothing(
    pytester: pytest.Pytester, no_engines: None
) -> None:
    result = pytester.runpytest_subprocess(
        *BASE, "--export-targets=onnx", "--export-models=mixtral", "-rs"
    )
    result.assert_outcomes(passed=1, skipped=len(engines_taking("onnx")))
    result.stdout.fnmatch_lines(["*'mixtral' is not one of them*", NO_EXPORT])


def _never(case: object) -> object:  # pragma: no cover - planning only
    raise AssertionError("planning must not run a check")


def test_the_planner_puts_the_engine_between_row_and_family_and_skips_targets_without_one() -> None:
    from pytest_exportcheck.checks import CheckSpec
    from pytest_exportcheck.checks.catalogue import CatalogueError
    from pytest_exportcheck.plan import Plan, plan
    from pytest_exportcheck.plan._items import TargetPlan

    spec = CheckSpec("served_like", "target", _never, per_model=True, per_engine=True)
    targets = (
        TargetPlan("ckpt", ((None, {}),), engines=("transformers", "vllm")),
        TargetPlan("prog", ((None, {}),)),  # no engine takes what it writes
    )
    items = plan(Plan(checks=(spec,), targets=targets, models=("llama",)))
    served = [(i.name, i.engine) for i in items if i.check == "served_like"]
    assert served == [
        ("served_like[ckpt-transformers-llama-cpu]", "transformers"),
        ("served_like[ckpt-vllm-llama-cpu]", "vllm"),
    ]
    with pytest.raises(CatalogueError, match="per_engine=True needs per_model=True"):
        CheckSpec("bad", "target", _never, per_engine=True)
