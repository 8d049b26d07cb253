"""Data-parallel calibration: every rank's statistics combined into one process's.

Under an initialised ``torch.distributed`` process group of more than one rank, each
rank runs the calibration forwards on its share of the data
(:func:`exportlm.calibration.calibrate_with` takes batches ``rank, rank + N, ...``).
Afterwards every statistic a calibration keeps is combined over the ranks, in rank
order, so that every rank holds the calibrated model one process computes from all
the data:

* :func:`reduce_max_statistics`: each activation quantizer's amax, the maximum;
* :func:`reduce_channel_statistics` (AWQ, SmoothQuant): the per-channel sums of
  ``mean(|x|)`` and their forward counts (summed), the per-channel amax (maximum);
* :func:`reduce_groups`: which linears read one input (the union: a rank that ran no
  forward saw none);
* :func:`reduce_searches` (AWQ's second pass): each search's Gram matrices (and the
  clip search's diagonal blocks of them) and losses (summed) and its counts;
* SmoothQuant's per-channel input ranges: :func:`reduce_ranges` (minimum, maximum).

A maximum is exact in any order. The sums are float64 sums of float32 values (the
per-forward means and losses), exact while a channel's values lie within 2**29 of each
other, so they too equal one process's bit for bit. The Gram matrices are float64 sums of
float64 products; their order moves them by ~1e-16 relative, and the search's losses by
as much: a decision decided by more than that (every decision beyond the search's
``PORTABLE_MARGIN`` of 1e-4) is the same, and the checkpoint's bytes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exportlm.errors import DistributedCalibrationError
from exportlm.quant._awq_clip import BlockGram
from exportlm.quant._awq_search import ScaleSearch
from exportlm.quant._quantizer import TensorQuantizer

__all__ = [
    "data_parallel_world",
    "reduce_channel_statistics",
    "reduce_clip_blocks",
    "reduce_groups",
    "reduce_max_statistics",
    "reduce_ranges",
    "reduce_searches",
]


def data_parallel_world() -> tuple[int, int] | None:
    """``(rank, world size)`` of the initialised default process group, ``None`` for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def _gather(world: tuple[int, int], local: list[Any], what: str) -> list[list[Any]]:
    """Every rank's ``local`` list, in rank order; each must be as long as this rank's."""
    import torch.distributed as dist

    gathered: list[list[Any] | None] = [None] * world[1]
    try:
        dist.all_gather_object(gathered, local)
    except (RuntimeError, ValueError) as err:
        raise DistributedCalibrationError(
            f"rank {world[0]}: gathering the {what} of {len(local)} modules failed: {err}; "
            "every rank must run the same export"
        ) from err
    for rank, values in enumerate(gathered):
        if values is None or len(values) != len(local):
            raise DistributedCalibrationError(
                f"rank {rank} calibrated {0 if values is None else len(values)} modules' "
                f"{what}, rank {world[0]} {len(local)}: every rank must quantize the same "
                "model with the same recipe"
            )
    return [v for v in gathered if v is not None]


def _cpu(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.detach().cpu()


def _combine(
    values: list[torch.Tensor | None], op: str, where: torch.device | None
) -> torch.Tensor | None:
    """The ranks' values (``None``: a rank that has none) combined in rank order."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    combined = present[0]
    for value in present[1:]:
        combined = (
            torch.maximum(combined, value)
            if op == "max"
            else torch.minimum(combined, value)
            if op == "min"
            else combined + value
        )
    return combined if where is None else combined.to(where)


def _device(value: torch.Tensor | None, default: torch.device | None) -> torch.device | None:
    return value.device if value is not None else default


def reduce_max_statistics(
    quantizers: Sequence[TensorQuantizer], device: torch.device | None = None
) -> None:
    """Set each quantizer's ``amax`` to its maximum over the ranks of the default group.

    A quantizer a rank never reached (no batch of its share routed a token to an expert)
    contributes nothing; one no rank reached keeps ``None`` (the final calibration check
    names it; one only other ranks reached gets it on ``device``). Every rank must pass
    the same quantizers in the same order (the modules of one model, walked in order).
    Nothing happens in a single process.

    Raises:
        DistributedCalibrationError: the ranks hold different quantizers, or the collective failed.
    """
    world = data_parallel_world()
    if world is None:
        return
    gathered = _gather(world, [_cpu(q.amax) for q in quantizers], "calibration amax")
    for index, quantizer in enumerate(quantizers):
        where = _device(quantizer.amax, device)
        combined = _combine([g[index] for g in gathered], "max", where)
        if combined is not None:
            quantizer.amax = combined


def reduce_channel_statistics(
    quantizers: Sequence[TensorQuantizer], device: torch.device | None = None
) -> None:
    """AWQ's ``mean(|x|)`` sums and forward counts (summed) and the per-channel amax
    (maximum) of every quantizer that tracks channels, over the ranks."""
    world = data_parallel_world()
    if world is None:
        return
    tracked = [q for q in quantizers if q.track_channels]
    local = [[_cpu(q.channel_sum), _cpu(q.channel_steps), _cpu(q.channel_amax)] for q in tracked]
    gathered = _gather(world, local, "per-channel statistics")
    for index, quantizer in enumerate(tracked):
        parts = [g[index] for g in gathered]
        where = _device(quantizer.channel_amax, device)
        quantizer.channel_sum = _combine([p[0] for p in parts], "sum", where)
        quantizer.channel_steps = _combine([p[1] for p in parts], "sum", where)
        quantizer.channel_amax = _combine([p[2] for p in parts], "max", where)


def reduce_groups(linears: Sequence[Any], groups: list[list[Any]]) -> list[list[Any]]:
    """The union over the ranks of the groups of linears that read one input.

    ``linears``: every quantized linear of the model in module order (the same on every
    rank). A group keeps the order its members were called in.
    """
    world = data_parallel_world()
    if world is None:
        return groups
    index = {id(m): i for i, m in enumerate(linears)}
    local = [[index[id(m)] for m in group] for group in groups]
    seen: dict[tuple[int, ...], list[int]] = {}
    for rank_groups in _gather(world, [local], "groups of shared inputs"):
        for group in rank_groups[0]:
            seen.setdefault(tuple(sorted(group)), group)
    return [[linears[i] for i in group] for group in seen.values()]


def reduce_ranges(ranges: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor] | None]:
    """SmoothQuant's per-channel ``[min, max]`` of each linear's input, over the ranks."""
    world = data_parallel_world()
    if world is None:
        return ranges
    local = [None if r is None else [_cpu(r[0]), _cpu(r[1])] for r in ranges]
    out: list[list[torch.Tensor] | None] = []
    for index, parts in enumerate(zip(*_gather(world, local, "input ranges"), strict=True)):
        mine = ranges[index]
        where = _device(None if mine is None else mine[0], None)
        low = _combine([None if p is None else p[0] for p in parts], "min", where)
        high = _combine([None if p is None else p[1] for p in parts], "max", where)
        out.append(None if low is None or high is None else [low, high])
    return out


def reduce_searches(searches: Sequence[ScaleSearch]) -> None:
    """Every AWQ search's losses, counts and Gram matrices summed over the ranks."""
    world = data_parallel_world()
    if world is None:
        return
    local = [_search_state(s) for s in searches]
    gathered = _gather(world, local, "AWQ search losses")
    for index, search in enumerate(searches):
        states = [g[index] for g in gathered]
        search.count = sum(int(s["count"]) for s in states)
        sse = _combine([s["sse"] for s in states], "sum", search.sse.device)
        search.sse = search.sse if sse is None else sse
        if search.own_loss is not None:
            search.own_loss = _combine([s["own"] for s in states], "sum", search.own_loss.device)
        if search.gram is not None:
            _reduce_gram(search, states)
        if search.clip is not None and search.gram is None:  # else taken from the summed G
            reduce_clip_blocks(search.clip, int(search.act.shape[-1]))


def reduce_clip_blocks(clip: BlockGram, cols: int) -> None:
    """A clip search's diagonal Gram blocks (of a ``cols``-wide input) summed over the ranks
    in rank order (zeros where a rank ran no forward); a no-op for one process."""
    if data_parallel_world() is None:
        return
    clip.blocks = _summed_float64(clip.blocks, (cols // clip.block, clip.block, clip.block))


def _summed_float64(mine: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """A float64 statistic summed over the ranks in rank order; a rank that has none
    (it ran no forward) gives zeros of ``shape``."""
    import torch.distributed as dist

    local = torch.zeros(shape, dtype=torch.float64) if mine is None else mine.cpu()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    summed = _combine(list(parts), "sum", None)
    assert summed is not None  # pragma: no cover - every part is a tensor
    return summed


def _search_state(search: ScaleSearch) -> dict[str, Any]:
    gram = search.gram
    state: dict[str, Any] = {"count": search.count, "sse": _cpu(search.sse)}
    state["own"] = _cpu(search.own_loss)
    if gram is not None:
        uniform = gram.mean_gram is None
        state["tokens"] = gram.tokens if uniform else -1
        state["forwards"] = gram.forwards
    return state


def _reduce_gram(search: ScaleSearch, states: list[dict[str, Any]]) -> None:
    """``G`` (and ``H`` where the forwards' token counts differ) summed in rank order."""
    gram = search.gram
    assert gram is not None  # pragma: no cover - checked by the caller
    if not any(s["forwards"] for s in states):
        return
    size = int(search.act.shape[-1])
    counts = {s["tokens"] for s in states if s["forwards"]}
    uniform = len(counts) == 1 and -1 not in counts
    mine = [gram.gram] + ([] if uniform else [gram.per_forward_mean()])
    combined = [_summed_float64(matrix, (size, size)) for matrix in mine]
    gram.gram = combined[0]
    gram.mean_gram = None if uniform else combined[1]
    gram.tokens = next(iter(counts)) if uniform else None
    gram.forwards = sum(int(s["forwards"]) for s in states)
