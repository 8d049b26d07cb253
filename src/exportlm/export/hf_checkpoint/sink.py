"""Where the export driver's tensors go: renamed, laid out for the format, written to shards.

:class:`CheckpointSink` is the sink :func:`exportlm.module_exporters.export_quantized_state`
writes to: it maps every tensor to its checkpoint name (:class:`CheckpointNamer`),
applies the layout's rules (:class:`~exportlm.quant.formats.CheckpointLayout`), and hands it to the
shard writer (:class:`~exportlm.export.hf_checkpoint.shards.ShardedSafetensorsWriter`, the one
writer of in-memory and streamed exports alike), so no full state dict is ever built.
The writer's names are re-exported here.
"""

from __future__ import annotations

import logging
import re

import torch

from exportlm.errors import DuplicateTensorError, ExportFailedError
from exportlm.export.hf_checkpoint.naming import CheckpointNamer
from exportlm.export.hf_checkpoint.safetensors_file import (
    SAFETENSORS_DTYPES,
    FileDigest,
    write_safetensors,
)
from exportlm.export.hf_checkpoint.shards import (
    INDEX_NAME,
    SINGLE_FILE_NAME,
    ShardedSafetensorsWriter,
    WriteSummary,
    parse_size,
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
