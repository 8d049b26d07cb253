"""``IterableMoEModel``: ``DecoderModel`` with a mixture-of-experts MLP in every layer.

"Iterable" because the experts are an ``nn.ModuleList`` of ordinary SwiGLU MLPs
(``experts.{j}.gate_proj`` ...), one ``nn.Linear`` per projection, as in
transformers v4 and in ModelOpt's quantized checkpoints, unlike transformers v5's
fused 3-D ``gate_up_proj``/``down_proj`` expert tensors.

Routing is computed densely: every expert runs on every token and the outputs
are combined with a ``[batch, seq, num_experts]`` weight tensor that is zero
outside each token's top-k. No boolean indexing or data-dependent shapes, so it
exports with dynamic batch and sequence like the dense model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exportlm.errors import InvalidConfigError
from exportlm.models.decoder import DecoderConfig, DecoderModel, SwiGLU

__all__ = ["IterableMoEConfig", "IterableMoEModel", "MoEBlock"]


@dataclass(frozen=True)
class IterableMoEConfig(DecoderConfig):
    """:class:`DecoderConfig` plus the experts: ``num_experts`` SwiGLU MLPs, ``top_k`` per token."""

    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.num_experts:
            raise InvalidConfigError(
                f"{type(self).__name__}: top_k={self.top_k} exceeds num_experts="
                f"{self.num_experts}; each token picks top_k distinct experts"
            )


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts: router ``gate`` (hidden -> experts) and ``experts``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(hidden_size, intermediate_size) for _ in range(num_experts)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum of every expert's output weighted by its (renormalized) top-k router softmax."""
        router_logits = self.gate(hidden_states)
        top_values, top_index = torch.topk(router_logits, self.top_k, dim=-1)
        top_weights = torch.softmax(top_values.float(), dim=-1).to(hidden_states.dtype)
        dense_weights = torch.zeros_like(router_logits).scatter(-1, top_index, top_weights)
        expert_outputs = torch.stack([expert(hidden_states) for expert in self.experts], dim=-2)
        return (expert_outputs * dense_weights.unsqueeze(-1)).sum(dim=-2)


class IterableMoEModel(DecoderModel):
    """:class:`DecoderModel` whose ``layers.{i}.mlp`` is a :class:`MoEBlock`.

    ``IterableMoEModel(config=None, **overrides)`` with an :class:`IterableMoEConfig`;
    same forward contract as :class:`DecoderModel`.
    """

    def __init__(self, config: IterableMoEConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)

    @classmethod
    def _default_config(cls) -> DecoderConfig:
        return IterableMoEConfig()

    def _build_mlp(self, config: DecoderConfig) -> nn.Module:
        if not isinstance(config, IterableMoEConfig):
            raise InvalidConfigError(
                f"IterableMoEModel needs an IterableMoEConfig, got {type(config).__name__}"
            )
        return MoEBlock(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.top_k
        )
