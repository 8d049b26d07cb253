"""Where a conformance run spends its time, and what a rerun takes from the cache.

The runs register a counting model family from a ``conftest.py`` (which takes it
out of the registry again when the run ends) and run in-process, with and without
xdist: every process builds each toy model once, the JSON report carries each
item's time profile, ``--export-durations`` prints the slowest items, and a
rerun says how many items the artifact cache served. A failed export is
remembered across runs. No assertion here is about how long anything took.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from exportlm.errors import ExportFailedError
from pytest_exportcheck.checks._services import CheckServices, ItemProfile
from pytest_exportcheck.run._failure_memo import ExportFailureMemo, RememberedExportFailure
from pytest_exportcheck.session.reporting._report import ItemRecord, ReportBuilder

COUNTING_FAMILY = '''
import gc
import os
from pathlib import Path

from exportlm.models import MODEL_REGISTRY, ensure_models_registered
from exportlm.models import DecoderModel, seeded_init_

ensure_models_registered()
BUILDS = Path(__file__).parent / "builds"


def counted(seed=0, **overrides):
    """The plain decoder, counting each construction in ./builds (one line per build);
    ./thresholds gets the garbage collector's thresholds at each build."""
    with BUILDS.open("a") as log:
        log.write(f"{os.getpid()}\\n")
    with (BUILDS.parent / "thresholds").open("a") as log:
        log.write(f"build {gc.get_threshold()}\\n")
    model = DecoderModel()
    seeded_init_(model, seed)
    return model.eval()


MODEL_REGISTRY.register("counted", counted)


def pytest_unconfigure(config):  # an in-process run leaves the registry as it was
    MODEL_REGISTRY.unregister("counted")
'''

ARGS = [
    "--export-targets=torchscript",
    "--export-exporters=none",
    "--export-models=counted",
    "--export-checks=roundtrip_logits,dynamic_shapes,unknown_kwargs,trust",
    "--export-only",
    "--export-report=report.json",
    "-k",
    "trace",  # the script variant is an expected failure of the plain decoder only
    "-p",
    "no:randomly",
]


def _builds(pytester: pytest.Pytester) -> dict[str, int]:
    """Builds of the counting family per process id."""
    log = pytester.path / "builds"
    pids = log.read_text().split() if log.exists() else []
    return {pid: pids.count(pid) for pid in set(pids)}


def _ran_clean(result: pytest.RunResult) -> None:
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 4, outcomes
    assert not outcomes.get("failed"), outcomes


def _report(pytester: pytest.Pytester) -> dict[str, dict[str, object]]:
    data = json.loads((pytester.path / "report.json").read_text())
    return {item["id"]: item for item in data["items"]}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_each_process_builds_a_toy_model_once_and_reports_profiles(
    pytester: pytest.Pytester, workers: str
) -> None:
    pytester.makeconftest(COUNTING_FAMILY)
    result = pytester.runpytest(*ARGS, "-n", workers, "--export-durations=3")
    _ran_clean(result)
    builds = _builds(pytester)
    assert all(count == 1 for count in builds.values()), builds
    items = _report(pytester)
    # The services' own count agrees: one build in all, on the first item of the
    # (target, family) of each process (runner accepts, cache key and check share it).
    counted = [
        item["profile"].get("builds", 0)  # type: ignore[union-attr]
        for item in items.values()
        if item["model"] == "counted"
    ]
    assert sum(counted) == len(builds), counted
    profile = items["roundtrip_logits[torchscript:trace-counted-cpu]"]["profile"]
    assert isinstance(profile, dict)
    assert set(profile) >= {"total", "build", "export", "cache", "load", "compare", "other"}
    assert profile["artifact"] in ("cached", "exported")
    result.stdout.fnmatch_lines(
        [
            "*exportcheck: slowest 3 items*",
            "*s *[[]torchscript*(build *s, export *s, cache *s, load *s, compare *s, other *s; *)",
        ]
    )


def test_a_rerun_takes_every_artifact_from_the_cache(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(COUNTING_FAMILY)
    first = pytester.runpytest(*ARGS)
    _ran_clean(first)
    exported = json.loads((pytester.path / "report.json").read_text())["cache"]
    assert exported["exports"] >= 1
    second = pytester.runpytest(*ARGS)
    _ran_clean(second)
    cache = json.loads((pytester.path / "report.json").read_text())["cache"]
    assert cache["exported"] == 0
    assert cache["exports"] == 0
    assert cache["served_from_cache"] >= 4
    second.stdout.fnmatch_lines(
        [f"artifact cache: {cache['served_from_cache']} items served from the cache, 0 exported*"]
    )


FAILING_FAMILY = '''
from exportlm.models import MODEL_REGISTRY, ensure_models_registered
from exportlm.models import DecoderModel, seeded_init_
import torch

ensure_models_registered()


class Untraceable(DecoderModel):
    """A decoder whose forward branches on data: TorchScript's trace refuses it."""

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        if input_ids.sum() > 0:
            raise RuntimeError("exportcheck test: this model cannot be traced")
        return super().forward(input_ids, attention_mask=attention_mask, use_cache=use_cache)


def untraceable(seed=0, **overrides):
    model = Untraceable()
    seeded_init_(model, seed)
    return model.eval()


MODEL_REGISTRY.register("untraceable", untraceable)


def pytest_unconfigure(config):  # an in-process run leaves the registry as it was
    MODEL_REGISTRY.unregister("untraceable")
'''


def test_a_failed_export_is_remembered_for_the_next_run(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAILING_FAMILY)
    args = [
        "--export-targets=torch_export",
        "--export-exporters=none",
        "--export-models=untraceable",
        "--export-checks=roundtrip_logits",
        "--export-only",
        "--export-report=report.json",
    ]
    first = pytester.runpytest(*args)
    first.assert_outcomes(passed=1, failed=1)
    failures = pytester.path / ".pytest_cache" / "d" / "exportcheck" / "failures"
    if not list(failures.glob("*.json")):
        pytest.skip("the exporter's failure was not an ExportFailedError on this torch version")
    second = pytester.runpytest(*args)
    second.assert_outcomes(passed=1, failed=1)
    item = _report(pytester)["roundtrip_logits[torch_export-untraceable-cpu]"]
    assert "RememberedExportFailure" in str(item["message"])
    assert item["profile"]["artifact"] == "cached"  # type: ignore[index]
    again = pytester.runpytest(*args, "--export-no-cache")
    again.assert_outcomes(passed=1, failed=1)
    assert "RememberedExportFailure" not in str(_report(pytester)[item["id"]]["message"])


# ----------------------------------------------------------------------------- pure parts


def test_nested_phases_count_their_time_once() -> None:
    profile = ItemProfile()
    with profile.phase("export") as outer:
        with profile.phase("build"):
            pass
        outer.name = "cache"
    data = profile.as_json(total=profile.seconds["cache"] + profile.seconds["build"] + 1.0)
    assert "export" not in profile.seconds
    assert data["other"] == pytest.approx(1.0, abs=1e-3)
    assert data["artifact"] is None
    profile.count("cache_hits")
    assert profile.artifact == "cached"
    profile.count("cache_misses")
    assert profile.artifact == "exported"


def test_services_build_once_and_hand_out_copies() -> None:
    built: list[str] = []

    def build(name: str, seed: int) -> list[int]:
        built.append(name)
        return [seed]

    services = CheckServices(build)
    first, second = services.model("a", 1), services.model("a", 1)
    first.append(99)
    assert built == ["a"]
    assert second == [1]
    assert services.pristine_model("a", 1) == [1]
    loads: list[int] = []
    for key in [1, 2, 1, 3, 4, 5, 1]:
        services.shared_runtime(key, lambda key=key: loads.append(key) or key)
    assert loads == [1, 2, 3, 4, 5]  # 1 stayed among the last four used


def test_the_slowest_items_and_the_cache_use_come_from_the_records(tmp_path: Path) -> None:
    report = ReportBuilder()
    for i, artifact in enumerate(["cached", "exported", None]):
        record = ItemRecord(f"c[{i}]", f"n{i}", "c", "target", "t", duration=float(i))
        record.profile = {"artifact": artifact, "exports": 1 if artifact == "exported" else 0}
        report.records[record.nodeid] = record
    assert [r.id for r in report.slowest(2)] == ["c[2]", "c[1]"]
    assert report.cache_use() == {"served_from_cache": 1, "exported": 1, "exports": 1}
    assert report.durations_lines(1)[0].endswith("; no shared artifact)")


def _failed_export(cause: BaseException) -> ExportFailedError:
    try:
        try:
            raise cause
        except BaseException as err:
            raise ExportFailedError("the exporter gave up on the graph") from err
    except ExportFailedError as failed:
        return failed


def test_only_failures_of_the_export_itself_are_remembered(tmp_path: Path) -> None:
    memo = ExportFailureMemo(tmp_path)
    memo.remember("source", _failed_export(OSError("could not get source code")))
    memo.remember("disk", _failed_export(OSError(errno.ENOSPC, "No space left on device")))
    memo.remember("memory", _failed_export(MemoryError()))
    memo.remember("other", RuntimeError("not an exporter failure"))
    recalled = memo.recall("source")
    assert isinstance(recalled, RememberedExportFailure)
    assert isinstance(recalled, ExportFailedError)
    assert str(recalled) == "the exporter gave up on the graph"
    assert [memo.recall(k) for k in ("disk", "memory", "other")] == [None, None, None]
    record = tmp_path / "source.json"
    record.write_text(record.read_text().replace("gave up", "succeeded"))  # unsigned change
    assert memo.recall("source") is None
    assert ExportFailureMemo(None).recall("source") is None


def test_onnx_exports_reuse_torchlib_table_and_write_the_same_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second ``onnx`` export of a process reuses the first one's torchlib table
    (``exportlm.export.onnx._registry``): the graph written is the one a fresh table gives."""
    pytest.importorskip("onnxscript")
    import onnx
    from torch.onnx._internal.exporter import _registration

    import exportlm.export.onnx._registry as memo
    from exportlm import export_model
    from exportlm.models import build_model

    monkeypatch.setattr(memo, "_BUILT", {})  # the first export below builds the table
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    model = build_model("decoder", seed=0, num_layers=1)
    fresh = export_model("onnx", model, tmp_path / "fresh.onnx")
    assert len(memo._BUILT) == 1, "the first export did not keep its table"
    reused = export_model("onnx", model, tmp_path / "reused.onnx")
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
    a, b = onnx.load(str(fresh)), onnx.load(str(reused))
    assert [(n.op_type, n.domain, list(n.input), list(n.output)) for n in a.graph.node] == [
        (n.op_type, n.domain, list(n.input), list(n.output)) for n in b.graph.node
    ]
    assert a.SerializeToString() == b.SerializeToString()


def test_a_reused_torchlib_table_keeps_each_exports_own_registrations() -> None:
    """What one export registers on its table (a custom translation) is not in the next one's."""
    pytest.importorskip("onnxscript")
    import torch
    from torch.onnx._internal.exporter import _registration

    from exportlm.export.onnx._registry import torchlib_registry_reused

    with torchlib_registry_reused():
        first = _registration.ONNXRegistry().from_torchlib(opset_version=20)
        first.register_op(torch.ops.aten.add.Tensor, lambda a, b: a, is_complex=False)
        second = _registration.ONNXRegistry().from_torchlib(opset_version=20)
    assert first.functions is not second.functions
    assert first.opset_version == second.opset_version == 20
    custom = [d.is_custom for d in first.get_decomps(torch.ops.aten.add.Tensor)]
    assert custom.count(True) == 1
    assert not any(d.is_custom for d in second.get_decomps(torch.ops.aten.add.Tensor))
    assert set(first.functions) == set(second.functions)


#: The counting family, with the user's own thresholds and a line after each test.
GC_PROBE = (
    COUNTING_FAMILY
    + """
SEEN = BUILDS.parent / "thresholds"
BEFORE = gc.get_threshold()
unregister_counted = pytest_unconfigure


def pytest_configure(config):
    gc.set_threshold(800, 11, 12)  # the user's own


def pytest_runtest_logfinish(nodeid, location):
    with SEEN.open("a") as log:
        log.write(f"after {nodeid.split('::')[-1]} {gc.get_threshold()}\\n")


def pytest_unconfigure(config):
    gc.set_threshold(*BEFORE)
    unregister_counted(config)
"""
)

USER_TEST = """
import gc
from pathlib import Path


def test_own():
    with (Path(__file__).parent / "thresholds").open("a") as log:
        log.write(f"own {gc.get_threshold()}\\n")
"""


def test_items_run_with_fewer_collections_and_the_users_tests_keep_their_thresholds(
    pytester: pytest.Pytester,
) -> None:
    """An item builds (and exports) under the plugin's thresholds; the user's test, and
    what follows an item, under the user's own (restored when the item ends)."""
    from pytest_exportcheck.run._gc import ITEM_GC_THRESHOLDS

    pytester.makeconftest(GC_PROBE)
    pytester.makepyfile(test_z_own=USER_TEST)
    result = pytester.runpytest(
        "--export-targets=torchscript",
        "--export-exporters=none",
        "--export-models=counted",
        "--export-checks=roundtrip_logits",
        "-k",
        "own or trace",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
    )
    result.assert_outcomes(passed=3, deselected=2)  # own, plugin_loads, roundtrip_logits
    seen = (pytester.path / "thresholds").read_text().splitlines()
    assert seen == [
        "own (800, 11, 12)",
        "after test_own (800, 11, 12)",
        "after plugin_loads[torchscript:trace] (800, 11, 12)",
        f"build {ITEM_GC_THRESHOLDS}",
        "after roundtrip_logits[torchscript:trace-counted-cpu] (800, 11, 12)",
    ], seen


def test_fewer_collections_keeps_higher_thresholds_and_a_disabled_collector() -> None:
    import gc

    from pytest_exportcheck.run._gc import ITEM_GC_THRESHOLDS, fewer_collections

    before = gc.get_threshold()
    try:
        gc.set_threshold(50_000, 5, 500)
        with fewer_collections():
            assert gc.get_threshold() == (50_000, ITEM_GC_THRESHOLDS[1], 500)
        assert gc.get_threshold() == (50_000, 5, 500)
        gc.set_threshold(0)
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        gc.set_threshold(700, 10, 10)
        with pytest.raises(RuntimeError), fewer_collections():
            raise RuntimeError("an item that raises still restores the thresholds")
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
