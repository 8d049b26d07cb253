"""KV-cache quantization where the cache is written: K after RoPE (and any per-head norm), V.

A serving engine stores in its FP8 KV cache the keys and values the attention
kernel receives: for transformers models, K after the rotary embedding (and,
in Qwen3, after ``k_norm``; in Llama4, after the L2 ``qk_norm``) and V. Their
scales must come from those tensors, as ModelOpt calibrates them (its
``k_bmm_quantizer`` / ``v_bmm_quantizer`` run inside a patched attention
function). The ``k_proj`` output is the wrong tensor wherever RoPE or a norm
sits between the projection and the cache.

The KV quantizers stay the ``output_quantizer`` of ``k_proj`` / ``v_proj`` (the
checkpoint names them ``k_proj.k_scale`` / ``v_proj.v_scale``, as ModelOpt
does), but where the parent attention calls transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS``) their *site* moves there:
:func:`route_kv_cache_to_attention` registers a wrapping attention function
(``exportlm_kv_<inner>``, with the inner implementation's mask function) that
quantizes ``key_states`` / ``value_states`` before calling the inner
implementation, and switches the model to it. Calibration then records the amax
of exactly the cached tensors, and the fake-quant forward sees the FP8 cache.

An attention that calls no attention interface (exportlm's own
:class:`~exportlm.models.DecoderModel`: no RoPE, no per-head norm, the cache
holds the projections' outputs) keeps the projection site.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from exportlm.errors import QuantizationError
from exportlm.quant._modules import QuantLinear
from exportlm.quant._quantizer import TensorQuantizer

__all__ = [
    "KV_ATTENTION_PREFIX",
    "kv_cache_quantizers",
    "route_kv_cache_to_attention",
    "uses_attention_interface",
]

logger = logging.getLogger(__name__)

#: Prefix of the attention implementations registered by
#: :func:`route_kv_cache_to_attention`: ``exportlm_kv_eager`` wraps ``eager``.
KV_ATTENTION_PREFIX = "exportlm_kv_"

#: Where a KV quantizer runs: on the projection's output, or inside the attention function.
SITE_PROJECTION = "projection"
SITE_ATTENTION = "attention"


def _class_modules(module: nn.Module) -> list[Any]:
    """The Python modules defining ``type(module)`` and its bases (a subclass may wrap it)."""
    found = []
    for cls in type(module).__mro__:
        mod = sys.modules.get(cls.__module__)
        if mod is not None and mod not in found:
            found.append(mod)
    return found


def uses_attention_interface(module: nn.Module) -> bool:
    """True for a transformers attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``.

    The test ModelOpt uses: the module's class is defined next to the attention
    interface, and its ``config`` names an attention implementation.
    """
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    return any(
        getattr(mod, "ALL_ATTENTION_FUNCTIONS", None) is not None for mod in _class_modules(module)
    )


def kv_cache_quantizers(
    attention: nn.Module,
) -> tuple[TensorQuantizer | None, TensorQuantizer | None]:
    """The enabled K and V cache quantizers of ``attention`` (``k_proj`` / ``v_proj``'s), or ``None``."""
    found: list[TensorQuantizer | None] = []
    for proj, role in (("k_proj", "k"), ("v_proj", "v")):
        linear = getattr(attention, proj, None)
        quantizer = linear.output_quantizer if isinstance(linear, QuantLinear) else None
        if quantizer is None or quantizer.kv_role != role:
            found.append(None)
        else:
            found.append(quantizer if quantizer.enabled or quantizer.calibrating else None)
    return found[0], found[1]


def _inner_function(module: nn.Module, inner: str) -> Callable[..., Any]:
    """The attention function ``inner`` names, for ``module``'s family."""
    if inner == "eager":  # each family has its own eager function (GptOss: with sinks)
        for mod in _class_modules(module):
            function = getattr(mod, "eager_attention_forward", None)
            if callable(function):
                return function  # type: ignore[no-any-return]
        raise QuantizationError(
            f"{type(module).__qualname__}: its module defines no eager_attention_forward, so "
            "the KV cache cannot be quantized inside its eager attention; load the model with "
            "attn_implementation='sdpa'"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS[inner]
    return registered


def _kv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The registered attention function: quantize the cached K / V, then attend."""
    k_quantizer, v_quantizer = kv_cache_quantizers(module)
    if k_quantizer is not None and getattr(k_quantizer, "kv_site", None) == SITE_ATTENTION:
        key = k_quantizer(key)
    if v_quantizer is not None and getattr(v_quantizer, "kv_site", None) == SITE_ATTENTION:
        value = v_quantizer(value)
    implementation = str(module.config._attn_implementation)  # type: ignore[union-attr]
    inner = implementation.removeprefix(KV_ATTENTION_PREFIX)
    return _inner_function(module, inner)(module, query, key, value, *args, **kwargs)


def _register(inner: str) -> str:
    """Register ``exportlm_kv_<inner>`` (attention and mask functions); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = KV_ATTENTION_PREFIX + inner
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise QuantizationError(
            f"attention implementation {inner!r} has no mask function in transformers' "
            "AttentionMaskInterface, so the KV cache cannot be quantized inside it; use "
            "'eager' or 'sdpa'"
        )
    AttentionInterface.register(name, _kv_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def route_kv_cache_to_attention(model: nn.Module) -> int:
    """Move the KV quantizers of transformers attentions to the attention function.

    For every attention module that calls transformers' attention interface and
    whose ``k_proj`` / ``v_proj`` carry KV-cache quantizers, those quantizers stop
    running on the projection outputs and run on the ``key_states`` /
    ``value_states`` the attention function receives (post-RoPE, post-norm: the
    tensors a serving engine caches). The model's attention implementation
    becomes ``exportlm_kv_<current>`` (registered here). Other attentions keep
    the projection site. Idempotent; returns the number of attentions routed.

    Raises:
        QuantizationError: the model's attention implementation has no mask
            function to wrap, or (eager) its family defines no eager function.
    """
    routed = []
    for module in model.modules():
        k_quantizer, v_quantizer = kv_cache_quantizers(module)
        if (k_quantizer is None and v_quantizer is None) or not uses_attention_interface(module):
            continue
        for quantizer in (k_quantizer, v_quantizer):
            if quantizer is not None:
                quantizer.kv_site = SITE_ATTENTION
        routed.append(module)
    if not routed:
        return 0
    config: Any = getattr(model, "config", None) or routed[0].config
    current = str(config._attn_implementation or "eager")
    if not current.startswith(KV_ATTENTION_PREFIX):
        name = _register(current)
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(name)
        for module in routed:  # a bare attention (no PreTrainedModel around it)
            own: Any = module.config
            if own._attn_implementation != name:
                own._attn_implementation = name
    logger.debug("KV cache quantized inside the attention function of %d module(s)", len(routed))
    return len(routed)
