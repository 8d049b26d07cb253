"""The ``onnx`` target's past-key-values graph (``kv_cache=True``).

One graph, with the names Optimum and onnxruntime-genai use::

    input_ids [batch, sequence]
    past_key_values.{i}.key / .value [batch, kv_heads, past_sequence, head_dim]
      -> logits [batch, sequence, vocab]
         present.{i}.key / .value [batch, kv_heads, past_sequence + sequence, head_dim]

``past_sequence`` may be 0 (onnxruntime runs zero-size tensors), so the prefill
is the same graph fed empty past tensors. Only the dynamo exporter, with dynamic
shapes, writes it; there is no ``attention_mask`` input (no padding: every row
of a batch has the same length).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidInputError
from exportlm.export._past import (
    PastKVWrapper,
    example_past,
    flat_past_names,
    past_dynamic_shapes,
    probe_past_layout,
)
from exportlm.export.job import ExportJob

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
    if attention_mask:
        refused.append("attention_mask=True (the graph has no attention_mask input)")
    if refused:
        raise InvalidInputError(
            f"onnx export with kv_cache=True does not take {'; '.join(refused)}; "
            "drop these options, or export without kv_cache"
        )


def torch_onnx_export(
    job: ExportJob,
    wrapper: nn.Module,
    args: tuple[torch.Tensor, ...],
    options: dict[str, Any],
    *,
    kv_cache: bool,
) -> None:
    """``torch.onnx.export`` of the logits-only ``wrapper`` on ``args``, or with ``kv_cache``
    of the past-key-values graph (:func:`export_past_graph`), to ``job.staged``."""
    if kv_cache:
        export_past_graph(job, options)
    else:
        torch.onnx.export(wrapper, args, str(job.staged), **options)


def export_past_graph(job: ExportJob, torch_options: dict[str, Any]) -> None:
    """Export the past-key-values graph of ``job.model`` to ``job.staged``.

    ``torch_options`` are the ``torch.onnx.export`` keywords of a logits-only export
    (opset, optimize, external data); names and dynamic shapes are replaced here.

    Raises:
        InvalidModelError: the model has no usable KV cache (the message says why).
    """
    layout = probe_past_layout(job.model)
    ids = job.inputs[0]
    layers = layout.num_layers
    options = dict(torch_options)
    options.pop("dynamic_axes", None)
    options["input_names"] = ["input_ids", *flat_past_names(layers, PAST_PREFIX)]
    options["output_names"] = ["logits", *flat_past_names(layers, PRESENT_PREFIX)]
    options["dynamic_shapes"] = past_dynamic_shapes(layers)
    wrapper = PastKVWrapper(job.model, layout).eval()
    with warnings.catch_warnings():
        # Every past tensor shares the batch and past_sequence dims on purpose; torch.onnx
        # warns once per repeated name that it keeps the first (the graph's names are right).
        warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
        torch.onnx.export(wrapper, (ids, example_past(layout, ids)), str(job.staged), **options)
