"""Reading a checkpoint directory without loading its tensors.

Each ``*.safetensors`` header is parsed here (8-byte little-endian length, then
that many bytes of JSON: ``{name: {"dtype", "shape", "data_offsets"}}``), so a
multi-gigabyte checkpoint is inspected from a few kilobytes per shard. Tensor
values are read (with ``safetensors.safe_open``) only for the rules that need
them: scales, which are tiny.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exportlm.errors import InvalidInputError

__all__ = [
    "HF_QUANT_CONFIG",
    "INDEX",
    "Checkpoint",
    "TensorInfo",
    "read_checkpoint",
    "read_safetensors_header",
    "safetensors_dtype",
]

INDEX = "model.safetensors.index.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000

#: Bytes per element of each safetensors dtype string.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_TORCH_TO_SAFETENSORS = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}
#: The safetensors dtypes of floating-point tensors that a float32 scale may be cast to.
FLOAT_SCALE_DTYPES = frozenset({"F32", "F16", "BF16"})


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors header string of ``dtype`` (``torch.float8_e4m3fn`` -> ``"F8_E4M3"``)."""
    return _TORCH_TO_SAFETENSORS.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it.

    Attributes:
        name: the saved name.
        dtype: the safetensors dtype string (``"F8_E4M3"``, ``"F32"``...).
        shape: the stored shape.
        file: the shard holding it (a file name in the checkpoint directory).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors ``path``'s header declares, without reading their data.

    Raises :class:`~exportlm.errors.InvalidInputError` naming the file when the
    header cannot be parsed, or when a tensor's bytes lie beyond the end of the
    file or do not match its dtype and shape (a truncated download).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidInputError(
                f"{path.name}: {size} bytes, too short for a safetensors header"
            )
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise InvalidInputError(
                f"{path.name}: the header claims {length} bytes but the file has {size}; "
                "the file is not safetensors or is truncated"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InvalidInputError(f"{path.name}: the header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise InvalidInputError(f"{path.name}: the header is not a JSON object")
    data_size = size - 8 - length
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info = _tensor_info(path.name, name, entry, data_size)
        tensors[name] = info
    return tensors


def _tensor_info(file: str, name: str, entry: Any, data_size: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        info = TensorInfo(name, str(dtype), tuple(int(d) for d in shape), file)
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidInputError(
            f"{file}: the header entry of {name!r} is malformed: {entry!r}"
        ) from err
    expected = info.numel * _ITEMSIZE.get(info.dtype, 0)
    if end > data_size or (info.dtype in _ITEMSIZE and end - begin != expected):
        raise InvalidInputError(
            f"{file}: tensor {name!r} ({info.dtype} {list(info.shape)}, {expected} bytes) spans "
            f"bytes {begin}..{end} of a {data_size}-byte data section; the file is truncated "
            "or was written wrongly"
        )
    return info


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, read from headers and JSON files only.

    Attributes:
        directory: the checkpoint directory.
        tensors: every tensor by name (the first shard holding it, in file order).
        locations: every shard holding each tensor (more than one is a defect).
        shards: the ``*.safetensors`` files read, sorted.
        unreadable: ``{file: reason}`` of shards whose header could not be read.
        index: the index's ``weight_map`` (tensor -> shard), ``None`` without an index.
        index_problem: why the index could not be read, or ``None``.
        config: ``config.json`` (``{}`` when absent).
        hf_quant_config: ``hf_quant_config.json`` (``{}`` when absent).
    """

    directory: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    locations: dict[str, list[str]] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)
    index: dict[str, str] | None = None
    index_problem: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    hf_quant_config: dict[str, Any] = field(default_factory=dict)

    def values(self, name: str) -> torch.Tensor:
        """The stored values of tensor ``name`` (read from its shard; use for small tensors)."""
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(self.directory / info.file), framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(name)
        return tensor

    def iter_values(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, values)`` of each of ``names``, one tensor in memory at a time, each shard
        opened once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        for file, in_file in sorted(by_file.items()):
            with safe_open(str(self.directory / file), framework="pt") as f:
                for name in in_file:
                    yield name, f.get_tensor(name)

    @property
    def quantization_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` (``{}`` when absent)."""
        section = self.config.get("quantization_config")
        return section if isinstance(section, dict) else {}


def read_checkpoint(directory: Path) -> Checkpoint:
    """Read ``directory``'s shard headers, index and JSON configs (no tensor data).

    Raises :class:`~exportlm.errors.InvalidInputError` when ``directory`` holds no
    ``*.safetensors`` file and no index (it is not a safetensors checkpoint).
    """
    checkpoint = Checkpoint(directory)
    checkpoint.shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not checkpoint.shards and not (directory / INDEX).is_file():
        raise InvalidInputError(
            f"{directory} holds no *.safetensors file and no {INDEX}; expected a Hugging Face "
            "safetensors checkpoint directory (or pass an .onnx file)"
        )
    for shard in checkpoint.shards:
        try:
            header = read_safetensors_header(directory / shard)
        except (InvalidInputError, OSError) as err:
            checkpoint.unreadable[shard] = str(err)
            continue
        for name, info in header.items():
            checkpoint.tensors.setdefault(name, info)
            checkpoint.locations.setdefault(name, []).append(shard)
    checkpoint.index, checkpoint.index_problem = _read_index(directory / INDEX)
    checkpoint.config = read_json(directory / "config.json")
    checkpoint.hf_quant_config = read_json(directory / HF_QUANT_CONFIG)
    return checkpoint


def _read_index(path: Path) -> tuple[dict[str, str] | None, str | None]:
    if not path.is_file():
        return None, None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{path.name} cannot be read or has no weight_map ({err!r})"
    if not isinstance(weight_map, dict):
        return None, f"{path.name}: weight_map is not a JSON object"
    return {str(k): str(v) for k, v in weight_map.items()}, None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent, unreadable or not an object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
