"""The safetensors header of one shard, validated the way the safetensors loader validates it.

A shard is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``) and
the data section. :func:`parse_safetensors_header` reads the first ``8 + N``
bytes only (through :func:`exportlm.safeio.open_regular`, so a FIFO or a device
is refused before a byte is read) and returns every problem it finds, each with
the rule of ``docs/checkpoint-rules.md`` it breaks:

* ``shard-unreadable``: too short, a length beyond the file, a header that is not
  a JSON object, a ``__metadata__`` that is not ``{str: str}``, a tensor whose
  bytes lie beyond the end of the file (truncated);
* ``shard-dtype-unknown``: a dtype that is no safetensors dtype (``"F99"``);
* ``shard-tensor-malformed``: an entry that is not ``{dtype, shape, data_offsets}``
  with a shape of non-negative ints and two ordered offsets spanning exactly
  ``dtype x shape`` bytes;
* ``shard-byte-ranges``: tensors sharing bytes, gaps between them, or bytes after
  the last one (the safetensors loader refuses all three).

:func:`read_safetensors_header` raises the first problem as a
:class:`~exportlm.errors.MalformedCheckpointError` naming the file and the tensor:
the ``hf_checkpoint`` loader calls it on every shard before safetensors opens one.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exportlm.errors import MalformedCheckpointError
from exportlm.safeio import open_regular

__all__ = [
    "ITEM_BITS",
    "HeaderProblem",
    "ShardHeader",
    "TensorInfo",
    "parse_safetensors_header",
    "read_safetensors_header",
]

#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER = 100_000_000
#: Bits per element of every safetensors dtype (safetensors 0.8 ``Dtype``).
ITEM_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it.

    Attributes:
        name: the saved name.
        dtype: the safetensors dtype string (``"F8_E4M3"``, ``"F32"``...).
        shape: the stored shape.
        file: the shard holding it (a file name in the checkpoint directory).
        offsets: ``(begin, end)`` of its bytes in the shard's data section.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offsets: tuple[int, int] = (0, 0)

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class HeaderProblem:
    """One thing wrong with a shard's header: the rule, the tensor (or ``None``), why."""

    rule: str
    field: str | None
    message: str


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header declares: the well-formed tensors and every problem found."""

    tensors: dict[str, TensorInfo]
    problems: tuple[HeaderProblem, ...]


def _fatal(rule: str, message: str) -> ShardHeader:
    return ShardHeader({}, (HeaderProblem(rule, None, message),))


def _load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"is not UTF-8 ({err.reason} at byte {err.start})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"is not JSON ({err.msg} at byte {err.pos})") from err
    except RecursionError as err:
        raise ValueError("is nested too deeply to parse") from err


def parse_safetensors_header(path: Path) -> ShardHeader:
    """The tensors and problems of shard ``path`` (see the module docstring).

    Only defects of the file are problems; :class:`~exportlm.errors.NotRegularFileError`
    (a FIFO, a device, a directory) and ``OSError`` propagate.
    """
    name = path.name
    with open_regular(path, what="safetensors shard") as handle:
        size = _size(handle)
        head = handle.read(8)
        if len(head) < 8:
            return _fatal("shard-unreadable", f"{name}: {size} bytes, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            return _fatal(
                "shard-unreadable",
                f"{name}: the header claims {length} bytes but the file has {size} (at most "
                f"{MAX_HEADER}); the file is not safetensors or is truncated",
            )
        raw = handle.read(length)
    try:
        header = _load_json(raw)
    except ValueError as err:
        return _fatal("shard-unreadable", f"{name}: the {length}-byte header {err}")
    if not isinstance(header, dict):
        return _fatal(
            "shard-unreadable",
            f"{name}: the header is a JSON {type(header).__name__}, expected an object "
            "{tensor name: {dtype, shape, data_offsets}}",
        )
    return _tensors(name, header, size - 8 - length)


def _size(handle: Any) -> int:
    handle.seek(0, 2)
    size: int = handle.tell()
    handle.seek(0)
    return size


def _tensors(file: str, header: dict[str, Any], data_size: int) -> ShardHeader:
    problems: list[HeaderProblem] = []
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        problems.append(
            HeaderProblem(
                "shard-unreadable",
                "__metadata__",
                f"{file}: __metadata__ is {_show(metadata)}, expected an object of strings "
                "(safetensors refuses to open the file)",
            )
        )
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, problem = _tensor(file, name, entry, data_size)
        if problem is not None:
            problems.append(problem)
        if info is not None:
            tensors[name] = info
    problems += _ranges(file, tensors.values(), data_size)
    return ShardHeader(tensors, tuple(problems))


def _show(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(
    file: str, name: str, entry: Any, data_size: int
) -> tuple[TensorInfo | None, HeaderProblem | None]:
    def malformed(what: str) -> tuple[None, HeaderProblem]:
        message = f"{file}: tensor {name!r}: {what}; the file was written wrongly or is corrupted"
        return None, HeaderProblem("shard-tensor-malformed", name, message)

    if not isinstance(entry, dict) or any(key not in entry for key in _ENTRY_KEYS):
        return malformed(
            f"the header entry is {_show(entry)}, expected {{{', '.join(_ENTRY_KEYS)}}}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEM_BITS:
        message = (
            f"{file}: tensor {name!r} has dtype {_show(dtype)}, which is no safetensors dtype "
            f"(one of {', '.join(sorted(ITEM_BITS))}); no loader can read it"
        )
        return None, HeaderProblem("shard-dtype-unknown", name, message)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return malformed(f"shape is {_show(shape)}, expected a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        return malformed(f"data_offsets is {_show(offsets)}, expected [begin, end] (ints >= 0)")
    begin, end = offsets
    bits = math.prod(shape) * ITEM_BITS[dtype]
    if begin > end or bits % 8 or end - begin != bits // 8:
        return malformed(
            f"data_offsets {offsets} span {end - begin} bytes, but {dtype} {shape} takes "
            f"{bits / 8:g}"
        )
    info = TensorInfo(name, dtype, tuple(shape), file, (begin, end))
    if end > data_size:
        message = (
            f"{file}: tensor {name!r} ({dtype} {shape}) spans bytes {begin}..{end} of a "
            f"{data_size}-byte data section; the file is truncated. Download or export it again"
        )
        return info, HeaderProblem("shard-unreadable", name, message)
    return info, None


def _ranges(file: str, tensors: Iterable[TensorInfo], data_size: int) -> list[HeaderProblem]:
    """Overlaps, gaps and trailing bytes: the tensors must tile the data section exactly."""
    problems: list[HeaderProblem] = []
    previous: TensorInfo | None = None
    covered = 0
    for info in sorted(tensors, key=lambda t: (t.offsets, t.name)):
        begin, end = info.offsets
        if begin < covered and previous is not None:
            problems.append(
                HeaderProblem(
                    "shard-byte-ranges",
                    info.name,
                    f"{file}: tensors {previous.name!r} (bytes {previous.offsets[0]}.."
                    f"{previous.offsets[1]}) and {info.name!r} (bytes {begin}..{end}) share "
                    "bytes; safetensors refuses overlapping tensors. Re-export the checkpoint",
                )
            )
        elif begin > covered:
            problems.append(
                HeaderProblem(
                    "shard-byte-ranges",
                    info.name,
                    f"{file}: bytes {covered}..{begin} before tensor {info.name!r} belong to no "
                    "tensor; safetensors refuses a data section with gaps. Re-export it",
                )
            )
        covered = max(covered, end)
        previous = info
    if covered < data_size:
        problems.append(
            HeaderProblem(
                "shard-byte-ranges",
                None,
                f"{file}: bytes {covered}..{data_size} after the last tensor belong to no "
                "tensor; safetensors refuses the file. Re-export it",
            )
        )
    return problems


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors ``path``'s header declares, without reading their data.

    Raises :class:`~exportlm.errors.MalformedCheckpointError` naming the file (and
    the tensor, as ``field``) for the first problem :func:`parse_safetensors_header`
    finds, :class:`~exportlm.errors.NotRegularFileError` for a FIFO / device /
    directory, and ``OSError`` when the file cannot be read.
    """
    header = parse_safetensors_header(path)
    if header.problems:
        first = header.problems[0]
        more = len(header.problems) - 1
        suffix = f" ({more} more problem(s) in this file)" if more else ""
        raise MalformedCheckpointError(f"{first.message}{suffix}", path=path, field=first.field)
    return header.tensors
