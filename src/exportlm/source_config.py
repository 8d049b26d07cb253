"""A model directory's ``config.json``, held to what its loaders take before transformers builds it.

Shared by the export's in-memory source (``export.hf_checkpoint.source_model``), its
streamed one (``stream._source.meta_model``), the CLI's recipe check and the plugin's
``--export-model`` rows (``models.directory``): the config's fields by the rules the ``hf_checkpoint``
loader and ``exportlm inspect`` hold a checkpoint's config to
(:func:`exportlm.inspection.config_field_problems`: size fields positive ints, fields
of the types the architecture's config class declares, ``dtype`` a torch dtype), and
no quantized checkpoint as the source
(:func:`exportlm.checkpoint.refuse_quantized_source`). transformers takes
``num_hidden_layers: -1`` and builds a model with no decoder layer, which exported as a
checkpoint ``inspect`` then failed: refused here, with inspect's message. A
``num_hidden_layers`` whose layers the shards do not store is refused from the tensor
names alone (:func:`missing_layers`). A
``generation_config.json`` that is not a JSON object is refused too: transformers'
``from_pretrained`` ignores it without a word and the checkpoint would get a generation
config made from ``config.json`` (another end-of-sequence id, no sampling defaults); so is
one whose ``bos`` / ``eos`` / ``pad_token_id`` is no token id (transformers copies it).
An ``architectures`` naming a model of another ``model_type`` is refused: transformers
builds the model from ``model_type``, vLLM and TensorRT-LLM from ``architectures``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exportlm.checkpoint import refuse_quantized_source
from exportlm.errors import ExportLMError, InvalidConfigError, MalformedCheckpointError
from exportlm.hfdir import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_json_object
from exportlm.inspection import (
    config_field_problems,
    layer_count_of,
    layer_gap,
    read_safetensors_header,
)

__all__ = ["check_source_config", "missing_layers", "stored_weight_map"]

GENERATION_CONFIG = "generation_config.json"

logger = logging.getLogger(__name__)

_WARNED: set[tuple[str, str]] = set()  # the architecture warning, once per directory and process


def check_source_config(directory: Path, config: Mapping[str, Any], where: str) -> None:
    """Refuse a source whose ``config.json`` has a field its loaders refuse, that is
    quantized, whose layer count the shards do not back, or whose generation config is no
    JSON object.

    Raises:
        InvalidConfigError: ``where`` and the first problem.
    """
    problems = config_field_problems(config)
    if problems:
        _, message = problems[0]
        raise InvalidConfigError(f"{where}: {message}; fix config.json")
    _check_architecture(directory, config, where)
    refuse_quantized_source(directory, config, where)
    _check_layer_count(directory, config, where)
    _check_generation_config(directory, config)


def _check_architecture(directory: Path, config: Mapping[str, Any], where: str) -> None:
    """Refuse an ``architectures`` class of another model type than ``model_type``.

    transformers' ``AutoModelForCausalLM`` builds the class ``model_type`` maps to and
    never reads ``architectures``; vLLM and TensorRT-LLM pick their model class from
    ``architectures``. A config whose two fields disagree (``model_type: llama`` with
    ``Qwen2ForCausalLM``) exported as one model while the engines would have read the
    source as another; the checkpoint names the class exported. A class of the same model
    type (``LlamaForSequenceClassification``) or one this transformers does not have is
    exported as the causal LM, with a warning.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch, model_type = config["architectures"][0], config["model_type"]
    if not where.endswith("config.json"):
        where = f"{where}: config.json"
    built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if built is None or arch == built:  # no causal LM: the load says so
        return
    named = getattr(transformers, arch, None)
    if not (isinstance(named, type) and issubclass(named, transformers.PreTrainedModel)):
        _warn_once(
            (str(directory), arch),
            f"{where}: architectures names {arch}, which transformers "
            f"{transformers.__version__} does not have; exporting the causal LM of model_type "
            f"{model_type!r}, {built}",
        )
        return
    named_type = getattr(named.config_class, "model_type", None)
    built_type = getattr(getattr(transformers, built).config_class, "model_type", None)
    if named_type in (model_type, built_type):
        _warn_once(
            (str(directory), arch),
            f"{where}: architectures names {arch}; exporting the causal LM {built} that "
            f"model_type {model_type!r} gives (the checkpoint names {built})",
        )
        return
    raise InvalidConfigError(
        f"{where}: architectures names {arch}, a {named_type!r} model, but its "
        f"model_type is {model_type!r}, from which transformers builds {built}; vLLM and "
        f"TensorRT-LLM pick the class by architectures and would read this directory as "
        f"another model than the one exported. Fix config.json: the model_type and "
        f"architectures of the model the weights belong to"
    )


def _warn_once(key: tuple[str, str], message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def _check_layer_count(directory: Path, config: Mapping[str, Any], where: str) -> None:
    problem = missing_layers(directory, config)
    if problem is not None:
        raise InvalidConfigError(f"{where}: {problem}")


def missing_layers(directory: Path, config: Mapping[str, Any]) -> str | None:
    """Why ``config``'s ``num_hidden_layers`` counts layers the weights do not store, else ``None``.

    Read off the tensor names (the index, or the single file's header), before anything
    is built: transformers would initialise the missing layers at random, and a count
    like ``10**9`` would have it build layers for hours. Layers stored beyond the count
    (DeepSeek-V3's multi-token-prediction layer) are left to the load, which warns.
    """
    names = _stored_names(directory)
    gap = layer_gap(layer_count_of(config), names) if names else None
    return gap.message() if gap is not None and gap.missing else None


def _stored_names(directory: Path) -> list[str]:
    """The tensor names of the weights transformers reads; ``[]`` where they cannot be read
    here (the load then says why)."""
    try:
        return list(stored_weight_map(directory))
    except (ExportLMError, OSError):
        return []


def stored_weight_map(directory: Path) -> dict[str, str]:
    """``{tensor: shard file}`` of the weights transformers' ``from_pretrained`` reads.

    ``model.safetensors`` where there is one (its header), else the index's
    ``weight_map``: the in-memory export (transformers), the streamed one and the layer
    count check all read the one file. Raises
    :class:`~exportlm.errors.MalformedCheckpointError` when neither is there or the one
    read is not readable (a header that is not safetensors', an index with no
    ``weight_map`` object, a FIFO).
    """
    single = directory / SAFETENSORS_SINGLE
    if single.exists() or single.is_symlink():  # a FIFO or dangling link: refused by the read
        try:
            return dict.fromkeys(read_safetensors_header(single), SAFETENSORS_SINGLE)
        except MalformedCheckpointError as err:
            raise MalformedCheckpointError(
                f"{single}: not a readable safetensors file ({err})"
            ) from err
    index = directory / SAFETENSORS_INDEX
    if not index.exists():
        raise MalformedCheckpointError(
            f"{directory}: neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX}; the export "
            "reads safetensors weights only"
        )
    weight_map = read_json_object(index, what="weight index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise MalformedCheckpointError(
            f"{index}: no weight_map object (found {type(weight_map).__name__}); an index "
            "maps each tensor name to its shard file"
        )
    return {str(name): str(shard) for name, shard in weight_map.items()}


def _check_generation_config(directory: Path, config: Mapping[str, Any]) -> None:
    """Refuse a ``generation_config.json`` that is there but is no JSON object, or whose
    token ids are no token ids.

    Most of what is in the object (a negative ``max_new_tokens``) transformers' own
    ``GenerationConfig`` judges where the model is built; a file it cannot read at all
    it would drop silently, and token ids of the wrong type it copies unchecked into the
    checkpoint, whose ``generate()`` then fails (``eos_token_id: "x"``: "new(): invalid
    data type 'str'") or never stops (an end-of-sequence id outside the vocabulary), so
    those are refused here.
    """
    path = directory / GENERATION_CONFIG
    if not path.exists() and not path.is_symlink():
        return
    try:
        generation = read_json_object(path, what="generation config")
    except MalformedCheckpointError as err:
        raise InvalidConfigError(
            f"{err}. transformers would ignore the file and the checkpoint would get a "
            "generation config made from config.json (its end-of-sequence id and sampling "
            f"defaults lost): fix {GENERATION_CONFIG} or remove it"
        ) from err
    vocab = config.get("vocab_size")
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        problem = _token_id_problem(generation.get(field), vocab, signed=field == "pad_token_id")
        if problem is not None:
            raise InvalidConfigError(
                f"{path}: {field} is {generation[field]!r}; {problem}: transformers copies it "
                f"as it is and the checkpoint's generate() fails or never stops. Fix "
                f"{GENERATION_CONFIG} (or remove the field)"
            )


def _token_id_problem(value: Any, vocab: Any, *, signed: bool) -> str | None:
    """What is wrong with ``value`` as a token id (or a list of them), or ``None``.

    ``pad_token_id`` may be negative (-1: "no padding token", as early Llama configs say);
    the others are ids the model can emit, so at least 0 and below ``vocab_size``.
    """
    if value is None:
        return None
    ids = value if isinstance(value, list) and value else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return "expected a token id (an int) or a non-empty list of them"
    if signed:
        return None
    limit = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    bad = [i for i in ids if i < 0 or (limit is not None and i >= limit)]
    if bad:
        span = f"[0, {limit})" if limit is not None else "at least 0"
        return f"{bad[0]} is not an id of the vocabulary {span}"
    return None
