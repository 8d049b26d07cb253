"""The ``onnx`` target's past-key-values graph (``kv_cache=True``).

One graph, with the names, dtypes and shapes Optimum's exporter and
onnxruntime-genai use::

    input_ids [batch, sequence] int64
    attention_mask [batch, past_sequence + sequence] int64     (1 = token, 0 = padding)
    position_ids [batch, sequence] int64                       (models that take them)
    past_key_values.{i}.key / .value [batch, kv_heads, past_sequence, head_dim]
      -> logits [batch, sequence, vocab]
         present.{i}.key / .value [batch, kv_heads, past_sequence + sequence, head_dim]

``past_sequence`` may be 0 (onnxruntime runs zero-size tensors), so the prefill
is the same graph fed empty past tensors. Only the dynamo exporter, with dynamic
shapes, writes it. ``attention_mask`` is an input whenever the model's forward
takes one (``attention_mask=None``, the default); ``attention_mask=False`` writes
the graph without it (and without ``position_ids``), whose rows must then be
unpadded. Optimum silently drops the mask of a graph without one, so a padded
batch through such a graph is wrong: keep the default for serving.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidModelError, InvalidOptionError
from exportlm.export._fake_cache import fake_tensor_cache_off
from exportlm.export._past import (
    MaskedPastKVWrapper,
    MaskOnlyPastKVWrapper,
    PastKVWrapper,
    PastLayout,
    example_past,
    flat_past_names,
    past_dynamic_shapes,
    positions_from_mask,
    probe_past_layout,
)
from exportlm.export.job import ExportJob
from exportlm.export.onnx._registry import torchlib_registry_reused
from exportlm.export.onnx._serving import write_serving_files

__all__ = [
    "PAST_PREFIX",
    "PRESENT_PREFIX",
    "check_kv_cache_options",
    "export_past_graph",
    "torch_onnx_export",
]

#: Prefix of the past inputs: ``past_key_values.{i}.key`` / ``.value``.
PAST_PREFIX = "past_key_values"
#: Prefix of the present outputs: ``present.{i}.key`` / ``.value``.
PRESENT_PREFIX = "present"


def check_kv_cache_options(
    kv_cache: bool, *, dynamo: bool, dynamic: bool, attention_mask: bool | None
) -> None:
    """With ``kv_cache``, refuse options the past-key-values graph cannot honour (before writing)."""
    if not kv_cache:
        return
    refused = []
    if not dynamo:
        refused.append("dynamo=False (the legacy exporter bakes in the past length)")
    if not dynamic:
        refused.append("dynamic=False (the past length changes at every decode step)")
    if refused:
        raise InvalidOptionError(
            f"onnx export with kv_cache=True does not take {'; '.join(refused)}; "
            "drop these options, or export without kv_cache"
        )


def torch_onnx_export(
    job: ExportJob,
    wrapper: nn.Module,
    args: tuple[torch.Tensor, ...],
    options: dict[str, Any],
    recorded: dict[str, Any],
    tokenizer: Mapping[str, bytes] | None = None,
) -> None:
    """``torch.onnx.export`` of the logits-only ``wrapper`` on ``args``, or, when the target's
    ``recorded`` options say ``kv_cache``, of the past-key-values graph
    (:func:`export_past_graph`, honouring ``attention_mask``) and the serving files that
    ``layout`` / ``genai_config`` ask for (:mod:`._serving`), to ``job.staged``."""
    # The dynamo exporter traces faster without torch's FakeTensor cache (_fake_cache.py) and
    # with torchlib's function table built once per process (_registry.py).
    with contextlib.ExitStack() as stack:
        if options.get("dynamo"):
            stack.enter_context(fake_tensor_cache_off())
            stack.enter_context(torchlib_registry_reused())
        if recorded.get("kv_cache"):
            graph = export_past_graph(job, options, attention_mask=recorded.get("attention_mask"))
            write_serving_files(
                job.model,
                job.staged,
                graph,
                optimum=recorded.get("layout") == "optimum",
                genai=bool(recorded.get("genai_config")),
                tokenizer=tokenizer,
            )
        else:
            torch.onnx.export(wrapper, args, str(job.staged), **options)


def _wants_mask(layout: PastLayout, attention_mask: bool | None, where: str) -> bool:
    if attention_mask and not layout.attention_mask:
        raise InvalidModelError(
            f"attention_mask=True but {where}.forward takes no attention_mask argument; "
            "pass attention_mask=False (an unpadded-only graph) or give the forward a 2-D "
            "padding mask argument"
        )
    return layout.attention_mask if attention_mask is None else attention_mask


def example_mask(ids: torch.Tensor, past: int) -> torch.Tensor:
    """A padding mask ``[batch, past + sequence]`` for tracing, row 0 left-padded by one.

    Not all ones, so no masking code can specialize the graph to an unpadded batch.
    """
    mask = torch.ones((ids.shape[0], past + ids.shape[1]), dtype=torch.long, device=ids.device)
    mask[0, 0] = 0
    return mask


def export_past_graph(
    job: ExportJob, torch_options: dict[str, Any], *, attention_mask: bool | None = None
) -> PastLayout:
    """Export the past-key-values graph of ``job.model`` to ``job.staged``; returns its layout
    (``attention_mask`` / ``position_ids``: the graph's inputs).

    ``torch_options`` are the ``torch.onnx.export`` keywords of a logits-only export
    (opset, optimize, external data); names and dynamic shapes are replaced here.
    ``attention_mask``: ``None`` adds ``attention_mask`` (and ``position_ids``, when
    the forward takes them) inputs when the model's forward takes a mask; ``False``
    never; ``True`` requires them.

    Raises:
        InvalidModelError: the model has no usable KV cache, or ``attention_mask=True``
            for a forward without one (the message says why).
    """
    layout = probe_past_layout(job.model)
    masked = _wants_mask(layout, attention_mask, type(job.model).__name__)
    ids = job.inputs[0]
    layers = layout.num_layers
    past = example_past(layout, ids)
    options = dict(torch_options)
    options.pop("dynamic_axes", None)
    extra: list[str] = []
    args: tuple[Any, ...] = (ids, past)
    wrapper: nn.Module = PastKVWrapper(job.model, layout).eval()
    if masked and layout.position_ids:
        mask = example_mask(ids, int(past[0].shape[2]))
        extra = ["attention_mask", "position_ids"]
        args = (ids, mask, positions_from_mask(mask, int(ids.shape[1])), past)
        wrapper = MaskedPastKVWrapper(job.model, layout).eval()
    elif masked:
        extra = ["attention_mask"]
        args = (ids, example_mask(ids, int(past[0].shape[2])), past)
        wrapper = MaskOnlyPastKVWrapper(job.model, layout).eval()
    options["input_names"] = ["input_ids", *extra, *flat_past_names(layers, PAST_PREFIX)]
    options["output_names"] = ["logits", *flat_past_names(layers, PRESENT_PREFIX)]
    options["dynamic_shapes"] = past_dynamic_shapes(
        layers, attention_mask=masked, position_ids=layout.position_ids
    )
    with warnings.catch_warnings():
        # Every past tensor shares the batch and past_sequence dims on purpose; torch.onnx
        # warns once per repeated name that it keeps the first (the graph's names are right).
        warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
        torch.onnx.export(wrapper, args, str(job.staged), **options)
    if masked:
        name_mask_axis(job.staged)
    return replace(layout, attention_mask=masked, position_ids=masked and layout.position_ids)


#: The mask's length axis, as Optimum's exporter names the same sum.
MASK_AXIS = "past_sequence + sequence"


def name_mask_axis(path: Any) -> None:
    """Name the ``attention_mask`` length axis (``torch.export`` leaves it ``s<N>``).

    Only the graph's protobuf is rewritten; external data files are not read.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for value in model.graph.input:
        if value.name == "attention_mask":
            value.type.tensor_type.shape.dim[1].dim_param = MASK_AXIS
    onnx.save(model, str(path))
