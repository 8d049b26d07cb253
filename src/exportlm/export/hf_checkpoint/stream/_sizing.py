"""The streamed export's memory bound, its output shard sized to the budget.

:func:`bound_of` states what one streamed export should peak at, term by term
(:class:`~exportlm.export.hf_checkpoint.stream._memory.MemoryBound`); :func:`fit_bound` first picks the
largest output shard that fits the budget beside one layer
(:func:`~exportlm.export.hf_checkpoint.stream._budget.shard_size_within`) and says so when it is smaller
than ``max_shard_size``. :func:`search_bytes` is the term of a calibration algorithm that
holds matrices of the inputs while a layer calibrates (AWQ's Gram matrices, GPTQ's
Hessians), :func:`clip_bytes` that of AWQ's clip search (blocks of ``X^T X`` per input
and per expert), both keyed on the recipe records' algorithms (:func:`calibration_algorithms`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from exportlm.export.hf_checkpoint.sink import parse_size
from exportlm.export.hf_checkpoint.stream._budget import shard_size_within
from exportlm.export.hf_checkpoint.stream._memory import MemoryBound
from exportlm.export.hf_checkpoint.stream._shared_inputs import Groups, shared_inputs
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource

__all__ = ["bound_of", "calibration_algorithms", "clip_bytes", "fit_bound", "search_bytes"]

logger = logging.getLogger("exportlm.stream")  # the documented logger of the streaming export
_GPTQ_BLOCK = 128  # GPTQ's columns per block of updates (exportlm.quant._gptq.GPTQ_BLOCK)
#: AWQ's loss of a candidate from a Gram matrix: a slice of rows (``quant._tensor``'s
#: ``CHUNK_ELEMENTS``, 2^17) in float64, its product with the matrix and their product
_LOSS_SLICE = 3 * 8 * (1 << 17)
_CLIP = "awq_clip:"  # an algorithm of calibration_algorithms: the clip search, its group size


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
    inside = source.layout.layers + "."
    groups = shared_inputs(source.model, inside) if quantized and search[0] else None
    kw: dict[str, Any] = {"quantized": quantized, "search": search, "groups": groups}
    floor, _ = bound_of(source, shells, 1, *terms, **kw)
    chosen = shard_size_within(budget, parse_size(max_shard_size), floor)
    if chosen != parse_size(max_shard_size):
        logger.info(
            "max_shard_size %s does not fit the budget beside one layer: shards of at most "
            "%.1f MB instead",
            max_shard_size,
            chosen / 1e6,
        )
        max_shard_size = chosen
    bound, largest = bound_of(source, shells, chosen, *terms, **kw)
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
    groups: Groups | None = None,
) -> tuple[MemoryBound, str]:
    """What this export should peak at, and what its largest module set is.

    The terms: the baseline, the largest modules loaded at once (a layer, or the head /
    tail modules: the embedding, ``lm_head``), one output shard (``max_shard_size``,
    capped at the model's size, or a single larger tensor), the calibration activations
    entering and leaving a layer, and, when a recipe quantizes, the largest weight of a
    layer in float32 (quantizing one linear) and what its calibration algorithms hold
    (``search``: the algorithms and the calibration batches' token counts, ``groups``: the
    linears that read one input, :func:`search_bytes`), held beside a decoder layer: it
    adds to the largest module set only what a layer and it exceed that set by."""
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
        search=search_bytes(state, inside, *search, groups)
        + clip_bytes(source.model, inside, search[0], groups)
        if quantized
        else 0,
        layer=max(layers, default=0),
    )
    return bound, what


def calibration_algorithms(recipes: Sequence[Any]) -> frozenset[str]:
    """The calibration algorithms of recipe records that hold matrices of a layer's inputs:
    ``awq``, ``gptq``, and ``awq_clip:<group size>`` where AWQ's clip search runs
    (:func:`clip_bytes`)."""
    found = {"awq" for r in recipes if r.awq}
    # AWQ's clip search holds its blocks of X^T X per group size
    found |= {
        f"{_CLIP}{r.weight_block}" for r in recipes if r.awq and r.awq_clip and r.weight_block
    }
    return frozenset(found | {"gptq" for r in recipes if getattr(r, "gptq", False)})


def clip_bytes(
    model: Any, inside: str, algorithms: frozenset[str], groups: Groups | None = None
) -> int:
    """The most any decoder layer's AWQ clip search holds: the diagonal ``block x block``
    blocks of ``X^T X`` (float64) of each input its linears read (``in x block``; one per
    linear where ``groups`` does not say which read one tensor), and of each expert's routed
    tokens for stacked experts (``E x in x block`` per projection), all held until the clip
    runs."""
    blocks = [int(a[len(_CLIP) :]) for a in algorithms if a.startswith(_CLIP)]
    if not blocks:
        return 0
    from exportlm.quant._experts import experts_base  # the quantization stack, when asked

    widths: dict[str, dict[str, int]] = {}  # layer -> {linear: in} or {experts: E * in}
    for name, module in model.named_modules():
        if not name.startswith(inside):
            continue
        layer, _, rest = name[len(inside) :].partition(".")
        base = experts_base(module)
        if base is not None and base.stores_fused_parameters:
            experts = int(module.get_parameter("gate_up_proj").shape[0])
            held = sum(experts * inp for _, _, inp in base.weight_dims(module))
            widths.setdefault(layer, {})[rest] = held
        elif isinstance(module, nn.Linear):
            widths.setdefault(layer, {})[rest] = int(module.in_features)
    most = 0
    for layer, own in widths.items():
        traced = _groups_of(own, (groups or {}).get(layer))
        inputs = [[n] for n in own] if traced is None else traced
        most = max(most, sum(max(own[n] for n in group) for group in inputs))
    return 8 * max(blocks) * most


def search_bytes(
    state: Mapping[str, Any],
    inside: str,
    algorithms: frozenset[str],
    tokens: Sequence[int],
    groups: Groups | None = None,
) -> int:
    """The most any decoder layer's calibration holds in matrices of its linears' inputs.

    One matrix per *input*, as the calibration keeps them: ``groups`` says which linears
    of a layer read one tensor (:func:`~exportlm.export.hf_checkpoint.stream._shared_inputs.
    shared_inputs`); a layer it does not cover is counted from its weights' shapes, as the
    most matrices its linears could need (below). Every matrix is ``in x in`` float64.

    AWQ (:mod:`exportlm.quant._awq_gram`): a Gram matrix per group of linears of one parent
    that read one input, where ``in <= sum(out)`` of the group; a second one (``H``) beside
    each when the batches' token counts differ. Untraced, a parent's linears of one input
    width hold at most one per linear with ``out >= in`` and one per ``in`` of the others'
    ``out`` together. The transient beside them: one forward's rows in float64 and their
    product (and the product over its token count), or, while the losses are taken, one
    ``G / tokens``; and a slice of rows' float64 temporaries of a candidate's loss.

    GPTQ (:mod:`exportlm.quant._gptq_hessian`): a Hessian per input (untraced: per linear)
    and beside them the most of :func:`_gptq_transient`.

    AWQ's and GPTQ's matrices are added when a recipe uses both; their transients are not
    (one calibration step runs at a time).
    """
    if not algorithms:
        return 0
    layers: dict[str, dict[str, tuple[int, int]]] = {}
    for name, t in state.items():
        if name.startswith(inside) and name.endswith(".weight") and t.dim() == 2:
            layer, _, rest = name[len(inside) :].removesuffix(".weight").partition(".")
            layers.setdefault(layer, {})[rest] = (int(t.shape[0]), int(t.shape[1]))
    copies = 2 if len(set(tokens)) > 1 else 1  # G and H
    rows = max(tokens, default=0)
    most = 0
    for layer, shapes in layers.items():
        traced = _groups_of(shapes, (groups or {}).get(layer))
        awq = _awq_widths(shapes, traced) if "awq" in algorithms else []
        gptq = _gptq_widths(shapes, traced) if "gptq" in algorithms else []
        held = copies * sum(8 * w * w for w in awq) + sum(8 * w * w for w in gptq)
        transient = [8 * w * (rows + copies * w) + _LOSS_SLICE for w in awq]
        if gptq:
            transient.append(_gptq_transient(shapes.values(), max(gptq), rows))
        most = max(most, held + max(transient, default=0))
    return most


def _gptq_transient(shapes: Iterable[tuple[int, int]], widest: int, rows: int) -> int:
    """What GPTQ holds beyond its Hessians (float64 sums) and one weight in float32 (the
    bound's ``working``), at its most: one forward's rows and product; or one input's
    Hessian in float32 (its sum freed) with three float32 ``[in, in]`` matrices of its
    factorization; or a second float32 weight (an update's product, the column order
    restored); and a block of columns' errors and LAPACK's panels beside each."""
    largest = max((out * cols for out, cols in shapes), default=0)
    outs = max((out for out, _ in shapes), default=0)
    return max(8 * widest * (rows + widest), 4 * largest) + 8 * (widest + outs) * _GPTQ_BLOCK


def _groups_of(
    shapes: Mapping[str, object], traced: list[list[str]] | None
) -> list[list[str]] | None:
    """The traced groups of a layer's weights, each weight the trace missed alone."""
    if traced is None:
        return None
    found = [[n for n in group if n in shapes] for group in traced]
    seen = {n for group in found for n in group}
    return [g for g in found if g] + [[n] for n in shapes if n not in seen]


def _awq_widths(shapes: Mapping[str, tuple[int, int]], traced: list[list[str]] | None) -> list[int]:
    """The input widths of the Gram matrices AWQ may hold for one layer."""
    classes: dict[tuple[str, int], list[int]] = {}
    if traced is not None:  # a group of one parent reading one input: one Gram where it fits
        widths = []
        for group in traced:
            for members in _by_parent(group).values():
                cols = max(shapes[n][1] for n in members)
                if cols <= sum(shapes[n][0] for n in members):
                    widths.append(cols)
        return widths
    for name, (out, cols) in shapes.items():
        classes.setdefault((name.rpartition(".")[0], cols), []).append(out)
    widths = []
    for (
        _,
        cols,
    ), outs in classes.items():  # each group either holds an out >= in or sums small outs
        small = sum(o for o in outs if o < cols)
        widths += [cols] * (sum(1 for o in outs if o >= cols) + small // cols)
    return widths


def _gptq_widths(
    shapes: Mapping[str, tuple[int, int]], traced: list[list[str]] | None
) -> list[int]:
    """The input widths of the Hessians GPTQ may hold for one layer."""
    if traced is None:
        return [cols for _, cols in shapes.values()]
    return [max(shapes[n][1] for n in group) for group in traced]


def _by_parent(group: list[str]) -> dict[str, list[str]]:
    parents: dict[str, list[str]] = {}
    for name in group:
        parents.setdefault(name.rpartition(".")[0], []).append(name)
    return parents
