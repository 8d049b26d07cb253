"""``exportlm export --stream`` / ``--max-memory``: the CLI streams a model directory layer by layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from exportlm.cli import main
from tests._stream_models import different_files, llama_directory


def _export(src: Path, out: Path, *extra: str) -> int:
    args = ["export", "--target", "hf_checkpoint", "--model", str(src), "--out", str(out)]
    return main([*args, "--quantize", "int8_wo", "-o", "max_shard_size=100KB", *extra])


def test_a_budget_below_the_model_streams_and_writes_the_in_memory_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = llama_directory(tmp_path, tied=True, layers=2)
    assert _export(src, tmp_path / "memory") == 0
    with caplog.at_level("INFO"):
        assert _export(src, tmp_path / "streamed", "--max-memory", "1MB") == 0
    assert "layer by layer" in caplog.text
    skip = ("exportlm-manifest.json",)
    assert different_files(tmp_path / "memory", tmp_path / "streamed", skip=skip) == []


def test_stream_refuses_what_it_cannot_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=1)
    assert _export(src, tmp_path / "a", "--stream", "--verify") == 2
    assert "--verify compares with the model in memory" in capsys.readouterr().err
    args = ["export", "--target", "onnx", "--model", "hf:llama", "--out", str(tmp_path / "m.onnx")]
    assert main([*args, "--stream"]) == 2
    assert "only --target hf_checkpoint" in capsys.readouterr().err
    assert _export(src, tmp_path / "b", "--max-memory", "lots") == 2
    assert "--max-memory lots" in capsys.readouterr().err
    # a budget nothing would follow: a toy model, or another target, runs in memory
    toy = ["export", "--target", "hf_checkpoint", "--model", "hf:llama", "--out"]
    assert main([*toy, str(tmp_path / "c"), "--max-memory", "1KB"]) == 2
    assert "--max-memory: only --target hf_checkpoint" in capsys.readouterr().err
    assert main([*args, "--max-memory", "8GB"]) == 2
    assert "--max-memory: only --target hf_checkpoint" in capsys.readouterr().err
    assert main([*toy, str(tmp_path / "d"), "--max-memory", "0"]) == 2
    assert "--max-memory 0: memory size '0' must be positive" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    assert not (tmp_path / "d").exists()


def test_a_small_max_memory_sizes_the_shards_instead_of_refusing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 0.8 MB: no room for the default 5 GB shard (the whole model) beside one layer; it
    # used to refuse "... lower max_shard_size"
    src = llama_directory(tmp_path, tied=False, layers=2)
    args = ["-v", "export", "--target", "hf_checkpoint", "--model", str(src), "--quantize", "fp8"]
    with caplog.at_level("INFO"):
        assert main([*args, "--out", str(tmp_path / "out"), "--max-memory", "0.8MB"]) == 0
    assert "max_shard_size 5GB does not fit the budget beside one layer" in caplog.text
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1


def test_a_streamed_export_builds_the_directorys_meta_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CLI checks the recipe on the directory's meta model and hands it to the stream,
    # which reads into it; both built their own before
    import transformers

    built = []
    from_config = transformers.AutoModelForCausalLM.from_config

    def counted(*args: object, **kwargs: object) -> object:
        built.append(1)
        return from_config(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", counted)
    src = llama_directory(tmp_path, tied=False, layers=1)
    assert _export(src, tmp_path / "out", "--stream") == 0
    assert len(built) == 1
