"""The files serving runtimes read beside a ``kv_cache=True`` ONNX graph.

* ``layout="optimum"``: ``config.json`` and ``generation_config.json`` (the model's
  transformers config and its own generation config, as ``save_pretrained`` writes them), so the artifact's folder
  is what Optimum's ``ORTModelForCausalLM.from_pretrained(folder)`` loads (name the
  file ``model.onnx``, Optimum's default, or pass ``file_name=``).
* ``genai_config=True``: onnxruntime-genai's ``genai_config.json`` (the ``decoder``
  section names this graph's inputs and outputs), so ``onnxruntime_genai.Model(folder)``
  loads it.

Both are written into the export's staging folder, so they are published with the
graph, all at once, and listed in its manifest. Only a transformers model has the
config these runtimes read; the options are refused for any other model before
anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from exportlm._transformers_model import is_transformers_model
from exportlm.errors import InvalidModelError, InvalidOptionError
from exportlm.export._past import PastLayout, flat_past_names
from exportlm.export.onnx._folder import genai_pad_token_id

__all__ = [
    "GENAI_CONFIG",
    "LAYOUTS",
    "SERVING_FILES",
    "check_serving_options",
    "serving_files",
    "write_serving_files",
]

#: The ``layout`` values of the ``onnx`` target: the bare graph, or Optimum's folder.
LAYOUTS = ("file", "optimum")
#: onnxruntime-genai's configuration file name.
GENAI_CONFIG = "genai_config.json"
#: Every file this module may write beside the graph (the artifact's companions).
SERVING_FILES = ("config.json", "generation_config.json", GENAI_CONFIG)

#: onnxruntime-genai's generic decoder-only model type (its ``ModelType::IsLLM`` list);
#: the graph carries everything model-specific, so no family's own type is needed.
_GENAI_TYPE = "decoder"


def _config(model: nn.Module) -> Any | None:
    if is_transformers_model(model):
        return model.config
    return None


def check_serving_options(model: Any, *, layout: str, genai_config: bool, kv_cache: bool) -> None:
    """Refuse ``layout`` / ``genai_config`` values this export cannot honour (before writing)."""
    if layout not in LAYOUTS:
        raise InvalidOptionError(
            f"onnx export: layout must be one of {list(LAYOUTS)}, got {layout!r}"
        )
    wanted = [f"layout={layout!r}"] if layout != "file" else []
    wanted += ["genai_config=True"] if genai_config else []
    if not wanted:
        return
    if not kv_cache:
        raise InvalidOptionError(
            f"onnx export: {' and '.join(wanted)} need kv_cache=True (Optimum's and "
            "onnxruntime-genai's generation loops feed past key/values); add kv_cache=True"
        )
    if isinstance(model, nn.Module) and _config(model) is None:
        raise InvalidModelError(
            f"onnx export: {' and '.join(wanted)} write the model's transformers config, and "
            f"{type(model).__name__} is not a transformers PreTrainedModel; export without "
            "them (layout='file', genai_config=False)"
        )


def serving_files(layout: str, genai_config: bool) -> list[str]:
    """The files :func:`write_serving_files` writes for these options."""
    return [*(SERVING_FILES[:2] if layout == "optimum" else ()), *([GENAI_CONFIG] * genai_config)]


def write_serving_files(
    model: nn.Module,
    graph: Path,
    layout: PastLayout,
    *,
    optimum: bool,
    genai: bool,
    tokenizer: Mapping[str, bytes] | None = None,
) -> None:
    """Write the requested files beside ``graph`` (the staged ``.onnx``); ``tokenizer`` (its
    files, as the folder carries them) chooses genai's pad id."""
    config = _config(model)
    if config is None:
        return
    folder = graph.parent
    if optimum:
        from transformers import GenerationConfig

        config.to_json_file(str(folder / "config.json"))
        # The model's own (loaded from its directory: EOS lists, sampling defaults), else
        # the one transformers derives from the config.
        generation = getattr(model, "generation_config", None)
        if generation is None:
            generation = GenerationConfig.from_model_config(config)
        generation.to_json_file(str(folder / "generation_config.json"))
    if genai:
        genai_json = genai_config_for(config, graph.name, layout, tokenizer=tokenizer or {})
        text = json.dumps(genai_json, indent=2, sort_keys=True)
        (folder / GENAI_CONFIG).write_text(text + "\n", encoding="utf-8")


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def genai_config_for(
    config: Any, filename: str, layout: PastLayout, *, tokenizer: Mapping[str, bytes]
) -> dict[str, Any]:
    """onnxruntime-genai's ``genai_config.json`` for the past-key-values graph ``filename``.

    ``pad_token_id`` is an id no prompt holds (:func:`._folder.genai_pad_token_id`, from
    the config and the ``tokenizer``'s files): onnxruntime-genai finds padding by that id
    in ``input_ids``, and pads a batch on the right. Token ids the config leaves unset are
    left out (onnxruntime-genai reads a JSON null as an error).
    """
    kv_heads, head_size = layout.heads[0]
    eos = _first(getattr(config, "eos_token_id", None))
    past = flat_past_names(1, "past_key_values")
    present = flat_past_names(1, "present")
    context = int(getattr(config, "max_position_embeddings", 2048))
    inputs = {"input_ids": "input_ids"}
    if layout.attention_mask:
        inputs["attention_mask"] = "attention_mask"
    if layout.position_ids:
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = past[0].replace(".0.", ".%d.")
    inputs["past_value_names"] = past[1].replace(".0.", ".%d.")
    ids = {"bos_token_id": _first(getattr(config, "bos_token_id", None)), "eos_token_id": eos}
    return {
        "model": {
            **{name: value for name, value in ids.items() if value is not None},
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": head_size,
                "hidden_size": int(config.hidden_size),
                "inputs": inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": present[0].replace(".0.", ".%d."),
                    "present_value_names": present[1].replace(".0.", ".%d."),
                },
                "num_attention_heads": int(config.num_attention_heads),
                "num_hidden_layers": layout.num_layers,
                "num_key_value_heads": kv_heads,
            },
            "pad_token_id": genai_pad_token_id(config, tokenizer),
            "type": _GENAI_TYPE,
            "vocab_size": int(config.vocab_size),
        },
        "search": {
            "do_sample": False,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # present = past + new positions, a new buffer each step (not shared in place)
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }
