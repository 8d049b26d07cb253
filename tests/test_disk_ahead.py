"""An in-memory export allocates its shard's file for the bytes it will write, from the start.

The export driver converts one module at a time and an unquantized ``lm_head`` comes last:
the shard writer that allocated only what had arrived left that tensor's space to the end,
on the chain the write waits for (docs/performance.md, "The whole shard allocated from the
start"). :func:`exportlm.module_exporters.checkpoint_bytes_at_least` says, before any weight
is read, about the fewest bytes the export writes; the writer allocates that much from its
first tensor on. The bytes written are those of a plain write whatever the hint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import exportlm
from exportlm.export.hf_checkpoint import safetensors_file
from exportlm.export.hf_checkpoint.sink import ShardedSafetensorsWriter, write_safetensors
from exportlm.models import tiny_hf_model
from exportlm.module_exporters import checkpoint_bytes_at_least
from exportlm.quant import quantize


def _model(family: str, recipe: str | None) -> Any:
    model = tiny_hf_model(family, num_hidden_layers=2)
    if recipe is not None:
        batch = torch.randint(
            0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
        )
        quantize(model, recipe, calibrate=lambda m: m(batch))
    return model


def _tensor_bytes(directory: Path, *, scales: bool = True) -> int:
    """Bytes of the checkpoint's tensors; without the scales (every ``*scale*`` leaf)
    when ``scales`` is false."""
    tensors = [
        t
        for shard in directory.glob("*.safetensors")
        for name, t in load_file(shard).items()
        if scales or "scale" not in name.rsplit(".", 1)[-1]
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    ("family", "recipe", "dtype"),
    [
        ("llama", "fp8", None),
        ("llama_tied", "fp8", None),
        ("llama", "nvfp4", None),
        ("llama", "int8_wo", None),
        ("llama", "int4_awq", None),
        ("llama", None, None),
        ("llama", "fp8", torch.bfloat16),
    ],
)
def test_the_bound_is_no_more_than_the_export_writes_and_most_of_it(
    tmp_path: Path, family: str, recipe: str | None, dtype: torch.dtype | None
) -> None:
    model = _model(family, recipe)
    bound = checkpoint_bytes_at_least(model, dtype=dtype)
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", dtype=dtype)
    written = _tensor_bytes(Path(out))
    assert bound <= written
    # every tensor counted as it is stored (the quantized weights at their format's bytes an
    # element): all but the scales, which the bound leaves out
    assert bound >= _tensor_bytes(Path(out), scales=False), (bound, written)
    assert checkpoint_bytes_at_least(model, dtype=dtype, is_qlora=True) == 0


def _record_reserves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    reserve = safetensors_file.reserve

    def recording(path: Path, start: int, length: int) -> None:
        calls.append((start, length))
        reserve(path, start, length)

    monkeypatch.setattr(safetensors_file, "RESERVE_STEP", 1024)
    monkeypatch.setattr(safetensors_file, "reserve", recording)
    return calls


def test_an_export_allocates_its_bound_with_its_first_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model("llama", "fp8")
    bound = checkpoint_bytes_at_least(model)
    calls = _record_reserves(monkeypatch)
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt"))
    start, length = calls[0]
    assert start == 0
    assert length == bound // 1024 * 1024  # the lm_head's space included
    # the FP8 weights' whole bytes too: what is left to allocate after the conversion is
    # the scales and the rest of a step, not half of every quantized weight
    written = _tensor_bytes(out)
    assert written - length <= written - _tensor_bytes(out, scales=False) + 1024 * 2
    shard = out / "model.safetensors"
    plain = tmp_path / "plain.safetensors"
    tensors = load_file(shard)
    write_safetensors(plain, tensors, {"format": "pt"})
    assert shard.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize("expected", [0, 700, 2_000, 50_000])
@pytest.mark.parametrize("max_shard_size", ["5GB", 3000])
def test_a_hinted_writer_writes_the_bytes_of_a_plain_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: int, max_shard_size: int | str
) -> None:
    calls = _record_reserves(monkeypatch)
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(300 + i, generator=g) for i in range(6)}
    writer = ShardedSafetensorsWriter(
        tmp_path / "w", max_shard_size=max_shard_size, expected_bytes=expected
    )
    (tmp_path / "w").mkdir()
    for name, t in tensors.items():
        writer.add(name, t)
    summary = writer.finish()
    if expected >= 2048:  # a hint above what arrived first: allocated with the first tensor
        assert calls[0] == (0, min(expected, writer.max_shard_size) // 1024 * 1024)
    for file in summary.files:  # space beyond the write (a hint that overshot) is cut off
        written = load_file(tmp_path / "w" / file)
        plain = tmp_path / f"plain-{file}"
        write_safetensors(plain, {n: tensors[n] for n in written}, {"format": "pt"})
        assert (tmp_path / "w" / file).read_bytes() == plain.read_bytes()
        assert summary.digests[file].size == plain.stat().st_size
