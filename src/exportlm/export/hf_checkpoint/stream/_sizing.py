"""The streamed export's memory bound, its output shard sized to the budget.

:func:`bound_of` states what one streamed export should peak at, term by term
(:class:`~exportlm.export.hf_checkpoint.stream._memory.MemoryBound`); :func:`fit_bound` first picks the
largest output shard that fits the budget beside one layer
(:func:`~exportlm.export.hf_checkpoint.stream._budget.shard_size_within`) and says so when it is smaller
than ``max_shard_size``.
"""

from __future__ import annotations

import logging

from exportlm.export.hf_checkpoint.sink import parse_size
from exportlm.export.hf_checkpoint.stream._budget import shard_size_within
from exportlm.export.hf_checkpoint.stream._memory import MemoryBound
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource

__all__ = ["bound_of", "fit_bound"]

logger = logging.getLogger("exportlm.stream")  # the documented logger of the streaming export


def fit_bound(
    source: CheckpointSource,
    shells: tuple[set[str], set[str]],
    budget: int | None,
    max_shard_size: int | str,
    baseline: int,
    layers: list[int],
    activations: int,
    *,
    quantized: bool,
) -> tuple[MemoryBound, str, int | str]:
    """:func:`bound_of` with the output shard sized to ``budget`` (``max_shard_size`` at most);
    the shard size chosen (``max_shard_size`` itself where it fits)."""
    terms = (baseline, layers, activations)
    floor, _ = bound_of(source, shells, 1, *terms, quantized=quantized)  # its largest tensor
    chosen = shard_size_within(budget, parse_size(max_shard_size), floor)
    if chosen != parse_size(max_shard_size):
        logger.info(
            "max_shard_size %s does not fit the budget beside one layer: shards of at most "
            "%.1f MB instead",
            max_shard_size,
            chosen / 1e6,
        )
        max_shard_size = chosen
    bound, largest = bound_of(source, shells, chosen, *terms, quantized=quantized)
    return bound, largest, max_shard_size


def bound_of(
    source: CheckpointSource,
    shells: tuple[set[str], set[str]],
    max_shard_size: int,
    baseline: int,
    layers: list[int],
    activations: int,
    *,
    quantized: bool,
) -> tuple[MemoryBound, str]:
    """What this export should peak at, and what its largest module set is.

    The terms: the baseline, the largest modules loaded at once (a layer, or the head /
    tail modules: the embedding, ``lm_head``), one output shard (``max_shard_size``,
    capped at the model's size, or a single larger tensor), the calibration activations
    entering and leaving a layer, and, when a recipe quantizes, the largest weight of a
    layer in float32 (quantizing one linear)."""
    state = source.model.state_dict(keep_vars=True)
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    shell_bytes = [sum(sizes[n] for n in source.saved(names)) for names in shells]
    shard = min(max_shard_size, source.total_bytes)
    inside = source.layout.layers + "."
    linear = max((t.numel() for n, t in state.items() if n.startswith(inside)), default=0)
    sets = [(size, f"decoder layer {i}") for i, size in enumerate(layers)]
    sets += [(shell_bytes[0], "the modules before the layers")]
    sets += [(shell_bytes[1], "the modules after them")]
    modules, what = max(sets, key=lambda pair: pair[0])
    bound = MemoryBound(
        baseline=baseline,
        modules=modules,
        shard=max(shard, *sizes.values()),
        activations=2 * activations,
        working=4 * linear if quantized else 0,
    )
    return bound, what
