"""The streaming export's work area: progress after every layer, and the activations between layers.

A streaming export of ``out/`` works in a private directory of its own beside it
(``.out.stream-XXXXXXXX/``, see :mod:`exportlm.export.hf_checkpoint.stream._workdir`: made by this run, mode
``0700``, locked while the run lives). After each layer it holds the shards written so
far, the open shard's tensors (spill files), the activations that enter the next layer
and ``progress.json``, the signed record of all that (:mod:`exportlm.export.hf_checkpoint.stream._record`).
The record names each of those files by a plain name with the digest the writer
recorded when it wrote the file, and the :class:`~exportlm.export.hf_checkpoint.stream._key.ResumeKey` of the
run: the options digest and the digests of the model's files.

A new run continues a dead run's directory only when its record verifies, its key is
the new run's (options, then the model files' digests) and every file it names still has
its recorded digest; then it continues after the last layer recorded there. Any other
dead work directory of this user's for the same output is removed, and the run starts
afresh in a new one. The area is removed once the checkpoint is published.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch

from exportlm.errors import NotRegularFileError
from exportlm.export.hf_checkpoint.safetensors_file import write_safetensors
from exportlm.export.hf_checkpoint.shards import WriterState
from exportlm.export.hf_checkpoint.stream._digest import file_digest
from exportlm.export.hf_checkpoint.stream._key import ResumeKey
from exportlm.export.hf_checkpoint.stream._record import load_record, save_record
from exportlm.export.hf_checkpoint.stream._workdir import WorkDirectory, create, leftovers

__all__ = ["ActivationStore", "Progress", "WorkArea", "activations_name"]

logger = logging.getLogger("exportlm.stream")


def activations_name(index: int) -> str:
    """The file holding the activations that enter layer ``index``."""
    return f"acts-{index}.safetensors"


@dataclass
class Progress:
    """What ``progress.json`` records besides the key: the parts finished and the writer."""

    layers_done: int = -1  # -1: not even the modules before the layers (the head)
    head: dict[str, Any] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    writer: dict[str, Any] | None = None
    activations: str | None = None  # the digest of acts-{layers_done}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Progress:
        """The progress of a verified record; ``ValueError`` when it is not one this code wrote."""
        progress = cls(
            int(record["layers_done"]),
            record["head"],
            list(record["layers"]),
            record["writer"],
            record["activations"],
        )
        if progress.layers_done < 0 or len(progress.layers) != progress.layers_done:
            raise ValueError(f"{progress.layers_done} layers done, {len(progress.layers)} recorded")
        if progress.writer is None or not isinstance(progress.activations, str):
            raise ValueError("no writer state or activations digest")
        WriterState.from_json(progress.writer)  # its names and digests are checked there
        return progress

    def files(self) -> Iterator[tuple[str, str]]:
        """``(name, digest)`` of every work file a resumed run reads or publishes."""
        state = WriterState.from_json(self.writer or {"shards": [], "pending": []})
        for name, _, digest in [*state.shards, *state.pending]:
            yield name, digest
        if self.activations is not None:
            yield activations_name(self.layers_done), self.activations


class WorkArea:
    """The work directory of one streaming export (see the module docstring)."""

    def __init__(self, output_path: Path, key: ResumeKey) -> None:
        self.key = key
        self.progress, self._directory = self._open(output_path)
        self.directory = self._directory.path

    @property
    def resumed(self) -> bool:
        """Whether this run continues a killed one."""
        return self.progress.layers_done >= 0

    def save(self) -> None:
        """Record the progress, signed (atomically: a kill leaves the previous record or this one)."""
        record = dict(vars(self.progress))
        record |= {"key": self.key.options, "sources": self.key.sources.result()}
        save_record(self.directory, record)

    def link_into(self, staged: Path, names: Sequence[str]) -> None:
        """Hard-link the work files ``names`` into ``staged`` (same filesystem: free), else
        copy them; the work area keeps its own, so a kill before publishing loses nothing."""
        for name in names:
            (staged / name).parent.mkdir(parents=True, exist_ok=True)  # a chat template's folder
            try:
                os.link(self.directory / name, staged / name)
            except OSError:
                shutil.copyfile(self.directory / name, staged / name)

    def remove(self) -> None:
        """Delete the work area (after publishing) and give up its lock."""
        self._directory.remove()

    def release(self) -> None:
        """Give up the lock, keeping the work area for a later run to continue (after a failure)."""
        self._directory.release()

    def _open(self, output: Path) -> tuple[Progress, WorkDirectory]:
        chosen: tuple[Progress, WorkDirectory] | None = None
        for leftover in leftovers(output):
            progress = self._continuable(leftover.path) if chosen is None else None
            if progress is not None:
                chosen = (progress, leftover)
                continue
            logger.info("removing %s, an earlier streaming export's work area", leftover.path)
            leftover.remove()
        if chosen is not None:
            return chosen
        self.key.sources.start()  # hashed while the first modules are exported
        return Progress(), create(output)

    def _continuable(self, directory: Path) -> Progress | None:
        """The progress recorded in ``directory`` when this run may continue it, else None."""
        record = load_record(directory)
        if record is None:
            return None
        if record.get("key") != self.key.options:
            logger.info("not resuming %s: it was started with other arguments", directory)
            return None
        if record.get("sources") != self.key.sources.result():
            logger.warning(
                "not resuming %s: the model's files are not those it was started on", directory
            )
            return None
        try:
            progress = Progress.from_record(record)
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("not resuming %s: malformed progress record (%s)", directory, err)
            return None
        for name, digest in progress.files():
            try:
                found = file_digest(directory / name, what="streaming work file")
            except (OSError, NotRegularFileError) as err:
                found = f"unreadable ({err})"
            if found != digest:
                logger.warning(
                    "not resuming %s: %s is not the file this export wrote (%s)",
                    directory,
                    name,
                    found,
                )
                return None
        return progress


class ActivationStore:
    """The hidden states entering one layer, one tensor per calibration batch.

    Every boundary is written to ``acts-K.safetensors`` (a restart reads it back); the
    tensors stay in memory too while they are within ``budget`` bytes, else they are read
    back from the file batch by batch.
    """

    def __init__(self, directory: Path, budget: int) -> None:
        self.directory = directory
        self.budget = budget
        self._held: list[torch.Tensor] | None = None
        self._file: Path | None = None
        self._count = 0

    def put(self, index: int, batches: list[torch.Tensor]) -> str:
        """Keep ``batches`` as the inputs of layer ``index``; the digest of their file."""
        file = self.directory / activations_name(index)
        tensors = {f"b{i}": t.contiguous() for i, t in enumerate(batches)}
        written = write_safetensors(file, tensors, {"format": "pt"})
        previous, self._file, self._count = self._file, file, len(batches)
        size = sum(t.numel() * t.element_size() for t in batches)
        self._held = batches if size <= self.budget else None
        if self._held is None:
            logger.debug(
                "the %d bytes of activations entering layer %d are read from disk", size, index
            )
        if previous is not None and previous != file:
            previous.unlink(missing_ok=True)
        return written.digest

    def restore(self, index: int) -> None:
        """Use the inputs of layer ``index`` that a killed run left on disk."""
        from safetensors import safe_open

        self._file = self.directory / activations_name(index)
        with safe_open(str(self._file), framework="pt", device="cpu") as handle:
            self._count = len(list(handle.keys()))
        self._held = None

    def batches(self) -> Sequence[torch.Tensor]:
        """The inputs: in memory, or read from the file one batch at a time as they are used."""
        if self._held is not None:
            return self._held
        if self._file is None:
            raise RuntimeError("no activations stored yet")
        return _FileBatches(self._file, self._count)


class _FileBatches(Sequence[torch.Tensor]):
    """Batch ``i`` read from an activations file when it is indexed (memory-mapped)."""

    def __init__(self, file: Path, count: int) -> None:
        from safetensors import safe_open

        self._handle = safe_open(str(file), framework="pt", device="cpu")
        self._count = count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not 0 <= index < self._count:
            raise IndexError(index)
        tensor: torch.Tensor = self._handle.get_tensor(f"b{index}")
        return tensor
