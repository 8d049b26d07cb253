"""The checkpoint room: one reader of a checkpoint's quantization configs and its model.

:func:`read_declaration` (a directory) and :func:`declaration_of` (already-read
``config.json`` / ``hf_quant_config.json``) turn ``config.json``'s
``quantization_config`` and ModelOpt's ``hf_quant_config.json`` into one
:class:`QuantizationDeclaration`: the layout (``modelopt``, ``compressed-tensors``,
another ``quant_method`` or none), the scheme per layer or group (ModelOpt's
``quant_algo`` and ``quantized_layers``, compressed-tensors' ``config_groups``), the
group size, the KV cache's scheme and the modules listed as excluded. The
``hf_checkpoint`` loader, ``exportlm inspect`` and the serving engines read a
checkpoint's quantization through it, and nothing else parses those keys
(``tests/test_architecture.py``). Standard library only: the engines import it.
"""

from exportlm.checkpoint._model import (
    MIXED_PRECISION,
    ConfigGroup,
    FineGrainedFP8,
    Listed,
    ModelOptLayer,
    QuantArgs,
    QuantizationDeclaration,
    Section,
)
from exportlm.checkpoint._read import (
    HF_QUANT_CONFIG_NAME,
    config_group,
    declaration_of,
    quant_args,
    read_declaration,
    refuse_quantized_source,
)

__all__ = [
    "HF_QUANT_CONFIG_NAME",
    "MIXED_PRECISION",
    "ConfigGroup",
    "FineGrainedFP8",
    "Listed",
    "ModelOptLayer",
    "QuantArgs",
    "QuantizationDeclaration",
    "Section",
    "config_group",
    "declaration_of",
    "quant_args",
    "read_declaration",
    "refuse_quantized_source",
]
