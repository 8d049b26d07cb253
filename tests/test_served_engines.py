"""``served`` has one item per target x engine x family, and resolves its engine before exporting.

Through the plugin (pytester, in-process runs; tests/conftest.py keeps the transformers
model classes a run imports, so a later run finds them whole). Nothing here starts an
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
    for engine in ("vllm", "openvino", "optimum-onnxruntime", "onnxruntime-genai"):
        if find_interpreter(engine).path is not None:
            pytest.skip(f"{engine} imports in this interpreter")


#: This interpreter's transformers (exportlm's pin), given as the transformers engine: not
#: the 5.19.0 its table was read from.
HERE = installed_version("transformers", sys.executable)
GIVEN = f"--export-engine=transformers={sys.executable}"


def test_one_item_per_engine_each_skipping_before_any_export(
    pytester: pytest.Pytester, no_engines: None
) -> None:
    """Missing engines, an off-version engine: no export; a family served does not run: no item."""
    if HERE == "5.19.0":
        pytest.skip("this interpreter has the table's transformers")
    targets = "--export-targets=hf_checkpoint,onnx,torch_export"
    result = pytester.runpytest(*BASE, targets, "--export-models=llama,mixtral", GIVEN, "-rs", "-v")
    ids = sorted(
        line.split("::")[-1].split(" ")[0] for line in result.outlines if "::served[" in line
    )
    engines = {"hf_checkpoint": engines_taking("hf_checkpoint"), "onnx": engines_taking("onnx")}
    assert engines["hf_checkpoint"] == ["transformers", "vllm"]
    assert set(engines["onnx"]) == {"openvino", "optimum-onnxruntime", "onnxruntime-genai"}
    assert ids == sorted(
        f"served[{t}-{e}-{m}-cpu]" for t, es in engines.items() for e in es for m in ("llama",)
    )  # torch_export: no engine takes a .pt2 program; served runs no mixtral: no item either
    result.assert_outcomes(passed=3, skipped=len(ids))  # passed: the plugin_loads items
    for line in (
        f"*[[]transformers / unverified[]] unverified: transformers {HERE} in *"
        "table was read from 5.19.0*",
        "*hf_checkpoint: [[]vllm / unavailable[]] vllm does not import in*",
        "*onnx: [[]openvino / unavailable[]] openvino does not import in*",
        "  · not applicable: * (row, check) cell(s), *",
        NO_EXPORT,
    ):
        result.stdout.fnmatch_lines([line])


def test_a_missing_or_off_version_engine_fails_under_require_engines(
    pytester: pytest.Pytester, no_engines: None
) -> None:
    if HERE == "5.19.0":
        pytest.skip("this interpreter has the table's transformers")
    items = [f"exportcheck::served[hf_checkpoint-{e}-llama-cpu]" for e in ("transformers", "vllm")]
    result = pytester.runpytest(
        *BASE, "--export-targets=hf_checkpoint", GIVEN, "--export-require-engines", *items
    )
    result.assert_outcomes(failed=2)
    for line in (
        "*[[]transformers / unverified[]] unverified: *(--export-require-engines)",
        "*[[]vllm / unavailable[]] vllm does not import *(--export-require-engines)",
        NO_EXPORT,
    ):
        result.stdout.fnmatch_lines([line])


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
