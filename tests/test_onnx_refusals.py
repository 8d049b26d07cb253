"""What onnxruntime refuses in an ONNX file, ``exportlm inspect`` fails with a rule name and the
``onnx`` runtime refuses with an exportlm error (never onnxruntime's raw ``Fail``): an operator
in a custom domain, and external data that is a symbolic link leaving the model's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import exportlm
from exportlm.cli import main
from exportlm.errors import MalformedOnnxError
from exportlm.inspection import inspect_checkpoint

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _model(path: Path, *, custom_op: bool = False, external: bool = False) -> Path:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((1, 4), np.float32), "W")
    last = helper.make_node("Identity", ["Y0"], ["logits"], name="last")
    opsets = [helper.make_opsetid("", 17)]
    if custom_op:
        last = helper.make_node("Payload", ["Y0"], ["logits"], name="last", domain="com.evil")
        opsets.append(helper.make_opsetid("com.evil", 1))
    cast = helper.make_node("Cast", ["input_ids"], ["X"], name="cast", to=TensorProto.FLOAT)
    graph = helper.make_graph(
        [cast, helper.make_node("Add", ["X", "W"], ["Y0"], name="add"), last],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=opsets)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save(
            model, str(path), save_as_external_data=True, location=f"{path.name}.data",
            size_threshold=0,
        )  # fmt: skip
    else:
        onnx.save(model, str(path))
    return path


def _linked_out(tmp_path: Path) -> Path:
    """A model whose external data is a symbolic link to a file outside its folder."""
    path = _model(tmp_path / "model" / "m.onnx", external=True)
    outside = tmp_path / "elsewhere" / "secret.bin"
    outside.parent.mkdir()
    data = path.with_name("m.onnx.data")
    os.replace(data, outside)
    data.symlink_to(outside)
    return path


def _custom(tmp_path: Path) -> Path:
    return _model(tmp_path / "model" / "m.onnx", custom_op=True)


CASES = {
    "custom-op": (_custom, "onnx-custom-op"),
    "linked-out": (_linked_out, "onnx-external-data-path"),
}


@pytest.mark.filterwarnings("ignore::exportlm.export.guard.UnverifiedArtifactWarning")
def test_the_controls_load(tmp_path: Path) -> None:
    import torch

    for external in (False, True):
        path = _model(tmp_path / f"ok{external}" / "m.onnx", external=external)
        assert inspect_checkpoint(path).ok
        run = exportlm.load_exported("onnx", path)  # no manifest: loaded unverified
        assert tuple(run(torch.tensor([[0, 1, 2, 3]])).shape) == (1, 4)


@pytest.mark.filterwarnings("ignore::exportlm.export.guard.UnverifiedArtifactWarning")
@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_fails_it_with_the_rule(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, rule = CASES[case]
    path = make(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert rule in {f["rule"] for f in findings if f["severity"] == "error"}, findings


@pytest.mark.filterwarnings("ignore::exportlm.export.guard.UnverifiedArtifactWarning")
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_runtime_refuses_it_with_an_exportlm_error(case: str, tmp_path: Path) -> None:
    make, rule = CASES[case]
    path = make(tmp_path)
    with pytest.raises(MalformedOnnxError, match=rule) as caught:
        exportlm.load_exported("onnx", path)
    assert str(path) in str(caught.value)
    assert "ONNXRuntimeError" not in str(caught.value)  # refused before onnxruntime saw it


def test_a_model_local_function_is_not_a_custom_op(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    function = helper.make_function(
        "pkg.local", "Twice", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
        [helper.make_opsetid("", 17)],
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Twice", ["X"], ["Y"], domain="pkg.local")],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph,
        functions=[function],
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pkg.local", 1)],
    )
    path = tmp_path / "f.onnx"
    onnx.save(model, str(path))
    assert inspect_checkpoint(path).ok
