"""What a streaming export's resume state is bound to: its :class:`ResumeKey`.

A killed run may be continued only by a run that would have written the same bytes. The
key has two parts:

* ``options``: a sha256 over the exportlm version, the recipe, the calibration mode and
  batches (dtype, shape and bytes), the target's options, and the names and sizes of the
  model's files. Cheap; a run whose ``options`` differ never looks further;
* ``sources``: the digest (:func:`~exportlm.export.hf_checkpoint.stream._digest.file_digest`) of every file of
  the model directory the export reads (``config.json``, ``generation_config.json``, the
  index and every shard), not their sizes or mtimes: a model replaced by another with the
  same sizes and mtimes has other digests.

Hashing the sources reads the model once (the shards are read again layer by layer).
:class:`SourceDigests` does it once per run: in a background thread from the start of a
fresh run (``hashlib`` and ``readinto`` release the GIL, so it overlaps the first
modules' work), or before anything else when a leftover work area's ``options`` match and
its sources must be compared.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from exportlm._version import __version__
from exportlm.errors import ExportLMError, MalformedCheckpointError
from exportlm.export.hf_checkpoint.stream._digest import file_digest

__all__ = ["ResumeKey", "SourceDigests", "resume_key"]

_READ_ALONGSIDE = ("config.json", "generation_config.json", "model.safetensors.index.json")


class SourceDigests:
    """The digests of a model directory's files, computed once (see the module docstring)."""

    def __init__(self, directory: Path, names: Sequence[str]) -> None:
        self.directory, self.names = directory, tuple(names)
        self._digests: dict[str, str] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin hashing in a background thread (:meth:`result` waits for it)."""
        if self._thread is None and self._digests is None:
            self._thread = threading.Thread(
                target=self._run, name="exportlm-source-digests", daemon=True
            )
            self._thread.start()

    def result(self) -> dict[str, str]:
        """``{file name: digest}``; hashes now unless :meth:`start` already did."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self._digests is None and self._error is None:
            self._run()
        if self._error is not None:
            raise self._error
        assert self._digests is not None
        return self._digests

    def _run(self) -> None:
        try:
            self._digests = {n: self._digest(n) for n in self.names}
        except BaseException as err:  # handed to result()'s caller, in its thread
            self._error = err

    def _digest(self, name: str) -> str:
        path = self.directory / name
        try:
            return file_digest(path, what="model file", follow=True)
        except ExportLMError:
            raise
        except OSError as err:
            raise MalformedCheckpointError(
                f"{path}: cannot be read to bind the streaming export's resume state to it "
                f"({err}); the model directory changed while exporting. Export again",
                path=path,
            ) from err


class ResumeKey:
    """The options digest and the model's files of one streaming export."""

    def __init__(self, options: str, sources: SourceDigests) -> None:
        self.options = options
        self.sources = sources


def resume_key(
    directory: Path,
    shards: Sequence[str],
    recipe: Any,
    batches: Sequence[torch.Tensor],
    mode: str,
    options: dict[str, Any],
) -> ResumeKey:
    """The :class:`ResumeKey` of streaming ``directory`` (shard files ``shards``) with these arguments."""
    names = sorted({*shards, *(n for n in _READ_ALONGSIDE if (directory / n).is_file())})
    sizes = [[n, (directory / n).stat().st_size] for n in names]
    settings = [__version__, repr(recipe), mode, {k: str(v) for k, v in options.items()}, sizes]
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for batch in batches:
        data = batch.detach().cpu().contiguous()
        digest.update(f"{data.dtype}{list(data.shape)}".encode())
        digest.update(data.numpy().tobytes())
    return ResumeKey(digest.hexdigest(), SourceDigests(directory, names))
