"""A tokenizer that would not load, or a chat template that does not compile, is found
before it is deployed.

A tokenizer JSON file that is not one (a truncated ``tokenizer.json``) exported as it was
and failed the tokenizer's load in transformers and vLLM. A broken chat template:
transformers, vLLM and SGLang load such a checkpoint without a word and fail every chat
request when they compile the template. Before, the export copied a source's broken
template into the checkpoint as it was, and ``exportlm inspect`` passed it. Now the
export refuses it (in memory, streamed, from the CLI, or from a ``tokenizer=`` object)
and ``inspect`` fails it (``chat-template-invalid``). Templates are compiled to Python
source text and never run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.cli import main
from exportlm.errors import InvalidConfigError
from exportlm.inspection import Severity, inspect_checkpoint
from exportlm.tokenizer_checks import chat_template_problems, json_problems
from tests._model_dirs import toy_model_dir, toy_tokenizer

#: A ChatML template of the kind instruct models ship (SmolLM2's, Qwen's).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
UNCLOSED = "{% for message in messages %}{{ message['content'] }}"


def _config(template: Any) -> dict[str, bytes]:
    return {"tokenizer_config.json": json.dumps({"chat_template": template}).encode()}


GOOD: dict[str, dict[str, bytes]] = {
    "chatml": {"chat_template.jinja": CHATML.encode()},
    # transformers' own additions: the {% generation %} block, loopcontrols, tojson
    "generation block": {
        "chat_template.jinja": b"{% for m in messages %}{% generation %}{{ m | tojson }}"
        b"{% endgeneration %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    },
    "named templates": _config([{"name": "default", "template": CHATML}]),
    "no template": {"tokenizer_config.json": b'{"model_max_length": 8}'},
    # not this check's to judge: the file's own readers report it
    "a tokenizer config that is no JSON": {"tokenizer_config.json": b"{not json"},
    # compiled, never rendered: what it would do at run time is not looked at
    "raises when rendered": {"chat_template.jinja": b"{{ raise_exception('no system role') }}"},
    "loops when rendered": {"chat_template.jinja": b"{% for i in range(10**12) %}{% endfor %}"},
}

#: case -> (files, where, what the problem says)
BAD: dict[str, tuple[dict[str, bytes], str, str]] = {
    "an unclosed block": (
        {"chat_template.jinja": UNCLOSED.encode()},
        "chat_template.jinja",
        "does not compile: line 1: Unexpected end of template",
    ),
    "an unknown tag": (
        {"chat_template.jinja": b"{% for m in messages %}{% endfo %}"},
        "chat_template.jinja",
        "Encountered unknown tag 'endfo'",
    ),
    "an unknown filter": (
        {"chat_template.jinja": b"line one\n{{ messages | to_json }}"},
        "chat_template.jinja",
        "line 2: No filter named 'to_json'",
    ),
    "a named template": (
        _config([{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "{%"}]),
        "tokenizer_config.json: chat_template['tool_use']",
        "does not compile",
    ),
    "a field of the wrong type": (
        _config(5),
        "tokenizer_config.json: chat_template",
        "is a JSON int, expected the template's Jinja text",
    ),
    "a processor's template": (
        {"chat_template.json": json.dumps({"chat_template": UNCLOSED}).encode()},
        "chat_template.json: chat_template",
        "does not compile",
    ),
    "an additional template": (
        {"additional_chat_templates/rag.jinja": UNCLOSED.encode()},
        "additional_chat_templates/rag.jinja",
        "does not compile",
    ),
    "not UTF-8": ({"chat_template.jinja": b"\xff\xfe{{"}, "chat_template.jinja", "not UTF-8"),
    "nested past the parser": (
        {"chat_template.jinja": b"{% if x %}" * 5000},
        "chat_template.jinja",
        "nested too deeply",
    ),
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_a_template_that_compiles_passes(case: str) -> None:
    started = time.monotonic()
    assert chat_template_problems(GOOD[case]) == []
    assert time.monotonic() - started < 30  # nothing was rendered (the loop would not end)


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_template_that_does_not_compile_is_named(case: str) -> None:
    files, where, says = BAD[case]
    ((found, problem),) = chat_template_problems(files)
    assert found == where
    assert says in problem


def test_the_toy_tokenizer_s_template_compiles(tmp_path: Path) -> None:
    toy_tokenizer().save_pretrained(tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert "chat_template.jinja" in files
    assert chat_template_problems(files) == []


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy model directory whose chat template has an unclosed block."""
    directory = toy_model_dir(tmp_path_factory.mktemp("broken") / "llama")
    (directory / "chat_template.jinja").write_text(UNCLOSED)
    return directory


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_the_export_refuses_a_source_whose_template_does_not_compile(
    broken_dir: Path, tmp_path: Path, stream: bool
) -> None:
    out = tmp_path / "out"
    with pytest.raises(InvalidConfigError) as raised:
        exportlm.export_model("hf_checkpoint", broken_dir, out, recipe="fp8", stream=stream)
    message = str(raised.value)
    assert f"the chat template chat_template.jinja of {broken_dir}" in message
    assert "every chat request" in message
    assert "Fix the template" in message
    assert not out.exists()


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["in-memory", "streamed"])
def test_the_cli_refuses_it_as_bad_input(
    broken_dir: Path, tmp_path: Path, stream: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["export", "--target", "hf_checkpoint", "--model", str(broken_dir), *stream]
    assert main([*args, "--quantize", "fp8", "--out", str(tmp_path / "out")]) == 2
    assert "Unexpected end of template" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_good_tokenizer_given_replaces_the_directory_s_broken_one(
    broken_dir: Path, tmp_path: Path, stream: bool
) -> None:
    """``tokenizer=`` is what the checkpoint gets: the directory's own files are neither
    written nor held against the export (the streamed path refused them before)."""
    out = tmp_path / "out"
    exportlm.export_model(
        "hf_checkpoint", broken_dir, out, recipe="fp8", stream=stream, tokenizer=toy_tokenizer()
    )
    written = (out / "chat_template.jinja").read_text()
    assert written != UNCLOSED
    assert chat_template_problems({"chat_template.jinja": written.encode()}) == []


def test_a_tokenizer_object_whose_template_does_not_compile_is_refused(tmp_path: Path) -> None:
    from exportlm.models import build_model

    tokenizer = toy_tokenizer()
    tokenizer.chat_template = UNCLOSED
    out = tmp_path / "out"
    with pytest.raises(InvalidConfigError, match=r"chat_template\.jinja of <\w+>"):
        exportlm.export_model(
            "hf_checkpoint", build_model("llama", seed=0), out, tokenizer=tokenizer
        )
    assert not out.exists()


def test_inspect_fails_a_checkpoint_whose_template_does_not_compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = toy_model_dir(tmp_path / "source")
    out = exportlm.export_model("hf_checkpoint", source, tmp_path / "ckpt", recipe="fp8")
    assert not [f for f in inspect_checkpoint(out).findings if f.rule == "chat-template-invalid"]

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "chat_template.jinja").write_text(UNCLOSED)  # edited after the export
    report = inspect_checkpoint(broken)
    assert not report.ok
    (finding,) = [f for f in report.findings if f.rule == "chat-template-invalid"]
    assert finding.severity is Severity.ERROR
    assert finding.subject == "chat_template.jinja"
    assert "Unexpected end of template" in finding.message
    assert main(["inspect", str(broken)]) == 1
    assert "chat-template-invalid" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b'{"model": {"vocab": ', "is not valid JSON (line 1: Expecting value)"),
        (b"[1, 2]", "holds a JSON list, expected an object"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
    ids=["truncated", "a list", "not UTF-8", "too deep"],
)
def test_a_tokenizer_json_file_that_is_no_object_is_named(data: bytes, says: str) -> None:
    files = {"tokenizer.json": data, "merges.txt": b"a b", "vocab.json": b"{}"}
    ((name, problem),) = json_problems(files)
    assert name == "tokenizer.json"
    assert says in problem


@pytest.fixture(scope="module")
def truncated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy model directory whose tokenizer.json was cut short (a partial copy)."""
    directory = toy_model_dir(tmp_path_factory.mktemp("truncated") / "llama")
    data = (directory / "tokenizer.json").read_bytes()
    (directory / "tokenizer.json").write_bytes(data[: len(data) // 2])
    return directory


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["in-memory", "streamed"])
def test_the_export_refuses_a_tokenizer_that_would_not_load(
    truncated_dir: Path, tmp_path: Path, stream: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidConfigError, match=r"the tokenizer file tokenizer\.json of"):
        exportlm.export_model("hf_checkpoint", truncated_dir, tmp_path / "lib", stream=bool(stream))
    args = ["export", "--target", "hf_checkpoint", "--model", str(truncated_dir), *stream]
    assert main([*args, "--out", str(tmp_path / "cli")]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "lib").exists()
    assert not (tmp_path / "cli").exists()


def test_inspect_fails_a_checkpoint_whose_tokenizer_would_not_load(tmp_path: Path) -> None:
    source = toy_model_dir(tmp_path / "source")
    out = exportlm.export_model("hf_checkpoint", source, tmp_path / "ckpt")
    (out / "tokenizer.json").write_bytes(b"{")  # edited after the export
    report = inspect_checkpoint(out)
    assert not report.ok
    (finding,) = [f for f in report.findings if f.rule == "config-unreadable"]
    assert finding.subject == "tokenizer.json"
    assert "fail to load the checkpoint's tokenizer" in finding.message

    (out / "tokenizer_config.json").write_bytes(b"[]")  # read for auto_map too: said once
    (finding,) = [f for f in inspect_checkpoint(out).findings if f.rule == "config-unreadable"]
    assert finding.subject.endswith("tokenizer_config.json")
