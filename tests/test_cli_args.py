"""Command-line arguments: --version, python -m, -v/-q anywhere, -o values, --model, usage errors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import exportlm
from exportlm.cli import main

pytestmark = pytest.mark.filterwarnings(
    "ignore::exportlm.export.torchscript.TorchScriptDeprecationWarning"
)

TORCHSCRIPT = ["export", "--target", "torchscript", "--model", "decoder"]


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exportlm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# ----------------------------------------------------------------------------- entry points


def test_version_names_the_package_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"exportlm {exportlm.__version__} (torch {metadata.version('torch')}, ")


def test_python_dash_m_is_the_same_entry_point() -> None:
    done = _run_module("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exportlm {exportlm.__version__} (torch ")
    (script,) = metadata.entry_points(group="console_scripts", name="exportlm")
    assert script.load() is main


def test_a_usage_error_in_a_fresh_process_is_one_line_and_exit_2() -> None:
    done = _run_module("export", "--target", "onnx", "--model", "decoder")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "exportlm: error: the following arguments are required: --out "
        "(see `exportlm export --help`)"
    ]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "exportlm: error: missing command: env, export, inspect, list, report"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["export", "--target", "onnx"], "the following arguments are required: --model, --out"),
        (
            [*TORCHSCRIPT, "--out", "x.pt", "--seed", "x"],
            "argument --seed: expected an integer from 0 to",
        ),
        (["list", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_argument_errors_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert message in err
    assert err.startswith("exportlm: error: ")


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--calib-data", "--calib-samples", "--calib-seq-len", "--calib-batch-size"):
        assert flag in out
    assert "--json" in out


# ----------------------------------------------------------------------------- verbosity


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_before_or_after_the_command_leaves_stderr_empty(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TORCHSCRIPT, "--out", str(tmp_path / "m.pt")]
    argv = ["-q", *argv] if where == "before" else [*argv, "-q"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("exported decoder with torchscript")


def test_default_verbosity_prints_progress_lines_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TORCHSCRIPT, "--out", str(tmp_path / "m.pt")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["exportlm: loading model decoder...", "exportlm: exporting to torchscript..."]


@pytest.mark.parametrize("flags", [["-v"], ["-vv"], ["-v", "-v", "-q"]])
def test_verbose_after_the_command_adds_exportlm_debug_lines(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TORCHSCRIPT, "--out", str(tmp_path / "m.pt"), *flags]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "exportlm: loading model decoder..." in err
    assert any(line.startswith("exportlm: debug: ") for line in err)
    if flags == ["-v"]:  # third-party loggers stay at WARNING below -vv
        assert all(line.startswith("exportlm: ") for line in err)


def test_verbose_before_and_after_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-v", *TORCHSCRIPT, "--out", str(tmp_path / "m.pt"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "exportlm: loading model decoder..." in err  # -v -q: the default
    assert "debug:" not in err


def test_logging_is_restored_after_each_command(tmp_path: Path) -> None:
    root = logging.getLogger()
    watched = [root, logging.getLogger("exportlm"), logging.getLogger("exportlm.cli")]
    before = ([log.level for log in watched], list(root.handlers))
    assert main(["-vv", *TORCHSCRIPT, "--out", str(tmp_path / "m.pt")]) == 0
    assert ([log.level for log in watched], list(root.handlers)) == before


# ----------------------------------------------------------------------------- -o values


def test_dtype_option_is_parsed_to_a_torch_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out)]
    assert main([*argv, "-o", "dtype=bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["options"] == {"dtype": "bfloat16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("target", "option", "message"),
    [
        (
            "hf_checkpoint",
            "dtype=bfloat17",
            "-o dtype=bfloat17: expected a dtype (bfloat16, bf16, float16, fp16, half, "
            "float32, fp32, float) or none",
        ),
        ("onnx", "opset=abc", "-o opset=abc: expected an integer"),
        ("torchscript", "method=foo", "-o method=foo: expected one of trace, script"),
        (
            "torchscript",
            "check_trace=maybe",
            "expected a boolean (true/false, yes/no, on/off, 1/0)",
        ),
        (
            "onnx",
            "attention_mask=2",
            "expected a boolean (true/false, yes/no, on/off, 1/0) or none",
        ),
        ("torchscript", "trace", "-o expects KEY=VALUE, got 'trace'"),
        # the last one won, silently
        ("hf_checkpoint", "dtype=fp16 -o dtype=bf16", "-o dtype is given twice"),
    ],
)
def test_bad_option_values_name_the_option_and_the_accepted_values(
    target: str, option: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    options = [arg for one in option.split(" -o ") for arg in ("-o", one)]
    argv = ["export", "--target", target, "--model", "llama", "--out", str(out), *options]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("exportlm: error: -o ")
    assert message in line
    assert not out.exists()


# ----------------------------------------------------------------------------- --model


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "meta-llama/Llama-3.2-1B",
            "--model meta-llama/Llama-3.2-1B: exportlm never downloads from the Hugging Face Hub; "
            "download it (e.g. `huggingface-cli download meta-llama/Llama-3.2-1B --local-dir DIR`) "
            "and pass DIR",
        ),
        ("./missing/model", "--model ./missing/model: no such file or directory: ./missing/model"),
        ("lama", "unknown model family 'lama'; available: {families}; or pass a model spec"),
        ("hf:nope", "unknown model family 'nope'"),
    ],
)
def test_a_model_that_is_nowhere_says_why(
    model: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exportlm.models import model_names

    argv = ["export", "--target", "torch_export", "--model", model, "--out", str(tmp_path / "m")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert message.format(families=", ".join(model_names())) in err


def test_a_directory_or_file_that_is_no_model_says_what_is_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    argv = ["export", "--target", "torch_export", "--out", "m.pt2", "--model"]
    assert main([*argv, "weights"]) == 2
    assert "--model weights: the directory has no config.json" in capsys.readouterr().err
    assert main([*argv, "notes.txt"]) == 2
    assert "--model notes.txt: is a file that is not .json" in capsys.readouterr().err
    (tmp_path / "llama").mkdir()  # a family name wins over a directory that is no model
    assert main([*argv, "llama", "-q"]) == 0


def test_a_local_hugging_face_directory_is_loaded_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exportlm.models import build_model

    model_dir = tmp_path / "tiny-llama"
    build_model("llama", seed=3).save_pretrained(model_dir)
    out = tmp_path / "m.pt2"
    argv = ["export", "--target", "torch_export", "--model", str(model_dir), "--out", str(out)]
    assert main([*argv, "--verify"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("OK")
    assert "Loading weights" not in captured.err  # transformers' own bar follows ours: off


def test_third_party_debug_lines_need_vv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered, export_target

    @export_target("cli_chatty", runtime="torch_export")
    def chatty(model: object, output_path: Path) -> Path:
        logging.getLogger("somelib.internals").debug("graph dump line")
        logging.getLogger("exportlm.somewhere").debug("exportlm detail")
        output_path.write_text("artifact")
        return output_path

    ensure_exporters_registered()
    EXPORT_REGISTRY.register("cli_chatty", chatty)
    try:
        argv = ["export", "--target", "cli_chatty", "--model", "decoder"]
        assert main([*argv, "--out", str(tmp_path / "a"), "-v"]) == 0
        err = capsys.readouterr().err
        assert "exportlm: debug: exportlm.somewhere: exportlm detail" in err
        assert "graph dump line" not in err
        assert main([*argv, "--out", str(tmp_path / "b"), "-vv"]) == 0
        assert "somelib.internals: debug: graph dump line" in capsys.readouterr().err
    finally:
        EXPORT_REGISTRY.unregister("cli_chatty")


def test_the_quantize_help_names_every_weight_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    """``exportlm export --help`` lists each recipe ``quantize`` takes (fp8_kv as ``+fp8_kv``)."""
    from exportlm.quant._recipe import recipe_names

    assert main(["export", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in recipe_names():
        assert (f"+{name}" if name == "fp8_kv" else f" {name},") in text, name
