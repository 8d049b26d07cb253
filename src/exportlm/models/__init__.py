"""Toy models with reproducible weights: the rows of the export conformance matrix.

- :class:`DecoderModel` / :class:`IterableMoEModel`: plain-torch decoder LMs
  with Llama-style module names, tied or untied embeddings, and a KV cache.
- :func:`tiny_hf_model`: tiny transformers models of :data:`HF_FAMILIES`, built
  from configs (never downloaded).
- :func:`seeded_init_`: weights from numpy's PCG64, the same bytes on every
  torch version and device.
- :class:`ModelSpec`, :func:`build_from_spec`: a decoder structure as a small
  JSON-serialisable spec (layers, heads / KV heads, tied head, dense or MoE,
  vocabulary) and the seeded transformers model it builds.
- :data:`MODEL_REGISTRY`, :func:`build_model`, :func:`model_names`: families by
  name, extensible through the ``exportlm.models`` entry-point group; a
  :class:`ModelFamily` declares the conformance items its family is known to
  fail (:func:`model_expected_failures`).
"""

from exportlm.models._init import seeded_init_
from exportlm.models.decoder import (
    SCRIPT_FAILURE_REASON,
    DecoderConfig,
    DecoderModel,
    KVCache,
    PositionalEncoding,
)
from exportlm.models.hf import HF_FAMILIES, HF_SCRIPT_FAILURE_REASON, tiny_hf_model
from exportlm.models.moe import IterableMoEConfig, IterableMoEModel
from exportlm.models.registry import (
    MODEL_REGISTRY,
    MODELS_GROUP,
    ModelFactory,
    ModelFamily,
    build_model,
    ensure_models_registered,
    model_expected_failures,
    model_names,
    model_traits,
    register_builtin_models,
)
from exportlm.models.spec import SPEC_FAMILIES, SPEC_FORMAT, ModelSpec, build_from_spec

__all__ = [
    "HF_FAMILIES",
    "HF_SCRIPT_FAILURE_REASON",
    "MODELS_GROUP",
    "MODEL_REGISTRY",
    "SCRIPT_FAILURE_REASON",
    "SPEC_FAMILIES",
    "SPEC_FORMAT",
    "DecoderConfig",
    "DecoderModel",
    "IterableMoEConfig",
    "IterableMoEModel",
    "KVCache",
    "ModelFactory",
    "ModelFamily",
    "ModelSpec",
    "PositionalEncoding",
    "build_from_spec",
    "build_model",
    "ensure_models_registered",
    "model_expected_failures",
    "model_names",
    "model_traits",
    "register_builtin_models",
    "seeded_init_",
    "tiny_hf_model",
]
