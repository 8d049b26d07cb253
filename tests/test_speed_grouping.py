"""The suite's xdist work units: the items that share an artifact or the survey run on one worker."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_exportcheck.plan import ItemSpec
from pytest_exportcheck.plan._nodeids import item_nodeid
from pytest_exportcheck.session.nodes._xdist import EXPORTER_UNIT, artifact_scheduler, work_units


def _target(check: str, column: str, model: str | None, device: str = "cpu") -> ItemSpec:
    params = (column, device) if model is None else (column, model, device)
    return ItemSpec(check, "target", column, params, target=column, model=model, device=device)


def _exporter(check: str, name: str, model: str | None = None) -> ItemSpec:
    params = (name,) if model is None else (name, model)
    return ItemSpec(check, "exporter", name, params, exporter=name, model=model, device="cpu")


def _id(spec: ItemSpec) -> str:
    return item_nodeid(spec.check, spec.name)


def test_items_of_one_artifact_share_a_unit_and_other_artifacts_do_not() -> None:
    a = _target("roundtrip_logits", "onnx", "llama")
    b = _target("generation_parity", "onnx", "llama")
    c = _target("roundtrip_logits", "onnx", "gpt_oss")
    d = _target("roundtrip_logits", "torch_export", "llama")
    units = work_units([a, b, c, d])
    assert units[_id(a)] == units[_id(b)]
    assert len({units[_id(a)], units[_id(c)], units[_id(d)]}) == 3


def test_row_checks_join_the_unit_of_the_row_default_model() -> None:
    row = _target("deterministic", "onnx", None)
    decoder = _target("roundtrip_logits", "onnx", "decoder")
    llama = _target("roundtrip_logits", "onnx", "llama")
    units = work_units([row, llama, decoder])
    assert units[_id(row)] == units[_id(decoder)] != units[_id(llama)]
    # A row whose target takes no default family keeps its model-less items alone.
    lone = _target("deterministic", "other", None)
    assert _id(lone) not in work_units([lone, _target("roundtrip_logits", "other", "gpt_oss")])


def test_exporter_items_share_one_unit_and_plugin_loads_have_none() -> None:
    x = _exporter("mro_match", "bmm_experts")
    y = _exporter("claims", "fp8", "llama")
    loads = ItemSpec("plugin_loads", "target", "onnx", ("onnx",), target="onnx")
    units = work_units([x, y, loads])
    assert units[_id(x)] == units[_id(y)] == EXPORTER_UNIT
    assert _id(loads) not in units


class _Config:
    def __init__(self, dist: str) -> None:
        self.dist = dist

    def getvalue(self, name: str) -> Any:
        assert name == "dist"
        return self.dist


@pytest.mark.parametrize("dist", ["loadgroup", "worksteal", "each", "loadfile"])
def test_an_explicit_other_dist_mode_is_left_to_xdist(dist: str) -> None:
    assert artifact_scheduler(_Config(dist), None, {}) is None
