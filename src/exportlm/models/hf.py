"""Tiny Hugging Face causal LMs built from configs with seeded weights (never from a hub).

One tiny config per family, in the spirit of transformers' own model testers:
hidden 128, 2 layers, 4 heads (2 KV heads, head_dim 32), vocab 256, dense
intermediate 256, experts 4 (top-2) of intermediate 128, 128 positions, eager
attention, float32, eval mode.

How transformers 5.x stores MoE experts (measured on 5.24; the factory leaves the
experts implementation as transformers builds it, and the export targets switch
it to a traceable one themselves):

- ``mixtral``, ``qwen2_moe``, ``qwen3_moe``: ``mlp.experts`` is one module with
  fused 3-D parameters ``gate_up_proj [E, 2*I, H]`` (gate rows first, then up)
  and ``down_proj [E, H, I]``, no biases, used as ``x @ W.T``; the router is
  ``mlp.gate`` (``weight [E, H]``). ``qwen2_moe`` adds a dense ``shared_expert``
  (an MLP with ``gate_proj``/``up_proj``/``down_proj`` linears) scaled by
  ``sigmoid(shared_expert_gate(x))``.
- ``gpt_oss``: ``mlp.experts`` has ``gate_up_proj [E, H, 2*I]`` (transposed:
  used as ``x @ W``) with gate and up *interleaved* along the last axis
  (``[..., ::2]`` is gate, ``[..., 1::2]`` is up), ``gate_up_proj_bias [E, 2*I]``,
  ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, a clamped SwiGLU
  (``swiglu_limit``, ``swiglu_alpha``); the router ``mlp.router`` has a weight and
  a bias, and attention has per-head ``sinks``. Its layers alternate sliding and
  full attention (``sliding_window`` 128, the whole tiny context), and it keeps
  YaRN rope scaled to the 128 positions.
- ``llama4`` (``Llama4ForCausalLM`` of a ``Llama4TextConfig``): every layer's
  ``feed_forward`` is a ``Llama4TextMoe``: ``experts`` (``Llama4TextExperts``) has
  ``gate_up_proj [E, H, 2*I]`` (transposed like GptOss, but gate columns then up
  columns, not interleaved) and ``down_proj [E, I, H]``, no biases; its forward
  takes the tokens already scaled by their sigmoid router scores, every expert
  seeing every token (``bmm``, no routing inside, no experts-implementation switch);
  the router ``feed_forward.router`` is an ``nn.Linear`` subclass with its own
  forward, and a dense ``shared_expert`` MLP runs beside the experts.
- ``dbrx`` (``DbrxForCausalLM``): ``ffn.experts`` (``DbrxExperts``) keeps the
  weights in its child ``mlp`` (``DbrxExpertGLU``) as 2-D ``w1`` (gate), ``v1`` (up)
  and ``w2`` (down), each ``[E * I, H]``; ``w1``/``v1`` hold ``[out, in]`` rows per
  expert, ``w2`` ``[in, out]`` rows. Its forward loops over the experts the batch
  hits (``nonzero``, a data-dependent shape); the router is ``ffn.router.layer``.
  Attention is one fused ``Wqkv`` linear clamped to ``clip_qkv`` (8, as DBRX
  ships; ``None`` fails in transformers 5.24's forward).

The experts forward is dispatched on ``config._experts_implementation``, which
transformers 5.24 resolves to ``"grouped_mm"`` when nothing is requested (also on
CPU): tokens are sorted by expert and run through ``torch._grouped_mm`` (or its
fallback). ``"eager"`` loops over the experts hit by the batch (``nonzero``, a
data-dependent shape); ``"batched_mm"`` gathers each token's top-k expert weights.
Switch with ``model.set_experts_implementation(...)`` and read it back with
``model.get_experts_implementation()``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from exportlm.errors import TiedWeightsError, UnknownNameError, UnknownOptionError
from exportlm.models._init import seeded_init_
from exportlm.models.causes import FailureCause

if TYPE_CHECKING:  # transformers loads when a family is built, not when one is listed
    import transformers

__all__ = [
    "HF_FAMILIES",
    "HF_SCRIPT_FAILURE_REASON",
    "hf_family_causes",
    "hf_family_failures",
    "hf_family_since",
    "tiny_hf_model",
]

logger = logging.getLogger(__name__)

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 128,
}
_MOE_INTERMEDIATE = 128
_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}

# Why some families' forwards do not export (measured on torch 2.13 / transformers 5.24).
_LLAMA4_COMPLEX_ROPE = (
    "Llama4's rotary embedding computes with complex tensors (torch.view_as_complex); the "
    "ONNX exporter has no translation for complex-valued aten.unsqueeze (DispatchError: No "
    "decompositions registered for the complex-valued input)"
)
_DBRX_DATA_DEPENDENT = (
    "DbrxExperts loops over the experts the batch hits (nonzero: a data-dependent shape) and "
    "has no traceable experts implementation to switch to: torch.export, and the ONNX "
    "exporter built on it, stop on a data-dependent guard (GuardOnDataDependentSymNode: "
    "Could not guard on data-dependent expression Eq(u0, 0))"
)
_DBRX_TRACE = (
    "DbrxExperts loops over the experts the batch hits: torch.jit.trace records that loop "
    "for the tracing batch only, and a batch hitting another set of experts fails "
    "(RuntimeError: Expected 3 elements in a list but found 4)"
)
_DBRX_LOOP = "data-dependent control flow in the expert loop"


@dataclasses.dataclass(frozen=True)
class _Family:
    """How to build one family: its transformers config class and tiny config values.

    ``causes`` say why the forward cannot be captured some ways (``TargetInfo.capture``:
    every target capturing so inherits the failure); ``failures`` maps an export
    target column (``"onnx"``) to a failure that is that target's own, not its
    capture's (measured, not guessed). ``since``: the catalogue version that added
    the family.
    """

    config_class: str
    config: Mapping[str, Any]
    failures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    causes: tuple[FailureCause, ...] = ()
    since: int = 1


_FAMILIES: dict[str, _Family] = {
    "llama": _Family("LlamaConfig", {**_COMMON, "tie_word_embeddings": False}),
    "llama_tied": _Family("LlamaConfig", {**_COMMON, "tie_word_embeddings": True}),
    "mixtral": _Family(
        "MixtralConfig",
        # Mixtral's intermediate_size *is* the expert size.
        {
            **_COMMON,
            "intermediate_size": _MOE_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen2_moe": _Family(
        "Qwen2MoeConfig",
        {
            **_COMMON,
            "moe_intermediate_size": _MOE_INTERMEDIATE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 256,
        },
    ),
    "qwen3_moe": _Family(
        "Qwen3MoeConfig",
        {
            **_COMMON,
            "moe_intermediate_size": _MOE_INTERMEDIATE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "gpt_oss": _Family(
        "GptOssConfig",
        # GptOss' intermediate_size *is* the expert size.
        # Keep GptOss' YaRN rope, scaled so that factor == max_positions / original.
        {
            **_COMMON,
            "intermediate_size": _MOE_INTERMEDIATE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4,
            },
        },
    ),
    "llama4": _Family(
        "Llama4TextConfig",
        # Llama4's intermediate_size is the expert (and shared expert) size;
        # intermediate_size_mlp sizes the dense layers (none: every layer is MoE).
        {
            **_COMMON,
            **_EXPERTS,
            "intermediate_size": _MOE_INTERMEDIATE,
            "intermediate_size_mlp": _COMMON["intermediate_size"],
        },
        failures={"onnx": _LLAMA4_COMPLEX_ROPE},
        since=3,
    ),
    "dbrx": _Family(
        "DbrxConfig",
        # DBRX names its sizes its own way (d_model, n_heads, ...); no head_dim, no
        # dense MLP: every block is MoE.
        {
            "vocab_size": _COMMON["vocab_size"],
            "d_model": _COMMON["hidden_size"],
            "n_heads": _COMMON["num_attention_heads"],
            "n_layers": _COMMON["num_hidden_layers"],
            "max_seq_len": _COMMON["max_position_embeddings"],
            "attn_config": {
                "kv_n_heads": _COMMON["num_key_value_heads"],
                "clip_qkv": 8.0,
                "rope_theta": 10000.0,
            },
            "ffn_config": {
                "ffn_hidden_size": _MOE_INTERMEDIATE,
                "moe_num_experts": _EXPERTS["num_local_experts"],
                "moe_top_k": _EXPERTS["num_experts_per_tok"],
            },
        },
        # torch.export covers the ONNX (dynamo) exporter built on it.
        causes=(
            FailureCause(_DBRX_LOOP, frozenset({"torch.export"}), _DBRX_DATA_DEPENDENT),
            FailureCause(_DBRX_LOOP, frozenset({"torchscript-trace"}), _DBRX_TRACE),
        ),
        since=3,
    ),
}

#: Why ``torch.jit.script`` fails on every family here (measured on torch 2.13 /
#: transformers 5.24, each family: OSError from inspect.getsource).
HF_SCRIPT_FAILURE_REASON = (
    "TorchScript cannot compile transformers models: scripting recurses into "
    "PretrainedConfig.__init__, whose source inspect cannot read (OSError: could not get "
    "source code), and their forwards take **kwargs, which TorchScript rejects"
)

#: The families :func:`tiny_hf_model` builds.
HF_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


#: Every family here fails TorchScript scripting, whatever target scripts it.
_HF_SCRIPT_CAUSE = FailureCause(
    "transformers source TorchScript cannot compile",
    frozenset({"torchscript-script"}),
    HF_SCRIPT_FAILURE_REASON,
)


def hf_family_failures(family: str) -> dict[str, str]:
    """``{target column: reason}``: failures of ``family`` that are one target's own.

    Failures of a way of capturing the model are :func:`hf_family_causes`.
    """
    return dict(_family(family).failures)


def hf_family_causes(family: str) -> tuple[FailureCause, ...]:
    """Why ``family``'s forward fails some captures (every family: TorchScript scripting)."""
    return (_HF_SCRIPT_CAUSE, *_family(family).causes)


def hf_family_since(family: str) -> int:
    """The catalogue version that added ``family``."""
    return _family(family).since


def _family(name: str) -> _Family:
    try:
        return _FAMILIES[name]
    except KeyError as err:
        raise UnknownNameError("Hugging Face model family", name, list(_FAMILIES)) from err


def _make_config(spec: _Family, overrides: Mapping[str, Any]) -> Any:
    """The family's tiny config with ``overrides``; a key the config lacks is refused.

    Transformers configs accept (and keep) any keyword, so a misspelled override
    would be silently ignored; it is checked against the family's default config.
    """
    import transformers

    config_cls = getattr(transformers, spec.config_class)
    reference = config_cls()
    unknown = [key for key in overrides if not hasattr(reference, key)]
    if unknown:
        accepted = sorted(k for k in reference.to_dict() if not k.startswith("_"))
        raise UnknownOptionError(f"{spec.config_class} overrides", unknown, accepted)
    return config_cls(**{**spec.config, **overrides})


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A tiny transformers causal LM of ``family``, with weights from :func:`seeded_init_`.

    ``family`` is one of :data:`HF_FAMILIES`; ``overrides`` update its config
    (e.g. ``num_hidden_layers=1``). The model is built from the config alone, in
    float32, with ``attn_implementation="eager"``, in eval mode; Hugging Face hub
    access is switched off (``HF_HUB_OFFLINE=1``) before anything is built. Tied
    families (``llama_tied``) share one ``lm_head``/``embed_tokens`` parameter.

    Raises :class:`~exportlm.errors.UnknownNameError` for an unknown family and
    :class:`~exportlm.errors.UnknownOptionError` for an override the family's
    config does not have.
    """
    spec = _family(family)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return build_from_config(_make_config(spec, overrides), seed, family)


def build_from_config(config: Any, seed: int, label: str) -> transformers.PreTrainedModel:
    """The causal LM of a transformers ``config``: float32, eager attention, eval, seeded.

    Shared by :func:`tiny_hf_model` and ``build_from_spec``; ``label`` names the
    model in errors and logs.
    """
    import transformers

    start = time.perf_counter()
    # transformers' own init draws from torch's global RNG; keep the caller's stream intact.
    with torch.random.fork_rng(devices=[]):
        model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32, trust_remote_code=False
        )
    seeded_init_(model, seed, std=config.initializer_range)
    _check_tied(model, label)
    model.eval()
    logger.debug("built tiny %s in %.3f s", label, time.perf_counter() - start)
    return model


def _check_tied(model: transformers.PreTrainedModel, family: str) -> None:
    """A config that ties word embeddings must leave one shared parameter, not two copies."""
    if not model.config.tie_word_embeddings:
        return
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is not embed.weight:
        raise TiedWeightsError(
            f"tiny {family!r} model: config.tie_word_embeddings=True but lm_head.weight and "
            "embed_tokens.weight are two tensors after building; transformers did not tie "
            "them, so an exporter would see two diverging copies. Report this with the "
            f"transformers version ({_transformers_version()})."
        )


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
