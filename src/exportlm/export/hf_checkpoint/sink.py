"""Where the export driver's tensors go: renamed, laid out for the format, streamed to shards.

:class:`CheckpointSink` is the sink :func:`exportlm.module_exporters.export_quantized_state`
writes to: it maps every tensor to its checkpoint name (:class:`CheckpointNamer`),
applies the layout's rules (:class:`~exportlm.quant.formats.CheckpointLayout`), and hands it to the streaming
shard writer, so no full state dict is ever built.

:class:`ShardedSafetensorsWriter`: tensors in, shards out as they fill.

``safetensors.torch.save_file`` needs the whole shard as a dict and copies every
tensor into a ``bytes`` object before writing (two copies of a shard in memory).
This writer keeps references to the shard filling (plus those being written) and
writes each with :func:`~exportlm.export.hf_checkpoint.safetensors_file.write_safetensors`
(tensor storage straight to the file, no copy).

Shard names follow the Hugging Face convention ``model-00001-of-00003.safetensors``;
since the number of shards is unknown while streaming, shards are written under
temporary names and renamed by :meth:`ShardedSafetensorsWriter.finish`.

Every file is hashed (BLAKE3, :mod:`~exportlm.export._digest`) from the bytes as they are
written, never read back:
:attr:`WriteSummary.digests` is what the manifest lists. A full shard is written by a
writer thread while the exporter converts the next tensors (``write_threads`` shards
at a time; ``file.write`` and ``blake3`` release the GIL), and within one file a
second thread hashes each piece while the next is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exportlm.errors import DuplicateTensorError, ExportFailedError, InvalidInputError
from exportlm.export._digest import digest_bytes
from exportlm.export.hf_checkpoint.naming import CheckpointNamer
from exportlm.export.hf_checkpoint.safetensors_file import (
    SAFETENSORS_DTYPES,
    FileDigest,
    write_safetensors,
)
from exportlm.quant.formats import CheckpointLayout, checkpoint_layout, scale_leaf_names

__all__ = [
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE_NAME",
    "CheckpointSink",
    "FileDigest",
    "ShardedSafetensorsWriter",
    "WriteSummary",
    "parse_size",
    "write_safetensors",
]

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

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
    """What :meth:`ShardedSafetensorsWriter.finish` wrote.

    ``digests``: every file written into the directory (shards, index and those given
    to :meth:`ShardedSafetensorsWriter.write_file`), by name relative to it.
    """

    files: list[str]
    weight_map: dict[str, str]
    total_size: int
    index_file: str | None = None
    digests: dict[str, FileDigest] = field(default_factory=dict)


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

    A full shard is written by a background thread; ``write_threads`` bounds how many
    are written at once, and so how many shards' tensors are held beyond the one
    filling (``add`` waits for the oldest). A failed write raises
    :class:`~exportlm.errors.ExportFailedError` (the thread's error chained) from the
    ``add`` that waits for it or from ``finish``; either then waits for the other writes
    and shuts the writer threads down (the writer is finished). After a failure
    elsewhere, call :meth:`abort` before the directory is removed: it waits for those
    writes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        metadata: dict[str, str] | None = None,
        write_threads: int = 1,
    ) -> None:
        if write_threads < 1:
            raise InvalidInputError(f"write_threads must be at least 1, got {write_threads}")
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._current = _Shard()
        self._written: list[tuple[Path, list[str], Future[FileDigest]]] = []
        self._extra: dict[str, FileDigest] = {}
        self._names: set[str] = set()
        self._total_size = 0
        self._finished = False
        self._threads = write_threads
        self._pool: ThreadPoolExecutor | None = None

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

    def write_file(self, name: str, data: bytes) -> FileDigest:
        """Write a further file of the checkpoint (a config) from ``data``; its digest is kept.

        It is listed in :attr:`WriteSummary.digests` (call before :meth:`finish`).
        """
        if self._finished:
            raise ExportFailedError(f"cannot write {name!r}: the checkpoint writer is finished")
        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        digest = FileDigest(digest_bytes(data), len(data))
        self._extra[name] = digest
        return digest

    def finish(self) -> WriteSummary:
        """Write the last shard, give every shard its final name, write the index."""
        if self._finished:
            raise ExportFailedError("the checkpoint writer is already finished")
        if self._current.tensors or not self._written:
            self._flush()  # a failed earlier write raises here, its pool already shut down
        self._finished = True
        digests = self._wait_all()
        count = len(self._written)
        weight_map: dict[str, str] = {}
        files: list[str] = []
        for i, (tmp_path, names, _) in enumerate(self._written, start=1):
            final = SINGLE_FILE_NAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(tmp_path, self.directory / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        found = dict(zip(files, digests, strict=True)) | self._extra
        index_file = None
        if count > 1:
            index = {
                "metadata": {"total_size": self._total_size},
                "weight_map": dict(sorted(weight_map.items())),
            }
            raw = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            (self.directory / INDEX_NAME).write_bytes(raw)
            found[INDEX_NAME] = FileDigest(digest_bytes(raw), len(raw))
            index_file = INDEX_NAME
        return WriteSummary(
            files=files,
            weight_map=weight_map,
            total_size=self._total_size,
            index_file=index_file,
            digests=found,
        )

    def abort(self) -> None:
        """After a failure: wait for the shards being written (their errors are dropped)."""
        self._finished = True
        if self._pool is not None:
            wait([future for _, _, future in self._written])
            self._pool.shutdown()
            self._pool = None

    def _wait_all(self) -> list[FileDigest]:
        try:
            return [_digest_of(path, future) for path, _, future in self._written]
        finally:
            self.abort()

    def _flush(self) -> None:
        shard = self._current
        self._current = _Shard()
        path = self.directory / f".shard-{len(self._written) + 1:05d}.safetensors.partial"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="exportlm-shard")
        running = [(p, future) for p, _, future in self._written if not future.done()]
        if len(running) >= self._threads:  # backpressure: hold at most that many shards
            try:
                _digest_of(*running[0])
            except BaseException:
                self.abort()  # a failed writer writes nothing more and leaves no thread behind
                raise
        future = self._pool.submit(write_safetensors, path, shard.tensors, self.metadata)
        future.add_done_callback(lambda _: logger.debug("wrote %s", path.name))
        self._written.append((path, list(shard.tensors), future))


def _digest_of(path: Path, future: Future[FileDigest]) -> FileDigest:
    """The digest of a shard written by a writer thread, or the reason it was not written.

    Raises:
        ExportFailedError: the write failed (a full disk, a removed directory, ...); the
            thread's error is chained. The export then publishes nothing.
    """
    try:
        return future.result()
    except Exception as err:
        raise ExportFailedError(
            f"writing the checkpoint shard {path.name} into {path.parent} failed: "
            f"{type(err).__name__}: {err}. The export publishes nothing (any previous "
            "checkpoint at the output path is unchanged); free space on that filesystem (or "
            "fix its permissions) and export again. The writer's error is chained below."
        ) from err


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
