"""Inputs from users that must never run code, block or crash: the attack rows of issue 17.

- A model directory that needs code of its own (``auto_map``, ``*.py``) is refused
  before transformers reads it, even with ``y`` waiting on standard input, and every
  transformers call passes ``trust_remote_code=False`` (so none ever prompts).
- A FIFO where a file is read (key file, calibration data, model spec file, a file
  of a model directory, the xfails file) ends within seconds with a clear error.
  Each such call runs under :func:`_finishes`, which fails the test (and releases
  the reader) instead of hanging the run when a regression blocks.
- The small ones: a deeply nested xfails JSON, ``--seed -1``, a file as the goldens
  directory, a directory as the key file, empty selections.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exportlm.calibration import CalibrationDataError, load_calibration_texts, load_local_tokenizer
from exportlm.cli import main
from exportlm.errors import CustomCodeRefusedError, InvalidConfigError
from exportlm.export import trustkey

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")

#: Seconds a refusal may take; a blocked read is far past it.
LIMIT_S = 30.0
EXPORT = ["export", "--target", "torch_export"]


def _finishes(call: Callable[[], Any], fifo: Path, seconds: float = LIMIT_S) -> Any:
    """``call()``'s result (or the exception it raised, returned), failing if it blocks.

    A reader blocked on ``fifo`` is released (a writer opens and closes it) so the
    thread ends and the failure is reported instead of hanging the test run.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:  # handed back to the test, which asserts on it
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        except OSError:
            pass
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds:.0f} s reading the FIFO {fifo}")
    return outcome[0]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _code_directory(root: Path, marker: Path, *, config_map: bool = True) -> Path:
    """A model directory whose loading would run ``evil_code.py``, which writes ``marker``."""
    directory = root / "custom-model"
    directory.mkdir()
    config: dict[str, Any] = {"model_type": "evil_lm", "architectures": ["EvilForCausalLM"]}
    if config_map:
        config["auto_map"] = {
            "AutoConfig": "evil_code.EvilConfig",
            "AutoModelForCausalLM": "evil_code.EvilForCausalLM",
        }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "evil_code.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('code ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_lm'\n"
    )
    return directory


# ----------------------------------------------------------------------------- remote code


def test_a_directory_with_auto_map_is_refused_with_y_on_stdin(tmp_path: Path) -> None:
    """The attack as reported: `echo y | exportlm export --model DIR` ran DIR's code."""
    marker = tmp_path / "marker"
    directory = _code_directory(tmp_path, marker)
    argv = [*EXPORT, "--model", str(directory), "--out", str(tmp_path / "m.pt2")]
    done = subprocess.run(
        [sys.executable, "-m", "exportlm", *argv],
        input="y\ny\ny\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert not marker.exists(), "the directory's code ran"
    assert done.returncode == 1, done.stderr  # a trust refusal, like UntrustedArtifactError
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert "needs code of its own to load" in done.stderr
    assert "config.json has auto_map -> evil_code.EvilConfig" in done.stderr
    assert "Python files evil_code.py" in done.stderr
    assert "convert the checkpoint" in done.stderr


@pytest.mark.parametrize("config_map", [True, False], ids=["auto_map", "py-file-only"])
def test_every_sign_of_custom_code_is_refused_before_loading(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    config_map: bool,
) -> None:
    marker = tmp_path / "marker"
    directory = _code_directory(tmp_path, marker, config_map=config_map)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code = main([*EXPORT, "--model", str(directory), "--out", str(tmp_path / "m.pt2")])
    assert code == 1
    assert not marker.exists()
    err = capsys.readouterr().err
    assert f"{directory} needs code of its own to load" in err
    assert ("config.json has auto_map ->" in err) is config_map
    assert "Python files evil_code.py" in err


def test_transformers_is_never_asked_to_trust_code_even_past_the_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second wall: with the directory check switched off, ``trust_remote_code=False``
    still makes transformers refuse, without reading the ``y`` on stdin."""
    import exportlm.cli._model as cli_model
    import exportlm.export.hf_checkpoint.source_model as source_model
    from exportlm.hfdir import read_config

    marker = tmp_path / "marker"
    directory = _code_directory(tmp_path, marker)
    monkeypatch.setattr(cli_model, "_vet_directory", lambda path, argument: None)
    monkeypatch.setattr(source_model, "vet_model_directory", lambda path, **_: read_config(path))
    stdin = io.StringIO("y\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    code = main([*EXPORT, "--model", str(directory), "--out", str(tmp_path / "m.pt2")])
    assert not marker.exists()
    assert stdin.tell() == 0, "something read standard input"
    assert code == 2
    assert "transformers cannot load a causal LM from this directory" in capsys.readouterr().err


def test_a_tokenizer_with_auto_map_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}})
    )
    (directory / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(CustomCodeRefusedError, match=r"tokenizer_config.json has auto_map"):
        load_local_tokenizer(directory)
    assert not marker.exists()


# ----------------------------------------------------------------------------- FIFOs


def test_a_fifo_as_the_key_file_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = _fifo(tmp_path / "key")
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(fifo))

    def sign_and_verify() -> tuple[str | None, bool, list[warnings.WarningMessage]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            signature = trustkey.sign(b"payload")
            return signature, trustkey.verify_signature(b"payload", "00" * 32), caught

    signature, verified, caught = _finishes(sign_and_verify, fifo)
    assert signature is None
    assert verified is False
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert all("is a FIFO, not a regular file; it is ignored" in m for m in messages)
    assert fifo.is_fifo()  # never replaced


def test_a_fifo_as_calibration_data_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = _fifo(tmp_path / "calib.txt")
    argv = [*EXPORT, "--model", "decoder", "--out", str(tmp_path / "m.pt2")]
    code = _finishes(lambda: main([*argv, "--quantize", "fp8", "--calib-data", str(fifo)]), fifo)
    assert code == 2
    assert f"calibration data {fifo} is a FIFO, not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["calib.txt", "calib.json", "dataset/state.json"])
def test_calibration_data_refuses_a_fifo_as_or_in_the_source(tmp_path: Path, name: str) -> None:
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "dataset_info.json").write_text("{}")
    fifo = _fifo(tmp_path / name)
    source = fifo if "/" not in name else fifo.parent
    error = _finishes(lambda: load_calibration_texts(source), fifo)
    assert isinstance(error, CalibrationDataError), error
    assert f"{fifo} is a FIFO" in str(error)


def test_a_fifo_as_the_model_spec_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = _fifo(tmp_path / "spec.json")
    code = _finishes(lambda: main([*EXPORT, "--model", str(fifo), "--out", "m.pt2"]), fifo)
    assert code == 2
    assert f"--model {fifo}: model spec file {fifo} is a FIFO" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_a_model_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    if name != "config.json":
        (directory / "config.json").write_text('{"model_type": "llama"}')
    fifo = _fifo(directory / name)
    argv = [*EXPORT, "--model", str(directory), "--out", str(tmp_path / "m.pt2")]
    assert _finishes(lambda: main(argv), fifo) == 2
    assert f"{fifo} is a FIFO, not a regular file" in capsys.readouterr().err


def test_a_weight_index_naming_a_file_outside_the_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    index = {"weight_map": {"lm_head.weight": "../../../dev/zero"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main([*EXPORT, "--model", str(directory), "--out", str(tmp_path / "m.pt2")]) == 2
    assert "names shard '../../../dev/zero', which is not a file name" in capsys.readouterr().err


def test_a_fifo_as_the_xfails_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    _fifo(pytester.path / "xfails.txt")
    result = pytester.runpytest_subprocess(
        "--export-targets=torch_export",
        "--export-checks=registered",
        "--export-xfails-file=xfails.txt",
        "-p",
        "no:cacheprovider",
        timeout=LIMIT_S * 4,
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-xfails-file: *xfails.txt is a FIFO; expected *file*"])


# ----------------------------------------------------------------------------- the small ones


SUITE = ["--export-targets=torch_export", "--export-checks=registered"]


def test_an_xfails_json_nested_100k_deep_is_a_usage_error(pytester: pytest.Pytester) -> None:
    depth = 100_000
    (pytester.path / "xfails.json").write_text('{"a":' * depth + '"b"' + "}" * depth)
    result = pytester.runpytest(*SUITE, "--export-xfails-file=xfails.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-xfails-file: *xfails.json holds JSON nested too deep*"])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_out_of_range_is_a_usage_error_naming_seed(
    capsys: pytest.CaptureFixture[str], seed: str
) -> None:
    assert main([*EXPORT, "--model", "decoder", "--out", "m.pt2", "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert f"argument --seed: expected an integer from 0 to {2**64 - 1}" in err
    assert f"got {seed}" in err


def test_a_negative_seed_is_refused_by_the_toy_builders_too() -> None:
    from exportlm.models import build_model

    with pytest.raises(InvalidConfigError, match=r"seed must be a non-negative integer.*got -1"):
        build_model("decoder", seed=-1)


def test_a_file_as_the_goldens_dir_is_a_usage_error(pytester: pytest.Pytester) -> None:
    (pytester.path / "goldens.txt").write_text("not a directory")
    result = pytester.runpytest(*SUITE, "--export-goldens-dir=goldens.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--export-goldens-dir: *goldens.txt is a regular file; expected the path of a directory*"]
    )


def test_a_directory_as_the_key_file_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_KEY_FILE", str(tmp_path))
    ignored = "is a directory, not a regular file; it is ignored"
    with pytest.warns(UserWarning, match=ignored):
        signature = trustkey.sign(b"payload")
    assert signature is None
    with pytest.warns(UserWarning, match=ignored):
        verified = trustkey.verify_signature(b"payload", "00" * 32)
    assert verified is False
    assert not list(tmp_path.iterdir())  # nothing created inside it


@pytest.mark.parametrize("option", ["--export-targets", "--export-exporters", "--export-models"])
def test_an_empty_selection_is_a_usage_error_saying_how_to_select(
    pytester: pytest.Pytester, option: str
) -> None:
    others = [] if option == "--export-targets" else ["--export-targets=torch_export"]
    result = pytester.runpytest(*others, f"{option}=")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*{option}: the value is empty ('')*pass 'all', a comma-separated list of names*"]
    )
