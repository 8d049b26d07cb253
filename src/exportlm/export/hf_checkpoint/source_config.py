"""A model directory's ``config.json``, held to what its loaders take before transformers builds it.

Shared by the in-memory source (:mod:`.source_model`) and the streamed one
(``stream._source.meta_model``): the config's fields by the rules the ``hf_checkpoint``
loader and ``exportlm inspect`` hold a checkpoint's config to
(:func:`exportlm.inspection.config_field_problems`: size fields positive ints, fields
of the types the architecture's config class declares, ``dtype`` a torch dtype), and
no quantized checkpoint as the source
(:func:`exportlm.checkpoint.refuse_quantized_source`). transformers takes
``num_hidden_layers: -1`` and builds a model with no decoder layer, which exported as a
checkpoint ``inspect`` then failed: refused here, with inspect's message.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exportlm.checkpoint import refuse_quantized_source
from exportlm.errors import InvalidConfigError
from exportlm.inspection import config_field_problems

__all__ = ["check_source_config"]


def check_source_config(directory: Path, config: Mapping[str, Any], where: str) -> None:
    """Refuse a source whose ``config.json`` has a field its loaders refuse, or that is quantized.

    Raises:
        InvalidConfigError: ``where`` and the first problem.
    """
    problems = config_field_problems(config)
    if problems:
        _, message = problems[0]
        raise InvalidConfigError(f"{where}: {message}; fix config.json")
    refuse_quantized_source(directory, config, where)
