"""Calibration data (``exportlm.calibration``) and ``exportlm export --quantize --calib-data``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from exportlm.calibration import (
    CalibrationDataError,
    calibrate_with,
    calibration_batches,
    load_calibration_texts,
    load_local_tokenizer,
    utf8_byte_ids,
)
from exportlm.cli import main

WORDS = [
    "<unk>",
    "</s>",
    *["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face directory: a tiny seeded Llama and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from exportlm.models import build_model

    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(directory)
    build_model("llama", seed=0).save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------- sources


def test_a_text_file_gives_one_sample_per_non_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "calib.txt"
    path.write_bytes(b"first line\r\n\r\n   \nsecond  line \nthird\n")
    assert load_calibration_texts(path, samples=None) == ["first line", "second  line ", "third"]
    assert load_calibration_texts(path, samples=2) == ["first line", "second  line "]


def test_a_byte_order_mark_is_no_part_of_the_first_sample(tmp_path: Path) -> None:
    """Editors on Windows start UTF-8 files with one: it was calibrated on as text (a
    text file) or refused as JSON ("Unexpected UTF-8 BOM")."""
    text, data = tmp_path / "calib.txt", tmp_path / "calib.json"
    text.write_bytes(b"\xef\xbb\xbffirst\nsecond \xef\xbb\xbf inside\n")
    assert load_calibration_texts(text) == ["first", "second \ufeff inside"]
    data.write_bytes(b"\xef\xbb\xbf" + json.dumps(["a"]).encode())
    assert load_calibration_texts(data) == ["a"]


def test_a_json_file_holds_a_list_of_strings(tmp_path: Path) -> None:
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(["a b", "", "c"]))
    assert load_calibration_texts(path) == ["a b", "c"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("calib.json", '{"text": "a"}', "holds a JSON dict; expected a list of strings"),
        ("calib.json", '["a", 3]', "item 1 is a int, expected a string"),
        ("calib.json", "[oops", "not valid JSON (line 1, column 2"),
        ("calib.txt", "\n \n", "holds no non-blank sample"),
        ("calib.txt", b"caf\xe9\n", "is not UTF-8 text"),
    ],
)
def test_malformed_sources_say_what_is_wrong(
    tmp_path: Path, name: str, content: str | bytes, message: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(CalibrationDataError, match=r"^calibration data ") as err:
        load_calibration_texts(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_missing_paths_and_plain_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CalibrationDataError, match="no such file or directory"):
        load_calibration_texts(tmp_path / "missing.txt")
    with pytest.raises(CalibrationDataError, match="not a dataset saved by datasets' save_to_disk"):
        load_calibration_texts(tmp_path)
    with pytest.raises(CalibrationDataError, match="samples must be at least 1"):
        load_calibration_texts(tmp_path, samples=0)


def test_a_dataset_directory_without_the_datasets_package_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(CalibrationDataError, match="run `pip install datasets`"):
        load_calibration_texts(tmp_path)


def test_a_saved_dataset_gives_its_text_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"id": [1, 2, 3], "text": ["one", " ", "three"], "source": ["x", "y", "z"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    assert load_calibration_texts(tmp_path / "plain") == ["one", "three"]
    single = {"id": [1, 2], "content": ["alpha", "beta"]}
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(single)})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_calibration_texts(tmp_path / "dict", samples=1) == ["alpha"]
    datasets.Dataset.from_dict({"a": ["x"], "b": ["y"]}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(CalibrationDataError, match="several string columns and none named 'text'"):
        load_calibration_texts(tmp_path / "two")


# ----------------------------------------------------------------------------- batches


def test_without_a_tokenizer_texts_become_utf8_bytes_modulo_the_vocabulary() -> None:
    assert utf8_byte_ids("aé", 256) == [97, 0xC3, 0xA9]
    assert utf8_byte_ids("a", 10) == [7]
    batches = calibration_batches(["ab", "c"], None, vocab_size=256, seq_len=2, batch_size=2)
    assert [b.tolist() for b in batches] == [[[97, 98], [10, 99]]]  # joined by "\n" (10)
    batches = calibration_batches(["ab", "cd"], None, vocab_size=256, seq_len=2, batch_size=1)
    assert [b.tolist() for b in batches] == [[[97, 98]], [[10, 99]], [[100]]]
    assert all(b.dtype == torch.long for b in batches)


def test_every_token_is_seen_once_in_full_rows_then_one_partial_row() -> None:
    texts = ["x" * 50, "y" * 27]
    batches = calibration_batches(texts, None, vocab_size=256, seq_len=16, batch_size=3)
    assert [tuple(b.shape) for b in batches] == [(3, 16), (1, 16), (1, 14)]
    assert sum(b.numel() for b in batches) == 50 + 1 + 27


def test_a_tokenizer_is_used_with_eos_between_texts(model_dir: Path) -> None:
    tokenizer = load_local_tokenizer(model_dir)
    assert tokenizer is not None
    batches = calibration_batches(["the quick fox", "lazy dog"], tokenizer, 256, 16, 4)
    assert [b.tolist() for b in batches] == [[[2, 3, 5, 1, 8, 9]]]
    with pytest.raises(
        CalibrationDataError, match="token id 9, outside the model's vocabulary of 9"
    ):
        calibration_batches(["lazy dog"], tokenizer, vocab_size=9)


def test_a_directory_without_tokenizer_files_has_no_tokenizer(tmp_path: Path) -> None:
    assert load_local_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(CalibrationDataError, match="has tokenizer files but transformers cannot"):
        load_local_tokenizer(tmp_path)


@pytest.mark.parametrize("field", ["vocab_size", "seq_len", "batch_size"])
def test_sizes_below_one_are_refused(field: str) -> None:
    sizes: dict[str, Any] = {"vocab_size": 256, "seq_len": 8, "batch_size": 2, field: 0}
    with pytest.raises(CalibrationDataError, match=f"{field} must be at least 1, got 0"):
        calibration_batches(["abc"], None, **sizes)


def test_calibrate_with_runs_every_batch_without_gradients() -> None:
    seen: list[tuple[tuple[int, ...], bool]] = []

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            seen.append((tuple(ids.shape), torch.is_grad_enabled()))
            return self.embed(ids)

    batches = calibration_batches(["hello world"] * 3, None, 256, seq_len=8, batch_size=2)
    calibrate_with(batches)(Recorder())
    assert seen == [((2, 8), False), ((2, 8), False), ((1, 3), False)]
    with pytest.raises(CalibrationDataError, match="at least one batch"):
        calibrate_with([])


# ----------------------------------------------------------------------------- the CLI


def _input_scales(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return {name: t for name, t in tensors.items() if name.endswith("input_scale")}


def test_calibration_data_sets_the_exported_activation_scales(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = tmp_path / "quiet.txt"
    quiet.write_text("the the the\nthe\n")
    loud = tmp_path / "loud.json"
    loud.write_text(json.dumps(["quick brown fox jumps over lazy dog", "hello world"] * 4))
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model_dir), "--quantize", "fp8"]
    scales: dict[str, dict[str, torch.Tensor]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for name, data in (("quiet", quiet), ("loud", loud)):
        out = tmp_path / name
        calib = ["--calib-data", str(data), "--calib-seq-len", "4", "--calib-batch-size", "2"]
        assert main([*argv, *calib, "--out", str(out), "--json", "--verify"]) == 0
        captured = capsys.readouterr()
        assert "synthetic" not in captured.err
        reports[name] = json.loads(captured.out)
        scales[name] = _input_scales(out)
    assert reports["quiet"]["calibration"] == {
        "source": str(quiet),
        "samples": 2,
        "tokens": 5,  # "the the the" </s> "the": one row of 4, one partial row of 1
        "batches": 2,
        "seq_len": 4,
        "batch_size": 2,
        "tokenizer": str(model_dir),
        "quantized_modules": 14,
    }
    assert reports["loud"]["calibration"]["samples"] == 8
    assert reports["loud"]["verify"]["passed"]
    assert scales["quiet"].keys() == scales["loud"].keys() != set()
    differing = [
        n for n in scales["quiet"] if not torch.equal(scales["quiet"][n], scales["loud"][n])
    ]
    assert differing  # different data, different activation ranges


def test_a_toy_family_calibrates_on_bytes_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"sample {i}" for i in range(200)))
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--quantize", "fp8"]
    assert main([*argv, "--calib-data", str(data), "--out", str(tmp_path / "ckpt"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)["calibration"]
    assert report["samples"] == 128  # the default
    assert report["seq_len"] == 128  # 512 by default, capped by the model's 128 positions
    assert report["tokenizer"] == "utf8-bytes"
    assert "llama has no tokenizer: calibration texts become UTF-8 byte ids" in captured.err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--calib-data", "x.txt"], "--calib-data: only used with --quantize RECIPE"),
        (["--calib-samples", "4"], "--calib-samples: only used with --quantize RECIPE"),
        (
            ["--quantize", "fp8", "--calib-seq-len", "4"],
            "--calib-seq-len: only used with --calib-data",
        ),
        (["--quantize", "fp8", "--calib-data", "missing.txt"], "missing.txt: no such file"),
        (["--quantize", "fp8", "--calib-batch-size", "0"], "expected a positive integer, got 0"),
        (["--quantize", "fp9"], "unknown quantization recipe 'fp9'"),
    ],
)
def test_calibration_flag_errors_are_usage_errors(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out), *extra]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line
    assert not out.exists()
