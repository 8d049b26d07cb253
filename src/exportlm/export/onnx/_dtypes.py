"""The dtypes an ONNX export runs in: a cast copy on request, and the dtypes refused up front."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from exportlm.errors import UnsupportedDtypeError
from exportlm.export._cast import cast_copy
from exportlm.export.job import ExportRequest
from exportlm.export.options import resolve_dtype

__all__ = ["in_dtype"]


#: The floating dtypes onnxruntime's CPU kernels run a graph in (measured: float32, float16).
_SUPPORTED_DTYPES = (torch.float32, torch.float16)
#: Dtypes that export but that onnxruntime's CPU kernels cannot run (see :func:`_check_dtypes`).
_REFUSED_DTYPES = frozenset({torch.bfloat16})


def _check_dtypes(model: Any) -> None:
    """Refuse a model holding tensors of a dtype onnxruntime cannot run, before anything is written.

    Measured (torch 2.13, onnxruntime 1.32 CPU): a bfloat16 model exports with both
    exporters, then onnxruntime refuses the graph when the session is created:
    ``NOT_IMPLEMENTED : Could not find an implementation for Add(14) node with name
    'node_add_12'`` (dynamo, toy decoder) and ``... for Where(16) node with name
    '/model/model/Where_1'`` (legacy, tiny Llama): its CPU kernels have no bfloat16
    arithmetic. float16 runs (max |logits diff| 7.6e-4 vs the float32 model on the toy
    decoder). FP8 initializers of quantized graphs are dequantized by ``DequantizeLinear``
    and are not affected.
    """
    if not isinstance(model, nn.Module):
        return  # export_job says what a model must be
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    for name, tensor in named:
        if tensor.dtype in _REFUSED_DTYPES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in _SUPPORTED_DTYPES)
            raise UnsupportedDtypeError(
                f"onnx export: {type(model).__name__} holds {tensor.dtype} tensors (first: "
                f"{name!r}); onnxruntime's CPU kernels cannot run a "
                f"{str(tensor.dtype).removeprefix('torch.')} graph (the session fails with "
                f"NOT_IMPLEMENTED). Supported dtypes: {supported}. Pass "
                "dtype=torch.float32 (CLI: -o dtype=fp32), export a float copy "
                "(model.float()), or load the model with dtype=torch.float32; the "
                "hf_checkpoint target keeps bfloat16 weights"
            )


def in_dtype(request: ExportRequest, dtype: Any) -> tuple[ExportRequest, torch.dtype | None]:
    """The request with its model cast to ``dtype`` (a copy; see ``cast_copy``), and the dtype;
    a model holding a dtype onnxruntime cannot run is refused (:func:`_check_dtypes`)."""
    cast_to = None
    if dtype is not None:
        cast_to = resolve_dtype(dtype, where="onnx dtype", supported=_SUPPORTED_DTYPES)
        request = replace(request, model=cast_copy(request.model, cast_to))
    _check_dtypes(request.model)
    return request, cast_to
