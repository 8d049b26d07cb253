"""The streaming export's own memory: its resident size, its bound, and handing freed memory back.

:func:`resident_bytes` is the process's RSS now (``/proc/self/statm``) and
:func:`peak_resident_bytes` its high-water mark (``ru_maxrss``). :class:`MemoryBound`
is the figure a streamed export promises to stay within, stated term by term: the
process as it stands before the first weight is read (interpreter, torch,
transformers, the meta model: measured, not assumed), the largest set of modules
loaded at once (a decoder layer, or the embedding / ``lm_head``), one output shard,
the calibration activations, and the working memory of quantizing one linear (its
largest weight in float32: what the AWQ search's weight error holds whole, and more
than a fake-quantized copy in the model's dtype plus the float32 temporaries of one
slice of rows).

:func:`release_freed` asks glibc to return freed heap pages to the system
(``malloc_trim``): torch frees a layer's tensors into malloc's arenas, and pieces
below the mmap threshold (32 MB at most) stay resident until trimmed, so without it
the RSS grows by freed-but-kept layers (measured on a 0.98 GB model, 150 MB output
shards: peak 1.73 GB without, 0.95 GB with a trim after every layer).
:func:`map_large_allocations` goes further: every allocation from 1 MiB up is its own
mapping, returned to the system the moment torch frees it, so the transients of one
linear (its float32 copy while it is quantized) do not pile up in the heap between
trims (0.95 GB -> 0.79 GB on the same FP8 run, at about the same CPU time). Every such
allocation costs fresh pages, though. The AWQ search used to allocate a weight-sized
temporary per candidate (one 0.98 GB-model layer took 24.5 CPU-s instead of 15.8, half
of it in page faults); it now fake-quantizes a slice of rows at a time
(:func:`~exportlm.quant._quantizer.row_chunks`), whose temporaries stay below the
threshold, so every recipe runs with it. Elsewhere than glibc both do nothing. Both live
in :mod:`exportlm.quant._heap`, whose trim the in-memory calibration uses too.
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass

from exportlm.quant._heap import map_large_allocations, release_freed

__all__ = [
    "MemoryBound",
    "map_large_allocations",
    "peak_resident_bytes",
    "release_freed",
    "resident_bytes",
]

logger = logging.getLogger("exportlm.stream")


def resident_bytes() -> int:
    """The process's resident set size now (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * resource.getpagesize()


def peak_resident_bytes() -> int:
    """The process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True)
class MemoryBound:
    """The peak a streamed export should stay within, term by term (bytes)."""

    baseline: int  # the process before the first weight: interpreter, torch, meta model
    modules: int  # the largest set of modules loaded at once (a layer, the embedding)
    shard: int  # one output shard being filled (max_shard_size, or a larger tensor)
    activations: int  # the calibration activations entering and leaving a layer
    #: quantizing one linear: its largest weight in float32 (the AWQ search's weight error,
    #: a fake-quantized copy and its slices' temporaries); 0 without a recipe
    working: int = 0
    #: what the calibration algorithm holds while a layer calibrates: AWQ's Gram matrices
    #: and its clip search's blocks (``_sizing.clip_bytes``),
    #: GPTQ's Hessians (``_sizing.search_bytes``); 0 for the others
    search: int = 0
    #: the largest decoder layer: the modules the calibration matrices are held beside
    #: (``None``: ``modules``). The embedding or ``lm_head`` is loaded only while no layer
    #: calibrates, so the matrices count beside a layer, not beside those.
    layer: int | None = None

    @property
    def beside_modules(self) -> int:
        """What the calibration matrices add to the largest module set: the part of a
        calibrating layer and its matrices above it (0 when the head or tail is larger)."""
        layer = self.modules if self.layer is None else self.layer
        return max(0, layer + self.search - self.modules)

    @property
    def held(self) -> int:
        """What the stream holds beyond the baseline, the activations aside: what a budget
        must cover (the activations take what it leaves, else go to disk)."""
        return self.modules + self.shard + self.working + self.beside_modules

    @property
    def total(self) -> int:
        """The bound: the sum of the terms."""
        return self.held + self.baseline + self.activations

    def describe(self) -> str:
        """The terms and their sum, in MB."""
        return (
            f"{_mb(self.total)} = baseline {_mb(self.baseline)} (interpreter, torch, meta model) "
            f"+ largest module set {_mb(self.modules)} + one output shard {_mb(self.shard)} "
            f"+ activations {_mb(self.activations)} "
            f"+ quantizing one linear {_mb(self.working)} (its weight in float32)"
            f" + calibration matrices {_mb(self.beside_modules)} beyond the largest module "
            f"set ({_mb(self.search)} of AWQ Gram and clip blocks / GPTQ Hessian, held beside a decoder layer "
            f"of {_mb(self.modules if self.layer is None else self.layer)})"
        )

    def report(self) -> int:
        """Log the measured peak against the bound; the peak."""
        peak = peak_resident_bytes()
        logger.info(
            "peak RSS %s against the bound %s (%.2f of it)",
            _mb(peak),
            _mb(self.total),
            peak / max(self.total, 1),
        )
        return peak


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"
