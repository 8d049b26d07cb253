"""Streaming quantize + export: models larger than memory, one decoder layer at a time.

Streaming is a source of the ``hf_checkpoint`` target:
``export_model("hf_checkpoint", DIR, out, recipe=..., stream="auto", max_memory=...)``
reads a local Hugging Face checkpoint layer by layer when an in-memory export would not
fit (``stream=True``: always). This package is its public face: :func:`export_streaming`
is that call with ``stream=True`` (one implementation,
:mod:`exportlm.export.hf_checkpoint.stream`), :func:`should_stream` the rule
``stream="auto"`` applies, :func:`memory_limit` the budget it uses by default. See
``docs/streaming.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from exportlm.export.hf_checkpoint.stream._budget import (
    IN_MEMORY_FACTOR,
    memory_limit,
    model_bytes,
    parse_memory,
    should_stream,
)
from exportlm.export.hf_checkpoint.stream._layers import CalibrationInputs
from exportlm.export.hf_checkpoint.stream._placement import Placement, place_layers
from exportlm.module_exporters import ExportFormat

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


def export_streaming(
    model_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    recipe: Any = None,
    calibration: Sequence[torch.Tensor] | None = None,
    max_memory: int | str | None = None,
    calibration_inputs: CalibrationInputs = "quantized",
    format: ExportFormat = "modelopt",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Quantize and export the checkpoint in ``model_dir`` layer by layer (see ``docs/streaming.md``).

    The same as ``export_model("hf_checkpoint", model_dir, output_path, stream=True, ...)``
    with these options. The model is built on the ``meta`` device from ``config.json``;
    each decoder layer is read from the safetensors shards, quantized with ``recipe`` on
    the calibration activations, exported through the module exporters and the
    ``hf_checkpoint`` target's shard writer, and freed before the next. The result is the
    ``hf_checkpoint`` target's directory (same files, same bytes where the calibration is
    the same, see ``calibration_inputs``), published all at once with its manifest.

    A killed run leaves its progress in a private ``.NAME.stream-XXXXXXXX/`` beside
    ``output_path``; the same call again, on the same model files (by digest), continues
    after the last finished layer and writes the same bytes (see ``docs/streaming.md``).

    Args:
        model_dir: a local Hugging Face model directory (safetensors shards).
        output_path: the checkpoint directory to publish.
        recipe: a quantization recipe as :func:`~exportlm.quant.quantize` takes it, of
            any registered weight format (``"fp8"``, ``"int8_wo"``, ``"int4_awq"``,
            ``"nvfp4"``, ``"int8_sq"``, ``"w8a8"``, or a plugin's), with or
            without ``"+fp8_kv"``, or a mapping of module-name
            patterns to them (mixed precision) that leaves the modules outside the
            decoder layers unquantized; ``None`` for an unquantized re-export. It takes
            the scale convention of ``format`` (:meth:`QuantRecipe.for_layout
            <exportlm.quant.QuantRecipe.for_layout>`) unless it spells ``scales=``.
        calibration: ``input_ids`` batches; default: one batch of
            :func:`~exportlm.inputs.make_input_ids`, what ``quantize`` uses by default.
        max_memory: the memory the export may use beyond the process itself (bytes or
            ``"8GB"``); default: the cgroup limit less what the process holds, else the
            available memory. It must hold the largest module set, one output shard and
            one linear in float32 (else :class:`~exportlm.errors.LayerTooLargeError`);
            the calibration activations are kept in what it leaves, else on disk.
        calibration_inputs: ``"quantized"`` (each layer calibrated on the outputs of the
            already fake-quantized previous layers, as llm-compressor does) or ``"float"``
            (on the unquantized outputs, as whole-model calibration: the in-memory bytes).
        format, max_shard_size, dtype, overwrite: as for the ``hf_checkpoint`` target.

    Raises:
        StreamingUnsupportedError: a family or recipe that does not stream yet.
        LayerTooLargeError: one layer does not fit ``max_memory``.
        OutputExistsError: ``output_path`` is a non-empty directory and not ``overwrite``.
        StreamIntegrityError: what was written is not the whole model (nothing is published).
    """
    from exportlm.export import export_model

    return export_model(
        "hf_checkpoint",
        Path(model_dir),
        output_path,
        stream=True,
        recipe=recipe,
        calibration=calibration,
        max_memory=max_memory,
        calibration_inputs=calibration_inputs,
        format=format,
        max_shard_size=max_shard_size,
        dtype=dtype,
        overwrite=overwrite,
    )
