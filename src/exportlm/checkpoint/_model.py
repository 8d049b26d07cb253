"""The declaration model: what a checkpoint's quantization configs say, as frozen records.

Scalars are kept as written (a ``quant_algo`` of the wrong type is a finding for
``exportlm inspect``, not a crash of the reader); structure is typed: a group is a
:class:`ConfigGroup`, a ``QuantizationArgs`` object a :class:`QuantArgs`. A value
of the wrong kind where an object or list belongs is kept in an ``*_invalid`` field
for the rules' messages, and read as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MIXED_PRECISION",
    "ConfigGroup",
    "FineGrainedFP8",
    "Listed",
    "ModelOptLayer",
    "QuantArgs",
    "QuantizationDeclaration",
    "Section",
]

#: ModelOpt's ``quant_algo`` of a checkpoint whose layers are in several formats.
MIXED_PRECISION = "MIXED_PRECISION"

#: The layout each ``config.json`` ``quant_method`` is read as (the ``format=`` names);
#: ``"fp8"``: DeepSeek-V3's / Qwen3-FP8's (transformers' ``FineGrainedFP8Config``);
#: ``"mxfp4"``: openai/gpt-oss's (transformers' ``Mxfp4Config``, vLLM's ``GptOssMxfp4Config``).
_LAYOUTS: Mapping[str, str] = {
    "modelopt": "modelopt",
    "compressed-tensors": "compressed-tensors",
    "fp8": "finegrained-fp8",
    "mxfp4": "gpt-oss-mxfp4",
}

#: What a compressed-tensors ``QuantizationArgs`` means for the stored tensors, with
#: compressed-tensors' defaults for a key left out. The rest (``observer``,
#: ``observer_kwargs``, ``scale_dtype``, ``zp_dtype``, ``block_structure`` of a
#: non-block strategy...) says how the producer calibrated or stores what the tensors'
#: own dtypes say: llm-compressor writes them, and they do not change what is read.
_MEANINGFUL = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": None,
    "group_size": None,
    "dynamic": False,
    "block_structure": None,  # the ``[rows, cols]`` tile of the ``block`` strategy only
}
_GROUPED = frozenset({"group", "tensor_group"})

#: compressed-tensors' preset scheme names by (weight type, weight bits, activation type
#: and bits or None): the names of ``compressed_tensors.quantization.quant_scheme``.
_CT_PRESETS: Mapping[tuple[str, int, tuple[str, int] | None], str] = {
    ("float", 8, ("float", 8)): "FP8",
    ("float", 8, None): "FP8_WEIGHT_ONLY",
    ("int", 8, ("int", 8)): "W8A8",
    ("int", 8, None): "W8A16",
    ("int", 4, None): "W4A16",
    ("int", 4, ("float", 8)): "W4AFP8",
    ("float", 4, ("float", 4)): "NVFP4",
    ("float", 4, None): "NVFP4A16",
}
#: compressed-tensors' MX presets by the group's ``format`` and whether it quantizes inputs:
#: their args differ from NVFP4's / FP8's only in ``group_size: 32`` and ``scale_dtype: uint8``.
_CT_MX_PRESETS: Mapping[tuple[str, bool], str] = {
    ("mxfp4-pack-quantized", False): "MXFP4A16",
    ("mxfp4-pack-quantized", True): "MXFP4",
    ("mxfp8-quantized", False): "MXFP8A16",
    ("mxfp8-quantized", True): "MXFP8",
}


@dataclass(frozen=True)
class QuantArgs:
    """One compressed-tensors ``QuantizationArgs`` object (weights, activations, KV cache).

    Every field is the value as written (``None``: absent); ``written`` is the whole
    object, for messages.
    """

    num_bits: Any = None
    type: Any = None
    symmetric: Any = None
    strategy: Any = None
    group_size: Any = None
    dynamic: Any = None
    actorder: Any = None
    block_structure: Any = None
    written: Mapping[str, Any] | None = None

    def meaning(self) -> tuple[Any, ...]:
        """What the args mean for the stored tensors: compressed-tensors' defaults filled
        in, the group size only for a grouped strategy (everything else is ignored)."""
        out = {k: getattr(self, k) for k in _MEANINGFUL}
        out = {k: _MEANINGFUL[k] if v is None else v for k, v in out.items()}
        if out["strategy"] not in _GROUPED:
            out["group_size"] = None
        tile = out["block_structure"]
        out["block_structure"] = tuple(tile) if out["strategy"] == "block" and tile else None
        return tuple(out.values())

    def bits(self) -> tuple[str, int]:
        """``(type, num_bits)`` as compressed-tensors' preset names key them."""
        bits = self.num_bits
        return str(self.type), bits if isinstance(bits, int) and not isinstance(bits, bool) else 0


def _meaning(args: QuantArgs | None) -> tuple[Any, ...] | None:
    return None if args is None else args.meaning()


@dataclass(frozen=True)
class ConfigGroup:
    """One ``config_groups`` entry (compressed-tensors, or ModelOpt's in ``config.json``).

    Attributes:
        name: the group's key.
        is_object: the group is a JSON object (else every other field is empty).
        format: the group's ``format`` as written, else the config's (``None``: neither).
        weights, input_activations, output_activations: the args, ``None`` when absent
            or not an object.
        weights_invalid: ``weights`` as written when it is not an object (``None`` else).
        targets: the ``targets`` strings.
        written: the group as written, for messages.
    """

    name: str
    is_object: bool
    format: Any = None
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    output_activations: QuantArgs | None = None
    weights_invalid: Any = None
    targets: tuple[str, ...] = ()
    written: Any = None

    def meaning(self) -> tuple[Any, ...]:
        """The format and what the weight, input and output args mean (:meth:`QuantArgs.meaning`)."""
        return (
            self.format,
            _meaning(self.weights),
            _meaning(self.input_activations),
            _meaning(self.output_activations),
        )

    @property
    def preset(self) -> str:
        """compressed-tensors' preset name of the group (``"W4A16"``), else ``"unknown (...)"``."""
        weights = (self.weights or QuantArgs()).bits()
        acts = self.input_activations.bits() if self.input_activations is not None else None
        key = (*weights, acts)
        mx = _CT_MX_PRESETS.get((str(self.format), acts is not None))
        if mx is not None:
            return mx
        if key == ("float", 8, ("float", 8)) and self.weights and self.weights.strategy == "block":
            return "FP8_BLOCK"  # weight tiles, inputs per group at run time
        return _CT_PRESETS.get(key, f"unknown {key}")


@dataclass(frozen=True)
class ModelOptLayer:
    """One ``quantized_layers`` entry: a layer's ``quant_algo`` and ``group_size`` as written.

    ``is_object`` is ``False`` when the entry is not an object: then ``quant_algo`` is
    the entry itself.
    """

    name: str
    quant_algo: Any
    group_size: Any = None
    is_object: bool = True


@dataclass(frozen=True)
class FineGrainedFP8:
    """``quant_method: "fp8"``'s own fields (transformers' ``FineGrainedFP8Config``, vLLM's
    ``Fp8Config``), each as written (``None``: absent).

    Attributes:
        weight_block_size: ``[rows, cols]`` of one weight scale's tile; absent, transformers
            takes ``(128, 128)`` and vLLM per-tensor scales, so a reader must refuse it.
        activation_scheme: ``"dynamic"`` (inputs quantized per group at run time) or ``"static"``.
        scale_fmt: transformers' scale dtype: ``"float"`` (float32) or ``"ue8m0"``.
        expert_dtype: transformers' experts' format: ``"fp8"`` or ``"fp4"``.
        store_dtype: vLLM's experts' storage (``"mxfp4"``).
        modules_to_convert: transformers' extra modules stored in FP8 (embeddings).
        modules_to_not_convert: the unquantized modules (transformers; vLLM without
            ``ignored_layers``).
        ignored_layers: the unquantized modules (vLLM; transformers without
            ``modules_to_not_convert``).
        has_block_size: ``weight_block_size`` is a key of the section (``null`` included).
    """

    weight_block_size: Any = None
    activation_scheme: Any = None
    scale_fmt: Any = None
    expert_dtype: Any = None
    store_dtype: Any = None
    modules_to_convert: Any = None
    modules_to_not_convert: Any = None
    ignored_layers: Any = None
    has_block_size: bool = False

    @property
    def block_size_null(self) -> bool:
        """``weight_block_size: null``: per-tensor scales (both loaders)."""
        return self.has_block_size and self.weight_block_size is None

    @property
    def block(self) -> int | None:
        """The edge of square tiles (``[128, 128]``: 128); ``None`` when not two equal positive ints."""
        size = self.weight_block_size
        if not (isinstance(size, list) and len(size) == 2):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
            return None
        return int(size[0]) if size[0] == size[1] else None


@dataclass(frozen=True)
class Listed:
    """One module name a section lists.

    Attributes:
        entry: the name as written (a module path, a wildcard, a ``re:`` pattern, a class).
        where: the file and key (``"hf_quant_config.json: quantization.exclude_modules"``).
        excluded: listed to be left unquantized (``exclude_modules`` / ``ignore``).
        target: a compressed-tensors group's ``targets`` entry (may name a class).
    """

    entry: str
    where: str
    excluded: bool
    target: bool = False


@dataclass(frozen=True)
class Section:
    """One file's quantization declaration: ``hf_quant_config.json``'s ``quantization`` or
    ``config.json``'s ``quantization_config``.

    Attributes:
        file: ``"hf_quant_config.json"`` or ``"config.json"``.
        source: the file and key, for messages (``"config.json quantization_config"``).
        empty: the section is an empty object.
        quant_method: as written (``None`` in ``hf_quant_config.json``).
        quant_algo, group_size, format: as written (ModelOpt; compressed-tensors' format).
        quantized_layers: ModelOpt's per-layer entries; ``quantized_layers_invalid`` holds
            the value as written when it is not an object.
        config_groups: the groups (``None``: absent or not an object); ``config_groups_invalid``
            the value as written when it is not an object.
        kv_cache_quant_algo: ModelOpt's KV-cache algorithm as written.
        kv_cache_scheme: the KV cache's args (``None``: none declared or not an object);
            ``kv_cache_scheme_invalid`` the value as written when it is not an object.
        listed: the module names the section lists (excluded ones, quantized layers, targets).
        finegrained: ``quant_method: "fp8"``'s fields (``None`` for another method).
        not_converted: ``quant_method: "mxfp4"``'s ``modules_to_not_convert`` as written
            (transformers' ``Mxfp4Config``; vLLM's reads none); ``None``: absent or another method.
        lists_invalid: ``(key, value as written)`` of each list of module names the loaders
            require a JSON list of strings and that is not one (``exclude_modules``,
            ``ignore``; a compressed-tensors group's ``targets``, which it requires).
    """

    file: str
    source: str
    empty: bool = False
    quant_method: Any = None
    quant_algo: Any = None
    group_size: Any = None
    format: Any = None
    quantized_layers: tuple[ModelOptLayer, ...] = ()
    quantized_layers_invalid: Any = None
    config_groups: tuple[ConfigGroup, ...] | None = None
    config_groups_invalid: Any = None
    kv_cache_quant_algo: Any = None
    kv_cache_scheme: QuantArgs | None = None
    kv_cache_scheme_invalid: Any = None
    listed: tuple[Listed, ...] = ()
    finegrained: FineGrainedFP8 | None = None
    not_converted: Any = None
    lists_invalid: tuple[tuple[str, Any], ...] = ()

    @property
    def layout(self) -> str:
        """``"modelopt"``, ``"compressed-tensors"``, ``"finegrained-fp8"`` (``quant_method:
        "fp8"``), ``"gpt-oss-mxfp4"`` (``quant_method: "mxfp4"``), ``"other"`` or ``"none"``."""
        if self.file != "config.json":
            return "modelopt"
        method = None if self.quant_method is None else str(self.quant_method)
        if method is not None and method in _LAYOUTS:
            return _LAYOUTS[method]
        return "other" if method else "none"

    @property
    def mixed(self) -> bool:
        """ModelOpt's ``quant_algo`` is ``MIXED_PRECISION`` (each layer its own)."""
        return bool(self.quant_algo == MIXED_PRECISION)

    @property
    def scheme(self) -> str | None:
        """The scheme the engines' support tables name: ModelOpt's ``quant_algo``, a
        compressed-tensors group's preset, ``MIXED_PRECISION`` for several."""
        if self.layout == "gpt-oss-mxfp4":  # gpt-oss's experts, compressed-tensors' MXFP4 codes
            return "MXFP4"
        if self.finegrained is not None and self.layout == "finegrained-fp8":
            # block-wise tiles: the preset compressed-tensors names the same scheme by
            return "FP8" if self.finegrained.weight_block_size is None else "FP8_BLOCK"
        if self.layout != "compressed-tensors":
            return None if self.quant_algo is None else str(self.quant_algo)
        presets = {group.preset for group in self.config_groups or () if group.is_object}
        return MIXED_PRECISION if len(presets) > 1 else next(iter(presets), None)


@dataclass(frozen=True)
class QuantizationDeclaration:
    """What a checkpoint's configs declare about its quantization.

    Attributes:
        hf_quant: ``hf_quant_config.json``'s ``quantization`` (``None``: no file, or no object).
        hf_quant_invalid: that ``quantization`` as written when the file is there but it is
            not an object (``hf_quant_present`` says the file holds something).
        config: ``config.json``'s ``quantization_config`` (``None``: absent or not an object).
        config_invalid: ``quantization_config`` as written when it is there but not an object.
        producer: the producer's name the configs record (ModelOpt's ``producer.name``).
    """

    hf_quant: Section | None = None
    config: Section | None = None
    hf_quant_present: bool = False
    hf_quant_invalid: Any = None
    config_invalid: Any = None
    producer: str | None = None

    @property
    def primary(self) -> Section | None:
        """The declaration loaders follow: ``hf_quant_config.json``'s, else ``config.json``'s."""
        return self.hf_quant if self.hf_quant is not None else self.config

    @property
    def declared_in(self) -> tuple[str, ...]:
        """Where a quantization is declared, valid or not (empty: a float model's configs)."""
        found = []
        if self.config is not None or self.config_invalid is not None:
            found.append("config.json has a quantization_config")
        if self.hf_quant_present:
            found.append("it has hf_quant_config.json")
        return tuple(found)

    @property
    def quant_method(self) -> str | None:
        """``config.json``'s ``quant_method`` as a string (``None`` when absent)."""
        method = self.config.quant_method if self.config is not None else None
        return None if method is None else str(method)

    @property
    def listed(self) -> tuple[Listed, ...]:
        """Every module name both sections list."""
        return tuple(i for s in (self.hf_quant, self.config) if s is not None for i in s.listed)
