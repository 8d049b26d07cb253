"""``export_streaming``: quantize and export a checkpoint directory one decoder layer at a time."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm._progress import progress
from exportlm.atomic import atomic_output, check_output_path
from exportlm.errors import OutputExistsError, StreamIntegrityError
from exportlm.export.guard import PendingManifest
from exportlm.export.hf_checkpoint.configs import quantization_section, write_configs
from exportlm.export.hf_checkpoint.naming import module_namer
from exportlm.export.hf_checkpoint.sink import CheckpointSink
from exportlm.export.hf_checkpoint.target import HF_CHECKPOINT_TARGET
from exportlm.export.hf_checkpoint.target import _one_torch_thread as one_torch_thread
from exportlm.export.hf_checkpoint.tokenizer import write_payload
from exportlm.inputs import make_input_ids
from exportlm.module_exporters import ExportFormat, export_quantized_state
from exportlm.quant import QuantRecipe
from exportlm.stream._budget import memory_limit, parse_memory
from exportlm.stream._checks import check_fits, check_streamable
from exportlm.stream._complete import check_complete
from exportlm.stream._key import resume_key
from exportlm.stream._layers import CalibrationInputs, capture_layer_inputs, quantize_layer
from exportlm.stream._memory import (
    map_large_allocations,
    release_freed,
    resident_bytes,
)
from exportlm.stream._sizing import fit_bound
from exportlm.stream._source import CheckpointSource
from exportlm.stream._summary import PhaseSink, PrefixSink, SummaryPart, merge_summaries
from exportlm.stream._work import ActivationStore, WorkArea
from exportlm.stream._writer import ResumableShardWriter, WriterState

__all__ = ["export_streaming"]

logger = logging.getLogger(__name__)


class _Run:
    """The state one streaming export carries from layer to layer."""

    def __init__(
        self,
        source: CheckpointSource,
        work: WorkArea,
        format: ExportFormat,
        max_shard_size: int | str,
        shells: tuple[set[str], set[str]],
    ) -> None:
        self.source, self.work, self.format = source, work, format
        self.writer = ResumableShardWriter(work.directory, max_shard_size=max_shard_size)
        self.sink = CheckpointSink(source.namer, self.writer, format)  # type: ignore[arg-type]
        self.head_names, self.tail_names = shells
        self.stored = source.stored_names()  # before a layer is quantized (check_complete)

    def checkpoint(self, tag: str) -> None:
        """Record progress after a part: spill the open shard, save, drop what it supersedes."""
        self.work.progress.writer = self.writer.spill(tag).to_json()
        self.work.save()
        self.writer.collect()
        release_freed()


def _shell_names(source: CheckpointSource) -> tuple[set[str], set[str]]:
    """The state-dict names before the decoder layers (head) and after them (tail)."""
    names = list(source.model.state_dict(keep_vars=True))
    inside = source.layout.layers + "."
    first = next(i for i, n in enumerate(names) if n.startswith(inside))
    return set(names[:first]), {n for n in names[first:] if not n.startswith(inside)}


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

    The model is built on the ``meta`` device from ``config.json``; each decoder layer is
    read from the safetensors shards, quantized with ``recipe`` on the calibration
    activations, exported through the module exporters and the ``hf_checkpoint`` sink,
    and freed before the next. The result is the ``hf_checkpoint`` target's directory
    (same files, same bytes where the calibration is the same, see
    ``calibration_inputs``), published all at once with its manifest.

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
    out = Path(output_path)
    check_output_path(out)
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    # the layout's scale convention: a compressed-tensors checkpoint is the calibrated model
    plan = QuantRecipe.parse(recipe).for_layout(format) if recipe is not None else None
    map_large_allocations()  # freed tensors go straight back to the system (see _memory.py)
    source = CheckpointSource(Path(model_dir))
    baseline = resident_bytes()  # before any weight: interpreter, torch, the meta model
    check_streamable(source.model, plan, source.reads_names, source.layout.layers)
    batches = list(calibration) if calibration is not None else [_default_ids(source.model)]
    budget = parse_memory(max_memory) if max_memory is not None else memory_limit()
    layers = [source.tensor_bytes(source.layer(i)) for i in range(source.layout.count)]
    acts = _activation_bytes(source.model, batches)
    shells = _shell_names(source)
    bound, largest, max_shard_size = fit_bound(
        source, shells, budget, max_shard_size, baseline, layers, acts, quantized=plan is not None
    )
    check_fits(budget, bound, largest)  # before anything is written
    options = _given(
        {"format": format, "max_shard_size": max_shard_size, "dtype": dtype, "overwrite": overwrite}
    )
    key = resume_key(
        source.directory,
        list(source.shard_of.values()),
        recipe,
        batches,
        calibration_inputs,
        options,
    )
    work = WorkArea(out, key)
    try:
        run = _Run(source, work, format, max_shard_size, shells)
        logger.info("streaming within a memory bound of %s", bound.describe())
        # the activations are held in what the budget leaves, else read back from the work area
        store = ActivationStore(work.directory, budget - bound.held if budget else 1 << 30)
        with one_torch_thread():  # as the hf_checkpoint target converts (see its docstring)
            summary = _export_parts(run, store, plan, batches, calibration_inputs, dtype)
        _publish(run, summary, out, options, dtype, overwrite)
    finally:
        work.release()  # kept for a later run to continue, unless published (removed)
    source.close()
    bound.report()
    return out


def _publish(
    run: _Run,
    summary: Any,
    out: Path,
    options: dict[str, Any],
    dtype: torch.dtype | None,
    overwrite: bool,
) -> None:
    """Finish the shards, check the checkpoint is the whole model, publish it with its manifest."""
    source, work = run.source, run.work
    written = run.writer.finish()
    logger.info(
        "streamed %d tensors (%d bytes) in %d file(s)",
        len(written.weight_map),
        written.total_size,
        len(written.files),
    )
    try:
        check_complete(source, work.progress.layers, written.weight_map, run.stored)
    except StreamIntegrityError:
        work.remove()  # its record led here: the next run must not continue it
        raise
    quant = quantization_section(summary, module_namer(source.model, run.sink.namer, False))
    manifest = PendingManifest(
        info=HF_CHECKPOINT_TARGET,
        model=None,  # never whole in memory: no model hash (see docs/streaming.md)
        options=options,  # as export_model records them: the options given
        vocab_size=getattr(source.model.config, "vocab_size", None),
        destination=Path(os.path.abspath(out)),
    )
    with atomic_output(
        out, directory=True, overwrite=overwrite, before_publish=manifest.hook
    ) as staged:
        work.link_into(staged, [*written.files, *filter(None, [written.index_file])])
        write_payload(staged, run.source.tokenizer_files)
        write_configs(source.model, staged, dtype, quant, run.format)
    work.remove()


def _export_parts(
    run: _Run,
    store: ActivationStore,
    plan: QuantRecipe | None,
    batches: list[torch.Tensor],
    mode: CalibrationInputs,
    dtype: torch.dtype | None,
) -> Any:
    """The head, every layer, then the tail, each exported and checkpointed; the merged summary."""
    source, progress_state = run.source, run.work.progress
    if progress_state.writer is not None:
        run.writer.resume(WriterState.from_json(progress_state.writer))
    inputs = _first_inputs(run, batches)
    release_freed()
    if progress_state.head is None:
        head = _export_shell(run, run.head_names, dtype)
        progress_state.head, progress_state.layers_done = head.to_json(), 0
        progress_state.activations = store.put(0, inputs.hidden)
        run.checkpoint("head")
    else:
        store.restore(progress_state.layers_done)
        logger.info(
            "resuming after layer %d of %d", progress_state.layers_done, source.layout.count
        )
    start, count = progress_state.layers_done, source.layout.count
    began = time.monotonic()
    for index in progress(
        range(start, count), "streaming layers", total=count - start, unit="layer"
    ):
        prefix = source.layout.prefix(index)
        layer = source.load(prefix)
        layer, outputs = quantize_layer(
            layer, plan, store.batches(), inputs.kwargs[index], mode, prefix
        )
        release_freed()  # the calibration's temporaries, before the export's
        part = export_quantized_state(
            layer, PrefixSink(run.sink, prefix + "."), format=run.format, dtype=dtype
        )  # type: ignore[arg-type]
        source.free(layer)
        del layer
        release_freed()  # the layer's pages back to the system before the next is read
        progress_state.layers.append(SummaryPart(part, prefix + ".").to_json())
        progress_state.layers_done = index + 1
        progress_state.activations = store.put(index + 1, outputs)
        run.checkpoint(f"layer{index}")
        _log_eta(index + 1 - start, count - start, began, index)
    tail = _export_shell(run, run.tail_names, dtype)
    head = SummaryPart.from_json(progress_state.head)
    head.written = run.head_names
    tail.written = run.tail_names
    return merge_summaries(head, [SummaryPart.from_json(p) for p in progress_state.layers], tail)


def _first_inputs(run: _Run, batches: list[torch.Tensor]) -> Any:
    """Layer 0's inputs per batch (the hidden states are re-read from disk when resuming)."""
    source = run.source
    with _loaded(source, run.head_names):
        layers = [source.layer(i) for i in range(source.layout.count)]
        return capture_layer_inputs(source.model, layers, batches)


def _export_shell(run: _Run, names: set[str], dtype: torch.dtype | None) -> SummaryPart:
    """Export the modules around the layers, writing only ``names`` (head or tail)."""
    source = run.source
    with _loaded(source, names), _without_layers(source) as shell:
        summary = export_quantized_state(
            shell, PhaseSink(run.sink, names), format=run.format, dtype=dtype
        )  # type: ignore[arg-type]
    return SummaryPart(summary, "", names)


@contextlib.contextmanager
def _loaded(source: CheckpointSource, names: set[str]) -> Iterator[None]:
    """The modules outside the layers that own ``names``, and every module with computed
    buffers (the rotary table), loaded for the duration (their own tensors only)."""
    model, layers = source.model, source.layout.layers + "."
    owners = {n.rsplit(".", 1)[0] if "." in n else "" for n in source.saved(names)}
    computed = {
        m
        for m, module in model.named_modules()
        if not m.startswith(layers) and _has_computed_buffers(module)
    }
    loaded = sorted(owners | computed)
    for name in loaded:
        source.load(name, recurse=False)
    try:
        yield
    finally:
        for name in loaded:
            source.free(model.get_submodule(name), recurse=False)


def _has_computed_buffers(module: nn.Module) -> bool:
    saved = set(module.state_dict(keep_vars=True))
    return any(b not in saved for b, _ in module.named_buffers(recurse=False))


@contextlib.contextmanager
def _without_layers(source: CheckpointSource) -> Iterator[nn.Module]:
    parent_name, _, attr = source.layout.layers.rpartition(".")
    parent = source.model.get_submodule(parent_name)
    layers = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList())
    try:
        yield source.model
    finally:
        setattr(parent, attr, layers)


_DEFAULTS = {"format": "modelopt", "max_shard_size": "5GB", "dtype": None, "overwrite": False}


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options that differ from the target's defaults (what a caller would have passed)."""
    return {k: v for k, v in options.items() if v != _DEFAULTS[k]}


def _default_ids(model: Any) -> torch.Tensor:
    return make_input_ids(int(model.config.vocab_size))


def _activation_bytes(model: nn.Module, batches: Sequence[torch.Tensor]) -> int:
    hidden = int(getattr(model.config, "hidden_size", 0))
    element = torch.finfo(next(model.parameters()).dtype).bits // 8
    return sum(b.numel() for b in batches) * hidden * element


def _log_eta(done: int, total: int, began: float, index: int) -> None:
    elapsed = time.monotonic() - began
    eta = elapsed / done * (total - done)
    logger.info(
        "layer %d done (%d/%d), %.1f s elapsed, ETA %.1f s", index, done, total, elapsed, eta
    )
