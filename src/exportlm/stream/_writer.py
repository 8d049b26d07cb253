"""A shard writer whose progress survives the process: the streaming export's resumable writer.

It fills shards by the rule of :class:`~exportlm.export.hf_checkpoint.sink.ShardedSafetensorsWriter`
(a shard is written when the next tensor would push it over ``max_shard_size``; a larger
tensor gets a shard of its own) and writes them with the sink module's public
:func:`~exportlm.export.hf_checkpoint.sink.write_safetensors`, so a streamed checkpoint is
the same bytes as an in-memory one. What it adds is a :meth:`ResumableShardWriter.state`:
the shards already written (complete files in the work directory) and the tensors of the
shard being filled, which :meth:`ResumableShardWriter.spill` writes to a side file so that
a restarted run rebuilds the writer exactly (:meth:`ResumableShardWriter.resume`).

A spilled tensor is dropped from memory: the shard being filled is read back from its
spill files (``readinto``, no mapping) only when it is written. So between parts the
open shard costs no memory, and the next layer is loaded and quantized without it (on
the 0.98 GB model of ``docs/streaming.md`` the embedding's 131 MB used to sit in the
open shard while layer 0 was quantized).

The sink's own writer keeps this state private; a public ``state()`` / ``resume()`` hook
there would make this class unnecessary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exportlm.atomic import write_text_atomic
from exportlm.errors import DuplicateTensorError, ExportFailedError
from exportlm.export.hf_checkpoint.sink import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_FILE_NAME,
    WriteSummary,
    parse_size,
    write_safetensors,
)
from exportlm.stream._record import plain_name

__all__ = ["ResumableShardWriter", "WriterState"]


@dataclass
class WriterState:
    """What a restarted run needs: written shards ``[(file, names, digest)]``, the pending
    spill files ``[(file, names, digest)]`` holding the open shard's tensors, and the bytes
    written in all. Each digest is the one :func:`write_safetensors` returned for the file."""

    shards: list[tuple[str, list[str], str]] = field(default_factory=list)
    pending: list[tuple[str, list[str], str]] = field(default_factory=list)
    total_size: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON data."""
        return {"shards": self.shards, "pending": self.pending, "total_size": self.total_size}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WriterState:
        """The state :meth:`to_json` wrote; ``ValueError`` for a file that is not a plain name."""
        return cls(
            shards=[_entry(e) for e in data["shards"]],
            pending=[_entry(e) for e in data["pending"]],
            total_size=int(data.get("total_size", 0)),
        )


def _entry(entry: Any) -> tuple[str, list[str], str]:
    file, names, digest = entry
    if not plain_name(file) or not isinstance(digest, str):
        raise ValueError(f"work file {file!r} is not a file name inside the work area")
    return str(file), [str(n) for n in names], digest


class ResumableShardWriter:
    """``add(name, tensor)`` into size-capped shards in ``directory``; see the module docstring."""

    def __init__(self, directory: Path, *, max_shard_size: int | str = "5GB") -> None:
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = {"format": "pt"}
        self._current: dict[str, torch.Tensor | None] = {}  # None: in a spill file
        self._current_bytes = 0
        self._unspilled: list[str] = []
        self._state = WriterState()
        self._names: set[str] = set()
        self._obsolete: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor``; writes the open shard first when ``tensor`` would overfill it."""
        if name in self._names:
            raise DuplicateTensorError(
                f"tensor name {name!r} was written twice; every checkpoint tensor needs a unique "
                "name (this is a bug in a module exporter or in the name mapping)"
            )
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ExportFailedError(f"tensor {name!r} has dtype {tensor.dtype}, not storable")
        tensor = tensor.detach().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + nbytes > self.max_shard_size:
            self._flush()
        self._names.add(name)
        self._current[name] = tensor
        self._current_bytes += nbytes
        self._unspilled.append(name)
        self._state.total_size += nbytes

    def spill(self, tag: str) -> WriterState:
        """Write the open shard's tensors added since the last spill to ``pending-TAG``; the state."""
        if self._unspilled:
            file = f"pending-{tag}.safetensors"
            tensors = {n: t for n in self._unspilled if (t := self._current[n]) is not None}
            written = write_safetensors(self.directory / file, tensors, self.metadata)
            self._state.pending.append((file, list(self._unspilled), written.digest))
            self._current.update(dict.fromkeys(self._unspilled))  # read back when written
            self._unspilled = []
        return self._state

    def collect(self) -> None:
        """Delete the spill files of shards written since (call after saving the state)."""
        for file in self._obsolete:
            (self.directory / file).unlink(missing_ok=True)
        self._obsolete = []

    def resume(self, state: WriterState) -> None:
        """Continue where a spilled ``state`` left off (the open shard stays in its spills)."""
        from exportlm.inspection import read_safetensors_header

        self._state = state
        self._names = {n for _, names, _ in state.shards for n in names}
        for file, names, _ in state.pending:
            infos = read_safetensors_header(self.directory / file)
            for name in names:
                begin, end = infos[name].offsets
                self._current[name] = None
                self._current_bytes += end - begin
                self._names.add(name)

    def finish(self) -> WriteSummary:
        """Write the last shard, give every shard its final name, write the index."""
        if self._current or not self._state.shards:
            self._flush()
        shards = self._state.shards
        count = len(shards)
        weight_map: dict[str, str] = {}
        files: list[str] = []
        for i, (tmp, names, _) in enumerate(shards, start=1):
            final = SINGLE_FILE_NAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            (self.directory / tmp).replace(self.directory / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = None
        if count > 1:
            index = {
                "metadata": {"total_size": self._state.total_size},
                "weight_map": dict(sorted(weight_map.items())),
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            write_text_atomic(self.directory / INDEX_NAME, text)
            index_file = INDEX_NAME
        return WriteSummary(files, weight_map, self._state.total_size, index_file)

    def _flush(self) -> None:
        tmp = f"shard-{len(self._state.shards) + 1:05d}.safetensors.partial"
        written = write_safetensors(self.directory / tmp, self._open_shard(), self.metadata)
        self._state.shards.append((tmp, list(self._current), written.digest))
        # deleted only once the progress that no longer names them is saved (collect)
        self._obsolete.extend(file for file, _, _ in self._state.pending)
        self._state.pending = []
        self._current, self._current_bytes, self._unspilled = {}, 0, []

    def _open_shard(self) -> dict[str, torch.Tensor]:
        """The open shard's tensors in the order they were added, spilled ones read back."""
        spilled: dict[str, torch.Tensor] = {}
        for file, _, _ in self._state.pending:
            spilled |= _read_safetensors(self.directory / file)
        return {n: t if t is not None else spilled[n] for n, t in self._current.items()}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a spill file, read with ``readinto`` into fresh tensors.

    Not ``safe_open``: its mapping counts in the RSS until it is closed, on top of the
    copies it hands out.
    """
    import struct

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
