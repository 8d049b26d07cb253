"""The streaming export's work area: progress after every layer, and the activations between layers.

A streaming export of ``out/`` works in the sibling ``.out.stream/`` (same filesystem, so
the finished shards move into the atomic staging directory by rename). After each layer
it holds the shards written so far, the open shard's tensors (spill files), the
activations that enter the next layer and ``progress.json`` (written atomically with
:func:`exportlm.atomic.write_text_atomic`), which names the arguments it belongs to by a
fingerprint. A run with the same fingerprint continues after the last layer recorded
there; any other run starts afresh. The area is removed once the checkpoint is published.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch

from exportlm.atomic import write_text_atomic
from exportlm.export.hf_checkpoint.sink import write_safetensors

__all__ = ["ActivationStore", "Progress", "WorkArea", "work_directory"]

_PROGRESS = "progress.json"
logger = logging.getLogger("exportlm.stream")


def work_directory(output_path: Path) -> Path:
    """``.NAME.stream`` beside ``output_path``."""
    return output_path.parent / f".{output_path.name}.stream"


@dataclass
class Progress:
    """What ``progress.json`` records: the fingerprint, the parts finished and the writer."""

    fingerprint: str
    layers_done: int = -1  # -1: not even the modules before the layers (the head)
    head: dict[str, Any] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    writer: dict[str, Any] | None = None


class WorkArea:
    """The work directory of one streaming export (see the module docstring)."""

    def __init__(self, output_path: Path, fingerprint: str) -> None:
        self.directory = work_directory(output_path)
        self.progress = self._load(fingerprint)

    @property
    def resumed(self) -> bool:
        """Whether this run continues a killed one."""
        return self.progress.layers_done >= 0

    def save(self) -> None:
        """Record the progress (atomically: a kill leaves the previous record or this one)."""
        data = {k: v for k, v in vars(self.progress).items()}
        write_text_atomic(self.directory / _PROGRESS, json.dumps(data) + "\n")

    def remove(self) -> None:
        """Delete the work area (after publishing)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def _load(self, fingerprint: str) -> Progress:
        path = self.directory / _PROGRESS
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("fingerprint") == fingerprint:
                return Progress(**data)
        except (OSError, ValueError, TypeError):
            pass
        self.remove()  # another export's leftovers, or none: start afresh
        self.directory.mkdir(parents=True, mode=0o700)
        return Progress(fingerprint)


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

    def put(self, index: int, batches: list[torch.Tensor]) -> None:
        """Keep ``batches`` as the inputs of layer ``index``."""
        file = self.directory / f"acts-{index}.safetensors"
        tensors = {f"b{i}": t.contiguous() for i, t in enumerate(batches)}
        write_safetensors(file, tensors, {"format": "pt"})
        previous, self._file, self._count = self._file, file, len(batches)
        size = sum(t.numel() * t.element_size() for t in batches)
        self._held = batches if size <= self.budget else None
        if self._held is None:
            logger.debug(
                "the %d bytes of activations entering layer %d are read from disk", size, index
            )
        if previous is not None and previous != file:
            previous.unlink(missing_ok=True)

    def restore(self, index: int) -> None:
        """Use the inputs of layer ``index`` that a killed run left on disk."""
        from safetensors import safe_open

        self._file = self.directory / f"acts-{index}.safetensors"
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
