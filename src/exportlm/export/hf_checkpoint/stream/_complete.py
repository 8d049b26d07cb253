"""The last check before a streamed checkpoint is published: every part of the model is in it.

The shards a streaming export publishes come from many parts (the modules before the
layers, each decoder layer, the modules after them), some of them written by an earlier,
killed run. Before anything is published, :func:`check_complete` holds what was written
to the model's own structure: the parts recorded are the decoder layers in order, one
each, and every module whose tensors the model reads from the checkpoint has at least one
tensor in the output (under that module's checkpoint name: quantization adds scales and
may change a weight's dtype, never its module).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from exportlm.errors import StreamIntegrityError
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource

__all__ = ["check_complete"]

_SHOWN = 5


def check_complete(
    source: CheckpointSource,
    layers: Sequence[dict[str, Any]],
    written: Collection[str],
    stored: Collection[str],
) -> None:
    """Raise :class:`StreamIntegrityError` unless ``written`` (tensor names) holds a tensor of
    every module of ``stored`` (:meth:`CheckpointSource.stored_names`, taken before any layer
    was quantized) and ``layers`` (the recorded layer parts) are the decoder layers in order."""
    recorded = [str(part.get("prefix", "")).removesuffix(".") for part in layers]
    expected = [source.layout.prefix(i) for i in range(source.layout.count)]
    if recorded != expected:
        raise StreamIntegrityError(
            f"the streamed parts are the layers {_few(recorded)}, the model in "
            f"{source.directory} has {_few(expected)}"
        )
    present = {name[:i] for name in written for i, char in enumerate(name) if char == "."}
    missing = sorted(
        module
        for name in stored
        if (module := name.rpartition(".")[0]) not in present and name not in written
    )
    if missing:
        raise StreamIntegrityError(
            f"no tensor of {len(set(missing))} module(s) of the model in {source.directory} "
            f"was written: {_few(sorted(set(missing)))}"
        )


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN]) or "none"
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
