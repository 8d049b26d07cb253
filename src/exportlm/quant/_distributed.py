"""Data-parallel calibration: the max statistics of every rank combined into one.

Under an initialised ``torch.distributed`` process group of more than one rank, each
rank runs the calibration forwards on its share of the data
(:func:`exportlm.calibration.calibrate_with` takes batches ``rank, rank + N, ...``);
:func:`reduce_max_statistics` then gives every activation quantizer (inputs, the
KV-cache outputs) the maximum of its amax over the ranks, so every rank holds the
calibrated model a single process would have computed from all the data. A maximum does
not depend on the order it is taken in: the scales are bit-identical to one process's.

AWQ (a mean of ``|x|`` and a search over losses) and SmoothQuant (per-channel ranges and
norm traces) keep statistics this module does not combine; :func:`refuse_unreduced`
refuses them under a group rather than calibrate each rank on its own share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exportlm.errors import DistributedCalibrationError
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import Algorithm

__all__ = ["data_parallel_world", "reduce_max_statistics", "refuse_unreduced"]

#: What runs under a multi-process group, for the refusal's message.
SUPPORTED = "max-calibrated recipes (fp8, nvfp4, fp8_kv) and weight-only recipes (int8_wo)"


def data_parallel_world() -> tuple[int, int] | None:
    """``(rank, world size)`` of the initialised default process group, ``None`` for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def refuse_unreduced(algorithms: Sequence[Algorithm]) -> None:
    """Refuse AWQ and SmoothQuant recipes under a multi-process group (before any work).

    Raises:
        DistributedCalibrationError: an algorithm whose statistics are not all-reduced.
    """
    world = data_parallel_world()
    if world is None:
        return
    names = sorted(
        {a.spelled or a.quant_algo for a in algorithms if a.awq or a.smoothquant_alpha is not None}
    )
    if names:
        raise DistributedCalibrationError(
            f"{', '.join(names)} cannot calibrate under a torch.distributed process group of "
            f"{world[1]} ranks: its AWQ / SmoothQuant statistics (mean |x|, search losses, "
            "channel ranges) are not combined across ranks, and each rank's own share would "
            f"give a different checkpoint. Supported there: {SUPPORTED}. Run this recipe in "
            "one process (without torchrun)."
        )


def reduce_max_statistics(
    quantizers: Sequence[TensorQuantizer], device: torch.device | None = None
) -> None:
    """Set each quantizer's ``amax`` to its maximum over the ranks of the default group.

    A quantizer a rank never reached (no batch of its share routed a token to an expert)
    contributes nothing; one no rank reached keeps ``None`` (the final calibration check
    names it; one only other ranks reached gets it on ``device``). Every rank must pass the same quantizers in the same order (the modules of
    one model, walked in order). Nothing happens in a single process.

    Raises:
        DistributedCalibrationError: the ranks hold different quantizers, or the collective failed.
    """
    world = data_parallel_world()
    if world is None:
        return
    import torch.distributed as dist

    local = [None if q.amax is None else q.amax.detach().cpu() for q in quantizers]
    gathered: list[list[torch.Tensor | None] | None] = [None] * world[1]
    try:
        dist.all_gather_object(gathered, local)
    except (RuntimeError, ValueError) as err:
        raise DistributedCalibrationError(
            f"rank {world[0]}: gathering the calibration amax of {len(quantizers)} quantizers "
            f"failed: {err}; every rank must run the same export"
        ) from err
    for rank, values in enumerate(gathered):
        if values is None or len(values) != len(quantizers):
            raise DistributedCalibrationError(
                f"rank {rank} calibrated {0 if values is None else len(values)} activation "
                f"quantizers, rank {world[0]} {len(quantizers)}: every rank must quantize the "
                "same model with the same recipe"
            )
    for index, quantizer in enumerate(quantizers):
        present = [t for v in gathered if v is not None and (t := v[index]) is not None]
        if not present:
            continue
        where = quantizer.amax.device if quantizer.amax is not None else device
        # torch.maximum in rank order: exact, as a maximum is whatever order it is taken in.
        combined = present[0]
        for value in present[1:]:
            combined = torch.maximum(combined, value)
        quantizer.amax = combined if where is None else combined.to(where)
