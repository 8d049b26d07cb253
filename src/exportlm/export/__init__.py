"""Export targets: registries, declarations and the public ``export_model`` / ``load_exported``."""

from exportlm.export._base import (
    CAPABILITIES,
    EXPORT_BACKENDS_GROUP,
    EXPORT_REGISTRY,
    EXPORT_RUNTIMES_GROUP,
    RUNTIME_REGISTRY,
    ExportFactory,
    RuntimeCallable,
    RuntimeLoader,
    TargetInfo,
    atomic_output,
    check_kwargs,
    ensure_exporters_registered,
    export_model,
    export_target,
    get_target_info,
    load_exported,
    runtime_loader,
)
from exportlm.export._compare import LogitsComparison, compare_logits
from exportlm.export._wrapper import ExportCacheWrapper, extract_logits
from exportlm.inputs import infer_vocab_size, make_input_ids, resolve_example_inputs

__all__ = [
    "CAPABILITIES",
    "EXPORT_BACKENDS_GROUP",
    "EXPORT_REGISTRY",
    "EXPORT_RUNTIMES_GROUP",
    "RUNTIME_REGISTRY",
    "ExportCacheWrapper",
    "ExportFactory",
    "LogitsComparison",
    "RuntimeCallable",
    "RuntimeLoader",
    "TargetInfo",
    "atomic_output",
    "check_kwargs",
    "compare_logits",
    "ensure_exporters_registered",
    "export_model",
    "export_target",
    "extract_logits",
    "get_target_info",
    "infer_vocab_size",
    "load_exported",
    "make_input_ids",
    "resolve_example_inputs",
    "runtime_loader",
]
