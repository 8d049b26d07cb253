"""Inputs that must not take unbounded memory, hang or crash the process (issue 39, item 5).

Each attack runs the command line in a child process under a 4 GiB data limit
(``RLIMIT_DATA``), so a regression fails the test (a ``MemoryError``, a different
exit code or message) instead of taking the machine's memory, and the child's
peak resident memory is asserted to stay far below what reading the input whole
would take. Sparse files (``truncate``) make the 10 and 16 GiB inputs cost no disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exportlm.calibration import (
    MAX_SAMPLE_BYTES,
    CalibrationDataError,
    calibration_batches,
    load_calibration_texts,
    load_local_tokenizer,
)
from exportlm.errors import InputTooLargeError, InvalidConfigError
from tests.test_trust_inputs import _finishes

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_DATA, VmHWM and sparse files: Linux"
)

ROOT = Path(__file__).resolve().parents[1]
#: The data limit the child runs under (room for a many-core machine's thread stacks): an
#: input read whole fails against it instead of taking the machine's memory.
DATA_LIMIT = 4 << 30
#: The peak resident memory a refusal may reach (the interpreter, torch and transformers
#: imported take about 0.5 GiB); reading any of these inputs whole takes gigabytes.
PEAK_LIMIT_MIB = 1200
GiB = 1 << 30

_DRIVER = textwrap.dedent(
    """
    import json, resource, subprocess, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "exportlm", *sys.argv[3:]],
            capture_output=True, text=True, timeout=float(sys.argv[2]),
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = None, f"timed out: {err}"
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"rc": rc, "out": out, "peak_mib": peak // 1024}))
    """
)


def _exportlm(
    args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[int | None, str, int]:
    """(exit code, output, peak RSS in MiB) of ``python -m exportlm ARGS`` under the data limit."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    environ.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(DATA_LIMIT), str(timeout), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environ,
        timeout=timeout + 60,
        check=True,
    )
    result = json.loads(done.stdout)
    return result["rc"], result["out"], result["peak_mib"]


def _sparse(path: Path, size: int, head: bytes = b"") -> Path:
    path.write_bytes(head)
    os.truncate(path, size)
    return path


def _quantize(data: Path, out: Path) -> list[str]:
    return [
        "export", "--target", "hf_checkpoint", "--model", "llama", "--quantize", "fp8",
        "--calib-data", str(data), "--calib-samples", "1", "--calib-seq-len", "16",
        "--out", str(out),
    ]  # fmt: skip


# ---------------------------------------------------------------- calibration text


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("one-line-30MB.txt", lambda p: p.write_bytes(b"x" * (30 << 20))),
        ("sparse-10GiB.txt", lambda p: _sparse(p, 10 * GiB)),
    ],
)
def test_a_calibration_line_over_the_bound_is_refused_with_its_size(
    tmp_path: Path, name: str, make: Callable[[Path], Any]
) -> None:
    data = tmp_path / name
    make(data)
    rc, out, peak = _exportlm(_quantize(data, tmp_path / "out"), tmp_path)
    assert rc == 2, out
    assert f"line 1 is longer than {MAX_SAMPLE_BYTES} bytes" in out
    assert f"the file has {data.stat().st_size} bytes" in out
    assert "Traceback" not in out
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"
    assert not (tmp_path / "out").exists()


def test_a_sparse_json_calibration_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    data = _sparse(tmp_path / "calib.json", 10 * GiB, b'["')
    rc, out, peak = _exportlm(_quantize(data, tmp_path / "out"), tmp_path)
    assert rc == 2, out
    assert f"has {10 * GiB} bytes, more than the" in out
    assert "one sample per line" in out
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_only_the_lines_the_samples_need_are_read(tmp_path: Path) -> None:
    data = _sparse(tmp_path / "calib.txt", 10 * GiB, b"first\n\nsecond\n")  # then 10 GiB of NULs
    assert load_calibration_texts(data, samples=2) == ["first", "second"]
    ok = tmp_path / "long.txt"
    ok.write_bytes(b"y" * MAX_SAMPLE_BYTES + b"\r\nz\rw\n")  # at the bound: read, not refused
    assert load_calibration_texts(ok, samples=None) == ["y" * MAX_SAMPLE_BYTES, "z", "w"]


# ---------------------------------------------------------------- datasets directories


def _dataset_dir(path: Path, state: dict[str, Any] | None = None) -> Path:
    """A directory laid out as ``Dataset.save_to_disk`` writes it (the Arrow file optional)."""
    path.mkdir()
    base: dict[str, Any] = {
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "0",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (path / "state.json").write_text(json.dumps({**base, **(state or {})}))
    features = {"text": {"dtype": "string", "_type": "Value"}}
    (path / "dataset_info.json").write_text(json.dumps({"features": features}))
    return path


@pytest.fixture
def datasets_that_must_not_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``datasets`` whose ``load_from_disk`` fails the test: the refusal must come first."""

    def load_from_disk(path: str) -> None:
        raise AssertionError(f"datasets.load_from_disk({path!r}) was reached")

    fake = types.ModuleType("datasets")
    fake.load_from_disk = load_from_disk  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)


@pytest.mark.usefixtures("datasets_that_must_not_be_reached")
@pytest.mark.parametrize("where", ["absolute", "parent", "link", "split"])
def test_a_dataset_naming_a_fifo_outside_its_directory_is_refused_before_datasets_opens_it(
    tmp_path: Path, where: str
) -> None:
    fifo = tmp_path / "fifo.arrow"
    os.mkfifo(fifo)
    names = {"absolute": str(fifo), "parent": "../fifo.arrow", "link": "linked.arrow"}
    if where == "split":
        root = tmp_path / "dict"
        root.mkdir()
        (root / "dataset_dict.json").write_text(json.dumps({"splits": ["../outside"]}))
        _dataset_dir(tmp_path / "outside", {"_data_files": [{"filename": "../fifo.arrow"}]})
    else:
        root = _dataset_dir(tmp_path / "ds", {"_data_files": [{"filename": names[where]}]})
        if where == "link":  # refused by the scan for special files, before and after
            (root / "linked.arrow").symlink_to(fifo)
    with pytest.raises(CalibrationDataError, match=r"outside the dataset directory|FIFO") as err:
        load_calibration_texts(root)
    assert "save_to_disk" in str(err.value) or "fifo" in str(err.value)


@pytest.mark.usefixtures("datasets_that_must_not_be_reached")
def test_a_custom_format_and_a_data_file_that_is_no_file_are_refused(tmp_path: Path) -> None:
    custom = _dataset_dir(tmp_path / "custom", {"_format_type": "custom"})
    (custom / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(CalibrationDataError, match="format 'custom' is not one"):
        load_calibration_texts(custom)
    folder = _dataset_dir(tmp_path / "folder")
    (folder / "data-00000-of-00001.arrow").mkdir()
    with pytest.raises(CalibrationDataError, match="which is not a regular file"):
        load_calibration_texts(folder)


def _arrow(path: Path, garbage: bool = False, texts: tuple[str, ...] = ("hello", "world")) -> None:
    pa = pytest.importorskip("pyarrow")
    if garbage:
        path.write_bytes(b"not an arrow stream" * 4)
        return
    table = pa.table({"text": list(texts)})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def test_with_datasets_a_fifo_named_outside_never_blocks(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    fifo = tmp_path / "fifo.arrow"
    os.mkfifo(fifo)
    root = _dataset_dir(tmp_path / "ds", {"_data_files": [{"filename": str(fifo)}]})
    got = _finishes(lambda: load_calibration_texts(root, samples=1), fifo)
    assert isinstance(got, CalibrationDataError), got
    assert "outside the dataset directory" in str(got)


@pytest.mark.parametrize("defect", ["custom-format", "unknown-feature", "garbage-arrow"])
def test_with_datasets_a_malformed_directory_is_a_calibration_data_error(
    tmp_path: Path, defect: str
) -> None:
    pytest.importorskip("datasets")
    state = {"_format_type": "custom"} if defect == "custom-format" else None
    root = _dataset_dir(tmp_path / "ds", state)
    _arrow(root / "data-00000-of-00001.arrow", garbage=defect == "garbage-arrow")
    if defect == "unknown-feature":
        features = {"text": {"dtype": "string", "_type": "NoSuchFeature"}}
        (root / "dataset_info.json").write_text(json.dumps({"features": features}))
    with pytest.raises(CalibrationDataError) as err:
        load_calibration_texts(root, samples=1)
    assert "save_to_disk" in str(err.value)
    rc, out, _ = _exportlm(_quantize(root, tmp_path / "out"), tmp_path)
    assert rc == 2, out
    assert "Traceback" not in out
    healthy = _dataset_dir(tmp_path / "healthy")
    _arrow(healthy / "data-00000-of-00001.arrow")
    assert load_calibration_texts(healthy, samples=1) == ["hello"]


def test_with_datasets_a_row_over_the_bound_is_refused_before_it_becomes_a_string(
    tmp_path: Path,
) -> None:
    pytest.importorskip("datasets")
    root = _dataset_dir(tmp_path / "ds")
    _arrow(root / "data-00000-of-00001.arrow", texts=("z" * (MAX_SAMPLE_BYTES + 1), "short"))
    with pytest.raises(CalibrationDataError, match=f"a text of {MAX_SAMPLE_BYTES + 1} bytes"):
        load_calibration_texts(root, samples=1)


# ---------------------------------------------------------------- model specs


def _spec(**fields: Any) -> str:
    spec = {
        "family": "llama", "vocab_size": 97, "hidden_size": 32, "num_layers": 1,
        "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
        "tie_embeddings": False, "num_experts": 0, "num_experts_per_tok": 0,
    }  # fmt: skip
    return json.dumps({**spec, **fields})


@pytest.mark.parametrize(
    "fields",
    [{"vocab_size": 10**9}, {"num_layers": 10**8}, {"hidden_size": 2**20, "num_heads": 2}],
)
def test_a_small_spec_of_a_huge_model_is_refused_before_allocating(
    tmp_path: Path, fields: dict[str, int]
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(_spec(**fields))
    assert spec.stat().st_size < 300
    args = ["export", "--target", "torch_export", "--model", str(spec), "--out", "m.pt2"]
    rc, out, peak = _exportlm(args, tmp_path)
    assert rc == 2, out
    assert "over the budget of 2147483648 bytes" in out
    assert "EXPORTLM_MAX_SPEC_BYTES" in out
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_the_spec_budget_is_set_by_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exportlm.models import build_from_spec

    spec = json.loads(_spec())
    assert build_from_spec(spec) is not None  # the default budget holds a toy spec
    monkeypatch.setenv("EXPORTLM_MAX_SPEC_BYTES", "1000")
    with pytest.raises(InputTooLargeError, match="over the budget of 1000 bytes") as err:
        build_from_spec(spec)
    assert err.value.limit == 1000
    assert err.value.size is not None
    assert err.value.size > 1000
    monkeypatch.setenv("EXPORTLM_MAX_SPEC_BYTES", "lots")
    with pytest.raises(InvalidConfigError, match="not a positive number of bytes"):
        build_from_spec(spec)


# ---------------------------------------------------------------- ONNX files


def test_a_sparse_16gib_onnx_file_is_refused_by_inspect_and_verify_unread(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    graph = _sparse(tmp_path / "model.onnx", 16 * GiB)
    rc, out, peak = _exportlm(["inspect", str(graph)], tmp_path)
    assert rc == 1, out
    assert "onnx-unreadable" in out
    assert "protobuf's 2 GiB limit" in out
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"
    args = ["verify", str(graph), "--engine", "onnxruntime-genai", "--model", "llama"]
    rc, out, peak = _exportlm([*args, "--python", sys.executable], tmp_path)
    assert rc == 2, out
    assert "protobuf's 2 GiB limit" in out
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak} MiB"


def test_the_onnx_readers_check_the_size_before_reading(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from exportlm.export.onnx import get_onnx_info
    from exportlm.inspection import MAX_ONNX_BYTES, check_onnx_size, read_onnx_model

    graph = _sparse(tmp_path / "model.onnx", MAX_ONNX_BYTES + 1)
    for reader in (check_onnx_size, read_onnx_model, get_onnx_info):
        with pytest.raises(InputTooLargeError, match=f"has {MAX_ONNX_BYTES + 1} bytes") as err:
            reader(graph)
        assert err.value.limit == MAX_ONNX_BYTES


# ---------------------------------------------------------------- tokenizers


def _panicking_tokenizer(directory: Path) -> Path:
    """A model directory whose ``tokenizer.json`` makes the Rust ``tokenizers`` panic.

    Its post-processor names a special token (``[X]``) the vocabulary lacks:
    ``pyo3_runtime.PanicException: no entry found for key``, a BaseException.
    """
    from exportlm.models import tiny_hf_model

    tiny_hf_model("llama").save_pretrained(directory)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": None, "decoder": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[X]", "type_id": 0}}],
            "pair": [], "special_tokens": {},
        },
        "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"},
    }  # fmt: skip
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def test_a_panicking_tokenizer_is_a_calibration_data_error(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    directory = _panicking_tokenizer(tmp_path / "model")
    tokenizer = load_local_tokenizer(directory)  # this one panics only when it encodes
    with pytest.raises(CalibrationDataError, match="PanicException") as err:
        calibration_batches(["hello"], tokenizer, vocab_size=128, seq_len=4)
    assert "failed on calibration text 0" in str(err.value)
    data = tmp_path / "calib.txt"
    data.write_text("hello world\n")
    args = ["export", "--target", "hf_checkpoint", "--model", str(directory)]
    args += ["--quantize", "fp8", "--calib-data", str(data), "--out", str(tmp_path / "out")]
    rc, out, _ = _exportlm(args, tmp_path)
    assert rc == 2, out
    assert "PanicException" in out
    assert "Traceback" not in out
    assert not (tmp_path / "out").exists()


def test_an_interrupt_inside_the_tokenizer_is_not_swallowed() -> None:
    class Interrupted:
        eos_token_id = None

        def __call__(self, text: str) -> dict[str, list[int]]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibration_batches(["hello"], Interrupted(), vocab_size=128, seq_len=4)
