"""The rule table: every rule an inspection evaluates, its severity and where it comes from.

Rules are data (:class:`Rule`; new schemes' rows in ``_scheme_rules``), evaluated in the module of
their concern (``_layers``, ``_values``, ``_w4a8``...); each has its ``docs/checkpoint-rules.md`` section.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from exportlm.errors import UnknownNameError
from exportlm.inspection._scheme_rules import SCHEME_RULE_ROWS

__all__ = ["RULES", "RULES_DOC", "Finding", "Rule", "Severity", "get_rule"]

#: Where the rules are documented, one section per rule id.
RULES_DOC = "docs/checkpoint-rules.md"


class Severity(enum.Enum):
    """How bad a failed rule is: ``error`` makes ``exportlm inspect`` exit 1."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """0 for errors, 1 for warnings, 2 for info (the order findings are listed in)."""
        return (Severity.ERROR, Severity.WARNING, Severity.INFO).index(self)


@dataclass(frozen=True)
class Rule:
    """One rule a checkpoint (or ONNX file) is held to.

    Attributes:
        id: the stable id (``"scale-missing"``), also the anchor of its section in
            ``docs/checkpoint-rules.md``.
        severity: how bad a violation is.
        loaders: the loaders whose behaviour the rule encodes (``"vLLM"``, ...).
        summary: one line: what the rule requires.
        applies_to: ``"checkpoint"`` (a Hugging Face directory) or ``"onnx"``.
    """

    id: str
    severity: Severity
    loaders: tuple[str, ...]
    summary: str
    applies_to: str = "checkpoint"

    @property
    def reference(self) -> str:
        """The rule's documentation: ``docs/checkpoint-rules.md#<id>``."""
        return f"{RULES_DOC}#{self.id}"

    def finding(self, subject: str, message: str, **details: Any) -> Finding:
        """A violation of this rule by ``subject`` (a tensor, module or file name)."""
        return Finding(self.id, self.severity, subject, message, MappingProxyType(dict(details)))


@dataclass(frozen=True)
class Finding:
    """One violated rule.

    Attributes:
        rule: the rule id.
        severity: the rule's severity.
        subject: what violates it: a tensor name, a module path or a file name.
        message: what is wrong, what a loader expects, what to do.
        details: machine-readable extras for ``--json`` (values, shapes, files).
    """

    rule: str
    severity: Severity
    subject: str
    message: str
    details: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``severity`` as its string value)."""
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "subject": self.subject,
            "message": self.message,
            "details": dict(self.details),
            "reference": f"{RULES_DOC}#{self.rule}",
        }


_E, _W, _I = Severity.ERROR, Severity.WARNING, Severity.INFO
_VLLM, _SGL, _TRT, _HF, _CT = "vLLM", "SGLang", "TensorRT-LLM", "transformers", "compressed-tensors"
_SERVING = (_VLLM, _SGL, _TRT)
_ALL = (*_SERVING, _HF)

_TABLE: tuple[Rule, ...] = (
    # -- files and names
    Rule(
        "shard-unreadable",
        _E,
        (_VLLM, _SGL, _TRT, _HF),
        "Every *.safetensors file has a valid header and holds all the bytes its header declares.",
    ),
    Rule(
        "shard-dtype-unknown", _E, _ALL, "Every tensor's dtype in a header is a safetensors dtype."
    ),
    Rule(
        "shard-tensor-malformed",
        _E,
        (_VLLM, _SGL, _TRT, _HF),
        "Every header entry has a dtype, a shape of non-negative ints and two ordered "
        "data_offsets spanning exactly dtype x shape bytes.",
    ),
    Rule(
        "shard-byte-ranges",
        _E,
        (_VLLM, _SGL, _TRT, _HF),
        "The tensors of a shard tile its data section: no shared bytes, no gap, nothing after "
        "the last tensor.",
    ),
    Rule(
        "index-unreadable",
        _E,
        (_VLLM, _HF),
        "model.safetensors.index.json is a JSON object whose weight_map maps tensor names to "
        "shard file names.",
    ),
    Rule(
        "index-path-escapes",
        _E,
        (_VLLM, _HF),
        "Every shard the index names is a relative path inside the checkpoint directory "
        "(no absolute path, no '..').",
    ),
    Rule(
        "index-mismatch",
        _E,
        (_VLLM, _HF),
        "model.safetensors.index.json lists exactly the "
        "shards' tensors, each in the shard that holds it, and no tensor is in two shards.",
    ),
    Rule(
        "layer-missing",
        _E,
        (*_SERVING, _HF),
        "The shards store every decoder layer 0..num_hidden_layers-1 (the text config's); "
        "exportlm's loader refuses a checkpoint missing one.",
    ),
    Rule(
        "tied-duplicate",
        _E,
        (_VLLM, _HF),
        "With tie_word_embeddings the tied weight is "
        "written once (the embedding), not also as lm_head.weight.",
    ),
    Rule(
        "leaked-buffer",
        _E,
        (*_SERVING, _HF),
        "No tensor name has a quantizer-internal "
        "component (_amax, _scale, _pre_quant_scale, *_quantizer.*).",
    ),
    # -- configs
    Rule(
        "config-unreadable",
        _E,
        (*_SERVING, _HF),
        "config.json exists and is a JSON object; hf_quant_config.json, where present, is one.",
    ),
    Rule(
        "config-field-invalid",
        _E,
        (*_SERVING, _HF),
        "config.json's fields have the types and values the architecture's config class "
        "declares: architectures a list of class names, sizes positive ints.",
    ),
    Rule(
        "custom-code",
        _E,
        (_HF, _VLLM),
        "Loading the checkpoint runs no code of its own (no auto_map in its configs, no *.py "
        "files); exportlm's loader refuses such a checkpoint.",
    ),
    Rule(
        "tokenizer-missing",
        _W,
        (_VLLM, _SGL, _HF),
        "The checkpoint carries its tokenizer (tokenizer.json, tokenizer.model, vocab.json "
        "or vocab.txt): a serving engine reads it, and the chat template, from the same "
        "directory.",
    ),
    Rule(
        "chat-template-invalid",
        _E,
        (_VLLM, _SGL, _HF),
        "Every chat template the checkpoint carries compiles as transformers compiles it "
        "(chat_template.jinja, additional_chat_templates/, a chat_template field).",
    ),
    Rule(
        "quant-method-unknown",
        _E,
        (*_SERVING, _HF),
        "config.json's quant_method is one a "
        "serving loader knows; loaders that do not know it are reported.",
    ),
    Rule(
        "quant-algo-unknown",
        _E,
        (*_SERVING, _CT),
        "Every ModelOpt quant_algo is one the ModelOpt loaders know, and every "
        "compressed-tensors config group has quantization args and a known format.",
    ),
    Rule(
        "quant-method-loaders",
        _I,
        (*_SERVING, _HF),
        "Reports the loaders that do not know "
        "the checkpoint's quant_method (transformers as installed).",
    ),
    Rule(
        "engine-refuses-scheme",
        _W,
        (_VLLM, _SGL),
        "An engine that knows the checkpoint's quant_method also accepts its algorithm / "
        "scheme (ModelOpt quant_algo), by the engine's own support table.",
    ),
    Rule(
        "quant-config-missing",
        _W,
        (_HF, _VLLM),
        "A checkpoint with quantized tensors declares "
        "its quantization in config.json (quantization_config).",
    ),
    Rule(
        "format-unchecked",
        _I,
        (),
        "A declared format exportlm has no FormatSpec for: only the "
        "format-independent rules ran on its layers.",
    ),
    Rule(
        "excluded-but-quantized",
        _E,
        _SERVING,
        "No module listed in exclude_modules / ignore has a quantized weight.",
    ),
    Rule(
        "excluded-name-unknown",
        _W,
        _SERVING,
        "Every exclude_modules / ignore entry names a "
        "module that the checkpoint saves tensors under.",
    ),
    Rule(
        "layer-name-unknown",
        _E,
        _SERVING,
        "Every quantized_layers key (and module-name "
        "target) names a module the checkpoint saves tensors under.",
    ),
    Rule(
        "excluded-stray-scale",
        _E,
        (_VLLM, _SGL),
        "No scale leaf (input_scale, weight_scale, "
        "...) on a module whose weight is not quantized (the lm_head.input_scale case).",
    ),
    # -- quantized layers
    Rule(
        "scale-missing",
        _E,
        (*_SERVING, _CT),
        "Every quantized linear stores all of its "
        "format's weight leaves, and input_scale when activations are quantized statically.",
    ),
    Rule(
        "weight-dtype",
        _E,
        (*_SERVING, _CT),
        "A quantized linear's weight is stored in its "
        "format's dtype (float8_e4m3fn, packed uint8, int8).",
    ),
    Rule(
        "scale-dtype",
        _E,
        (*_SERVING, _CT),
        "Every scale leaf has its format's dtype (NVFP4 "
        "block scales float8_e4m3fn, other scales float32).",
    ),
    Rule(
        "scale-shape",
        _E,
        (*_SERVING, _CT),
        "Per-tensor scales hold one value, per-row scales one per output row.",
    ),
    Rule(
        "block-scale-shape",
        _E,
        (*_SERVING, _CT),
        "Block scales are [out, in / block] for the "
        "weight's logical shape (NVFP4 blocks of 16, INT4 AWQ groups).",
    ),
    Rule(
        "kv-scale-missing",
        _E,
        (_VLLM, _SGL, _TRT),
        "When KV-cache quantization is declared, every attention layer stores k_scale and v_scale.",
    ),
    Rule(
        "kv-scale-undeclared",
        _W,
        (_VLLM, _TRT),
        "k_scale / v_scale are stored only when the configs declare KV-cache quantization.",
    ),
    # -- values
    Rule("scale-nonfinite", _E, (*_SERVING, _CT), "No scale holds NaN or an infinity."),
    Rule(
        "scale-nonpositive",
        _E,
        (*_SERVING, _CT),
        "Per-tensor scales (weight, input, KV) are > 0; no scale is negative.",
    ),
    Rule("scale-zero-entries", _W, (_VLLM, _TRT), "Per-row and per-block scales have no zeros."),
    Rule(
        "moe-input-scale-shared",
        _W,
        (_VLLM, _SGL, _TRT),
        "The experts of one MoE block share one input_scale per projection.",
    ),
    Rule(
        "gate-up-scale-consistent",
        _W,
        (_VLLM, _TRT),
        "Where the format shares the per-tensor "
        "weight scale of fused GEMMs, gate and up (w1 / w3) store equal ones.",
    ),
    # -- ONNX files
    Rule("onnx-unreadable", _E, ("onnxruntime",), "The file parses as an ONNX model.", "onnx"),
    Rule(
        "onnx-opset",
        _E,
        ("onnxruntime",),
        "The default-domain opset is at least the one its "
        "initializers' dtypes need (19 for float8, 21 for int4).",
        "onnx",
    ),
    Rule(
        "onnx-custom-op",
        _E,
        ("onnxruntime",),
        "Every operator is a standard one or in a domain onnxruntime ships kernels for (no "
        "custom-op library needed); model-local functions count as defined.",
        "onnx",
    ),
    Rule(
        "onnx-external-data-path",
        _E,
        ("onnxruntime",),
        "Every external-data location is a relative path inside the model's directory (no "
        "absolute path, no '..', no link out of it).",
        "onnx",
    ),
    Rule(
        "onnx-external-data",
        _E,
        ("onnxruntime",),
        "Every external-data file an initializer names exists and is long enough for its "
        "offset and length.",
        "onnx",
    ),
    Rule(
        "onnx-quantized-initializers",
        _I,
        ("onnxruntime",),
        "Reports the quantized initializers (FLOAT8E4M3FN, INT8, INT4...) and their bytes.",
        "onnx",
    ),
    Rule(
        "loader-misreads",
        _W,
        (_HF,),
        "No loader that loads the checkpoint without an error computes something else.",
    ),
)

_SCHEMES = tuple(Rule(i, Severity(s), ls, text) for i, s, ls, text in SCHEME_RULE_ROWS)
#: Every rule by id, in the order of ``docs/checkpoint-rules.md``.
RULES: Mapping[str, Rule] = MappingProxyType({rule.id: rule for rule in _TABLE + _SCHEMES})


def get_rule(rule_id: str) -> Rule:
    """The rule ``rule_id``; raises :class:`~exportlm.errors.UnknownNameError` listing the ids."""
    if rule_id not in RULES:
        raise UnknownNameError("inspection rule", rule_id, list(RULES))
    return RULES[rule_id]
