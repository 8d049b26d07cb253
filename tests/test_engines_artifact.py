"""What the engines read of an artifact before serving it: the ONNX manifest's inputs
(every graph input, as the graph declares it) and ``artifact_kind`` of a kv_cache graph."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import exportlm
from exportlm.engines import artifact_kind, get_engine
from exportlm.engines.spec import Verdict
from exportlm.models import build_model
from tests._exports import SharedExport, shared_export


def _manifest_inputs(graph: Path) -> list[dict[str, object]]:
    manifest = graph.with_name(graph.name + ".manifest.json")
    return list(json.loads(manifest.read_text(encoding="utf-8"))["inputs"])


def _served_llama(tmp_path_factory: pytest.TempPathFactory) -> SharedExport:
    """The llama Optimum + genai folder, read-only, as tests/test_generation_padded.py has it."""
    return shared_export(
        tmp_path_factory,
        "onnx",
        "llama",
        filename="model.onnx",
        kv_cache=True,
        layout="optimum",
        genai_config=True,
    )


def test_a_kv_cache_manifest_lists_every_graph_input_with_its_dims(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    shared = _served_llama(tmp_path_factory)
    model, graph = shared.model, shared.path
    listed = _manifest_inputs(graph)
    real = [i.name for i in onnx.load(str(graph), load_external_data=False).graph.input]
    assert [i["name"] for i in listed] == real
    layers = model.config.num_hidden_layers
    past = [f"past_key_values.{n}.{kind}" for n in range(layers) for kind in ("key", "value")]
    assert real == ["input_ids", "attention_mask", "position_ids", *past]
    by_name = {i["name"]: i for i in listed}
    assert by_name["input_ids"] == {
        "name": "input_ids",
        "dtype": "int64",
        "shape": ["batch", "sequence"],
    }
    assert by_name["past_key_values.0.key"]["dtype"] == "float32"
    assert by_name["past_key_values.0.key"]["shape"][0] == "batch"


def test_a_plain_graph_lists_its_inputs_too(tmp_path: Path) -> None:
    graph = exportlm.export_model("onnx", build_model("llama"), tmp_path / "model.onnx")
    real = [i.name for i in onnx.load(str(graph), load_external_data=False).graph.input]
    assert [i["name"] for i in _manifest_inputs(graph)] == real == ["input_ids", "attention_mask"]


def test_a_kv_cache_graph_and_its_optimum_folder_are_the_tables_kv_cache_rows(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    graph = _served_llama(tmp_path_factory).path
    for path in (graph, graph.parent):
        kind = artifact_kind(path)
        assert (kind.target, kind.layout, kind.scheme) == ("onnx", "kv_cache", None)
    for engine in ("optimum-onnxruntime", "onnxruntime-genai"):
        assert get_engine(engine).support("onnx", "kv_cache").verdict is Verdict.RUNS
