"""GoldenStore outcomes (missing / update / match / mismatch) and tensor digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pytest_exportcheck.goldens import GoldenStore, dump_golden, safetensors_digest, tensor_digest

DATA = {"tensors": {"w": {"dtype": "float32", "shape": [2], "sha256": "ab"}}, "names": ["w"]}


def test_missing_golden_fails_and_says_how_to_create_it(tmp_path: Path) -> None:
    result = GoldenStore(tmp_path).check("fp8/decoder", DATA)
    assert result.status == "fail"
    assert "is missing" in result.message
    assert "--export-update-goldens" in result.message
    assert not (tmp_path / "fp8").exists()


def test_update_writes_sorted_json_and_passes(tmp_path: Path) -> None:
    result = GoldenStore(tmp_path, update=True).check("fp8/decoder", {"b": 1, "a": [1, 2]})
    assert result.status == "pass"
    assert "written" in result.message
    text = (tmp_path / "fp8" / "decoder.json").read_text()
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    again = GoldenStore(tmp_path, update=True).check("fp8/decoder", {"b": 1, "a": [1, 2]})
    assert "updated" in again.message


def test_matching_golden_passes_and_removes_a_stale_obtained_file(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    (tmp_path / "g.json").write_text(dump_golden(DATA))
    (tmp_path / "g.obtained").write_text("old")
    assert store.check("g", DATA).status == "pass"
    assert not (tmp_path / "g.obtained").exists()


def test_mismatch_writes_obtained_and_returns_a_unified_diff(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    (tmp_path / "g.json").write_text(dump_golden(DATA))
    changed = json.loads(json.dumps(DATA))
    changed["tensors"]["w"]["sha256"] = "cd"
    result = store.check("g", changed)
    assert result.status == "fail"
    assert json.loads((tmp_path / "g.obtained").read_text()) == changed
    assert '-      "sha256": "ab"' in result.message
    assert '+      "sha256": "cd"' in result.message
    assert "--export-update-goldens" in result.message
    assert result.details["obtained"] == str(tmp_path / "g.obtained")
    # The golden itself is untouched until an update is requested.
    assert json.loads((tmp_path / "g.json").read_text()) == DATA


@pytest.mark.parametrize("name", ["../escape", "/abs", "a//b", "", "a b"])
def test_unsafe_golden_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid golden name"):
        GoldenStore(tmp_path).check(name, DATA)


def test_fp8_digest_hashes_the_raw_bytes() -> None:
    values = torch.tensor([[1.0, -2.0], [448.0, 0.5]]).to(torch.float8_e4m3fn)
    digest = tensor_digest(values)
    expected = hashlib.sha256(values.view(torch.uint8).numpy().tobytes()).hexdigest()
    assert digest == {"dtype": "float8_e4m3fn", "shape": [2, 2], "sha256": expected}
    flipped = values.view(torch.uint8).clone()
    flipped[0, 0] ^= 1
    assert tensor_digest(flipped.view(torch.float8_e4m3fn))["sha256"] != expected


def test_scalar_and_non_contiguous_tensors_digest() -> None:
    assert tensor_digest(torch.tensor(0.5))["shape"] == []
    matrix = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_digest(matrix.t()) == tensor_digest(matrix.t().contiguous())


def test_safetensors_digest_covers_every_shard(tmp_path: Path) -> None:
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.bfloat16)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert safetensors_digest(tmp_path) == {"a": tensor_digest(a), "b": tensor_digest(b)}
    save_file({"a": a}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="more than one shard"):
        safetensors_digest(tmp_path)


def test_fallback_goldens_are_read_but_never_written(tmp_path: Path) -> None:
    shipped, local = tmp_path / "shipped", tmp_path / "local"
    GoldenStore(shipped, update=True).check("fp8/x", {"a": 1})
    before = (shipped / "fp8" / "x.json").read_text()
    store = GoldenStore(local, fallbacks=(shipped,))
    assert store.check("fp8/x", {"a": 1}).status == "pass"
    mismatch = store.check("fp8/x", {"a": 2})
    assert mismatch.status == "fail"
    assert str(shipped / "fp8" / "x.json") in mismatch.message
    assert GoldenStore(local, update=True, fallbacks=(shipped,)).check("fp8/x", {"a": 2}).ok
    assert (local / "fp8" / "x.json").exists()
    assert (shipped / "fp8" / "x.json").read_text() == before


def test_builtin_goldens_ship_inside_the_package() -> None:
    from pytest_exportcheck.goldens import BUILTIN_GOLDENS

    assert (BUILTIN_GOLDENS / "fp8_buffers" / "quant_linear.json").is_file()
