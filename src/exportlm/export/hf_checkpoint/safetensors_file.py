"""One safetensors file written from tensors in memory, hashed as it is written.

:func:`write_safetensors` writes each tensor's storage straight to the file through a
``memoryview`` (no copy) and hands the same pieces, in order, to a second thread that
hashes them while the next piece is written (``file.write`` and ``blake3`` release the
GIL), so the file's digest (:class:`FileDigest`: BLAKE3, multithreaded for a file from
:data:`~exportlm.export._digest.THREADED_FROM` up) costs no read of the file. The layout is
what ``safetensors.safe_open`` reads: an 8-byte little-endian header length, a JSON
header (``__metadata__`` + ``{name: {dtype, shape, data_offsets}}``) padded with spaces
to a multiple of 8 bytes, then the tensor bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import struct
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from exportlm.errors import ExportFailedError
from exportlm.export._digest import DIGEST, new_hasher

__all__ = [
    "SAFETENSORS_DTYPES",
    "RESERVE_STEP",
    "FileDigest",
    "SpaceAhead",
    "read_safetensors",
    "reserve",
    "write_safetensors",
]

#: torch dtype -> safetensors dtype tag.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class FileDigest:
    """The digest (hex BLAKE3) and size of the bytes written to one file, as the manifest
    lists them."""

    digest: str
    size: int

    def entry(self) -> dict[str, str | int]:
        """``{"blake3", "size"}``: the manifest's entry for the file."""
        return {DIGEST: self.digest, "size": self.size}


#: Bytes per piece handed to the hashing thread while the next piece is written.
_PIECE = 8 << 20


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> FileDigest:
    """Write ``tensors`` to ``path`` in the safetensors format without copying their data.

    Tensors are laid out by element size (largest first), then by name, so every
    tensor starts at an offset aligned to its element size. Returns the digest and
    size of the bytes written, hashed from memory while they are written (a second
    thread hashes each piece as the next one is written), never read back.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    digest = new_hasher(size=len(prefix) + offset)
    # not truncated on open: space the shard writer reserved ahead (``reserve``) is kept
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb") as f:
        with ThreadPoolExecutor(1) as hasher:
            hashed: list[Future[object]] = []
            for piece in _pieces(prefix, (tensors[name] for name in order)):
                hashed.append(hasher.submit(digest.update, piece))  # in order: one worker
                f.write(piece)
            for done in hashed:
                done.result()
        f.truncate()  # whatever the file held beyond the bytes just written
    return FileDigest(digest.hexdigest(), len(prefix) + offset)


#: :class:`SpaceAhead` allocates an open shard's file this many bytes at a time.
RESERVE_STEP = 32 << 20


class SpaceAhead:
    """A file allocated (:func:`reserve`) on a writer thread while its tensors are collected,
    then written (:meth:`then`) into the space allocated: the shard writer's open shard.

    Only whole steps of the bytes collected so far are allocated, or of ``at_least`` (the
    bytes the caller expects the file to hold; allocated from the first tensor on, so the
    space of a tensor that comes last, such as an ``lm_head``, is not left to the end). The
    write truncates the file at its last byte, so a file ends exactly where its write does,
    also below an ``at_least`` that overshot.
    """

    def __init__(self, at_least: int = 0) -> None:
        self._done: list[Future[None]] = []
        self._bytes = 0
        self._at_least = at_least

    def grow(self, pool: ThreadPoolExecutor, path: Path, collected: int) -> None:
        """``collected`` bytes are waiting for ``path``: allocate the whole steps not yet queued."""
        end = max(collected, self._at_least) // RESERVE_STEP * RESERVE_STEP
        if end > self._bytes:
            self._done.append(pool.submit(reserve, path, self._bytes, end - self._bytes))
            self._bytes = end

    def then(self, write: Callable[..., FileDigest], *args: Any) -> FileDigest:
        """``write(*args)`` (:func:`write_safetensors`) once the allocations queued before it
        are done: none allocates in the file while it is being written."""
        wait(self._done)
        return write(*args)


def reserve(path: Path, start: int, length: int) -> None:
    """Allocate bytes ``[start, start + length)`` of ``path`` (created if missing) ahead of
    :func:`write_safetensors`, which then writes into space already allocated.

    On tmpfs, allocating (and zeroing) a page costs about as much as copying into it, so a
    shard writer that reserves its open shard while the exporter converts takes that part of
    the write off the conversion-then-write chain. Best effort: Linux's ``fallocate(2)``
    only (never glibc's emulation, which writes a byte per block); a filesystem that cannot
    allocate ahead, or a full one, is left to the write itself, which reports the error.
    The caller keeps ``start + length`` within what the write will cover, or relies on the
    write's final truncate to give back the space beyond it.
    """
    fallocate = _fallocate()
    if fallocate is None or length <= 0:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError:
        return
    try:
        fallocate(fd, 0, start, length)  # -1 (unsupported, full): the write will tell
    finally:
        os.close(fd)


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``fallocate(2)`` from the C library, or ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", function)


def _pieces(prefix: bytes, tensors: Iterable[torch.Tensor]) -> Iterable[memoryview]:
    """The file's bytes as memoryviews of at most :data:`_PIECE` bytes (no copy of tensor data)."""
    yield memoryview(prefix)
    for tensor in tensors:
        t = tensor.contiguous()
        if not t.numel():
            continue
        view = t.reshape(-1).view(torch.uint8).numpy().data
        for start in range(0, len(view), _PIECE):
            yield view[start : start + _PIECE]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file :func:`write_safetensors` wrote (a streamed export's spill
    file), read with ``readinto`` into fresh tensors.

    Not ``safe_open``: its mapping counts in the RSS until it is closed, on top of the
    copies it hands out.
    """
    from exportlm.inspection import read_safetensors_header

    dtypes = {tag: dtype for dtype, tag in SAFETENSORS_DTYPES.items()}
    infos = read_safetensors_header(path)
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        for name, info in infos.items():
            begin, end = info.offsets
            tensor = torch.empty(tuple(info.shape), dtype=dtypes[info.dtype])
            view = tensor.reshape(-1).view(torch.uint8).numpy().data
            f.seek(8 + length + begin)
            if (f.readinto(view) if len(view) else 0) != end - begin:
                raise ExportFailedError(
                    f"{path}: spilled tensor {name!r} is truncated; the work area was changed "
                    "outside this export. Delete it to start afresh"
                )
            tensors[name] = tensor
    return tensors
