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
  fail (:func:`model_expected_failures`), the :class:`FailureCause` records of why
  its forward fails some ways of capturing a model (:func:`model_failure_causes`)
  and the catalogue version that added it (:func:`model_since`).
"""

from exportlm.models._init import seeded_init_
from exportlm.models.causes import PER_MODEL_CHECKS, FailureCause
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
    DECODER_SCRIPT_CAUSE,
    MODEL_REGISTRY,
    MODELS_GROUP,
    ModelFactory,
    ModelFamily,
    build_model,
    ensure_models_registered,
    family_tolerance_scale,
    model_expected_failures,
    model_failure_causes,
    model_names,
    model_since,
    model_tolerance_scale,
    model_traits,
    register_builtin_models,
)
from exportlm.models.spec import SPEC_FAMILIES, SPEC_FORMAT, ModelSpec, build_from_spec

__all__ = [
    "DECODER_SCRIPT_CAUSE",
    "HF_FAMILIES",
    "HF_SCRIPT_FAILURE_REASON",
    "MODELS_GROUP",
    "MODEL_REGISTRY",
    "PER_MODEL_CHECKS",
    "SCRIPT_FAILURE_REASON",
    "SPEC_FAMILIES",
    "SPEC_FORMAT",
    "DecoderConfig",
    "DecoderModel",
    "FailureCause",
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
    "model_failure_causes",
    "model_names",
    "model_since",
    "family_tolerance_scale",
    "model_tolerance_scale",
    "model_traits",
    "register_builtin_models",
    "seeded_init_",
    "tiny_hf_model",
]
