"""``DecoderModel``: a small plain-torch decoder LM that every export target must handle.

Module names follow Hugging Face's Llama (``layers.0.self_attn.q_proj``, ...), so
the quantization and checkpoint code sees the same layout on toy and HF models.
Every linear is an ``nn.Linear`` submodule called through ``__call__``, so a
quantization wrapper can replace it. The forward uses only plain matmul /
softmax and shape arithmetic (no data-dependent shapes, no Python ints derived
from tensor values), so it exports with ``torch.jit.trace``, ``torch.export``
with dynamic batch and sequence, and ``torch.onnx`` (dynamo) with dynamic axes.
"""

# No ``from __future__ import annotations``: TorchScript cannot resolve string
# annotations in a class body, and would then fail for that reason instead of the
# one recorded in SCRIPT_FAILURE_REASON.

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from exportlm.errors import InvalidConfigError, InvalidInputError, UnknownOptionError

__all__ = [
    "SCRIPT_FAILURE_REASON",
    "DecoderConfig",
    "DecoderModel",
    "KVCache",
    "PositionalEncoding",
]

#: Per layer, ``(key, value)`` of shape ``[batch, heads, total_seq, head_dim]``.
KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]

#: Why ``torch.jit.script(DecoderModel())`` fails, or ``None`` if it scripts.
#: Measured on torch 2.13; the torchscript target declares its ``method="script"``
#: expected failure from this, and ``tests/test_models.py`` checks on the installed
#: torch that scripting still fails. The model is written for tracing and
#: ``torch.export``; its cache and return types are the export contract and are not
#: bent to fit TorchScript.
SCRIPT_FAILURE_REASON: str | None = (
    "TorchScript cannot type the kv cache annotation tuple[tuple[Tensor, Tensor], ...] "
    "(one (key, value) pair per layer): it has no variable-length tuple type "
    "(RuntimeError: Can not create tuple with None type); forward's return type also "
    "depends on use_cache (logits, or (logits, kv_cache)), which TorchScript cannot express"
)

C = TypeVar("C", bound="DecoderConfig")


@dataclass(frozen=True)
class DecoderConfig:
    """Dimensions of :class:`DecoderModel`.

    The defaults are tiny and chosen so that every linear's input dimension is a
    multiple of 128: NVFP4 (blocks of 16) and INT4 AWQ (groups of 128) both fit.
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", int) and (not isinstance(value, int) or value <= 0):
                raise InvalidConfigError(
                    f"{type(self).__name__}.{field.name} must be a positive int, got {value!r}"
                )
        if self.hidden_size % self.num_heads:
            raise InvalidConfigError(
                f"{type(self).__name__}: hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick num_heads that divides hidden_size"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    def with_overrides(self: C, overrides: Mapping[str, Any]) -> C:
        """A copy with ``overrides`` applied; an unknown key raises :class:`UnknownOptionError`."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = [key for key in overrides if key not in fields]
        if unknown:
            raise UnknownOptionError(type(self).__name__, unknown, fields)
        return dataclasses.replace(self, **overrides)


def _sinusoid_table(num_positions: int, dim: int) -> torch.Tensor:
    """The ``[num_positions, dim]`` sin/cos table of "Attention Is All You Need", in float32.

    Computed in float64 by numpy, so its bytes do not depend on torch's kernels.
    """
    positions = np.arange(num_positions, dtype=np.float64)[:, None]
    rates = np.exp(-math.log(10000.0) * np.arange(0, dim, 2, dtype=np.float64) / dim)
    table = np.zeros((num_positions, dim), dtype=np.float64)
    table[:, 0::2] = np.sin(positions * rates)
    table[:, 1::2] = np.cos(positions * rates[: dim // 2])
    return torch.from_numpy(table.astype(np.float32))


# Public, but not re-exported for type checkers. Aliased at module level so the type
# comment stays out of any function body TorchScript parses.
_jit_is_tracing = torch.jit.is_tracing  # type: ignore[attr-defined]


def _is_eager() -> bool:
    """False while tracing or exporting, where a Python check on a size would add a guard."""
    return not (_jit_is_tracing() or torch.compiler.is_compiling())


class PositionalEncoding(nn.Module):
    """Adds fixed sinusoidal position embeddings to ``hidden_states [batch, seq, hidden]``.

    The table is a non-persistent buffer (not in the state dict; it is derived).
    Rows are looked up with ``F.embedding`` on ``arange(offset, offset + seq)``
    rather than sliced, so no exporter sees a guard ``seq <= max_positions``: the
    sequence dimension stays fully dynamic under ``torch.export``, ONNX dynamo and
    ``torch.jit.trace``. In eager mode, positions past the table raise
    :class:`~exportlm.errors.InvalidInputError`.
    """

    pe: torch.Tensor

    def __init__(self, hidden_size: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("pe", _sinusoid_table(max_positions, hidden_size), persistent=False)

    def forward(self, hidden_states: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``hidden_states`` plus the encodings of positions ``offset .. offset + seq - 1``."""
        seq = hidden_states.size(1)
        if _is_eager() and offset + seq > self.max_positions:
            raise InvalidInputError(
                f"positions {offset}..{offset + seq - 1} exceed the {self.max_positions} "
                "positions of the sinusoidal table; shorten the input or build the model "
                "with a larger max_position_embeddings"
            )
        positions = torch.arange(seq, device=hidden_states.device) + offset
        return hidden_states + F.embedding(positions, self.pe).to(hidden_states.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with an optional KV cache (plain matmul/softmax)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, S, hidden] -> [B, H, S, D]; unflatten uses constants only, never B or S.
        heads: torch.Tensor = x.unflatten(-1, (self.num_heads, self.head_dim))
        return heads.transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attn_bias: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend over the cached and the new positions; returns ``(output, (key, value))``."""
        q = self._heads(self.q_proj(hidden_states))
        k = self._heads(self.k_proj(hidden_states))
        v = self._heads(self.v_proj(hidden_states))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale + attn_bias
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        output: torch.Tensor = self.o_proj(out)
        return output, (k, v)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, the Llama MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        output: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return output


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: DecoderConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = mlp

    def forward(
        self,
        hidden_states: torch.Tensor,
        attn_bias: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Run one block; returns the new hidden states and this layer's ``(key, value)``."""
        attn_out, kv = self.self_attn(self.input_layernorm(hidden_states), attn_bias, past)
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, kv


def causal_attention_bias(
    q_len: int,
    k_len: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive bias ``[batch or 1, 1, q_len, k_len]``: 0 where allowed, dtype-min elsewhere.

    Query ``i`` sits at absolute position ``k_len - q_len + i`` and may see keys
    ``0 .. that position``. ``attention_mask`` (``[batch, k_len]``, 1 = real
    token, 0 = padding) additionally hides padded keys. A row with nothing
    visible gets a uniform softmax, never NaN, because the bias is finite.
    """
    query_pos = torch.arange(q_len, device=device) + (k_len - q_len)
    key_pos = torch.arange(k_len, device=device)
    allowed = (key_pos[None, :] <= query_pos[:, None])[None, None, :, :]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    zero = torch.zeros((), dtype=dtype, device=device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed, zero, blocked)


class DecoderModel(nn.Module):
    """A Llama-shaped decoder LM in plain torch, with sinusoidal positions and MHA.

    ``DecoderModel(config=None, **overrides)``: ``overrides`` replace fields of
    ``config`` (default :class:`DecoderConfig`); an unknown field raises
    :class:`~exportlm.errors.UnknownOptionError`. Weights are left at torch's
    default init; use :func:`~exportlm.models.seeded_init_` (or
    :func:`~exportlm.models.build_model`) for reproducible weights.

    With ``tie_embeddings=True``, ``lm_head.weight`` *is* ``embed_tokens.weight``
    and ``_tied_weights_keys`` declares it the way transformers v5 does
    (``{target: source}``); untied it is ``{}``.
    """

    def __init__(self, config: DecoderConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        config = (config if config is not None else self._default_config()).with_overrides(
            overrides
        )
        self.config: DecoderConfig = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_encoding = PositionalEncoding(config.hidden_size, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self._build_mlp(config)) for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tied_weights_keys: dict[str, str] = {}
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self._tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    @classmethod
    def _default_config(cls) -> DecoderConfig:
        return DecoderConfig()

    def _build_mlp(self, config: DecoderConfig) -> nn.Module:
        """The MLP of one layer (subclasses swap it, e.g. for a mixture of experts)."""
        return SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, KVCache]:
        """Logits ``[batch, seq, vocab]``, or ``(logits, kv_cache)`` when ``use_cache``.

        ``past_key_values`` (a previous call's ``kv_cache``) continues decoding:
        ``input_ids`` are then the new tokens only, their positions start after
        the cached ones, and ``attention_mask``, if given, covers cached + new
        tokens (``[batch, past + seq]``, 1 = real token).
        """
        past_len = 0 if past_key_values is None else past_key_values[0][0].size(2)
        if _is_eager():
            self._check_inputs(input_ids, attention_mask, past_key_values, past_len)
        hidden = self.pos_encoding(self.embed_tokens(input_ids), past_len)
        q_len = input_ids.size(1)
        bias = causal_attention_bias(
            q_len, past_len + q_len, attention_mask, hidden.dtype, hidden.device
        )
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[i]
            hidden, kv = layer(hidden, bias, past)
            cache.append(kv)
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        if use_cache:
            return logits, tuple(cache)
        return logits

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: KVCache | None,
        past_len: int,
    ) -> None:
        """Eager-only checks that turn shape mistakes into errors that say what to pass."""
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise InvalidInputError(
                f"input_ids must be integer token ids [batch, seq], got a {input_ids.dtype} "
                f"tensor of shape {tuple(input_ids.shape)}"
            )
        if past_key_values is not None and len(past_key_values) != len(self.layers):
            raise InvalidInputError(
                f"past_key_values has {len(past_key_values)} entries, expected one (key, value) "
                f"pair per layer ({len(self.layers)}); pass the kv_cache a previous call returned"
            )
        expected = (input_ids.size(0), past_len + input_ids.size(1))
        if attention_mask is not None and tuple(attention_mask.shape) != expected:
            raise InvalidInputError(
                f"attention_mask must be [batch, past + seq] = {list(expected)}, got "
                f"{list(attention_mask.shape)}; with past_key_values it covers the cached tokens too"
            )
