"""``config.json`` and the quantization configs, held to what their loaders accept.

:func:`config_field_problems` checks a model config's field types and values:
``architectures`` a list of class names, ``model_type`` a string, the common size
fields positive ints, and every field the architecture's transformers config
class annotates (``LlamaConfig.hidden_size: int``...) of its annotated type. The
class is looked up in transformers' own ``CONFIG_MAPPING`` by ``model_type``: no
code of the checkpoint runs, and without transformers the generic rules still do.

:func:`quant_config_problems` checks ``quant_algo`` (ModelOpt) and the
compressed-tensors ``config_groups`` against the values their loaders know.

Both return plain ``(field, message)`` / ``(rule, subject, message)`` tuples, so
the ``hf_checkpoint`` loader raises the same verdicts the inspector reports.
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from exportlm.checkpoint import HF_QUANT_CONFIG_NAME, ConfigGroup, QuantizationDeclaration, Section
from exportlm.inspection._ct_args import args_problems
from exportlm.inspection._finegrained import finegrained_problems
from exportlm.inspection._loaders import compressed_tensors_formats, modelopt_quant_algos
from exportlm.inspection._quant_fields import group_size_problem, kv_algo_problem, list_problems

__all__ = [
    "MAX_SIZE",
    "SIZE_FIELDS",
    "config_field_problems",
    "quant_config_problems",
    "sub_config_problems",
]

#: Size fields every loader divides or allocates by: a positive int where present.
SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "n_routed_experts", "n_layer", "n_head", "n_embd",
)  # fmt: skip
_CONFIG = "config.json"
_HF_QUANT = HF_QUANT_CONFIG_NAME
_CT_TYPES = ("int", "float")


#: Above any model's size field (hidden sizes are below 2**17, vocabularies 2**20, contexts
#: 2**25), below what a tensor shape can hold: 10**30 made torch fail to unpack a shape.
MAX_SIZE = 2**40


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE


@functools.cache
def _config_class(model_type: str) -> type | None:
    """transformers' config class for ``model_type`` (``None``: unknown, or no transformers)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
    except (ImportError, KeyError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def _annotations(model_type: str) -> Mapping[str, Any]:
    """The field annotations of transformers' config class for ``model_type`` (``{}``: unknown)."""
    cls = _config_class(model_type)
    return {} if cls is None else _class_annotations(cls)


@functools.cache
def _class_annotations(cls: type) -> Mapping[str, Any]:
    """The field and ``__init__`` annotations of config class ``cls`` and its bases."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for annotated in (klass, vars(klass).get("__init__")):  # fields, then keyword arguments
            if annotated is None:
                continue
            try:  # transformers annotates with names it imports lazily (torch.dtype)
                found = typing.get_type_hints(annotated, localns={"torch": torch})
            except Exception:  # an annotation transformers cannot resolve stays unchecked
                raw = vars(annotated).get("__annotations__", {}) if annotated is klass else {}
                found = {k: v for k, v in raw.items() if not isinstance(v, str)}
            hints.update({k: v for k, v in found.items() if k not in ("return", "kwargs")})
    return hints


def _conforms(value: Any, hint: Any) -> bool:
    """``value`` (parsed JSON) is of type ``hint``.

    JSON holds a class other than its own types (``torch.dtype`` aside, which is
    also annotated ``str``) as an object; an Enum as one of its values; a hint
    this function does not know (a ``TypeVar``, ``Callable``) is not checked.
    """
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list or hint is list:
        args = typing.get_args(hint)
        return isinstance(value, list) and (not args or all(_conforms(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value in {member.value for member in hint}
    if isinstance(hint, type):  # torch.dtype, a TypedDict, a sub-config: JSON holds them as objects
        return isinstance(value, dict)
    return True


def config_field_problems(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, message)`` of every invalid field of the model config ``config``."""
    problems: list[tuple[str, str]] = []
    arch = config.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
        problems.append(
            (
                "architectures",
                f"{_CONFIG}: architectures is {arch!r}, expected a non-empty list of model class "
                'names (["LlamaForCausalLM"]): loaders pick the model class from it',
            )
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        problems.append(
            (
                "model_type",
                f'{_CONFIG}: model_type is {model_type!r}, expected a string ("llama"): '
                "transformers' AutoConfig picks the config class from it",
            )
        )
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is not None and not _positive_int(value):
            problems.append(
                (
                    name,
                    f"{_CONFIG}: {name} is {value!r}, expected a positive int (at most "
                    "2**40): loaders size the model's tensors by it",
                )
            )
    problems += _dtype_problems(config)
    hints = _annotations(model_type) if isinstance(model_type, str) else {}
    problems += _typed_fields(config, hints, {field for field, _ in problems}, "")
    cls = _config_class(model_type) if isinstance(model_type, str) else None
    if cls is not None:
        flagged = {field for field, _ in problems}
        problems += [p for p in sub_config_problems(config, cls, hints) if p[0] not in flagged]
    return problems


def _dtype_problems(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``dtype`` / ``torch_dtype`` naming no floating-point torch dtype.

    transformers' config turns the string into ``getattr(torch, value)``
    (``AttributeError`` for ``"float99"`` or ``"auto"``); vLLM takes float16,
    bfloat16 and float32 only. A dict (a dtype per sub-config) is left to the loaders.
    """
    problems = []
    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if not isinstance(value, str):
            continue
        dtype = getattr(torch, value, None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            problems.append(
                (
                    name,
                    f"{_CONFIG}: {name} is {value!r}, expected the name of a torch floating-point "
                    'dtype ("bfloat16", "float16", "float32"): loaders build the model in it',
                )
            )
    return problems


def _typed_fields(
    config: Mapping[str, Any], hints: Mapping[str, Any], flagged: set[str], where: str
) -> list[tuple[str, str]]:
    """Fields of ``config`` not of the type ``hints`` annotates (``where``: a sub-config's prefix)."""
    problems = []
    for name, hint in sorted(hints.items()):
        if name in config and name not in flagged and not _conforms(config[name], hint):
            shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            problems.append(
                (
                    f"{where}{name}",
                    f"{_CONFIG}: {where}{name} is {config[name]!r}, but transformers' config class "
                    f"declares it {shown}",
                )
            )
    return problems


#: The keys transformers' ``get_text_config`` reads as the text model's config.
TEXT_CONFIG_NAMES = ("text_config", "decoder", "generator", "text_encoder")


def sub_config_problems(
    config: Mapping[str, Any], cls: type, hints: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """``(field, message)`` of sub-configs that ``cls`` (the config class) cannot hold.

    A text-config key (:data:`TEXT_CONFIG_NAMES`) on a class that declares no such
    sub-config stays a plain dict, on which transformers fails building the model
    (``AttributeError: 'dict' object has no attribute 'to_dict'``); a declared
    sub-config must be an object (or null), and its fields are held to its own class.
    """
    declared: Mapping[str, Any] = getattr(cls, "sub_configs", None) or {}
    problems: list[tuple[str, str]] = []
    for name in sorted(set(config) & (set(declared) | set(TEXT_CONFIG_NAMES))):
        value, sub = config[name], declared.get(name)
        if sub is None and name not in hints:
            problems.append(
                (
                    name,
                    f"{_CONFIG}: {name} is set, but transformers' {cls.__name__} has no "
                    f"sub-config {name!r} (its sub-configs: {', '.join(sorted(declared)) or 'none'})"
                    ": transformers keeps it as a plain dict and fails building the model. Remove "
                    f"{name}, or fix model_type",
                )
            )
        elif sub is not None and value is not None and not isinstance(value, dict):
            problems.append(
                (name, f"{_CONFIG}: {name} is {value!r}, expected an object ({sub.__name__})")
            )
        elif isinstance(sub, type) and isinstance(value, dict) and sub.__name__ != "AutoConfig":
            sizes = [(f, v) for f in SIZE_FIELDS if (v := value.get(f)) is not None]
            bad = {f for f, v in sizes if not _positive_int(v)}
            problems += [
                (
                    f"{name}.{f}",
                    f"{_CONFIG}: {name}.{f} is {value[f]!r}, expected a positive int (at most "
                    "2**40)",
                )
                for f in sorted(bad)
            ]
            problems += _typed_fields(value, _class_annotations(sub), bad, f"{name}.")
    return problems


def _algo_problem(algo: Any, where: str, subject: str) -> tuple[str, str, str] | None:
    known = modelopt_quant_algos()
    if algo is None or (isinstance(algo, str) and algo in known):
        return None
    return (
        "quant-algo-unknown",
        subject,
        f"{where} quant_algo is {algo!r}, which no ModelOpt loader knows (one of "
        f"{', '.join(sorted(known))}): vLLM and TensorRT-LLM refuse the checkpoint. Export "
        "with a registered format",
    )


def _modelopt_problems(section: Section, where: str) -> list[Any]:
    subject = section.file
    found = [
        _algo_problem(section.quant_algo, where, subject),
        group_size_problem(section.group_size, where, subject),
        kv_algo_problem(section.kv_cache_quant_algo, where, subject),
    ]
    for layer in sorted(section.quantized_layers, key=lambda layer: layer.name):
        at = f"{where} quantized_layers[{layer.name!r}]"
        found.append(_algo_problem(layer.quant_algo, at, subject))
        found.append(group_size_problem(layer.group_size, at, subject))
    if section.quantized_layers_invalid is not None:
        found.append(
            (
                "quant-algo-unknown",
                subject,
                f"{where} quantized_layers is {type(section.quantized_layers_invalid).__name__}, "
                "expected an object {layer: {quant_algo}}",
            )
        )
    return [p for p in found if p is not None]


def _group_problem(group: ConfigGroup, known: frozenset[str]) -> str | None:
    weights = group.weights
    if weights is None:
        return f"weights is {group.weights_invalid!r}, expected quantization args"
    if not _positive_int(weights.num_bits) or weights.type not in _CT_TYPES:
        return (
            f"weights num_bits={weights.num_bits!r} type={weights.type!r}, "
            "expected a positive num_bits and type 'int' or 'float'"
        )
    if group.format is not None and group.format not in known:
        return (
            f"format {group.format!r} is no compressed-tensors format ({', '.join(sorted(known))})"
        )
    return None


def _args_problems(section: Section, where: str) -> list[tuple[str, str, str]]:
    """``config-field-invalid`` for every args object compressed-tensors' validation refuses."""
    found = [
        why
        for group in sorted(section.config_groups or (), key=lambda group: group.name)
        for key in ("weights", "input_activations", "output_activations")
        for why in args_problems(
            getattr(group, key), f"{where}.config_groups[{group.name!r}].{key}"
        )
    ]
    found += args_problems(section.kv_cache_scheme, f"{where}.kv_cache_scheme")
    return [
        (
            "config-field-invalid",
            _CONFIG,
            f"{why}: compressed-tensors' own validation (QuantizationArgs) refuses these "
            "args, and the loaders of this layout (vLLM, SGLang, transformers) fail at load",
        )
        for why in found
    ]


def _ct_problems(section: Section) -> list[tuple[str, str, str]]:
    where = f"{_CONFIG} quantization_config"
    if section.config_groups is None:
        return [
            (
                "quant-algo-unknown",
                _CONFIG,
                f"{where}: config_groups is {section.config_groups_invalid!r}, expected an object "
                "{group: scheme}",
            )
        ]
    known = compressed_tensors_formats()
    problems: list[tuple[str, str, str]] = []
    for group in sorted(section.config_groups, key=lambda group: group.name):
        why = _group_problem(group, known)
        if why:
            problems.append(
                (
                    "quant-algo-unknown",
                    _CONFIG,
                    f"{where}.config_groups[{group.name!r}]: {why}; compressed-tensors cannot "
                    "decompress the layers",
                )
            )
    return problems + _args_problems(section, where)


def quant_config_problems(declaration: QuantizationDeclaration) -> list[tuple[str, str, str]]:
    """``(rule, subject, message)`` of every unknown ``quant_algo`` or compressed-tensors scheme."""
    problems: list[tuple[str, str, str]] = []
    if declaration.hf_quant is not None:
        problems += _modelopt_problems(declaration.hf_quant, f"{_HF_QUANT} quantization")
    elif declaration.hf_quant_present:
        problems.append(
            (
                "quant-algo-unknown",
                _HF_QUANT,
                f"{_HF_QUANT}: quantization is {declaration.hf_quant_invalid!r}, expected an "
                "object with quant_algo",
            )
        )
    section = declaration.config
    for declared in (declaration.hf_quant, section):
        problems += list_problems(declared) if declared is not None else []
    if section is None and declaration.config_invalid is None:
        return problems
    if section is None or not isinstance(section.quant_method, str):
        method = declaration.config_invalid if section is None else section.quant_method
        problems.append(
            (
                "config-field-invalid",
                _CONFIG,
                f"{_CONFIG}: quantization_config must be an object with a quant_method string; "
                f"got {method!r}",
            )
        )
    elif section.layout == "modelopt":
        problems += _modelopt_problems(section, f"{_CONFIG} quantization_config")
    elif section.layout == "compressed-tensors":
        problems += _ct_problems(section)
    elif section.layout == "finegrained-fp8":
        problems += finegrained_problems(section)
    return problems
