"""The one shard writer of every ``hf_checkpoint`` export: tensors in, shards out as they fill.

``safetensors.torch.save_file`` copies every tensor into a ``bytes`` object before writing
(two copies of a shard in memory). :class:`ShardedSafetensorsWriter` keeps references to
the shard filling (plus those being written) and writes each with
:func:`~exportlm.export.hf_checkpoint.safetensors_file.write_safetensors` (no copy); while
a shard fills, its file is allocated ahead on the writer thread (``SpaceAhead``).

Shard names follow the Hugging Face convention ``model-00001-of-00003.safetensors``; as
the number of shards is unknown while writing, shards are written under temporary names
and renamed by :meth:`ShardedSafetensorsWriter.finish`.

Every file is hashed (BLAKE3, :mod:`~exportlm.export._digest`) from the bytes as they are
written, never read back: :attr:`WriteSummary.digests` is what the manifest lists. In
memory, a full shard is written by a writer thread while the exporter converts the next
tensors (``write_threads`` shards at a time; ``file.write`` and ``blake3`` release the
GIL). A streamed export makes it ``resumable``: each shard is written before ``add``
returns (one shard in memory, the stream's bound), and :meth:`~ShardedSafetensorsWriter.spill`
writes the open shard's tensors to a side file and drops them from memory, so that the
writer's :class:`WriterState` survives the process and a restarted run rebuilds it
exactly (:meth:`~ShardedSafetensorsWriter.resume`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exportlm.errors import DuplicateTensorError, ExportFailedError, InvalidOptionError
from exportlm.export._digest import digest_bytes
from exportlm.export.hf_checkpoint.safetensors_file import (
    SAFETENSORS_DTYPES,
    FileDigest,
    SpaceAhead,
    read_safetensors,
    write_safetensors,
)

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "ShardedSafetensorsWriter",
    "WriteSummary",
    "WriterState",
    "parse_size",
]

logger = logging.getLogger(__name__)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
#: A work file's name as a resumable writer's state holds it: inside its directory.
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"64KiB"``.

    Decimal units (KB, MB, GB) are powers of 10 as in ``save_pretrained``; binary
    units (KiB, MiB, GiB) powers of 2.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidOptionError(
            f"max_shard_size must be an int (bytes) or a string like '5GB', got {size!r}"
        )
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise InvalidOptionError(
                f"max_shard_size {size!r} is not a size; expected digits and a unit "
                f"such as '5GB', '500MB' or '64MiB' (units: {', '.join(sorted(u for u in _UNITS if u))})"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidOptionError(f"max_shard_size must be positive, got {size!r}")
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
class WriterState:
    """What a restarted resumable writer needs: written shards ``[(file, names, digest)]``,
    the spill files ``[(file, names, digest)]`` holding the open shard's tensors, and the
    bytes added in all. Each digest is the one :func:`write_safetensors` returned."""

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
    plain = isinstance(file, str) and _PLAIN.fullmatch(file) is not None and ".." not in file
    if not plain or not isinstance(digest, str):
        raise ValueError(f"work file {file!r} is not a file name inside the work area")
    return str(file), [str(n) for n in names], digest


class ShardedSafetensorsWriter:
    """Write named tensors into size-capped safetensors shards in ``directory``.

    ``add`` buffers references until the next tensor would push the shard over
    ``max_shard_size``; then the shard is written and released. A tensor larger
    than the cap gets a shard of its own (as in ``save_pretrained``). ``finish``
    writes the last shard, renames the shards to their final names and writes
    ``model.safetensors.index.json`` when there is more than one.

    A full shard is written by a background thread; ``write_threads`` bounds how many
    are written at once, and so how many shards' tensors are held beyond the one
    filling (``add`` waits for the oldest). ``resumable=True`` writes each shard before
    ``add`` returns instead, and allows :meth:`spill` / :meth:`resume` (see the module
    docstring). A failed write raises :class:`~exportlm.errors.ExportFailedError` (the
    error chained) from the ``add`` that waits for it or from ``finish``, which then
    waits for the other writes. After a failure elsewhere, call :meth:`abort` before
    the directory is removed: it waits for those writes and stops the writer thread.
    ``expected_bytes``: the bytes the caller expects to add (a hint): the first shard's file
    is allocated up to it (``max_shard_size`` at most) from the first ``add`` on.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        metadata: dict[str, str] | None = None,
        write_threads: int = 1,
        resumable: bool = False,
        expected_bytes: int = 0,
    ) -> None:
        if write_threads < 1:
            raise InvalidOptionError(f"write_threads must be at least 1, got {write_threads}")
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._current: dict[str, torch.Tensor | None] = {}  # None: in a spill file
        self._current_bytes = 0
        self._unspilled: list[str] = []
        self._pending: list[tuple[str, list[str], str]] = []  # the open shard's spill files
        self._obsolete: list[str] = []  # spill files of shards written since the last save
        self._written: list[tuple[Path, list[str], Future[FileDigest]]] = []
        self._extra: dict[str, FileDigest] = {}
        self._names: set[str] = set()
        self._total_size = 0
        self._finished = False
        self._threads = write_threads
        self._resumable = resumable
        self._pool: ThreadPoolExecutor | None = None
        # the open shard's file, allocated while it fills
        self._ahead = SpaceAhead(min(expected_bytes, self.max_shard_size))

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
        if self._current and self._current_bytes + nbytes > self.max_shard_size:
            self._flush()
        self._names.add(name)
        self._current[name] = tensor
        self._current_bytes += nbytes
        self._unspilled.append(name)
        self._total_size += nbytes
        if not self._resumable:  # the header needs every tensor; the space does not
            self._ahead.grow(self._pool_of_writers(), self._partial(), self._current_bytes)

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

    def spill(self, tag: str) -> WriterState:
        """Write the open shard's tensors added since the last spill to ``pending-TAG`` and
        drop them from memory (read back when the shard is written); the state to save."""
        self._require_resumable("spill")
        if self._unspilled:
            file = f"pending-{tag}.safetensors"
            tensors = {n: t for n in self._unspilled if (t := self._current[n]) is not None}
            written = write_safetensors(self.directory / file, tensors, self.metadata)
            self._pending.append((file, list(self._unspilled), written.digest))
            self._current.update(dict.fromkeys(self._unspilled))
            self._unspilled = []
        shards = [(p.name, names, f.result().digest) for p, names, f in self._written]
        return WriterState(shards, list(self._pending), self._total_size)

    def collect(self) -> None:
        """Delete the spill files of shards written since (call after saving the state)."""
        for file in self._obsolete:
            (self.directory / file).unlink(missing_ok=True)
        self._obsolete = []

    def resume(self, state: WriterState) -> None:
        """Continue where a spilled ``state`` left off (the open shard stays in its spills)."""
        from exportlm.inspection import read_safetensors_header

        self._require_resumable("resume")
        for file, names, digest in state.shards:
            size = (self.directory / file).stat().st_size
            self._written.append((self.directory / file, names, _done(FileDigest(digest, size))))
            self._names.update(names)
        self._pending, self._total_size = list(state.pending), state.total_size
        for file, names, _ in state.pending:
            infos = read_safetensors_header(self.directory / file)
            for name in names:
                begin, end = infos[name].offsets
                self._current[name] = None
                self._current_bytes += end - begin
                self._names.add(name)

    def finish(self) -> WriteSummary:
        """Write the last shard, give every shard its final name, write the index."""
        if self._finished:
            raise ExportFailedError("the checkpoint writer is already finished")
        if self._current or not self._written:
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

    def _require_resumable(self, what: str) -> None:
        if not self._resumable:
            raise ExportFailedError(f"{what}: this shard writer was not made resumable=True")

    def _wait_all(self) -> list[FileDigest]:
        try:
            digests = [_digest_of(path, future) for path, _, future in self._written]
        except BaseException:
            self.abort()
            raise
        if self._pool is not None:  # every write done: its thread only frees what it wrote
            self._pool.shutdown(wait=False)  # (~6 ms for an FP8 170M model), off the export
            self._pool = None
        return digests

    def _flush(self) -> None:
        tensors, names = self._open_shard(), list(self._current)
        self._current, self._current_bytes, self._unspilled = {}, 0, []
        if self._resumable:  # a plain name: the state names it (see WriterState)
            path = self.directory / self._partial().name[1:]
            future: Future[FileDigest] = Future()
            try:
                future.set_result(write_safetensors(path, tensors, self.metadata))
            except Exception as err:
                future.set_exception(err)
            self._written.append((path, names, future))
            _digest_of(path, future)  # on disk before add returns: the state may name it
            # deleted only once the state that no longer names them is saved (collect)
            self._obsolete.extend(file for file, _, _ in self._pending)
            self._pending = []
            return
        path, pool = self._partial(), self._pool_of_writers()
        running = [(p, future) for p, _, future in self._written if not future.done()]
        if len(running) >= self._threads:  # backpressure: hold at most that many shards
            try:
                _digest_of(*running[0])
            except BaseException:
                self.abort()  # a failed writer writes nothing more and leaves no thread behind
                raise
        ahead, self._ahead = self._ahead, SpaceAhead()
        future = pool.submit(ahead.then, write_safetensors, path, tensors, self.metadata)
        future.add_done_callback(lambda _: logger.debug("wrote %s", path.name))
        self._written.append((path, names, future))

    def _partial(self) -> Path:  # the open shard's file: written by a thread unless resumable
        return self.directory / f".shard-{len(self._written) + 1:05d}.safetensors.partial"

    def _pool_of_writers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="exportlm-shard")
        return self._pool

    def _open_shard(self) -> dict[str, torch.Tensor]:
        """The open shard's tensors in the order they were added, spilled ones read back."""
        spilled: dict[str, torch.Tensor] = {}
        for file, _, _ in self._pending:
            spilled |= read_safetensors(self.directory / file)
        return {n: t if t is not None else spilled[n] for n, t in self._current.items()}


def _done(digest: FileDigest) -> Future[FileDigest]:
    future: Future[FileDigest] = Future()
    future.set_result(digest)
    return future


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
