"""The plan package on its own: plain unit tests over fake discovery records (no pytester, no torch).

The planner, the expected-failure book, selections and node ids are pure; these
tests build a :class:`~pytest_exportcheck.plan.Discovery` by hand (two fake
targets, one with variants, a failed target, an exporter, a failed model
family) and check what the one planner plans for the suite and for the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck.checks import CheckSpec
from pytest_exportcheck.plan import (
    PLUGIN_LOADS,
    CaseOptions,
    Discovery,
    NameSelection,
    Planner,
    PlanRequest,
    PluginFailure,
    XfailBook,
    case_options,
    not_applicable,
    plan,
)
from pytest_exportcheck.plan._api_request import ApiSelection, api_planner, single_item
from pytest_exportcheck.plan._nodeids import (
    item_id_of,
    item_nodeid,
    last_failed_args,
    split_suite_args,
)


@dataclass(frozen=True)
class FakeTarget:
    """The parts of ``TargetInfo`` the planner reads."""

    runtime: str = "rt"
    capabilities: frozenset[str] = frozenset({"dynamic"})
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    expected_failures: Mapping[str, str] = field(default_factory=dict)
    accepts: Any = None
    artifact: str = "file"


def _fn(case: Any) -> Any:  # pragma: no cover - never called: planning only
    raise AssertionError("planning must not run a check")


CHECKS = {
    spec.id: spec
    for spec in (
        CheckSpec(PLUGIN_LOADS, "target", _fn),
        CheckSpec("once", "target", _fn),
        CheckSpec("logits", "target", _fn, per_model=True),
        CheckSpec("dynamic", "target", _fn, per_model=True, needs={"dynamic", "cuda"}),
        CheckSpec("golden", "exporter", _fn, markers={"slow"}),
    )
}

DISCOVERY = Discovery(
    targets={
        "alpha": FakeTarget(expected_failures={"logits[alpha-big-*]": "too big"}),
        "beta": FakeTarget(
            runtime="brt", capabilities=frozenset(), variants={"fast": {"opt": 1}, "slow": {}}
        ),
    },
    models=("big", "small"),
    exporters={"qlin": object()},
    failures=(
        PluginFailure("target", "broken", "acme 1.0", "ImportError: no module acme"),
        PluginFailure("model family", "ghost", "acme 1.0", "ImportError: ghost"),
    ),
    model_failures={"small": {"dynamic": "small is static"}},
)


def _planner() -> Planner:
    return Planner(DISCOVERY, CHECKS)


def _ids(request: PlanRequest) -> list[str]:
    return [s.name for s in plan(_planner().plan(request))]


def test_planning_names_every_item_in_a_fixed_order() -> None:
    request = PlanRequest(NameSelection.of(["alpha"]), models=NameSelection.of(["big"]))
    assert _ids(request) == [
        "plugin_loads[alpha]",
        "once[alpha-cpu]",
        "logits[alpha-big-cpu]",
        "dynamic[alpha-big-cpu]",
    ]


def test_an_item_carries_its_checks_cost_for_the_shard_split() -> None:
    """The cost is a fact of the check's record (no table of costs keyed by check id)."""
    checks = {**CHECKS, "logits": replace(CHECKS["logits"], cost=5)}
    request = PlanRequest(NameSelection.of(["alpha"]), models=NameSelection.of(["big"]))
    specs = {s.name: s for s in plan(Planner(DISCOVERY, checks).plan(request))}
    assert specs["logits[alpha-big-cpu]"].cost == 5
    assert specs["once[alpha-cpu]"].cost == 1
    with pytest.raises(ValueError, match="cost must be a whole number >= 1"):
        replace(CHECKS["logits"], cost=0)


def test_variants_are_rows_and_a_capability_gap_is_no_item_but_a_cell_with_its_reason() -> None:
    request = PlanRequest(NameSelection.of("beta"), models=NameSelection.of("small"))
    p = _planner().plan(request)
    specs = {s.name: s for s in plan(p)}
    assert [n for n in specs if n.startswith("plugin_loads")] == [
        "plugin_loads[beta:fast]",
        "plugin_loads[beta:slow]",
    ]
    assert specs["logits[beta:fast-small-cpu]"].export_kwargs == {"opt": 1}
    assert specs["logits[beta:fast-small-cpu]"].skip is None
    # beta declares no 'dynamic': the check cannot apply to either row, so it is no item...
    assert not [n for n in specs if n.startswith("dynamic[")]
    # ...but a cell of each row, once, with the reason
    cells = {(c.column, c.check): c for c in not_applicable(p)}
    assert set(cells) == {("beta:fast", "dynamic"), ("beta:slow", "dynamic")}
    gap = cells[("beta:slow", "dynamic")]
    assert "target 'beta' does not declare 'dynamic' (declared: none)" in gap.reason
    assert (gap.scope, gap.items, gap.check_index) == ("target", 1, 3)


def test_a_cuda_capability_gap_stays_a_skip_with_its_cause() -> None:
    """'cuda' is declared where the runtime's GPU build is installed: a gap in it can close."""
    request = PlanRequest(NameSelection.of("alpha"), models=NameSelection.of("big"))
    p = _planner().plan(request)
    (dynamic,) = [s for s in plan(p) if s.check == "dynamic"]
    assert dynamic.skip is not None
    assert "capability gap: target 'alpha' does not declare 'cuda'" in dynamic.skip
    assert not_applicable(p) == []


#: Checks declaring what they apply to besides capabilities: an artifact kind, families,
#: devices, an engine that takes the target's output.
APPLICABILITY = {
    spec.id: spec
    for spec in (
        CheckSpec("reads_dir", "target", _fn, per_model=True, artifacts={"directory"}),
        CheckSpec("big_only", "target", _fn, per_model=True, models={"big"}),
        CheckSpec("engine", "target", _fn, per_model=True, per_engine=True),
        CheckSpec("gemm", "exporter", _fn, per_device=True, devices={"cuda"}),
    )
}
APPLICABILITY_DISCOVERY = Discovery(
    targets={"dirt": FakeTarget(artifact="directory"), "filet": FakeTarget()},
    models=("big", "small"),
    exporters={"qlin": object()},
    target_engines={"dirt": ("vllm",)},
)


def test_artifacts_families_devices_and_engines_decide_which_cells_are_items() -> None:
    planner = Planner(APPLICABILITY_DISCOVERY, APPLICABILITY)
    everything = PlanRequest(
        NameSelection.of("all"), NameSelection.of("all"), NameSelection.of("all")
    )
    p = planner.plan(everything)
    assert [s.name for s in plan(p)] == [
        "plugin_loads[dirt]",
        "reads_dir[dirt-big-cpu]",
        "big_only[dirt-big-cpu]",
        "engine[dirt-vllm-big-cpu]",
        "reads_dir[dirt-small-cpu]",
        "engine[dirt-vllm-small-cpu]",
        "plugin_loads[filet]",
        "big_only[filet-big-cpu]",
    ]
    cells = {(c.column, c.check): (c.reason, c.items) for c in planner.not_applicable(everything)}
    assert cells == {
        ("dirt", "big_only"): ("big_only runs the families big only, not small", 1),
        ("filet", "reads_dir"): (
            "target 'filet' writes a file artifact; reads_dir reads directory artifacts",
            2,
        ),
        ("filet", "big_only"): ("big_only runs the families big only, not small", 1),
        ("filet", "engine"): (  # never an item: it is shown as ·, it leaves out none
            "no serving engine's support table takes what target 'filet' writes",
            0,
        ),
        ("qlin", "gemm"): (
            "gemm runs on cuda devices only, not cpu (select one with --export-device=cuda)",
            1,
        ),
    }
    # a run on a GPU too: the device check is an item there; its CPU item is still left out
    on_gpu = PlanRequest(exporters=NameSelection.of("qlin"), devices=("cpu", "cuda"))
    assert [s.name for s in plan(planner.plan(on_gpu))] == ["gemm[qlin-cuda]"]
    assert [(c.column, c.items) for c in planner.not_applicable(on_gpu)] == [("qlin", 1)]


def test_a_cell_that_cannot_apply_asked_for_by_name_says_why() -> None:
    """run_check plans it as a skip with the reason; its node id on the command line says why."""
    planner = api_planner(APPLICABILITY_DISCOVERY, APPLICABILITY)
    item = single_item(
        planner, "reads_dir", target="filet", exporter=None, model="big", device="cpu"
    )
    assert item.skip == (
        "not applicable: target 'filet' writes a file artifact; reads_dir reads directory artifacts"
    )
    gemm = single_item(planner, "gemm", target=None, exporter="qlin", model=None, device="cpu")
    assert gemm.skip is not None
    assert gemm.skip.startswith("not applicable: gemm runs on cuda")
    args, _ = split_suite_args(["exportcheck::reads_dir[filet-big-cpu]"], Path.cwd())
    with pytest.raises(pytest.UsageError, match="not applicable: target 'filet' writes a file"):
        Planner(APPLICABILITY_DISCOVERY, APPLICABILITY).items(PlanRequest(), args)


def test_a_failed_plugin_is_a_failing_plugin_loads_item_and_nothing_else() -> None:
    request = PlanRequest(NameSelection.of("all"), models=NameSelection.of(["ghost"]))
    specs = {s.name: s for s in plan(_planner().plan(request))}
    assert specs["plugin_loads[broken]"].failure == "ImportError: no module acme"
    assert not [n for n in specs if "broken-" in n]
    assert specs["plugin_loads[model:ghost]"].failure == "ImportError: ghost"
    assert specs["plugin_loads[alpha]"].failure is None


def test_exporter_items_and_their_markers() -> None:
    request = PlanRequest(exporters=NameSelection.of("qlin"), models=NameSelection())
    (item,) = plan(_planner().plan(request))
    assert (item.name, item.scope, item.column, item.markers) == (
        "golden[qlin]",
        "exporter",
        "qlin",
        frozenset({"slow"}),
    )


def test_selection_parsing_and_unknown_names() -> None:
    assert NameSelection.parse("b, a,a") == NameSelection(names=("a", "b"))
    assert NameSelection.parse("all").all
    assert NameSelection.parse("none") == NameSelection()
    with pytest.raises(pytest.UsageError, match="the value is empty"):
        NameSelection.parse(" ,", "--export-models")
    with pytest.raises(pytest.UsageError, match="cannot be combined"):
        NameSelection.parse("all,a")
    with pytest.raises(pytest.UsageError, match=r"--export-targets: unknown export target 'gamma'"):
        _planner().plan(PlanRequest(NameSelection.of("gamma")))


def test_the_api_plans_the_suites_items_and_raises_unknown_name_error() -> None:
    from exportlm.errors import UnknownNameError

    planner = api_planner(DISCOVERY, CHECKS)
    selection = ApiSelection.resolve(planner, ["alpha"], (), ["big"], None, "cpu")
    suite = PlanRequest(NameSelection.of("alpha"), models=NameSelection.of("big"))
    assert [s.name for s in plan(selection.plan)] == _ids(suite)
    with pytest.raises(UnknownNameError):
        ApiSelection.resolve(planner, ["gamma"], (), "all", None, "cpu")
    with pytest.raises(ValueError, match="select at least one"):
        ApiSelection.resolve(planner, (), (), "all", None, "cpu")


def test_run_check_plans_one_item_of_a_variant_row() -> None:
    planner = api_planner(DISCOVERY, CHECKS)
    item = single_item(
        planner, "logits", target="beta:fast", exporter=None, model="big", device="cuda"
    )
    assert (item.name, dict(item.export_kwargs)) == ("logits[beta:fast-big-cuda]", {"opt": 1})
    with pytest.raises(ValueError, match="runs per model"):
        single_item(planner, "logits", target="alpha", exporter=None, model=None, device="cpu")


def test_expected_failures_resolve_by_scope_and_pattern() -> None:
    planner = _planner()
    book = planner.xfail_book()
    (rule,) = book.match("logits[alpha-big-cpu]", "logits", "alpha")
    assert (rule.reason, rule.source) == ("too big", "TargetInfo of 'alpha'")
    assert not book.match("logits[alpha-small-cpu]", "logits", "alpha")
    assert not book.match("logits[beta:fast-big-cpu]", "logits", "beta:fast")
    # A model family's rule applies to every row.
    assert [r.reason for r in book.match("dynamic[beta:fast-small-cpu]", "dynamic", "beta:fast")]
    assert planner.unmatched(book) == []
    stray = XfailBook()
    stray.add({"logits[nowhere-*]": "x"}, source="file", scope=None)
    assert [r.pattern for r in planner.unmatched(stray)] == ["logits[nowhere-*]"]


def test_node_ids_round_trip_and_name_only_planned_items(tmp_path: Path) -> None:
    specs = plan(_planner().everything())
    for spec in specs:
        assert item_id_of(item_nodeid(spec.check, spec.name)) == spec.name
    node = item_nodeid("logits", "logits[alpha-big-cpu]")
    args, rest = split_suite_args([node, "tests/x.py", "exportcheck::once"], tmp_path)
    assert rest == ["tests/x.py"]
    assert args.item_ids == {"logits[alpha-big-cpu]"}
    assert args.checks == {"once"}
    request = PlanRequest(NameSelection.of("beta"))
    chosen = [s.name for s in _planner().items(request, args)]
    # The check's items over the request, the named item whatever the request; plan order.
    assert chosen == ["logits[alpha-big-cpu]", "once[beta:fast-cpu]", "once[beta:slow-cpu]"]
    bad, _ = split_suite_args(["exportcheck::logits[alpha-huge-cpu]"], tmp_path)
    with pytest.raises(pytest.UsageError, match="no such exportcheck item"):
        _planner().items(request, bad)


def test_case_options_are_typed_and_read_as_a_mapping() -> None:
    options = case_options("all", "cuda", require_device=True, expected_failure="known")
    assert options == CaseOptions("all", "cuda", True, "known")
    assert options["models"] == "all"
    assert options.get("expected_failure") == "known"
    assert dict(options) == {
        "models": "all",
        "device": "cuda",
        "require_device": True,
        "expected_failure": "known",
        "engines": (),
        "require_engines": False,
        "quantize": (),
    }
    assert case_options(("a", "b"), None) == CaseOptions("a,b", "cpu")
    assert options.get("nope") is None


def test_last_failed_records_name_the_suite_items_only() -> None:
    record = {
        "tests/test_x.py::test_y": True,
        item_nodeid("logits", "logits[alpha-big-cpu]"): True,
        "exportcheck::once[beta:fast-cpu]": True,
    }
    args = last_failed_args(record)
    assert args.item_ids == {"logits[alpha-big-cpu]", "once[beta:fast-cpu]"}
    assert args.lenient
    assert not last_failed_args(["not", "a", "dict"])
    # An item that vanished since (its target was uninstalled) is dropped, not an error.
    gone = last_failed_args({"exportcheck::once::once[gamma-cpu]": True})
    assert _planner().items(PlanRequest(), gone) == []
