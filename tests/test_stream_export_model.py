"""Streaming is a source of the hf_checkpoint target: ``export_model(..., DIR, stream=...)``.

One pipeline (issue 40): a model directory is read layer by layer (``stream=True``, or
``"auto"`` over the memory bound) or loaded whole, and both write the same bytes through
the same shard writer, manifest and publish.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exportlm import export_model
from exportlm.errors import InvalidInputError, InvalidModelError
from tests._stream_models import MANIFEST, assert_same_checkpoint, llama_directory

SHARD = "100KB"


def _manifest(directory: Path) -> dict[str, object]:
    return dict(json.loads((directory / MANIFEST).read_text()))


def test_a_directory_streamed_and_loaded_whole_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", "1")  # a whole model is then hashed
    src = llama_directory(tmp_path, tied=False)
    common = {"recipe": "fp8", "max_shard_size": SHARD, "calibration_inputs": "float"}
    whole = export_model("hf_checkpoint", src, tmp_path / "whole", stream=False, **common)
    streamed = export_model("hf_checkpoint", src, tmp_path / "streamed", stream=True, **common)
    assert_same_checkpoint(whole, streamed)  # the streamed manifest has no model hash
    assert _manifest(whole)["model_blake3"] is not None  # the model was whole in memory
    # the manifest records what the checkpoint is, not how its weights were read
    assert _manifest(streamed)["options"] == {"max_shard_size": SHARD}
    assert _manifest(whole)["options"] == {"max_shard_size": SHARD}
    assert not list(tmp_path.glob(".streamed.stream*"))  # the work area is gone once published


def test_auto_streams_only_when_the_model_does_not_fit_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", "1")  # a whole model is then hashed
    src = llama_directory(tmp_path, tied=True)
    small = export_model("hf_checkpoint", src, tmp_path / "small", recipe="fp8", max_memory="1MB")
    large = export_model("hf_checkpoint", src, tmp_path / "large", recipe="fp8", max_memory="64GB")
    assert _manifest(small)["model_blake3"] is None  # streamed: never whole in memory
    assert _manifest(large)["model_blake3"] is not None  # fits: loaded whole


def test_a_model_in_memory_takes_no_source_option(tmp_path: Path) -> None:
    from exportlm.models import tiny_hf_model

    model = tiny_hf_model("llama")
    for option in ({"stream": True}, {"recipe": "fp8"}, {"max_memory": "1GB"}):
        with pytest.raises(InvalidInputError, match="only a model directory"):
            export_model("hf_checkpoint", model, tmp_path / "out", **option)
    assert not (tmp_path / "out").exists()


def test_a_path_that_is_no_directory_is_refused_by_name(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(InvalidModelError, match=r"nowhere.*not a model directory"):
        export_model("hf_checkpoint", missing, tmp_path / "out", stream=True)
    with pytest.raises(InvalidInputError, match="stream must be"):
        export_model(
            "hf_checkpoint", llama_directory(tmp_path, tied=True), tmp_path / "o", stream=2
        )
