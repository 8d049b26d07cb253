"""The streamed source of the ``hf_checkpoint`` target: a checkpoint directory one decoder layer at a time.

:func:`stream_checkpoint` is what ``export_model("hf_checkpoint", DIR, out, ...)`` runs
when the directory streams (:mod:`~exportlm.export.hf_checkpoint.directory`; the public
face is :mod:`exportlm.stream`, see ``docs/streaming.md``). It reads each decoder layer
from the safetensors shards into a ``meta``-device model, quantizes it on the calibration
activations, exports it through the module exporters into the target's one shard writer
(resumable: its progress is recorded after every layer in a private work area) and
publishes through the export job, as the in-memory source does: one manifest, one
atomic publish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm._progress import progress
from exportlm.errors import StreamIntegrityError
from exportlm.export.hf_checkpoint._write import (
    CheckpointOptions,
    finish_checkpoint,
    one_torch_thread,
)
from exportlm.export.hf_checkpoint.configs import quantization_section
from exportlm.export.hf_checkpoint.naming import module_namer
from exportlm.export.hf_checkpoint.shards import ShardedSafetensorsWriter, WriterState
from exportlm.export.hf_checkpoint.sink import CheckpointSink
from exportlm.export.hf_checkpoint.stream._budget import memory_limit, parse_memory
from exportlm.export.hf_checkpoint.stream._checks import check_fits, check_streamable
from exportlm.export.hf_checkpoint.stream._complete import check_complete
from exportlm.export.hf_checkpoint.stream._key import resume_key
from exportlm.export.hf_checkpoint.stream._layers import (
    CalibrationInputs,
    capture_layer_inputs,
    quantize_layer,
)
from exportlm.export.hf_checkpoint.stream._memory import (
    map_large_allocations,
    release_freed,
    resident_bytes,
)
from exportlm.export.hf_checkpoint.stream._sizing import calibration_algorithms, fit_bound
from exportlm.export.hf_checkpoint.stream._source import CheckpointSource
from exportlm.export.hf_checkpoint.stream._stored_extras import left_out
from exportlm.export.hf_checkpoint.stream._summary import (
    PhaseSink,
    PrefixSink,
    SummaryPart,
    merge_summaries,
)
from exportlm.export.hf_checkpoint.stream._work import ActivationStore, WorkArea
from exportlm.export.job import ExportRequest, export_job
from exportlm.hfdir import warn_left_out
from exportlm.inputs import make_input_ids
from exportlm.module_exporters import ExportFormat, export_quantized_state
from exportlm.quant import QuantRecipe, check_layout, check_layout_model, resolve_algorithm

__all__ = ["stream_checkpoint"]

logger = logging.getLogger("exportlm.stream")  # the documented logger of the streaming export


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
        self.writer = ShardedSafetensorsWriter(
            work.directory, max_shard_size=max_shard_size, resumable=True
        )
        self.sink = CheckpointSink(source.namer, self.writer, format)
        self.head_names, self.tail_names = shells
        self.stored = source.stored_names()  # before a layer is quantized (check_complete)
        model = type(source.model).__name__
        warn_left_out(left_out(source), str(source.directory), model)  # as in memory

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


def stream_checkpoint(
    request: ExportRequest,
    how: Any,
    options: CheckpointOptions,
    given_dtype: Any,
    skeleton: nn.Module | None = None,
) -> Path:
    """Stream the model directory ``request.model`` into ``request.output_path``.

    ``how``: the :class:`~exportlm.export.hf_checkpoint.directory.DirectorySource`
    (recipe, calibration, ``max_memory``, ``calibration_inputs``); ``given_dtype``: the
    ``dtype`` as given (recorded in the manifest and the resume key as it was given);
    ``skeleton``: the directory's ``meta`` model the recipe was already checked on
    (:func:`~exportlm.export.hf_checkpoint.directory.checked_skeleton`), else built here.
    Raises as :func:`exportlm.stream.export_streaming` documents.
    """
    out = request.output_path  # checked by export_directory before anything is read
    # the layout's scale convention: a compressed-tensors checkpoint is the calibrated model
    recipe = how.recipe
    plan = QuantRecipe.parse(recipe).for_layout(options.format) if recipe is not None else None
    if plan is not None:
        check_layout(plan, options.format)  # a layout that cannot hold it: before any read
    map_large_allocations()  # freed tensors go straight back to the system (see _memory.py)
    source = CheckpointSource(Path(request.model), skeleton)
    check_layout_model(source.model, options.format)  # its model type, before a weight is read
    baseline = resident_bytes()  # before any weight: interpreter, torch, the meta model
    check_streamable(source.model, plan, source.reads_names, source.layout.layers)
    batches = list(how.calibration) if how.calibration is not None else [_default_ids(source)]
    budget = parse_memory(how.max_memory) if how.max_memory is not None else memory_limit()
    layers = [source.tensor_bytes(source.layer(i)) for i in range(source.layout.count)]
    shells = _shell_names(source)
    bound, largest, max_shard_size = fit_bound(
        source,
        shells,
        budget,
        options.max_shard_size,
        baseline,
        layers,
        _activation_bytes(source.model, batches),
        quantized=plan is not None,
        search=(_algorithms(plan), [int(b.numel()) for b in batches]),
    )
    check_fits(budget, bound, largest)  # before anything is written
    given = {"format": options.format, "max_shard_size": max_shard_size}
    given = _given(given | {"dtype": given_dtype, "overwrite": options.overwrite})
    shards = list(source.shard_of.values())
    key = resume_key(source.directory, shards, how.recipe, batches, how.calibration_inputs, given)
    work = WorkArea(out, key)
    try:
        run = _Run(source, work, options.format, max_shard_size, shells)
        logger.info("streaming within a memory bound of %s", bound.describe())
        # the activations are held in what the budget leaves, else read back from the work area
        store = ActivationStore(work.directory, budget - bound.held if budget else 1 << 30)
        with one_torch_thread():  # as the in-memory source converts (see its docstring)
            summary = _export_parts(run, store, plan, batches, how.calibration_inputs, options)
        _publish(run, summary, request, given, options)
    finally:
        work.release()  # kept for a later run to continue, unless published (removed)
    source.close()
    bound.report()
    return out


def _publish(
    run: _Run,
    summary: Any,
    request: ExportRequest,
    given: dict[str, Any],
    options: CheckpointOptions,
) -> None:
    """Finish the checkpoint in the work area, check it is the whole model, publish it
    through the export job with its manifest (the files' digests as they were written)."""
    source, work = run.source, run.work
    quant = quantization_section(summary, module_namer(source.model, run.sink.namer, False))
    written = finish_checkpoint(run.writer, source.model, quant, options)
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
    # never whole in memory: no weight check, no model hash (see docs/streaming.md); the
    # manifest records the options given, as export_model does
    streamed = dataclasses.replace(request, model=source.model, recorded=None)
    with export_job(
        streamed, options=given, traced=False, overwrite=options.overwrite, streamed=True
    ) as job:
        work.link_into(job.staged, sorted(written.digests))
        job.manifest.record_files({name: d.entry() for name, d in written.digests.items()})
    work.remove()


def _export_parts(
    run: _Run,
    store: ActivationStore,
    plan: QuantRecipe | None,
    batches: list[torch.Tensor],
    mode: CalibrationInputs,
    options: CheckpointOptions,
) -> Any:
    """The head, every layer, then the tail, each exported and checkpointed; the merged summary."""
    source, progress_state, dtype = run.source, run.work.progress, options.dtype
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


def _default_ids(source: CheckpointSource) -> torch.Tensor:
    return make_input_ids(int(source.model.config.vocab_size))


def _algorithms(plan: QuantRecipe | None) -> frozenset[str]:
    """The calibration algorithms of the recipes ``plan`` applies (default and overrides)."""
    spelled = [] if plan is None else [plan.algo, *(a for _, a in plan.overrides)]
    return calibration_algorithms([resolve_algorithm(a) for a in spelled if a is not None])


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
