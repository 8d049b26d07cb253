"""Export targets: registries, declarations, the public ``export_model`` / ``load_exported``,
and the stable ONNX API.

One concern per module:

* :mod:`~exportlm.export.targets`: :class:`TargetInfo`, the registries, :func:`export_model`;
* :mod:`~exportlm.export.options`: keyword-option checks of factories and loaders;
* :mod:`~exportlm.atomic`: every all-or-nothing write;
* :mod:`~exportlm.export.job`: the steps every built-in export shares;
* :mod:`~exportlm.export.runtime`: what the torch runtimes share;
* :mod:`~exportlm.export.generation`: generation with a KV cache (``kv_cache=True``
  artifacts, :class:`GenerationRuntime`, :func:`greedy_generate`);
* one module or package per built-in target: :mod:`~exportlm.export.onnx`,
  :mod:`~exportlm.export.torchscript`, :mod:`~exportlm.export.torch_export`,
  :mod:`~exportlm.export.hf_checkpoint`.

Importing this package imports no ONNX package: ``onnx``, ``onnxruntime`` and
``onnxscript`` are needed only to use the ``onnx`` target (``pip install 'exportlm[onnx]'``).
"""

from exportlm.atomic import atomic_output
from exportlm.export._compare import LogitsComparison, compare_logits
from exportlm.export._wrapper import ExportCacheWrapper, extract_logits
from exportlm.export.generation import (
    GenerationResult,
    GenerationRuntime,
    PastKeyValues,
    greedy_generate,
    kv_cache_refusal,
)
from exportlm.export.onnx import (
    OnnxInfo,
    OnnxVerification,
    build_onnx_exporter,
    export_to_onnx,
    get_onnx_info,
    verify_onnx,
)
from exportlm.export.options import accepted_kwargs, check_kwargs
from exportlm.export.targets import (
    CAPABILITIES,
    EXPORT_BACKENDS_GROUP,
    EXPORT_REGISTRY,
    EXPORT_RUNTIMES_GROUP,
    RUNTIME_REGISTRY,
    ExportFactory,
    RuntimeCallable,
    RuntimeLoader,
    TargetInfo,
    ensure_exporters_registered,
    export_model,
    export_target,
    get_target_info,
    load_exported,
    runtime_loader,
)
from exportlm.inputs import infer_vocab_size, make_input_ids, resolve_example_inputs

__all__ = [
    "CAPABILITIES",
    "EXPORT_BACKENDS_GROUP",
    "EXPORT_REGISTRY",
    "EXPORT_RUNTIMES_GROUP",
    "RUNTIME_REGISTRY",
    "ExportCacheWrapper",
    "ExportFactory",
    "GenerationResult",
    "GenerationRuntime",
    "LogitsComparison",
    "OnnxInfo",
    "OnnxVerification",
    "PastKeyValues",
    "RuntimeCallable",
    "RuntimeLoader",
    "TargetInfo",
    "atomic_output",
    "build_onnx_exporter",
    "accepted_kwargs",
    "check_kwargs",
    "compare_logits",
    "ensure_exporters_registered",
    "export_model",
    "export_target",
    "export_to_onnx",
    "extract_logits",
    "get_onnx_info",
    "get_target_info",
    "greedy_generate",
    "infer_vocab_size",
    "kv_cache_refusal",
    "load_exported",
    "make_input_ids",
    "resolve_example_inputs",
    "runtime_loader",
    "verify_onnx",
]
