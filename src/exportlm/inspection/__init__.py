"""Checking a checkpoint against the serving loaders' rules, before a GPU is rented.

:func:`inspect_checkpoint` reads a Hugging Face checkpoint directory from any
producer (exportlm, NVIDIA ModelOpt, llm-compressor) — the safetensors headers,
the index and the JSON configs, plus the values of the scales only — or an ONNX
file, and evaluates the rules of :data:`RULES`. Each rule has a stable id, a
severity and the loaders it comes from, and is documented with its source in
``docs/checkpoint-rules.md``. The command line is ``exportlm inspect PATH``.

The name rules of the ``checkpoint_names`` conformance check live here too
(:func:`checkpoint_name_problems`, :func:`listed_names`, :func:`saved_tensor_names`).
"""

from exportlm.inspection._completeness import LayerGap, layer_count_of, layer_gap
from exportlm.inspection._config import config_field_problems, quant_config_problems
from exportlm.inspection._files import escape_problem
from exportlm.inspection._header import TensorInfo, read_safetensors_header
from exportlm.inspection._inspect import InspectionReport, inspect_checkpoint
from exportlm.inspection._names import (
    ListedName,
    checkpoint_name_problems,
    listed_names,
    saved_tensor_names,
)
from exportlm.inspection._onnx import onnx_load_problems
from exportlm.inspection._onnx_file import MAX_ONNX_BYTES, check_onnx_size, read_onnx_model
from exportlm.inspection._rules import RULES, RULES_DOC, Finding, Rule, Severity, get_rule

__all__ = [
    "MAX_ONNX_BYTES",
    "RULES",
    "RULES_DOC",
    "Finding",
    "InspectionReport",
    "LayerGap",
    "ListedName",
    "Rule",
    "Severity",
    "TensorInfo",
    "check_onnx_size",
    "checkpoint_name_problems",
    "config_field_problems",
    "escape_problem",
    "get_rule",
    "inspect_checkpoint",
    "layer_count_of",
    "layer_gap",
    "listed_names",
    "onnx_load_problems",
    "quant_config_problems",
    "read_onnx_model",
    "read_safetensors_header",
    "saved_tensor_names",
]
