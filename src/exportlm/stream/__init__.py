"""Streaming quantize + export: models larger than memory, one decoder layer at a time.

:func:`export_streaming` reads a local Hugging Face checkpoint lazily (a ``meta``-device
model from ``config.json``, tensors memory-mapped from the safetensors shards), quantizes
and exports each decoder layer in turn through the ordinary module exporters and the
``hf_checkpoint`` sink, records its progress after every layer (a killed run resumes) and
publishes the checkpoint all at once. :func:`should_stream` is the rule the CLI uses to
stream by itself. See ``docs/streaming.md``.
"""

from __future__ import annotations

import os
from pathlib import Path

from exportlm.stream._budget import IN_MEMORY_FACTOR, memory_limit, needs_streaming, parse_memory
from exportlm.stream._layers import CalibrationInputs
from exportlm.stream._pipeline import export_streaming
from exportlm.stream._placement import Placement, place_layers

__all__ = [
    "IN_MEMORY_FACTOR",
    "CalibrationInputs",
    "Placement",
    "export_streaming",
    "memory_limit",
    "model_bytes",
    "parse_memory",
    "place_layers",
    "should_stream",
]


def model_bytes(model_dir: str | os.PathLike[str]) -> int:
    """Bytes of the safetensors files of ``model_dir`` (the weights on disk)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def should_stream(model_dir: str | os.PathLike[str], max_memory: int | str | None = None) -> bool:
    """Whether an in-memory export of ``model_dir`` would not fit ``max_memory``
    (default: the cgroup limit, else the available memory)."""
    budget = parse_memory(max_memory) if max_memory is not None else memory_limit()
    return needs_streaming(model_bytes(model_dir), budget)
