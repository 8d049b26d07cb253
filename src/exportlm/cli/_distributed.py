"""``exportlm export`` under ``torchrun``: the process group of data-parallel calibration.

``torchrun --nproc-per-node N -m exportlm export ...`` starts ``N`` processes with
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` set. Each joins one
process group (gloo on CPU, NCCL when CUDA is available), calibrates on its share of
the batches, and takes part in the all-reduce of the statistics
(``exportlm.quant._distributed``); rank 0 alone writes the checkpoint while the others
wait at a barrier, then exit 0. The group is destroyed on the way out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from exportlm.cli._errors import UsageError

__all__ = ["DataParallel", "data_parallel_group"]

logger = logging.getLogger("exportlm.cli")


class DataParallel:
    """This process's place in the group: ``rank`` of ``world`` (``world == 1`` alone)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world

    @property
    def writes(self) -> bool:
        """Whether this process writes the artifact (rank 0, or the only process)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (nothing alone)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as err:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from err


@contextmanager
def data_parallel_group() -> Iterator[DataParallel]:
    """The process group torchrun's environment describes, or one process without it.

    A group initialised by the caller is used as it is (and left alone); one started
    here is destroyed on exit.
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield DataParallel(dist.get_rank(), dist.get_world_size())
        return
    world = _env_int("WORLD_SIZE")
    if world is None or world < 2:
        yield DataParallel()
        return
    if not dist.is_available():
        raise UsageError(
            f"WORLD_SIZE={world} asks for {world} processes but this torch has no "
            "torch.distributed; run exportlm export without torchrun"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    logger.info("data-parallel calibration: rank %d of %d (%s)", rank, world, dist.get_backend())
    try:
        yield DataParallel(rank, world)
    finally:
        dist.destroy_process_group()
