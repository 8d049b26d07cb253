"""Fewer full garbage collections while a conformance item runs.

An item traces and exports toy models: ``torch.export``, the ONNX decompositions and
their symbolic-shape arithmetic allocate millions of short-lived objects, and at
Python's default thresholds (700, 10, 10) they trigger a full (generation 2)
collection every few exports. In a pytest process whose heap already holds torch,
transformers, the cached toy models and the loaded runtimes, each full collection
scans all of it: in a cold ``pytest -n 2 --export-targets=all`` on a 2-core AMD EPYC
each worker spent about 11 s of its ~95 CPU-s in the collector, 9.4 s of it in 24-28
full collections. With the thresholds below, about 5 s (measured with a
``gc.callbacks`` probe; ``benchmarks/conformance_time.py`` gives the run's totals).

The thresholds are raised only while an item runs and restored after it, so the
user's own tests in the same session keep theirs; a threshold the user set higher is
kept, and a collector the user turned off (``gc.disable()`` or a zero threshold)
stays off. Garbage cycles are still collected, in fewer and larger passes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["ITEM_GC_THRESHOLDS", "fewer_collections"]

#: ``gc.set_threshold`` while an item runs: 10000 allocations before a young
#: collection, 50 young collections before a middle one, 100 middle ones before a full one.
ITEM_GC_THRESHOLDS = (10_000, 50, 100)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the collector's thresholds to :data:`ITEM_GC_THRESHOLDS` for the block."""
    previous = gc.get_threshold()
    if previous[0] == 0:  # automatic collection turned off: leave it so
        yield
        return
    gc.set_threshold(*(max(old, new) for old, new in zip(previous, ITEM_GC_THRESHOLDS)))
    try:
        yield
    finally:
        gc.set_threshold(*previous)
