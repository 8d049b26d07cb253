"""Handing the C heap's freed memory back to the system (glibc; elsewhere a no-op).

Torch allocates CPU tensors with ``malloc``. glibc serves a request below its mmap
threshold from its heap, and the threshold rises with the sizes freed, up to 32 MB: after
the first large tensor is freed, every activation-sized temporary of a calibration
forward (one decoder layer's input in float32 at 8 x 512 tokens: 9 to 25 MB on a
135M-parameter model) comes from the heap. The statistics calibration keeps (an amax, a
per-channel amax or mean: a few KB each, allocated between those temporaries) split the
freed blocks, so a later temporary of the same size no longer fits in one and the heap
grows instead. The memory stays resident though no tensor holds it: SmolLM2-135M's
SmoothQuant calibration (32 x 512 tokens) held 0.29 GB of live tensors and 2.5 GB of
RSS at its end, all of it gained during the first forward, 60 MB per decoder layer.

:func:`release_freed` returns the freed heap pages (``malloc_trim(0)``), and
:func:`released_per_block` does so after each block of a forward: the calibration's
RSS then stays at the model plus one layer's temporaries (measured: 0.90 GB peak for
that calibration). :func:`map_large_allocations` goes further for the streaming export,
which owns its process's memory (``docs/streaming.md``): it fixes the threshold at 1 MiB
for the rest of the process. ``quantize`` does not change that setting for its caller.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from torch import nn

__all__ = ["map_large_allocations", "release_freed", "released_per_block"]


@cache
def _libc(function: str) -> object | None:
    """``function`` of the C library when it has one (glibc's ``malloc_trim``, ``mallopt``)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function, None) if name else None
    except OSError:  # pragma: no cover - no C library to load
        return None


#: glibc's ``mallopt`` parameter for the mmap threshold (``<malloc.h>``).
_M_MMAP_THRESHOLD = -3
_MAPPED_FROM = 1 << 20


def map_large_allocations() -> None:
    """Serve allocations of 1 MiB and more with their own mappings (glibc ``mallopt``).

    This fixes glibc's mmap threshold, which otherwise rises up to 32 MB with the
    sizes freed; it is the process's setting from then on (glibc cannot go back to
    the rising threshold), which only costs the mapping of each large tensor.
    """
    mallopt = _libc("mallopt")
    if callable(mallopt):
        mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM)


def release_freed() -> None:
    """Return the heap pages freed so far to the system (glibc ``malloc_trim(0)``)."""
    trim = _libc("malloc_trim")
    if callable(trim):
        trim(0)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The items of ``model``'s outermost ``nn.ModuleList``s (a decoder's layers; not the
    experts inside a layer), and ``model`` itself (the modules around the layers)."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(
            outer == "" or name.startswith(f"{outer}.") for outer in inside
        ):
            inside.append(name)
            blocks.extend(module)
    return [*blocks, model]


def _release_hook(module: nn.Module, args: object, output: object) -> None:
    release_freed()  # returns None: the module's output is kept as it is


@contextmanager
def released_per_block(model: nn.Module) -> Iterator[None]:
    """Return the freed heap pages after each block of ``model``'s forwards in the block
    (each decoder layer, and each whole forward), and once more at its end."""
    handles = [block.register_forward_hook(_release_hook) for block in _blocks(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        release_freed()
