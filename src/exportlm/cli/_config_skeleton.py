"""The linears of a dense Llama-style model directory, from its ``config.json`` alone.

Building the ``meta`` skeleton of :mod:`exportlm.cli._recipe` imports transformers and
the model's modeling code (about 2.5 s of a refusal that should cost the CLI's start-up
only). For the architectures whose linears follow from a few config numbers (Llama,
Mistral, Qwen2, Qwen3: ``q/k/v/o_proj``, ``gate/up/down_proj``, an ``lm_head``), this
module builds the same module names, types and shapes as plain ``torch.nn`` modules on
the ``meta`` device, in the order transformers registers them, so
:func:`~exportlm.quant.check_recipe` refuses the same module with the same message. No
weight file is opened. Any other architecture, or a config missing a number, gets
``None`` and the full skeleton is built as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exportlm.inspection._config import MAX_SIZE

__all__ = ["config_skeleton"]

#: ``model_type`` values whose decoder layers hold exactly these linears, named so.
DENSE_LLAMA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int | None:
    """A size field, or ``None`` where it is no int in the range the config rules allow."""
    value = config.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE:
        return value
    return None


def _dims(config: dict[str, Any]) -> dict[str, int] | None:
    """The sizes the linears' shapes come from, or ``None`` where one is missing."""
    if config.get("model_type") not in DENSE_LLAMA_TYPES:
        return None
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    head_dim = _int(config, "head_dim")
    if config.get("head_dim") is None and hidden % heads == 0:
        head_dim = hidden // heads
    dims = {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _int(config, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "inter": _int(config, "intermediate_size"),
        "layers": _int(config, "num_hidden_layers"),
        "vocab": _int(config, "vocab_size"),
    }
    known = {key: value for key, value in dims.items() if value is not None}
    return known if len(known) == len(dims) else None


def _layer(d: dict[str, int]) -> nn.Module:
    attention = nn.Module()
    q_out, kv_out = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    attention.q_proj = nn.Linear(d["hidden"], q_out, bias=False)
    attention.k_proj = nn.Linear(d["hidden"], kv_out, bias=False)
    attention.v_proj = nn.Linear(d["hidden"], kv_out, bias=False)
    attention.o_proj = nn.Linear(q_out, d["hidden"], bias=False)
    mlp = nn.Module()
    mlp.gate_proj = nn.Linear(d["hidden"], d["inter"], bias=False)
    mlp.up_proj = nn.Linear(d["hidden"], d["inter"], bias=False)
    mlp.down_proj = nn.Linear(d["inter"], d["hidden"], bias=False)
    layer = nn.Module()
    layer.self_attn, layer.mlp = attention, mlp
    return layer


def config_skeleton(config: dict[str, Any]) -> nn.Module | None:
    """``config``'s causal LM as ``meta`` modules named as transformers names them, or ``None``.

    Only the modules a recipe can quantize are built (embedding, linears, ``lm_head``);
    norms and rotary tables hold no quantizable weight.
    """
    d = _dims(config)
    if d is None:
        return None
    with torch.device("meta"):
        root, body = nn.Module(), nn.Module()
        # a given weight: no normal_ initialisation, which on ``meta`` imports torch._dynamo
        body.embed_tokens = nn.Embedding(
            d["vocab"], d["hidden"], _weight=torch.empty(d["vocab"], d["hidden"])
        )
        body.layers = nn.ModuleList(_layer(d) for _ in range(d["layers"]))
        root.model = body
        root.lm_head = nn.Linear(d["hidden"], d["vocab"], bias=False)
    return root
