"""GoldenStore outcomes (missing / update / match / mismatch) and tensor digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pytest_exportcheck.goldens import (
    GoldenStore,
    dump_golden,
    safetensors_digest,
    tensor_digest,
    tensor_record,
    tensors_digest,
)

DATA = {"tensors": {"w": {"dtype": "float32", "shape": [2], "sha256": "ab"}}, "names": ["w"]}


def test_missing_golden_fails_and_says_how_to_create_it(tmp_path: Path) -> None:
    result = GoldenStore(tmp_path).check("fp8/decoder", DATA)
    assert result.ok is False
    assert result.kind == "missing"
    assert "is missing" in result.message
    assert "--export-update-goldens" in result.message
    assert not (tmp_path / "fp8").exists()


def test_update_writes_sorted_json_and_passes(tmp_path: Path) -> None:
    result = GoldenStore(tmp_path, update=True).check("fp8/decoder", {"b": 1, "a": [1, 2]})
    assert result.ok
    assert "written" in result.message
    text = (tmp_path / "fp8" / "decoder.json").read_text()
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    again = GoldenStore(tmp_path, update=True).check("fp8/decoder", {"b": 1, "a": [1, 2]})
    assert "updated" in again.message


def test_matching_golden_passes_and_removes_a_stale_obtained_file(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    (tmp_path / "g.json").write_text(dump_golden(DATA))
    (tmp_path / "g.obtained").write_text("old")
    assert store.check("g", DATA).ok
    assert not (tmp_path / "g.obtained").exists()


def test_mismatch_writes_obtained_and_names_what_differs(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    (tmp_path / "g.json").write_text(dump_golden(DATA))
    changed = json.loads(json.dumps(DATA))
    changed["tensors"]["w"]["sha256"] = "cd"
    result = store.check("g", changed)
    assert result.ok is False
    assert result.kind == "mismatch"
    assert json.loads((tmp_path / "g.obtained").read_text()) == changed
    assert "w (float32 [2]): bytes differ" in result.message
    assert "--export-update-goldens" in result.message
    assert result.details["obtained"] == str(tmp_path / "g.obtained")
    # The golden itself is untouched until an update is requested.
    assert json.loads((tmp_path / "g.json").read_text()) == DATA


@pytest.mark.parametrize("name", ["../escape", "/abs", "a//b", "", "a b"])
def test_unsafe_golden_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid golden name"):
        GoldenStore(tmp_path).check(name, DATA)


def test_a_one_ulp_change_of_a_scale_reads_as_both_values(tmp_path: Path) -> None:
    scale = torch.tensor(0.0011751170, dtype=torch.float32)
    nudged = torch.nextafter(scale, torch.tensor(1.0))
    store = GoldenStore(tmp_path)
    (tmp_path / "g.json").write_text(
        dump_golden({"tensors": tensors_digest({"a.input_scale": scale})})
    )
    result = store.check("g", {"tensors": tensors_digest({"a.input_scale": nudged})})
    assert result.ok is False
    assert "a.input_scale: 0.001175117 -> 0.0011751171 (rel 8.5e-08)" in result.message


def test_small_tensors_carry_values_and_large_ones_a_summary() -> None:
    small = tensor_record(torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn))
    assert small["values"] == [0.5, -2.0]
    large = tensor_record(torch.full((8, 8), 3.0))
    assert "values" not in large
    assert large["summary"] == {"absmax": 3.0, "mean": 3.0, "nonfinite": 0}
    nan = tensor_record(torch.tensor([float("nan")] * 40))
    assert nan["summary"]["nonfinite"] == 40


def test_summaries_are_shown_but_never_compared(tmp_path: Path) -> None:
    record = tensor_record(torch.ones(64))
    other = json.loads(json.dumps(record))
    other["summary"]["mean"] = 0.99  # another machine's rounding of a statistic
    (tmp_path / "g.json").write_text(dump_golden({"tensors": {"w": other}}))
    assert GoldenStore(tmp_path).check("g", {"tensors": {"w": record}}).ok
    changed = tensor_record(torch.full((64,), 2.0))
    result = GoldenStore(tmp_path).check("g", {"tensors": {"w": changed}})
    assert "w (float32 [64]): bytes differ; absmax 1.0 -> 2.0, mean 0.99 -> 2.0" in result.message


def test_approx_values_compare_within_the_obtained_tolerance(tmp_path: Path) -> None:
    golden = {"tolerance": {"rtol": 1e-4, "atol": 0.0}, "approx": {"s": [1.0, 2.0]}}
    (tmp_path / "g.json").write_text(dump_golden(golden))
    store = GoldenStore(tmp_path)
    close = {"tolerance": {"rtol": 1e-4, "atol": 0.0}, "approx": {"s": [1.00005, 2.0]}}
    assert store.check("g", close).ok
    far = {"tolerance": {"rtol": 1e-4, "atol": 0.0}, "approx": {"s": [1.0, 2.01]}}
    result = store.check("g", far)
    assert result.ok is False
    assert (
        "approx s: 2.0 -> 2.01 (rel 5.0e-03) beyond atol=0 + rtol=0.0001*|golden|" in result.message
    )
    # A golden cannot loosen the tolerance: the check's own (the obtained one) applies.
    loose = {"tolerance": {"rtol": 1.0, "atol": 1.0}, "approx": {"s": [1.0, 2.0]}}
    (tmp_path / "g.json").write_text(dump_golden(loose))
    assert store.check("g", far).ok is False


def test_configs_compare_exactly_and_name_the_key(tmp_path: Path) -> None:
    golden = {"configs": {"hf_quant_config.json": {"quantization": {"quant_algo": "FP8"}}}}
    (tmp_path / "g.json").write_text(dump_golden(golden))
    obtained = {"configs": {"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4"}}}}
    result = GoldenStore(tmp_path).check("g", obtained)
    assert (
        'configs.hf_quant_config.json.quantization.quant_algo: "FP8" -> "NVFP4"' in result.message
    )


def test_update_writes_atomically_and_keeps_an_unchanged_file(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path, update=True)
    store.check("a/b", {"x": 1})
    golden = tmp_path / "a" / "b.json"
    mtime = golden.stat().st_mtime_ns
    store.check("a/b", {"x": 1})
    assert golden.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in golden.parent.iterdir()) == ["b.json"]  # no temporaries
    assert store.used == {str(golden)}


def test_update_refused_for_another_distribution_compares_instead(tmp_path: Path) -> None:
    GoldenStore(tmp_path, update=True).check("g", {"x": 1})

    def only_mine(owner: str | None) -> str | None:
        return None if owner == "mine" else f"{owner} provides it"

    store = GoldenStore(tmp_path, update=True, may_update=only_mine)
    refused = store.check("g", {"x": 2}, owner="exportlm")
    assert refused.ok is False
    assert "not updated: exportlm provides it" in refused.message
    assert json.loads((tmp_path / "g.json").read_text()) == {"x": 1}
    assert store.check("g", {"x": 2}, owner="mine").ok
    assert json.loads((tmp_path / "g.json").read_text()) == {"x": 2}


def test_unused_lists_goldens_no_item_touched(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path, update=True)
    store.check("a/used", {"x": 1})
    (tmp_path / "a" / "stale.json").write_text("{}")
    assert store.unused(store.used) == [tmp_path / "a" / "stale.json"]


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
    assert safetensors_digest(tmp_path) == {"a": tensor_record(a), "b": tensor_record(b)}
    save_file({"a": a}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="more than one shard"):
        safetensors_digest(tmp_path)


def test_fallback_goldens_are_read_but_never_written(tmp_path: Path) -> None:
    shipped, local = tmp_path / "shipped", tmp_path / "local"
    GoldenStore(shipped, update=True).check("fp8/x", {"a": 1})
    before = (shipped / "fp8" / "x.json").read_text()
    store = GoldenStore(local, fallbacks=(shipped,))
    assert store.check("fp8/x", {"a": 1}).ok
    mismatch = store.check("fp8/x", {"a": 2})
    assert mismatch.ok is False
    assert str(shipped / "fp8" / "x.json") in mismatch.message
    assert GoldenStore(local, update=True, fallbacks=(shipped,)).check("fp8/x", {"a": 2}).ok
    assert (local / "fp8" / "x.json").exists()
    assert (shipped / "fp8" / "x.json").read_text() == before


def test_builtin_goldens_ship_inside_the_package() -> None:
    from pytest_exportcheck.goldens import BUILTIN_GOLDENS

    assert (BUILTIN_GOLDENS / "checkpoint" / "untied_llama" / "quant_linear.json").is_file()
