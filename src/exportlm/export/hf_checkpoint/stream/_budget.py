"""How much memory an export may use, and whether a model fits it in one piece.

:func:`memory_limit` is what the process's own cgroups leave (every level from its
cgroup up to the mount's root, v1 and v2: :mod:`~exportlm.export.hf_checkpoint.stream._cgroup`), capped at
``MemAvailable`` from ``/proc/meminfo``. :func:`shard_size_within` picks the output
shard size a streamed export can afford under a budget. :func:`needs_streaming`
compares a model directory with a budget the way the in-memory export uses memory:
about twice the weights (the loaded model and its quantized copy), which is what the
issue's measurements show (2.06 GB RSS for 0.98 GB of bf16 shards).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from exportlm.errors import InvalidOptionError
from exportlm.export.hf_checkpoint.stream._cgroup import cgroup_headroom
from exportlm.export.hf_checkpoint.stream._memory import MemoryBound

__all__ = [
    "IN_MEMORY_FACTOR",
    "memory_limit",
    "model_bytes",
    "needs_streaming",
    "parse_memory",
    "shard_size_within",
    "should_stream",
]

logger = logging.getLogger("exportlm.stream")

#: Peak RSS of the in-memory export per byte of weights on disk (measured: 2.06 / 0.98).
IN_MEMORY_FACTOR = 2.1
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory(text: str | int) -> int:
    """Bytes from ``8GB`` / ``512MiB`` / an int; raises :class:`~exportlm.errors.InvalidOptionError`."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().upper().replace(" ", "")
        digits = raw.rstrip("KMGTIB")
        unit = raw[len(digits) :]
        try:
            value = int(float(digits) * _UNITS[unit])
        except (KeyError, ValueError, OverflowError):  # inf and 1e400 overflow int()
            raise InvalidOptionError(
                f"memory size {text!r}: expected a number and a unit such as 8GB, 512MB or 16GiB"
            ) from None
    if value <= 0:
        raise InvalidOptionError(f"memory size {text!r} must be positive")
    return value


def memory_limit(proc: Path = Path("/proc"), root: Path = Path("/")) -> int | None:
    """The memory this export may still allocate: the smallest headroom (limit less what
    is charged, page cache included) over the process's cgroup and its ancestors, capped
    at ``MemAvailable``; ``MemAvailable`` alone where no cgroup limits memory.

    The same quantity ``--max-memory`` gives: the budget beyond the process itself (the
    cgroup's charge already counts it), as accelerate's ``max_memory`` budgets the
    weights. ``proc`` and ``root`` locate ``/proc`` and the cgroup mounts (for tests).
    """
    found = cgroup_headroom(proc, root)
    available = _mem_available(proc)
    if found is None:
        return available
    logger.info("memory budget: %s", found.describe())
    budget = max(found.headroom, 1)
    return budget if available is None else min(budget, available)


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def needs_streaming(model_bytes: int, budget: int | None) -> bool:
    """Whether an in-memory export of ``model_bytes`` of weights would exceed ``budget``."""
    return budget is not None and model_bytes * IN_MEMORY_FACTOR > budget


def model_bytes(model_dir: str | os.PathLike[str]) -> int:
    """Bytes of the safetensors files of ``model_dir`` (the weights on disk)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def should_stream(model_dir: str | os.PathLike[str], max_memory: int | str | None = None) -> bool:
    """Whether an in-memory export of ``model_dir`` would not fit ``max_memory``
    (default: the cgroup limit, else the available memory)."""
    budget = parse_memory(max_memory) if max_memory is not None else memory_limit()
    return needs_streaming(model_bytes(model_dir), budget)


def shard_size_within(budget: int | None, cap: int, floor: MemoryBound) -> int:
    """The output shard size a streamed export can afford: ``cap`` where it fits, else less.

    ``floor`` is the export's bound with the smallest shard there is (its largest tensor
    alone). What the budget leaves beside the modules loaded at once and quantizing one
    linear goes to one shard and the calibration activations; the activations keep their
    share where the shard still holds the largest tensor beside them, else they go to
    disk (:class:`~exportlm.export.hf_checkpoint.stream._work.ActivationStore`). Below ``cap`` the size is a
    power of two (bytes), so a resumed run under a slightly different budget picks the
    same one. Without a budget, ``cap``. A budget too small even for the floor is not
    this function's to refuse (:func:`~exportlm.export.hf_checkpoint.stream._checks.check_fits` does).
    """
    if budget is None:
        return cap
    room = budget - floor.held + floor.shard  # for one shard and the activations
    beside = room - floor.activations
    usable = beside if beside >= floor.shard else room
    if cap <= usable:
        return cap
    return 1 << (max(usable, 1).bit_length() - 1)
