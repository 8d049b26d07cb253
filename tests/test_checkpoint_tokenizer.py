"""A complete checkpoint: the tokenizer files and chat template travel with the weights.

`exportlm export --model DIR` (in memory and `--stream`) copies the directory's tokenizer
files; `export_model("hf_checkpoint", ..., tokenizer=...)` takes a tokenizer object or a
directory; each file is listed in the manifest; a directory's files are read by the safe
readers (no link out, no FIFO, no custom code). ONNX `layout="optimum"` keeps the model's
own generation config.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.cli import main
from exportlm.errors import (
    ArtifactIntegrityError,
    CustomCodeRefusedError,
    InvalidInputError,
    MalformedCheckpointError,
    NotRegularFileError,
)
from exportlm.models import build_model
from tests._model_dirs import toy_model_dir, toy_tokenizer

TOKENIZER_NAMES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
PROMPT = [{"role": "user", "content": "the model exports"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model_dir(tmp_path_factory.mktemp("toy") / "llama")


def _manifest_files(out: Path) -> dict[str, Any]:
    files: dict[str, Any] = json.loads((out / "exportlm-manifest.json").read_text())["files"]
    return files


def assert_complete(out: Path, source: Path) -> None:
    """Every tokenizer file of ``source``, byte for byte, listed in the manifest; it loads."""
    from transformers import AutoTokenizer

    listed = _manifest_files(out)
    for name in TOKENIZER_NAMES & {p.name for p in source.iterdir()}:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
        assert listed[name]["size"] == (source / name).stat().st_size, name
    tokenizer = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template == original.chat_template is not None
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == original.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("stream", [False, True], ids=["in_memory", "stream"])
def test_the_cli_copies_the_directory_s_tokenizer(
    model_dir: Path, tmp_path: Path, stream: bool
) -> None:
    out = tmp_path / "out"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model_dir), "--out", str(out)]
    assert main([*argv, *(["--stream"] if stream else [])]) == 0
    assert {p.name for p in out.iterdir()} >= TOKENIZER_NAMES
    assert_complete(out, model_dir)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 4]  # the directory's own, not one derived
    exportlm.load_exported("hf_checkpoint", out)  # every file verified against the manifest


def test_a_streamed_export_refuses_another_tokenizer(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model_dir), "--out", str(out)]
    assert main([*argv, "--stream", "-o", f"tokenizer={tmp_path}"]) == 2
    assert "-o tokenizer: not taken by a streaming export" in capsys.readouterr().err
    assert not out.exists()


def test_a_changed_tokenizer_file_fails_the_manifest(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model_dir), "--out", str(out)]
    assert main(argv) == 0
    (out / "chat_template.jinja").write_text("{{ 'something else' }}")
    with pytest.raises(ArtifactIntegrityError, match=r"chat_template\.jinja"):
        exportlm.load_exported("hf_checkpoint", out)


@pytest.mark.parametrize("given", ["object", "directory"])
def test_the_library_takes_a_tokenizer_object_or_directory(
    model_dir: Path, tmp_path: Path, given: str
) -> None:
    tokenizer: Any = toy_tokenizer() if given == "object" else model_dir
    expected = f"<{type(tokenizer).__name__}>" if given == "object" else str(model_dir)
    out = exportlm.export_model(
        "hf_checkpoint", build_model("llama", seed=0), tmp_path / "out", tokenizer=tokenizer
    )
    assert_complete(out, model_dir)
    recorded = json.loads((out / "exportlm-manifest.json").read_text())["options"]["tokenizer"]
    assert recorded == expected


def test_without_a_tokenizer_the_checkpoint_holds_weights_and_configs(tmp_path: Path) -> None:
    out = exportlm.export_model("hf_checkpoint", build_model("llama", seed=0), tmp_path / "out")
    assert not TOKENIZER_NAMES & {p.name for p in out.iterdir()}


def _tokenizer_source(tmp_path: Path) -> Path:
    source = tmp_path / "tok"
    toy_tokenizer().save_pretrained(source)
    return source


def _link_out(source: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not the tokenizer's")
    (source / "tokenizer.model").symlink_to(secret)


def _fifo(source: Path, tmp_path: Path) -> None:
    del tmp_path
    (source / "tokenizer.json").unlink()
    os.mkfifo(source / "tokenizer.json")


def _auto_map(source: Path, tmp_path: Path) -> None:
    del tmp_path
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tok.MyTokenizer", None]}
    (source / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (_link_out, MalformedCheckpointError, "symbolic link to .*secret.txt"),
        (_fifo, NotRegularFileError, "FIFO"),
        (_auto_map, CustomCodeRefusedError, "auto_map"),
    ],
    ids=["link_out", "fifo", "auto_map"],
)
def test_a_tokenizer_directory_is_read_by_the_safe_rules(
    tmp_path: Path, edit: Any, error: type[Exception], message: str
) -> None:
    source = _tokenizer_source(tmp_path)
    edit(source, tmp_path)
    out = tmp_path / "out"
    outcome: list[BaseException] = []

    def export() -> None:
        try:
            exportlm.export_model(
                "hf_checkpoint", build_model("llama", seed=0), out, tokenizer=source
            )
        except BaseException as err:
            outcome.append(err)

    worker = threading.Thread(target=export, daemon=True)  # a FIFO must not hang it
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the export blocked on the tokenizer directory"
    assert len(outcome) == 1, outcome
    assert isinstance(outcome[0], error), outcome
    assert re.search(message, str(outcome[0])), outcome[0]
    assert not out.exists()  # refused before anything was written


def test_a_tokenizer_that_is_neither_is_refused(tmp_path: Path) -> None:
    model = build_model("llama", seed=0)
    with pytest.raises(InvalidInputError, match="save_pretrained"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "a", tokenizer=42)
    with pytest.raises(InvalidInputError, match="is not a directory"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "b", tokenizer=tmp_path / "none")
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()


def test_onnx_optimum_layout_keeps_the_model_s_generation_config(tmp_path: Path) -> None:
    model = build_model("llama", seed=0)
    model.generation_config.eos_token_id = [2, 4]
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    path = exportlm.export_model(
        "onnx", model, tmp_path / "model.onnx", kv_cache=True, layout="optimum"
    )
    generation = json.loads((path.parent / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 4]
    assert generation["do_sample"] is True
    assert generation["temperature"] == 0.6
