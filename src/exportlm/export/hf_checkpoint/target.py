"""The ``hf_checkpoint`` export target: a (quantized) Hugging Face checkpoint directory.

Layout (see ``docs/checkpoint-format.md``)::

    out/
      model.safetensors                  # or model-0000i-of-0000N.safetensors + index
      model.safetensors.index.json       # only when sharded
      config.json                        # the model's config (+ quantization_config)
      generation_config.json             # when the model can generate
      hf_quant_config.json               # only when quantized, modelopt format
      tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   # with tokenizer=

The export driver (:func:`exportlm.module_exporters.export_quantized_state`) walks the
model one module at a time and hands every tensor to a
:class:`~exportlm.export.hf_checkpoint.sink.CheckpointSink`, so no full state
dict is ever built. The directory is assembled by the shared export job
(:func:`~exportlm.export.job.export_job`) in a temporary sibling, gets its manifest
(``exportlm-manifest.json``, :mod:`~exportlm.export.manifest`) and is swapped in
atomically (:func:`~exportlm.atomic.atomic_output`: the path names the old checkpoint
or the new one at every instant on Linux).

Only transformers ``PreTrainedModel`` instances are accepted: the checkpoint's
``config.json`` must name a model class that the runtime (and vLLM, TensorRT-LLM,
SGLang, transformers) can rebuild. A plain torch decoder gets a clear reason.

The weights come from one of two sources, written by the same shard writer and
published by the same job: the model in memory (:mod:`._write`), or a local model
directory (:mod:`.directory`), read layer by layer when it does not fit the memory it
may use (:mod:`.stream`, ``docs/streaming.md``) and loaded whole otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from exportlm.errors import InvalidOptionError
from exportlm.export.declaration import TargetInfo
from exportlm.export.hf_checkpoint._write import CheckpointOptions, export_in_memory
from exportlm.export.hf_checkpoint.configs import CHECKPOINT_FORMATS
from exportlm.export.hf_checkpoint.directory import (
    DirectorySource,
    export_directory,
    is_model_directory,
    without_source_options,
)
from exportlm.export.hf_checkpoint.tokenizer import describe_tokenizer, tokenizer_payload
from exportlm.export.job import ExportRequest, job_target
from exportlm.export.options import resolve_dtype
from exportlm.quant import check_layout_model

__all__ = ["HF_CHECKPOINT_TARGET", "build_hf_checkpoint_exporter", "export_hf_checkpoint"]

logger = logging.getLogger(__name__)

#: What ``dtype=`` may cast unquantized floating tensors to (a dtype or its name).
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _hf_accepts(model: Any) -> str | None:
    """Why this target cannot take ``model``, or ``None`` (a model directory is taken)."""
    if isinstance(model, (str, os.PathLike)):
        if is_model_directory(model):
            return None
        return f"{os.fspath(model)!r} is not a model directory (a directory of safetensors shards)"
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "transformers is not installed"
    if not isinstance(model, PreTrainedModel):
        return (
            f"{type(model).__name__} is not a transformers PreTrainedModel; a Hugging Face "
            "checkpoint needs a config.json naming a model class that loaders can rebuild "
            "(export plain torch models with onnx, torch_export or torchscript)"
        )
    return None


#: The ``hf_checkpoint`` target's declaration.
HF_CHECKPOINT_TARGET = TargetInfo(
    name="hf_checkpoint",
    runtime="hf_checkpoint",
    # Unquantized: the same float weights, the diff is 0. Quantized: measured 0 for
    # FP8 / NVFP4 / INT8 on every tiny family, < 4e-7 for AWQ (folded pre_quant_scale);
    # the bound is looser for any user model (op order, attention kernels); see docs.
    atol=1e-4,
    rtol=1e-3,
    capabilities=frozenset({"quantized", "multi_file", "cuda"}),
    artifact="directory",
    artifact_kind="hf_checkpoint",
    capture="weights",  # the runtime rebuilds the model from the saved weights
    accepts=_hf_accepts,
    description="Hugging Face checkpoint directory (safetensors shards; ModelOpt, compressed-tensors, finegrained-fp8 or gpt-oss-mxfp4 quantization)",
    runtime_library="safetensors",
)


@job_target(HF_CHECKPOINT_TARGET)
def export_hf_checkpoint(
    request: ExportRequest,
    *,
    format: Literal[
        "modelopt", "compressed-tensors", "finegrained-fp8", "gpt-oss-mxfp4"
    ] = "modelopt",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    is_qlora: bool = False,
    example_inputs: Any = None,
    safe_serialization: bool = True,
    tokenizer: Any = None,
    stream: bool | Literal["auto"] = "auto",
    max_memory: int | str | None = None,
    recipe: Any = None,
    calibration: Sequence[torch.Tensor] | None = None,
    calibration_inputs: Literal["quantized", "float"] = "quantized",
) -> Path:
    """Write ``model`` (quantized with :func:`exportlm.quant.quantize`, or not) as an HF checkpoint.

    The factory is ``export_hf_checkpoint(model, output_path, **options)``; its body gets
    the :class:`~exportlm.export.job.ExportRequest` (:func:`~exportlm.export.job.job_target`).

    Args:
        model: a transformers ``PreTrainedModel`` (never modified), or a local Hugging Face
            model directory (safetensors shards), quantized here with ``recipe``.
        output_path: the checkpoint directory. An existing non-empty directory is
            refused unless ``overwrite=True``, which replaces it atomically.
        format: ``"modelopt"`` (vLLM / TensorRT-LLM / SGLang),
            ``"compressed-tensors"`` (transformers; formats with a compressed-tensors
            scheme: of the built-ins, FP8 ``float-quantized``) or ``"finegrained-fp8"``
            (DeepSeek-V3's / Qwen3-FP8's ``quant_method: "fp8"``; ``fp8_block`` only) or
            ``"gpt-oss-mxfp4"`` (openai/gpt-oss's ``quant_method: "mxfp4"``: a GptOss model's
            experts in ``mxfp4``, nothing else quantized).
        max_shard_size: bytes per shard, an int or ``"500MB"``-style string.
        dtype: cast unquantized floating tensors to this dtype, a ``torch.dtype`` or its
            name (``"bfloat16"``); float32, float16 or bfloat16 (default: as in the model).
        overwrite: replace an existing non-empty directory.
        is_qlora: drop LoRA adapters and write ``base_layer`` weights under the base names.
        example_inputs: accepted for API uniformity; nothing is traced.
        safe_serialization: must be true: the checkpoint is safetensors only, never pickle.
        tokenizer: the tokenizer files to carry (``docs/checkpoint-format.md``): a
            tokenizer object (its ``save_pretrained``) or a model directory (its
            ``tokenizer.json``, ``tokenizer_config.json``, chat template, ...); read before
            anything else is done. ``None``: weights and configs only (a model
            directory: its own tokenizer files).
        stream, max_memory, recipe, calibration, calibration_inputs: a model directory
            only (the source options, :class:`~.directory.DirectorySource`; never in the
            manifest). ``stream="auto"`` reads it layer by layer when an in-memory export
            would not fit ``max_memory`` (``docs/streaming.md``), ``True`` always, ``False``
            never; ``recipe`` and ``calibration`` quantize it.

    Returns:
        ``output_path``.
    """
    del example_inputs  # weights only: there is nothing to trace
    if not safe_serialization:
        raise InvalidOptionError(
            "hf_checkpoint writes safetensors only (pickle checkpoints can run code on load); "
            "drop safe_serialization=False"
        )
    if format not in CHECKPOINT_FORMATS:
        raise InvalidOptionError(
            f"format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {format!r}"
        )
    cast_to: torch.dtype | None = None
    if dtype is not None:
        cast_to = resolve_dtype(dtype, where="hf_checkpoint dtype", supported=_FLOAT_DTYPES)
    source = DirectorySource(stream, max_memory, recipe, calibration, calibration_inputs)
    request = without_source_options(request)
    if request.recorded is not None and "tokenizer" in request.recorded:
        recorded = {**request.recorded, "tokenizer": describe_tokenizer(tokenizer)}
        request = dataclasses.replace(request, recorded=recorded)
    files = tokenizer_payload(tokenizer) if tokenizer is not None else None
    options = CheckpointOptions(format, max_shard_size, cast_to, overwrite, is_qlora, files or {})
    if is_model_directory(request.model):
        return export_directory(request, source, options, given_dtype=dtype, tokenizer=files)
    source.refuse_for_model()
    check_layout_model(request.model, format)  # a model the layout cannot hold: nothing written
    recorded = {"format": format, "max_shard_size": max_shard_size, "dtype": cast_to}
    recorded |= {"overwrite": overwrite, "is_qlora": is_qlora}
    if tokenizer is not None:
        recorded["tokenizer"] = describe_tokenizer(tokenizer)
    return export_in_memory(request, options, recorded)


def build_hf_checkpoint_exporter() -> Callable[..., Path]:
    """The declared ``hf_checkpoint`` export factory, for code that builds its own registry."""
    return export_hf_checkpoint
