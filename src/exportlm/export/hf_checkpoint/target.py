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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from exportlm.errors import InvalidInputError
from exportlm.export.declaration import TargetInfo
from exportlm.export.hf_checkpoint.configs import (
    CHECKPOINT_FORMATS,
    CheckpointQuantization,
    quantization_section,
    write_configs,
)
from exportlm.export.hf_checkpoint.naming import CheckpointNamer, module_namer
from exportlm.export.hf_checkpoint.sink import CheckpointSink, ShardedSafetensorsWriter
from exportlm.export.hf_checkpoint.tokenizer import describe_tokenizer, tokenizer_payload
from exportlm.export.job import ExportRequest, export_job, job_target
from exportlm.export.options import resolve_dtype

__all__ = ["HF_CHECKPOINT_TARGET", "build_hf_checkpoint_exporter", "export_hf_checkpoint"]

logger = logging.getLogger(__name__)

#: What ``dtype=`` may cast unquantized floating tensors to (a dtype or its name).
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _hf_accepts(model: Any) -> str | None:
    """Why this target cannot take ``model``, or ``None``."""
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
    description="Hugging Face checkpoint directory (safetensors shards; ModelOpt or compressed-tensors quantization)",
    runtime_library="safetensors",
)


@job_target(HF_CHECKPOINT_TARGET)
def export_hf_checkpoint(
    request: ExportRequest,
    *,
    format: Literal["modelopt", "compressed-tensors"] = "modelopt",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    is_qlora: bool = False,
    example_inputs: Any = None,
    safe_serialization: bool = True,
    tokenizer: Any = None,
) -> Path:
    """Write ``model`` (quantized with :func:`exportlm.quant.quantize`, or not) as an HF checkpoint.

    The factory is ``export_hf_checkpoint(model, output_path, **options)``; its body gets
    the :class:`~exportlm.export.job.ExportRequest` (:func:`~exportlm.export.job.job_target`).

    Args:
        model: a transformers ``PreTrainedModel``; never modified.
        output_path: the checkpoint directory. An existing non-empty directory is
            refused unless ``overwrite=True``, which replaces it atomically.
        format: ``"modelopt"`` (vLLM / TensorRT-LLM / SGLang) or
            ``"compressed-tensors"`` (transformers; formats with a compressed-tensors
            scheme: of the built-ins, FP8 ``float-quantized``).
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
            anything else is done. ``None``: weights and configs only.

    Returns:
        ``output_path``.
    """
    del example_inputs  # weights only: there is nothing to trace
    if not safe_serialization:
        raise InvalidInputError(
            "hf_checkpoint writes safetensors only (pickle checkpoints can run code on load); "
            "drop safe_serialization=False"
        )
    if format not in CHECKPOINT_FORMATS:
        raise InvalidInputError(
            f"format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {format!r}"
        )
    cast_to: torch.dtype | None = None
    if dtype is not None:
        cast_to = resolve_dtype(dtype, where="hf_checkpoint dtype", supported=_FLOAT_DTYPES)
    from exportlm.module_exporters import export_quantized_state

    tokenizer_files = tokenizer_payload(tokenizer)
    if request.recorded is not None and "tokenizer" in request.recorded:
        recorded = {**request.recorded, "tokenizer": describe_tokenizer(tokenizer)}
        request = dataclasses.replace(request, recorded=recorded)
    options = {"format": format, "max_shard_size": max_shard_size, "dtype": cast_to}
    options |= {"overwrite": overwrite, "is_qlora": is_qlora}
    if tokenizer is not None:
        options["tokenizer"] = describe_tokenizer(tokenizer)
    with export_job(request, options=options, traced=False, overwrite=overwrite) as job:
        model, staging = job.model, job.staged
        job.manifest.hash_model_in_background()  # on worker threads while the export runs
        writer = ShardedSafetensorsWriter(staging, max_shard_size=max_shard_size)
        sink = CheckpointSink(CheckpointNamer(model), writer, format)
        try:
            with _one_torch_thread():
                summary = export_quantized_state(
                    model, sink, format=format, dtype=cast_to, is_qlora=is_qlora
                )
            quant = quantization_section(summary, module_namer(model, sink.namer, is_qlora))
            _write_configs(writer, model, cast_to, quant, format)
            for name, data in tokenizer_files.items():
                writer.write_file(name, data)
            written = writer.finish()
        except BaseException:
            writer.abort()  # no shard is being written into the directory about to be removed
            job.manifest.cancel_model_hash()
            raise
        finally:
            sink.close()
        job.manifest.record_files({name: d.entry() for name, d in written.digests.items()})
        logger.info(
            "hf_checkpoint: wrote %d tensors (%d bytes) in %d file(s) to %s",
            len(written.weight_map),
            written.total_size,
            len(written.files),
            request.output_path,
        )
    return request.output_path


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch's intra-op threads set to one while the exporters convert, then restored.

    The conversion runs elementwise kernels on small chunks (``quant/formats``), where
    an OpenMP team costs more than it gives, and on a busy machine far more: measured
    on 2 shared cores, FP8 of a 2816x1024 weight took 0.42 s with 2 threads and 0.015 s
    with 1, and the 170M benchmark export 4.0 CPU-s against 1.3. The parallelism comes
    from the threads that write and hash while the conversion goes on. The setting is
    the process's: torch work in other threads during the export runs on one thread too.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_configs(
    writer: ShardedSafetensorsWriter,
    model: Any,
    dtype: torch.dtype | None,
    quant: CheckpointQuantization | None,
    format: str,
) -> None:
    """The configs through ``writer``, so that it hashes them as it writes them.

    transformers' ``save_pretrained`` (its validation, a custom config's code) writes
    them into a scratch directory beside the staged one; their bytes (a few KB) are
    then written into the checkpoint, and hashed, from memory.
    """
    with tempfile.TemporaryDirectory(dir=writer.directory.parent, prefix=".configs-") as tmp:
        scratch = Path(tmp)
        write_configs(model, scratch, dtype, quant, format)
        for path in sorted(p for p in scratch.rglob("*") if p.is_file()):
            writer.write_file(path.relative_to(scratch).as_posix(), path.read_bytes())


def build_hf_checkpoint_exporter() -> Callable[..., Path]:
    """The declared ``hf_checkpoint`` export factory, for code that builds its own registry."""
    return export_hf_checkpoint
