"""The streamed export's memory bound, its output shard sized to the budget.

:func:`bound_of` states what one streamed export should peak at, term by term
(:class:`~exportlm.export.hf_checkpoint.stream._memory.MemoryBound`); :func:`fit_bound` first picks the
largest output shard that fits the budget beside one layer
(:func:`~exportlm.export.hf_checkpoint.stream._budget.shard_size_within`) and says so when it is smaller
than ``max_shard_size``. :func:`search_bytes` is the term of a calibration algorithm that
holds matrices of the inputs while a layer calibrates (AWQ's Gram matrices, GPTQ's
Hessians), keyed on the recipe records' algorithms (:func:`calibration_algorithms`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from exportlm.export.hf_checkpoint.sink import parse_size
from exportlm.export.hf_checkpoint.stream._budget import shard_size_within
from exportlm.export.hf_checkpoint.stream._memory import MemoryBound
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource

__all__ = ["bound_of", "calibration_algorithms", "fit_bound", "search_bytes"]

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
    search: tuple[frozenset[str], Sequence[int]] = (frozenset(), ()),
) -> tuple[MemoryBound, str, int | str]:
    """:func:`bound_of` with the output shard sized to ``budget`` (``max_shard_size`` at most);
    the shard size chosen (``max_shard_size`` itself where it fits)."""
    terms = (baseline, layers, activations)
    floor, _ = bound_of(source, shells, 1, *terms, quantized=quantized, search=search)
    chosen = shard_size_within(budget, parse_size(max_shard_size), floor)
    if chosen != parse_size(max_shard_size):
        logger.info(
            "max_shard_size %s does not fit the budget beside one layer: shards of at most "
            "%.1f MB instead",
            max_shard_size,
            chosen / 1e6,
        )
        max_shard_size = chosen
    bound, largest = bound_of(source, shells, chosen, *terms, quantized=quantized, search=search)
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
    search: tuple[frozenset[str], Sequence[int]] = (frozenset(), ()),
) -> tuple[MemoryBound, str]:
    """What this export should peak at, and what its largest module set is.

    The terms: the baseline, the largest modules loaded at once (a layer, or the head /
    tail modules: the embedding, ``lm_head``), one output shard (``max_shard_size``,
    capped at the model's size, or a single larger tensor), the calibration activations
    entering and leaving a layer, and, when a recipe quantizes, the largest weight of a
    layer in float32 (quantizing one linear) and what its calibration algorithms hold
    (``search``: the algorithms and the calibration batches' token counts,
    :func:`search_bytes`)."""
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
        search=search_bytes(state, inside, *search) if quantized else 0,
    )
    return bound, what


def calibration_algorithms(recipes: Sequence[Any]) -> frozenset[str]:
    """The calibration algorithms of recipe records that hold matrices of a layer's inputs."""
    found = {"awq" for r in recipes if r.awq}
    return frozenset(found | {"gptq" for r in recipes if getattr(r, "gptq", False)})


def search_bytes(
    state: Mapping[str, Any], inside: str, algorithms: frozenset[str], tokens: Sequence[int]
) -> int:
    """The most any decoder layer's calibration holds in matrices of its linears' inputs.

    AWQ (:mod:`exportlm.quant._awq_gram`): an ``in x in`` float64 Gram matrix per group of
    linears reading one input, where it is no larger than the group's float32 weights
    twice over; the groups are found while calibrating, so each linear is counted with
    the largest group it could be in (the linears of its parent module with its input
    width): an upper bound. A second matrix of the same size when the batches' token
    counts differ, and one forward's transient (its rows in float64 and their product).
    GPTQ: an ``in x in`` float64 Hessian per linear, and the float32 factorization of one.
    """
    if not algorithms:
        return 0
    widths: dict[str, dict[tuple[str, int], list[int]]] = {}
    for name, t in state.items():
        if name.startswith(inside) and name.endswith(".weight") and t.dim() == 2:
            layer, _, rest = name[len(inside) :].partition(".")
            parent = rest.rsplit(".", 2)[0]
            widths.setdefault(layer, {}).setdefault((parent, int(t.shape[1])), []).append(
                int(t.shape[0])
            )
    most, widest = 0, max((w for c in widths.values() for _, w in c), default=0)
    for classes in widths.values():
        held = 0
        for (_, cols), outs in classes.items():
            if "awq" in algorithms and cols <= sum(outs):
                held += len(outs) * 8 * cols * cols * (2 if len(set(tokens)) > 1 else 1)
            if "gptq" in algorithms:
                held += len(outs) * 8 * cols * cols
        most = max(most, held)
    transient = 8 * widest * (widest + max(tokens, default=0)) if "awq" in algorithms else 0
    factor = 8 * widest * widest if "gptq" in algorithms else 0
    return most + max(transient, factor)
