"""Where the export driver's tensors go: renamed, laid out for the format, streamed to shards.

:class:`CheckpointSink` is the sink :func:`exportlm.module_exporters.export_quantized_state`
writes to: it maps every tensor to its checkpoint name (:class:`CheckpointNamer`),
applies the layout's rules (:class:`~exportlm.quant.formats.CheckpointLayout`), and hands it to the streaming
shard writer, so no full state dict is ever built.

:class:`ShardedSafetensorsWriter`: tensors in, shards out as they fill.

``safetensors.torch.save_file`` needs the whole shard as a dict and copies every
tensor into a ``bytes`` object before writing (two copies of a shard in memory).
This writer keeps references to at most one shard's tensors, writes each tensor's
storage straight to the file through a ``memoryview`` (no copy) and produces files
that ``safetensors.safe_open`` reads: an 8-byte little-endian header length, a JSON
header (``__metadata__`` + ``{name: {dtype, shape, data_offsets}}``) padded with
spaces to a multiple of 8 bytes, then the tensor bytes.

Shard names follow the Hugging Face convention ``model-00001-of-00003.safetensors``;
since the number of shards is unknown while streaming, shards are written under
temporary names and renamed by :meth:`ShardedSafetensorsWriter.finish`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exportlm.errors import DuplicateTensorError, ExportFailedError, InvalidInputError
from exportlm.export.hf_checkpoint.naming import CheckpointNamer
from exportlm.quant.formats import CheckpointLayout, checkpoint_layout, scale_leaf_names

__all__ = [
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE_NAME",
    "CheckpointSink",
    "ShardedSafetensorsWriter",
    "WriteSummary",
    "parse_size",
    "write_safetensors",
]

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

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

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"64KiB"``.

    Decimal units (KB, MB, GB) are powers of 10 as in ``save_pretrained``; binary
    units (KiB, MiB, GiB) powers of 2.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidInputError(
            f"max_shard_size must be an int (bytes) or a string like '5GB', got {size!r}"
        )
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise InvalidInputError(
                f"max_shard_size {size!r} is not a size; expected digits and a unit "
                f"such as '5GB', '500MB' or '64MiB' (units: {', '.join(sorted(u for u in _UNITS if u))})"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidInputError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass
class WriteSummary:
    """What :meth:`ShardedSafetensorsWriter.finish` wrote."""

    files: list[str]
    weight_map: dict[str, str]
    total_size: int
    index_file: str | None = None


@dataclass
class _Shard:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


class ShardedSafetensorsWriter:
    """Write named tensors into size-capped safetensors shards in ``directory``.

    ``add`` buffers references until the next tensor would push the shard over
    ``max_shard_size``; then the shard is written and released. A tensor larger
    than the cap gets a shard of its own (as in ``save_pretrained``). ``finish``
    writes the last shard, renames the shards to their final names and writes
    ``model.safetensors.index.json`` when there is more than one.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._current = _Shard()
        self._written: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._total_size = 0
        self._finished = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name``; writes the current shard when it is full."""
        if self._finished:
            raise ExportFailedError(
                f"cannot add {name!r}: the checkpoint writer is already finished"
            )
        if name in self._names:
            raise DuplicateTensorError(
                f"tensor name {name!r} was written twice; every checkpoint tensor needs a unique "
                "name (this is a bug in a module exporter or in the name mapping)"
            )
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ExportFailedError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
                f"supported: {', '.join(sorted(str(d) for d in SAFETENSORS_DTYPES))}"
            )
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if self._current.tensors and self._current.nbytes + nbytes > self.max_shard_size:
            self._flush()
        self._names.add(name)
        self._current.tensors[name] = tensor
        self._current.nbytes += nbytes
        self._total_size += nbytes

    def finish(self) -> WriteSummary:
        """Write the last shard, give every shard its final name, write the index."""
        if self._finished:
            raise ExportFailedError("the checkpoint writer is already finished")
        if self._current.tensors or not self._written:
            self._flush()
        self._finished = True
        count = len(self._written)
        weight_map: dict[str, str] = {}
        files: list[str] = []
        for i, (tmp_path, names) in enumerate(self._written, start=1):
            final = SINGLE_FILE_NAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(tmp_path, self.directory / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = None
        if count > 1:
            index = {
                "metadata": {"total_size": self._total_size},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.directory / INDEX_NAME).write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
            index_file = INDEX_NAME
        return WriteSummary(
            files=files, weight_map=weight_map, total_size=self._total_size, index_file=index_file
        )

    def _flush(self) -> None:
        shard = self._current
        self._current = _Shard()
        path = self.directory / f".shard-{len(self._written) + 1:05d}.safetensors.partial"
        write_safetensors(path, shard.tensors, self.metadata)
        logger.debug("wrote %s (%d tensors, %d bytes)", path.name, len(shard.tensors), shard.nbytes)
        self._written.append((path, list(shard.tensors)))


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format without copying their data.

    Tensors are laid out by element size (largest first), then by name, so every
    tensor starts at an offset aligned to its element size.
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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name].contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)


class CheckpointSink:
    """The driver's sink: rename to checkpoint names (and the format's layout), then write."""

    def __init__(
        self, namer: CheckpointNamer, writer: ShardedSafetensorsWriter, format: str
    ) -> None:
        self.namer = namer
        self._writer = writer
        self._layout = checkpoint_layout(format)
        # read once per export: the formats registered now are the ones this export writes
        self._scale_leaves = frozenset(scale_leaf_names())
        self._closed = False
        self._sources: dict[str, str] = {}  # checkpoint name -> the driver's name it came from

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Accept one tensor from the export driver.

        Raises :class:`~exportlm.errors.DuplicateTensorError` when its checkpoint
        name was written before (the export context adds which exporter wrote it).
        """
        if self._closed:
            raise ExportFailedError(f"tensor {name!r} arrived after the export finished")
        for ckpt_name, value in self.namer.rename(name, tensor):
            ckpt_name, value = _laid_out(self._layout, ckpt_name, value, self._scale_leaves)
            first = self._sources.get(ckpt_name)
            if first is not None:
                raise DuplicateTensorError(
                    f"checkpoint tensor {ckpt_name!r} was written twice: first from {first!r}, "
                    f"again from {name!r}; every checkpoint tensor needs a unique name (a module "
                    "exporter emits it twice, or two names map to it)"
                )
            self._sources[ckpt_name] = name
            self._writer.add(ckpt_name, value)

    def close(self) -> None:
        """Refuse any later tensor (a driver bug would otherwise write into a finished export)."""
        self._closed = True


_KV_SCALE = re.compile(r"^(?P<attn>.*)\.(?P<proj>[kv])_proj\.(?P=proj)_scale$")


def _laid_out(
    layout: CheckpointLayout, name: str, tensor: torch.Tensor, scale_leaves: frozenset[str]
) -> tuple[str, torch.Tensor]:
    """``name`` and ``tensor`` as ``layout`` stores them: per-tensor scales in its shape
    (:meth:`CheckpointLayout.stored_scale`, the rule ``ExportContext.emit_scale`` applies
    too), KV-cache scales on the attention module where it puts them.

    ``scale_leaves``: the leaves that are scales in some registered format
    (:func:`~exportlm.quant.formats.scale_leaf_names`).
    """
    if name.rsplit(".", 1)[-1] in scale_leaves:
        tensor = layout.stored_scale(tensor)
    match = _KV_SCALE.match(name) if layout.kv_scales_on_attention else None
    if match:
        name = f"{match['attn']}.{match['proj']}_scale"
    return name, tensor
