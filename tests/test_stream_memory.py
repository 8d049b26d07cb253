"""Streaming export's memory: the bound it states, and the shards read straight into the modules."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exportlm.errors import MalformedCheckpointError
from exportlm.quant.formats._int4 import pack_int4_rows, unpack_int4_rows
from exportlm.stream import export_streaming
from tests._stream_models import different_files, llama_directory

_BOUND = re.compile(
    r"memory bound of (\d+) MB = baseline (\d+) MB .* \+ largest module set (\d+) MB "
    r"\+ one output shard (\d+) MB \+ activations (\d+) MB \+ quantizing one linear (\d+) MB"
)


def test_the_stream_logs_its_bound_term_by_term_and_the_peak_against_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = llama_directory(tmp_path, tied=False)
    with caplog.at_level(logging.INFO, logger="exportlm"):
        export_streaming(src, tmp_path / "out", recipe="fp8", max_shard_size="100KB")
    found = [m for r in caplog.records if (m := _BOUND.search(r.getMessage()))]
    assert len(found) == 1
    total, baseline, modules, shard, acts, working = (int(g) for g in found[0].groups())
    assert baseline > 50  # the interpreter and torch are counted, not assumed away
    assert abs(total - (baseline + modules + shard + acts + working)) <= 3  # terms rounded to MB
    # the largest module set is the embedding (256 x 128 bf16, 0.07 MB) and the output
    # shard is max_shard_size: both far below 1 MB here
    assert modules == 0
    assert shard == 0
    assert any(
        "peak RSS" in r.getMessage() and "against the bound" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(("recipe", "working"), [("fp8", 4), (None, 0)])
def test_the_bound_counts_quantizing_one_linear_as_its_largest_weight_in_float32(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recipe: str | None, working: int
) -> None:
    # gate / up / down are 2048 x 512: 1M elements, 4.2 MB in float32; nothing to
    # quantize without a recipe
    src = llama_directory(tmp_path, tied=False, layers=1, hidden_size=512, intermediate_size=2048)
    with caplog.at_level(logging.INFO, logger="exportlm"):
        export_streaming(src, tmp_path / "out", recipe=recipe)
    found = [m for r in caplog.records if (m := _BOUND.search(r.getMessage()))]
    assert [int(m.group(6)) for m in found] == [working]


def test_a_checkpoint_stored_in_another_dtype_is_converted_as_it_is_read(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    widened = tmp_path / "f32"
    widened.mkdir()
    for file in src.iterdir():
        if file.suffix == ".safetensors":  # the same values in float32; config.json stays bf16
            save_file({k: v.float() for k, v in load_file(file).items()}, widened / file.name)
        else:
            (widened / file.name).write_bytes(file.read_bytes())
    a = export_streaming(src, tmp_path / "a", recipe="fp8")
    b = export_streaming(widened, tmp_path / "b", recipe="fp8")
    assert different_files(a, b, skip=("exportlm-manifest.json",)) == []


def test_a_truncated_shard_is_refused_naming_it(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(MalformedCheckpointError, match=shard.name):
        export_streaming(src, tmp_path / "out", recipe="fp8")


@pytest.mark.parametrize("shape", [(2, 16), (4, 6, 16), (16, 256)])
def test_int4_rows_unpack_to_the_codes_packed(shape: tuple[int, ...]) -> None:
    codes = torch.randint(
        -8, 8, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(1)
    )
    codes.view(-1)[:16] = torch.arange(-8, 8, dtype=torch.int8)  # every code, in both nibbles
    packed = pack_int4_rows(codes)
    assert packed.shape == (*shape[:-2], shape[-2] // 2, shape[-1])
    assert torch.equal(unpack_int4_rows(packed), codes)


def _whole_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """One slice of rows for every tensor: the slice size of fake quantization, INT4
    quantization and the AWQ weight statistic set to 2**40 elements."""
    monkeypatch.setattr("exportlm.quant._tensor.CHUNK_ELEMENTS", 1 << 40)


@pytest.mark.parametrize(
    ("fmt", "block", "calibrated"),
    [("fp8", None, True), ("int4", 128, False), ("nvfp4", 16, True), ("int8", None, False)],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_weight_quantized_in_slices_of_rows_is_the_whole_tensors_quantization(
    monkeypatch: pytest.MonkeyPatch, fmt: str, block: int | None, calibrated: bool, layout: str
) -> None:
    from exportlm.quant import TensorQuantizer

    # 1002 x 512: more than one slice of rows (2**17 elements each), the last one shorter
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(1002, 512, generator=gen) * 0.02).to(torch.bfloat16)
    if layout == "transposed":  # a [1002, 512] view of a [512, 1002] tensor
        weight = (torch.randn(512, 1002, generator=gen) * 0.02).to(torch.bfloat16).t()
    quantizer = TensorQuantizer(fmt, block_size=block)
    if calibrated:
        quantizer.amax = weight.abs().amax().float()
    sliced, codes = quantizer(weight), quantizer.quantize(weight)
    _whole_tensors(monkeypatch)
    whole, whole_codes = quantizer(weight), quantizer.quantize(weight)
    assert sliced.dtype == weight.dtype
    assert sliced.stride() == weight.stride()  # laid out like the weight, as a loader's copy
    # bit for bit (a value comparison would take -0.0 for 0.0)
    assert torch.equal(_bits(sliced), _bits(whole))
    assert torch.equal(_bits(codes.data), _bits(whole_codes.data))
    assert torch.equal(codes.scale.float(), whole_codes.scale.float())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_the_awq_search_in_slices_of_rows_writes_the_bytes_of_the_whole_tensors_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exportlm import export_model
    from exportlm.cli._model import resolve_model
    from exportlm.quant import quantize

    # gate / up / down are 1024 x 256: two slices of rows each at the default slice size
    src = llama_directory(tmp_path, tied=False, layers=1, hidden_size=256, intermediate_size=1024)

    def export(out: str) -> Path:
        model = quantize(resolve_model(str(src)).build(), "int4_awq")
        return export_model("hf_checkpoint", model, tmp_path / out)

    sliced = export("sliced")
    _whole_tensors(monkeypatch)
    whole = export("whole")
    assert different_files(sliced, whole, skip=("exportlm-manifest.json",)) == []
