"""What an ONNX export writes beside its graph, and what it may replace there.

The graph's folder carries the tokenizer (``tokenizer=``, or ``exportlm export --model
DIR``), listed in the manifest; genai_config.json names a pad id that no prompt holds
(onnxruntime-genai masks every position holding it); and a publish removes only files
that this graph's exports wrote, never a model directory's own ``config.json``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.cli import main
from exportlm.errors import InvalidInputError
from exportlm.models import tiny_hf_model
from tests._model_dirs import toy_model_dir

pytest.importorskip("onnxscript")

_GENAI = {"kv_cache": True, "genai_config": True}


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_hf_model("llama", num_hidden_layers=1).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model_dir(tmp_path_factory.mktemp("toy") / "llama")


def _listed(graph: Path) -> set[str]:
    manifest = json.loads(graph.with_name(graph.name + ".manifest.json").read_text())
    return set(manifest["files"])


def _genai_pad(graph: Path) -> int:
    config = json.loads((graph.parent / "genai_config.json").read_text())
    pad: int = config["model"]["pad_token_id"]
    return pad


def test_a_graph_exported_into_a_model_directory_keeps_the_directorys_own_files(
    model: Any, tmp_path: Path
) -> None:
    """The directory's config.json and generation_config.json were removed as stale
    serving files by a bare-graph export beside them."""
    model.save_pretrained(tmp_path)
    own = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {"config.json", "generation_config.json"} <= set(own)
    graph = exportlm.export_model("onnx", model, tmp_path / "model.onnx")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in own} == own
    assert _listed(graph) == {"model.onnx"}


def test_a_re_export_removes_what_the_previous_export_of_the_graph_wrote(
    model: Any, model_dir: Path, tmp_path: Path
) -> None:
    graph = tmp_path / "out" / "model.onnx"
    exportlm.export_model("onnx", model, graph, layout="optimum", tokenizer=model_dir, **_GENAI)
    written = {p.name for p in graph.parent.iterdir()}
    assert {"config.json", "genai_config.json", "tokenizer.json", "chat_template.jinja"} <= written
    (graph.parent / "notes.txt").write_text("mine")
    exportlm.export_model("onnx", model, graph)  # the bare graph: none of those files now
    left = {p.name for p in graph.parent.iterdir()}
    assert left == {"model.onnx", "model.onnx.manifest.json", "notes.txt"}
    assert exportlm.load_exported("onnx", graph) is not None


def test_the_tokenizer_travels_beside_the_graph_listed_in_the_manifest(
    model: Any, model_dir: Path, tmp_path: Path
) -> None:
    graph = tmp_path / "model.onnx"
    exportlm.export_model("onnx", model, graph, tokenizer=model_dir, **_GENAI)
    names = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert names <= _listed(graph)
    for name in names:
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes()
    (tmp_path / "chat_template.jinja").write_text("{{ 'changed' }}")
    with pytest.raises(exportlm.errors.ArtifactIntegrityError, match="chat_template"):
        exportlm.load_exported("onnx", graph)


def test_the_cli_carries_a_model_directorys_tokenizer_into_the_onnx_folder(
    model_dir: Path, tmp_path: Path
) -> None:
    graph = tmp_path / "onnx" / "model.onnx"
    argv = ["export", "--target", "onnx", "--model", str(model_dir), "--out", str(graph)]
    assert main([*argv, "-o", "kv_cache=true", "-o", "genai_config=true"]) == 0
    assert (graph.parent / "tokenizer.json").read_bytes() == (
        model_dir / "tokenizer.json"
    ).read_bytes()
    assert "tokenizer.json" in _listed(graph)


def test_a_tokenizer_that_is_no_directory_is_refused_before_anything_is_written(
    model: Any, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInputError, match="not a directory"):
        exportlm.export_model("onnx", model, tmp_path / "model.onnx", tokenizer=tmp_path / "no")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_genai_pads_with_a_special_token_no_chat_prompt_holds(
    model: Any, real_model_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2's pad_token_id is 2, ``<|im_end|>``, which ends every chat turn: as
    genai's pad id, each turn's end would be masked. Its ``<|endoftext|>`` (0) is a
    special token that the chat template never writes."""
    from transformers import AutoTokenizer

    config = model.config
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 2, 2, 1  # SmolLM2's
    graph = tmp_path / "model.onnx"
    exportlm.export_model("onnx", model, graph, tokenizer=real_model_dir, **_GENAI)
    pad = _genai_pad(graph)
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 2 in prompt  # every turn ends with <|im_end|>
    assert pad not in prompt
    assert pad in tokenizer.all_special_ids
    assert pad not in (1, 2)


def test_without_a_tokenizer_an_end_of_sequence_pad_id_is_kept_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_hf_model("llama", num_hidden_layers=1).eval()
    model.config.pad_token_id = model.config.eos_token_id = 2
    with caplog.at_level(logging.WARNING, logger="exportlm.export.onnx._folder"):
        graph = exportlm.export_model("onnx", model, tmp_path / "model.onnx", **_GENAI)
    assert _genai_pad(graph) == 2
    assert "pad_token_id is 2, the end-of-sequence id" in caplog.text
    assert "Pass tokenizer=" in caplog.text
    shutil.rmtree(tmp_path)
