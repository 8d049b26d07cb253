"""What every ``hf_checkpoint`` export does with its writer, whichever source the weights come from.

:func:`export_model_weights` is the in-memory source: the whole model handed to the export
driver at once. The streamed source (:mod:`~exportlm.export.hf_checkpoint.stream`) hands it
one decoder layer at a time. Both write through one
:class:`~exportlm.export.hf_checkpoint.shards.ShardedSafetensorsWriter`, end in
:func:`finish_checkpoint` (configs, tokenizer files, the last shard and the index, every
file hashed as it is written) and publish through the export job
(:func:`~exportlm.export.job.export_job`: one manifest, one atomic publish).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exportlm.export.hf_checkpoint.configs import (
    CheckpointQuantization,
    quantization_section,
    write_configs,
)
from exportlm.export.hf_checkpoint.naming import CheckpointNamer, module_namer
from exportlm.export.hf_checkpoint.shards import ShardedSafetensorsWriter, WriteSummary
from exportlm.export.hf_checkpoint.sink import CheckpointSink
from exportlm.export.job import ExportJob, ExportRequest, export_job

if TYPE_CHECKING:
    from exportlm.module_exporters import ExportFormat

__all__ = [
    "CheckpointOptions",
    "export_in_memory",
    "export_model_weights",
    "finish_checkpoint",
    "one_torch_thread",
]

logger = logging.getLogger("exportlm.export.hf_checkpoint.target")


@dataclass(frozen=True)
class CheckpointOptions:
    """The checkpoint's options, checked by the target: what every source writes by."""

    format: ExportFormat
    max_shard_size: int | str
    dtype: torch.dtype | None  # unquantized floating tensors cast to it
    overwrite: bool
    is_qlora: bool
    tokenizer_files: Mapping[str, bytes]


def export_in_memory(
    request: ExportRequest, options: CheckpointOptions, recorded: Mapping[str, Any]
) -> Path:
    """The in-memory source: ``request.model`` written whole, published by the export job.

    ``recorded``: the options the manifest records when the target was called directly.
    """
    with export_job(request, options=recorded, traced=False, overwrite=options.overwrite) as job:
        written = export_model_weights(job, options)
        job.manifest.record_files({name: d.entry() for name, d in written.digests.items()})
        logger.info(
            "hf_checkpoint: wrote %d tensors (%d bytes) in %d file(s) to %s",
            len(written.weight_map),
            written.total_size,
            len(written.files),
            request.output_path,
        )
    return request.output_path


def export_model_weights(job: ExportJob, options: CheckpointOptions) -> WriteSummary:
    """Write the in-memory ``job.model`` into ``job.staged``; the files it wrote, hashed.

    The writer is aborted on every way out but success (its writer thread stopped).
    """
    from exportlm.module_exporters import checkpoint_bytes_at_least, export_quantized_state

    model = job.model
    job.manifest.hash_model_in_background()  # if asked for: on worker threads meanwhile
    # the shard's file allocated from the start, an lm_head that comes last included
    expected = checkpoint_bytes_at_least(model, dtype=options.dtype, is_qlora=options.is_qlora)
    writer = ShardedSafetensorsWriter(
        job.staged, max_shard_size=options.max_shard_size, expected_bytes=expected
    )
    sink = CheckpointSink(CheckpointNamer(model), writer, options.format)
    try:
        with one_torch_thread():
            summary = export_quantized_state(
                model, sink, format=options.format, dtype=options.dtype, is_qlora=options.is_qlora
            )
        quant = quantization_section(summary, module_namer(model, sink.namer, options.is_qlora))
        written = finish_checkpoint(writer, model, quant, options)
    except BaseException:
        writer.abort()  # no shard is being written into the directory about to be removed
        job.manifest.cancel_model_hash()
        raise
    finally:
        sink.close()
    return written


def finish_checkpoint(
    writer: ShardedSafetensorsWriter,
    model: Any,
    quant: CheckpointQuantization | None,
    options: CheckpointOptions,
) -> WriteSummary:
    """The configs and tokenizer files through ``writer`` (hashed as written), then its last
    shard and the index: every file of the checkpoint but the manifest."""
    _write_configs(writer, model, options.dtype, quant, options.format)
    for name, data in options.tokenizer_files.items():
        writer.write_file(name, data)
    return writer.finish()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
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
    them into a scratch directory beside the writer's; their bytes (a few KB) are
    then written into the checkpoint, and hashed, from memory.
    """
    with tempfile.TemporaryDirectory(dir=writer.directory.parent, prefix=".configs-") as tmp:
        scratch = Path(tmp)
        write_configs(model, scratch, dtype, quant, format)
        for path in sorted(p for p in scratch.rglob("*") if p.is_file()):
            writer.write_file(path.relative_to(scratch).as_posix(), path.read_bytes())
