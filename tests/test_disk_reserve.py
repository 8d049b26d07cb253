"""The shard writer allocates the open shard's file while it fills; the bytes are unchanged.

On tmpfs, allocating a page costs about as much as copying into it (docs/performance.md,
"Space allocated while the shard fills"), so the writer thread allocates the file in
steps while the exporter still converts; the write then only copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from exportlm.export.hf_checkpoint import safetensors_file
from exportlm.export.hf_checkpoint.sink import ShardedSafetensorsWriter, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(300 + i, generator=g) for i in range(6)}


@pytest.mark.parametrize("max_shard_size", ["5GB", 3000])
def test_a_reserved_shard_holds_the_bytes_of_a_plain_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_shard_size: int | str
) -> None:
    calls: list[tuple[str, int, int]] = []
    reserve = safetensors_file.reserve

    def recording(path: Path, start: int, length: int) -> None:
        calls.append((path.name, start, length))
        reserve(path, start, length)

    monkeypatch.setattr(safetensors_file, "RESERVE_STEP", 1024)
    monkeypatch.setattr(safetensors_file, "reserve", recording)
    writer = ShardedSafetensorsWriter(tmp_path / "w", max_shard_size=max_shard_size)
    (tmp_path / "w").mkdir()
    tensors = _tensors()
    for name, t in tensors.items():
        writer.add(name, t)
    summary = writer.finish()
    assert calls  # the space was allocated ahead, in whole steps of what had arrived
    assert all(start % 1024 == 0 and length % 1024 == 0 for _, start, length in calls)
    for file in summary.files:  # a plain write of the same tensors: the same bytes
        written = load_file(tmp_path / "w" / file)
        plain = tmp_path / f"plain-{file}"
        write_safetensors(plain, {n: tensors[n] for n in written}, {"format": "pt"})
        assert (tmp_path / "w" / file).read_bytes() == plain.read_bytes()


def test_a_write_over_a_longer_file_leaves_only_its_bytes(tmp_path: Path) -> None:
    tensors: dict[str, Any] = _tensors()
    fresh, reused = tmp_path / "fresh.safetensors", tmp_path / "reused.safetensors"
    write_safetensors(fresh, tensors, {"format": "pt"})
    reused.write_bytes(b"\xff" * (fresh.stat().st_size + 5000))  # space held beyond the end
    digest = write_safetensors(reused, tensors, {"format": "pt"})
    assert reused.read_bytes() == fresh.read_bytes()
    assert digest.size == fresh.stat().st_size
