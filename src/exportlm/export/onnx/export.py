"""The built-in ``onnx`` export target: ``torch.onnx.export`` behind the shared export job.

Design notes (measured with torch 2.13 CPU, transformers 5.24, onnxruntime 1.32):

* The dynamo exporter (default) keeps batch and sequence symbolic. The legacy
  TorchScript-based exporter (``dynamo=False``) is ~15x faster but bakes
  shape-dependent Python values into the graph: on a plain ``nn.MultiheadAttention``
  decoder the result fails in onnxruntime at any other sequence length. It is
  offered honestly: when the trace recorded such values a single
  :class:`~exportlm.export.onnx.LegacyTraceWarning` says so.
* transformers models get an explicit ``attention_mask`` graph input: the legacy
  exporter fails on ``aten::diff`` in transformers-5 masking without one, and with
  it both exporters produce graphs that honour padding. The runtime feeds ones.
* Opset 23 with dynamic shapes emits a ``RotaryEmbedding`` node that onnxruntime
  1.32 rejects; 18-22 work, the default is :data:`DEFAULT_OPSET`.
* External data is written only when the weights exceed protobuf's 2 GiB limit,
  so a small model is one self-contained ``.onnx`` file. The data file is named after
  its content (``model.onnx.<sha256[:16]>.data``) and published before the graph that
  references it, so a crash or a concurrent writer never pairs a graph with another
  export's weights; data files no graph uses any more are removed after publishing.
* ``onnx`` and ``onnxscript`` are optional (the ``onnx`` extra): this module
  imports neither, and an export without them raises
  :class:`~exportlm.errors.MissingDependencyError` before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm._transformers_model import is_transformers_model
from exportlm.errors import InvalidModelError, InvalidOptionError
from exportlm.export._optional import require_modules
from exportlm.export._wrapper import ExportCacheWrapper, accepts_attention_mask
from exportlm.export.declaration import TargetInfo
from exportlm.export.hf_checkpoint.tokenizer import describe_tokenizer, write_payload
from exportlm.export.job import ExportJob, ExportRequest, export_job, job_target
from exportlm.export.onnx._dtypes import in_dtype
from exportlm.export.onnx._external import name_external_data_by_content
from exportlm.export.onnx._folder import owned_companions, tokenizer_beside_graph
from exportlm.export.onnx._io import AXES, INPUT_NAMES, OUTPUT_NAMES
from exportlm.export.onnx._legacy import (
    consolidate_external_data,
    legacy_graph_log_captured,
    warn_legacy_trace,
)
from exportlm.export.onnx._past import check_kv_cache_options, torch_onnx_export
from exportlm.export.onnx._qdq import check_quantized_export, qdq_refusal, quantized_graph
from exportlm.export.onnx._serving import check_serving_options, serving_files

__all__ = [
    "DEFAULT_OPSET",
    "ONNX_ATOL",
    "ONNX_RTOL",
    "ONNX_TARGET",
    "build_onnx_exporter",
    "export_onnx_target",
    "export_to_onnx",
]

#: Default ONNX opset: inside the 18-22 range that both exporters and onnxruntime 1.32 handle
#: with dynamic shapes (23 emits RotaryEmbedding, which onnxruntime rejects); >= 19 keeps
#: FLOAT8 initializers for quantized graphs.
DEFAULT_OPSET = 20
_MAX_TESTED_OPSET = 22
#: The oldest opset torch's dynamo exporter writes.
_DYNAMO_MIN_OPSET = 18

# Tolerance: the onnxruntime CPU kernels reorder float32 reductions. Measured max |diff| of
# logits vs eager: 6e-8..1.2e-7 on the tiny toy/HF models (dynamo and legacy alike) and 2e-6 on
# a 58M-parameter Llama; the MoE models additionally differ by the batched_mm experts kernel
# used for export (~1e-7). 1e-4 absolute leaves a 50x margin over the largest measurement while
# still failing any real graph error (those are >= 1e-2 on logits of magnitude ~1).
ONNX_ATOL = 1e-4
ONNX_RTOL = 1e-4

#: What to try when the exporter fails, by ``dynamo``.
_HINTS = {
    False: "Try dynamo=True (the default).",
    True: "Try dynamo=False (legacy exporter) or another opset in 18-22.",
}

#: Above this many bytes of weights, protobuf cannot hold the model: use external data.
_PROTOBUF_LIMIT = 2**31


def _onnx_cuda_available() -> bool:
    """Whether onnxruntime's CUDA execution provider is installed.

    Read from package metadata: importing onnxruntime to ask costs ~0.1 s and
    ~13 MB in every process that merely registers the targets.
    """
    from importlib import metadata

    try:
        metadata.distribution("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        return False
    return True


_CAPABILITIES = {"dynamic_shapes", "multi_file", "quantized", "kv_cache"} | (
    {"cuda"} if _onnx_cuda_available() else set()
)


def _weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _check_opset(opset: Any, dynamo: bool) -> None:
    """Refuse an opset the exporter would not write: asked for one below 18 (dynamo) or
    newer than the installed onnx knows, torch 2.13's exporter wrote opset 18 instead,
    without a word, and the graph then failed in runtimes that need the opset asked."""
    if not isinstance(opset, int) or isinstance(opset, bool) or opset < 7:
        raise InvalidOptionError(f"opset must be an int ONNX opset version (18-22), got {opset!r}")
    newest = _newest_opset()
    if newest is not None and opset > newest:
        raise InvalidOptionError(
            f"opset {opset} is newer than any the installed onnx knows (up to {newest}); "
            f"the exporter would write opset {_DYNAMO_MIN_OPSET} instead. Pass an opset from "
            f"{_DYNAMO_MIN_OPSET} to {_MAX_TESTED_OPSET} (tested)"
        )
    if dynamo and opset < _DYNAMO_MIN_OPSET:
        raise InvalidOptionError(
            f"opset {opset}: torch's dynamo exporter writes opset {_DYNAMO_MIN_OPSET} or newer "
            f"(asked for an older one, it writes {_DYNAMO_MIN_OPSET}). Pass dynamo=False (the "
            f"TorchScript exporter, deprecated in torch 2.13) for opset {opset}, or an opset "
            f"from {_DYNAMO_MIN_OPSET}"
        )
    if opset > _MAX_TESTED_OPSET:
        warnings.warn(
            f"opset {opset} is above {_MAX_TESTED_OPSET}; onnxruntime 1.32 rejects the "
            "RotaryEmbedding node opset 23 emits with dynamic shapes",
            UserWarning,
            stacklevel=3,
        )


def _newest_opset() -> int | None:
    """The newest default-domain opset the installed ``onnx`` knows (``None``: no onnx)."""
    try:
        import onnx
    except ImportError:  # _require_exporter says what to install
        return None
    return int(onnx.defs.onnx_opset_version())


def _require_exporter(dynamo: bool) -> None:
    """The ONNX packages this export needs, or :class:`MissingDependencyError`."""
    needed = ("onnx", "onnxscript") if dynamo else ("onnx",)
    which = "dynamo" if dynamo else "legacy"
    require_modules(
        *needed, extra="onnx", purpose=f"exporting with the 'onnx' target ({which} exporter)"
    )


def _export_args(
    job: ExportJob, attention_mask: bool | None
) -> tuple[ExportCacheWrapper, tuple[torch.Tensor, ...], list[str]]:
    """The wrapper, positional args and input names for one export."""
    wants_mask = (
        attention_mask
        if attention_mask is not None
        else is_transformers_model(job.model) and accepts_attention_mask(job.model)
    )
    if wants_mask and not accepts_attention_mask(job.model):
        raise InvalidModelError(
            f"attention_mask=True but {type(job.model).__name__}.forward takes no "
            "attention_mask argument; pass attention_mask=False"
        )
    ids = job.inputs[0]
    wrapper = ExportCacheWrapper(job.model).eval()
    if wants_mask:
        mask = job.inputs[1] if len(job.inputs) > 1 else torch.ones_like(ids)
        return wrapper, (ids, mask), list(INPUT_NAMES)
    return wrapper, (ids,), list(INPUT_NAMES[:1])


def _torch_onnx_options(
    names: list[str], *, opset: int, dynamo: bool, dynamic: bool, optimize: bool, external: bool
) -> dict[str, Any]:
    """Keyword arguments of ``torch.onnx.export`` for one export."""
    options: dict[str, Any] = {
        "input_names": names,
        "output_names": list(OUTPUT_NAMES),
        "opset_version": opset,
        "dynamo": dynamo,
        "external_data": external,
        "verbose": False,
    }
    if dynamo:
        options["optimize"] = optimize
        if dynamic:
            # Names become Dim.DYNAMIC and then the graph's axis names. The mask's sequence
            # axis shares the ids' symbol, so it stays unnamed (naming it again warns).
            mask_axes = {0: AXES[0], 1: torch.export.Dim.DYNAMIC}
            options["dynamic_shapes"] = {
                name: dict(AXES) if name == "input_ids" else mask_axes for name in names
            }
    elif dynamic:
        options["dynamic_axes"] = {name: dict(AXES) for name in [*names, *OUTPUT_NAMES]}
    return options


#: The ``onnx`` target's declaration.
ONNX_TARGET = TargetInfo(
    name="onnx",
    runtime="onnx",
    atol=ONNX_ATOL,
    rtol=ONNX_RTOL,
    capabilities=frozenset(_CAPABILITIES),
    accepts=qdq_refusal,
    suffix=".onnx",
    artifact_kind="onnx",
    capture="torch.export",  # the dynamo exporter runs torch.export first
    description="ONNX graph (torch.onnx dynamo exporter, dynamic batch/seq) run in onnxruntime",
    runtime_library="onnxruntime",
)


@job_target(ONNX_TARGET)
def export_onnx_target(
    request: ExportRequest,
    *,
    example_inputs: Any = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
    dynamic: bool = True,
    optimize: bool = True,
    external_data: bool | None = None,
    attention_mask: bool | None = None,
    kv_cache: bool = False,
    layout: str = "file",
    genai_config: bool = False,
    dtype: torch.dtype | str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Export ``model`` to an ONNX file at ``output_path``; returns the path.

    The factory is ``export_onnx_target(model, output_path, **options)``; its body gets
    the :class:`~exportlm.export.job.ExportRequest` (:func:`~exportlm.export.job.job_target`).

    Args:
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``. It is exported in eval
            mode with traceable MoE experts and restored afterwards.
        output_path: the ``.onnx`` file to write (atomically).
        example_inputs: ``input_ids`` [batch, seq] or a tuple ``(input_ids, attention_mask)``;
            default: deterministic ids [2, 8] from the model's vocabulary.
        opset: ONNX opset; 18-22 are tested with onnxruntime. The dynamo exporter writes
            18 or newer (an older one needs ``dynamo=False``); one newer than the installed
            ``onnx`` knows is refused.
        dynamo: ``True`` uses ``torch.onnx``'s dynamo exporter; ``False`` the legacy
            TorchScript-based exporter (faster; may bake in the sequence length, see
            :class:`~exportlm.export.onnx.LegacyTraceWarning`).
        dynamic: symbolic ``batch`` and ``sequence`` axes on every input and the logits.
        optimize: run the onnxscript graph optimizer (dynamo only).
        external_data: write weights to ``<file>.<sha256[:16]>.data``; ``None`` (default) only when
            they exceed the 2 GiB protobuf limit.
        attention_mask: add an ``attention_mask`` graph input; ``None`` (default) does so
            for transformers models, whose masking needs it for the legacy exporter.
        kv_cache: export the past-key-values graph instead (``past_key_values.{i}.key`` ...
            in, ``logits`` and ``present.{i}.key`` ... out; see :mod:`._past`); dynamo only.
        layout: ``"optimum"`` also writes ``config.json`` and ``generation_config.json``
            beside the graph, the folder Optimum's ``ORTModelForCausalLM`` loads
            (``kv_cache=True``, transformers models; see :mod:`._serving`).
        genai_config: also write onnxruntime-genai's ``genai_config.json`` beside the graph
            (``kv_cache=True``, transformers models).
        dtype: export a copy whose bfloat16 / float16 / float32 tensors are cast to this
            dtype (``torch.float32`` or ``torch.float16``, or its name), e.g. a bfloat16
            checkpoint as onnxruntime's CPU kernels can run it; the model is not changed.
            Quantized (FP8, integer) tensors stay as they are. Default: the model's own.
        tokenizer: a tokenizer object (its ``save_pretrained``) or a model directory: its
            ``tokenizer.json``, ``tokenizer_config.json``, chat template, ... are written
            beside the graph and listed in the manifest (what a runtime's tokenizer reads
            from the folder); with ``genai_config`` they choose a pad id no prompt holds
            (:mod:`._folder`). ``exportlm export --model DIR`` passes the directory.

    Raises:
        InvalidModelError / InvalidInputError: the model or inputs do not fit.
        UnsupportedDtypeError: the model holds bfloat16 tensors, which onnxruntime's CPU
            kernels cannot run (pass ``dtype=torch.float32``); supported: float32, float16.
        MissingDependencyError: ``onnx`` (or, for ``dynamo=True``, ``onnxscript``) is
            not installed: ``pip install 'exportlm[onnx]'``.
        ExportFailedError: ``torch.onnx.export`` failed (the cause is chained).
    """
    _check_opset(opset, dynamo)
    request, cast_to = in_dtype(request, dtype)
    model = request.model
    check_kv_cache_options(kv_cache, dynamo=dynamo, dynamic=dynamic, attention_mask=attention_mask)
    check_serving_options(model, layout=layout, genai_config=genai_config, kv_cache=kv_cache)
    check_quantized_export(model, opset=opset, dynamo=dynamo)
    _require_exporter(dynamo)
    recorded: dict[str, Any] = {
        "opset": opset,
        "dynamo": dynamo,
        "dynamic": dynamic,
        "optimize": optimize,
        "external_data": external_data,
        "attention_mask": attention_mask,
        "kv_cache": kv_cache,
        **({"dtype": str(cast_to).removeprefix("torch.")} if cast_to is not None else {}),
    }
    if layout != "file" or genai_config:  # recorded only when asked: older manifests stay equal
        recorded.update(layout=layout, genai_config=genai_config)
    carried = tokenizer_beside_graph(tokenizer)  # read (or refused) before any work
    if tokenizer is not None:
        recorded["tokenizer"] = describe_tokenizer(tokenizer)
    writes = [*serving_files(layout, genai_config), *carried]
    with export_job(
        request,
        example_inputs,
        hint=_HINTS[dynamo],
        options=recorded,
        companions=owned_companions(request.output_path, writes),
    ) as job:
        write_payload(job.staged.parent, carried)
        wrapper, args, names = _export_args(job, attention_mask)
        use_external = (
            external_data if external_data is not None else _weight_bytes(model) > _PROTOBUF_LIMIT
        )
        options = _torch_onnx_options(
            names,
            opset=opset,
            dynamo=dynamo,
            dynamic=dynamic,
            optimize=optimize,
            external=use_external,
        )
        # No torch.no_grad() here: under no_grad nn.MultiheadAttention takes its fused
        # fast path (aten::_native_multi_head_attention), which the legacy exporter rejects.
        with (
            legacy_graph_log_captured(job.noise) if not dynamo else contextlib.nullcontext(),
            quantized_graph(job.model, opset=opset) as translations,  # QDQ: see _qdq.py
        ):
            if translations:
                options["custom_translation_table"] = translations
            torch_onnx_export(job, wrapper, args, options, recorded, carried)  # see _past.py
        if not dynamo:
            if use_external:
                consolidate_external_data(job.staged)
            warn_legacy_trace(job, dynamic)
        if use_external:
            name_external_data_by_content(job.staged)
    return request.output_path


def export_to_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    example_inputs: Any = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
    dynamic: bool = True,
    optimize: bool = True,
    external_data: bool | None = None,
    attention_mask: bool | None = None,
) -> Path:
    """Export ``model`` to ONNX at ``path`` (stable API); see :func:`export_onnx_target`."""
    return export_onnx_target(
        model,
        Path(path),
        example_inputs=example_inputs,
        opset=opset,
        dynamo=dynamo,
        dynamic=dynamic,
        optimize=optimize,
        external_data=external_data,
        attention_mask=attention_mask,
    )


def build_onnx_exporter() -> Callable[..., Path]:
    """The declared ``onnx`` export factory, for code that builds its own registry or wraps it.

    ``onnx`` is registered in code with the other built-ins
    (:func:`~exportlm.export.builtins.register_builtin_targets`); this is the same object.
    """
    return export_onnx_target
