"""A model directory from elsewhere, loaded whole by transformers once it is a float model's.

``exportlm export --model DIR`` and ``export_model("hf_checkpoint", DIR, ...)`` hand a
directory someone else wrote to transformers. Before it builds anything:
:func:`~exportlm.hfdir.vet_model_directory` (no code of its own, no FIFO, shards
confined), :func:`exportlm.source_config.check_source_config` (the config's fields, no
quantized checkpoint), and the shards' headers against the config's model on the
``meta`` device (a shape the config does not describe; integer or float8 codes where the
model has a float weight, which transformers would cast without a word). While it
loads, whatever transformers raises is one :class:`~exportlm.errors.InvalidConfigError`
(:func:`~exportlm.hfdir.transformers_errors`); after, a weight no shard holds is refused
(transformers initialises it at random) and a stored tensor the model has no place for
is named in a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exportlm.errors import ExportLMError, InvalidConfigError
from exportlm.hfdir import check_loading_info, transformers_errors, vet_model_directory
from exportlm.source_config import check_source_config, stored_weight_map

__all__ = ["load_source_model"]


def load_source_model(directory: Path, where: str) -> Any:
    """The causal LM saved in ``directory`` (vetted, its config and weights checked), in eval mode.

    In the dtype it was saved in, with eager attention, as every exportlm runtime and the
    toy families compute it: sdpa alone moved a bfloat16 toy llama's logits by 0.0049
    where eager gives 0.0 (tests/test_bf16_directory.py). Never the directory's own
    code, nothing downloaded; ``where`` begins every message.

    Raises:
        InvalidConfigError: a config field its loaders refuse, a quantized checkpoint,
            weights the config does not describe, or transformers failed.
        CustomCodeRefusedError: loading would run the directory's own code.
    """
    from transformers import AutoModelForCausalLM

    config = vet_model_directory(directory)  # no code of its own, shards confined
    check_source_config(directory, config, where)
    problem = _weights_problem(directory)
    if problem is not None:
        raise InvalidConfigError(f"{where}: {problem}")
    with transformers_errors(where, "load a causal LM"):
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory,
            local_files_only=True,
            trust_remote_code=False,
            attn_implementation="eager",
            output_loading_info=True,
        )
    model, info = loaded
    check_loading_info(info, where, type(model).__name__)
    return model.eval()


def _weights_problem(directory: Path) -> str | None:
    """The first stored tensor that is not the weight ``config.json`` describes, in words.

    From the shards' headers and the config's model on the ``meta`` device, before any
    weight is read: a shape the config does not give the parameter (transformers says
    only "look at the above report", its log), or a float parameter stored as integers
    or float8 (transformers casts them to the model's dtype without a word). A name
    transformers converts on load is not compared; ``None`` where nothing differs or
    the model cannot be built (the load itself then says why).
    """
    from exportlm.export.hf_checkpoint.stream._source import meta_model, stored_codes_problem
    from exportlm.inspection import read_safetensors_header

    try:
        expected = meta_model(directory).state_dict()
        # the files transformers reads: not a stray *.safetensors beside them
        for shard in sorted({directory / s for s in stored_weight_map(directory).values()}):
            for name, info in sorted(read_safetensors_header(shard).items()):
                want = expected.get(name)
                if want is None:
                    continue
                if list(want.shape) != list(info.shape):
                    return (
                        f"tensor {name!r} has shape {list(info.shape)} in {shard.name}, the "
                        f"config expects {list(want.shape)}; config.json does not describe "
                        "these weights (fix it, or use the config the weights were saved with)"
                    )
                codes = stored_codes_problem(f"tensor {name!r} in {shard.name}", info.dtype, want)
                if codes is not None:
                    return codes
    except (ExportLMError, OSError):
        return None
    return None
