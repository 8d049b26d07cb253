"""What the stream holds at once: one module set at a time, never more than its bound says.

Peak RSS is too noisy for a test (the allocator, the interpreter, other threads); these
tests count instead the bytes of the model's tensors that have CPU storage each time the
stream loads a module set, which is exact and the same on every machine. The measured
peaks against the bound are in ``docs/streaming.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.export.hf_checkpoint.stream import _sizing as sizing
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource
from exportlm.stream import export_streaming
from tests._stream_models import family_directory, llama_directory


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of CPU storage behind ``model``'s parameters and buffers (a tied one counted once)."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _Residency:
    """Records, at each load, what the source's model holds, and the bound the stream planned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.after_load: list[tuple[str, int]] = []
        self.modules_bound = 0
        self.model_bytes = 0
        load, plan = CheckpointSource.load, sizing.bound_of

        def recording_load(source: CheckpointSource, prefix: str, **kwargs: Any) -> Any:
            module = load(source, prefix, **kwargs)
            self.after_load.append((prefix, _resident_bytes(source.model)))
            return module

        def recording_bound(source: CheckpointSource, *args: Any, **kwargs: Any) -> Any:
            bound, what = plan(source, *args, **kwargs)
            self.modules_bound = bound.modules
            self.model_bytes = source.total_bytes
            return bound, what

        monkeypatch.setattr(CheckpointSource, "load", recording_load)
        monkeypatch.setattr(sizing, "bound_of", recording_bound)

    @property
    def peak(self) -> int:
        return max(size for _, size in self.after_load)


@pytest.mark.parametrize(
    ("family", "recipe"),
    [("llama", "int4_awq"), ("llama_tied", "fp8+fp8_kv"), ("mixtral", "fp8"), ("gpt_oss", "nvfp4")],
)
def test_the_stream_holds_one_module_set_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, recipe: str
) -> None:
    if family.startswith("llama"):
        src = llama_directory(tmp_path, tied=family == "llama_tied", layers=4)
    else:
        src = family_directory(tmp_path, family)
    residency = _Residency(monkeypatch)
    export_streaming(src, tmp_path / "out", recipe=recipe, max_shard_size="100KB")

    sizes = [size for p, size in residency.after_load if ".layers." in p]
    assert len(sizes) >= 2  # the layers were loaded one by one
    assert residency.modules_bound > 0
    # the largest set loaded at once is within the bound's module term...
    assert residency.peak <= residency.modules_bound, residency.after_load
    # ...and that term is a fraction of the model: the stream never holds it whole
    assert residency.modules_bound < residency.model_bytes / 2
    # each decoder layer was freed before the next was read: at every layer's load the
    # model held that layer and the computed buffers, not the previous layers too
    assert max(sizes) - min(sizes) <= residency.modules_bound // 2
