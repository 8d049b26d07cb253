"""The streamed export's bound counts what AWQ's scale search holds: its Gram matrices.

A Gram matrix (``in x in``, float64, :mod:`exportlm.quant._awq_gram`) is kept for every
group of linears reading one input where it is no larger than the group's float32
weights twice over; with the intermediate size equal to the hidden size, every group of
a decoder layer keeps one, together four times the layer's ``hidden x hidden`` weights
in float64: more than the layer in bf16 and the float32 weight of its largest linear
(the bound's other terms). Counted exactly (the bytes of the matrices alive at each
forward), not as a noisy RSS.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from exportlm.export.hf_checkpoint.stream import _sizing as sizing
from exportlm.quant import _awq_gram
from exportlm.stream import export_streaming
from tests._stream_models import llama_directory


class _Grams:
    """The most bytes of Gram matrices alive at once while the stream ran, and its bound."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live: weakref.WeakSet[Any] = weakref.WeakSet()
        self.peak = 0
        self.bounds: list[Any] = []
        add, plan = _awq_gram.GramLoss.add, sizing.bound_of

        def recording_add(loss: Any, x: Any) -> None:
            add(loss, x)
            self.live.add(loss)
            held = sum(
                t.numel() * t.element_size()
                for g in self.live
                for t in (g.gram, g.mean_gram)
                if t is not None
            )
            self.peak = max(self.peak, held)

        def recording_bound(*args: Any, **kwargs: Any) -> Any:
            bound, what = plan(*args, **kwargs)
            self.bounds.append(bound)
            return bound, what

        monkeypatch.setattr(_awq_gram.GramLoss, "add", recording_add)
        monkeypatch.setattr(sizing, "bound_of", recording_bound)


@pytest.mark.parametrize("lengths", [(32, 32), (32, 24)])
def test_the_bound_of_an_awq_stream_covers_its_gram_matrices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lengths: tuple[int, int]
) -> None:
    import torch

    src = llama_directory(tmp_path, tied=False, layers=2, hidden_size=256, intermediate_size=256)
    grams = _Grams(monkeypatch)
    batches = [torch.randint(0, 256, (1, n)) for n in lengths]  # (32, 24): H kept beside G
    out = tmp_path / "out"
    export_streaming(src, out, recipe="int4_awq", calibration=batches, max_shard_size="100KB")
    gc.collect()
    bound = grams.bounds[-1]
    assert grams.peak > 0  # the search kept Gram matrices
    # what the bound held before it counted them (a layer, a shard, quantizing one
    # linear) is less than the matrices alone...
    assert grams.peak > bound.modules + bound.shard + bound.working
    # ...the term for the calibration matrices covers them, and the bound counts it
    assert grams.peak <= bound.search
    assert bound.held == bound.modules + bound.shard + bound.working + bound.search
    assert bound.total == bound.baseline + bound.held + bound.activations


def test_a_recipe_without_a_search_adds_no_calibration_matrices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = llama_directory(tmp_path, tied=False, layers=1, hidden_size=256, intermediate_size=256)
    grams = _Grams(monkeypatch)
    export_streaming(src, tmp_path / "out", recipe="fp8")
    assert grams.peak == 0
    assert [b.search for b in grams.bounds] == [0] * len(grams.bounds)
