"""The stacked-experts wrappers' base: every expert layout seen as ``[E, out, in]`` stacks.

:class:`QuantExperts` is mixed into an experts module's own class, as the other wrappers
of :mod:`exportlm.quant._modules` are; :class:`QuantFusedExperts` and
:class:`QuantBMMExperts` are the layouts transformers' experts decorator stores.
:mod:`exportlm.quant._experts` picks the base of each experts module and holds the
families' own (Llama4, DBRX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from exportlm.quant._modules import QuantModule
from exportlm.quant._quantizer import TensorQuantizer

__all__ = ["QuantBMMExperts", "QuantExperts", "QuantFusedExperts"]


class QuantExperts(QuantModule):
    """Base of the stacked-experts wrappers (mixed into the original experts class).

    Weights are seen in the canonical per-expert layout ``[E, out, in]``
    (:meth:`canonical_weight`); each has a per-expert weight quantizer
    (``gate_up_proj_weight_quantizer``, ``down_proj_weight_quantizer``, amax
    ``[E]``), so the gate and up rows of one expert share one scale. Each
    projection has one input quantizer shared by all experts
    (``gate_up_proj_input_quantizer``, ``down_proj_input_quantizer``), so the
    experts of one block share one input scale.
    """

    #: Default layout when the experts class does not declare transformers'
    #: ``is_transposed`` / ``is_concatenated`` flags.
    default_transposed: ClassVar[bool] = False
    default_interleaved: ClassVar[bool] = False

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    num_experts: int
    gate_up_proj_weight_quantizer: TensorQuantizer
    down_proj_weight_quantizer: TensorQuantizer
    gate_up_proj_input_quantizer: TensorQuantizer
    down_proj_input_quantizer: TensorQuantizer

    PROJECTIONS: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")
    #: The experts keep ``gate_up_proj`` / ``down_proj`` as 3-D parameters of their own.
    stores_fused_parameters: ClassVar[bool] = True
    # Provided by the original experts class (transformers' experts decorator).
    _apply_gate: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def refuses(cls, algo: Any) -> str | None:
        """Why the weight algorithm ``algo`` cannot quantize these experts, or ``None``."""
        return None

    @classmethod
    def stored_weights(
        cls, module: nn.Module, projection: str, canonical: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-expert linears back in the layout ``module`` stores them.

        ``canonical`` is ``[E, out, in]``: for ``down_proj`` the experts' down
        linears, for ``gate_up_proj`` each expert's gate rows then its up rows
        (``torch.cat((gate, up), dim=1)`` of the split the exporters write).
        Returns ``{parameter path inside module: tensor}``: what a checkpoint
        loader needs to rebuild the experts' own parameters from per-expert
        weights. ``module`` may be the original experts module; its
        ``is_transposed`` / ``is_concatenated`` flags win over this class's
        defaults, as in :attr:`transposed` / :attr:`interleaved`.
        """
        transposed = bool(getattr(module, "is_transposed", cls.default_transposed))
        interleaved = not getattr(module, "is_concatenated", not cls.default_interleaved)
        weight = canonical
        if projection == "gate_up_proj" and interleaved:
            gate, up = canonical.chunk(2, dim=1)
            weight = torch.stack((gate, up), dim=2).flatten(1, 2)  # gate0, up0, gate1, ...
        if transposed:
            weight = weight.transpose(-1, -2)
        return {projection: weight.contiguous()}

    @classmethod
    def weight_dims(cls, module: nn.Module) -> list[tuple[str, int, int]]:
        """``(projection, out features, in features)`` of ``module``'s canonical weights.

        ``module`` is the experts module before conversion (so the layout flags
        are read from it, with this class's defaults).
        """
        transposed = bool(getattr(module, "is_transposed", cls.default_transposed))
        dims = []
        for projection in cls.PROJECTIONS:
            shape = module.get_parameter(projection).shape
            out, inp = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
            dims.append((projection, int(out), int(inp)))
        return dims

    @property
    def transposed(self) -> bool:
        """Weights stored ``[E, in, out]`` instead of ``[E, out, in]``."""
        return bool(getattr(self, "is_transposed", self.default_transposed))

    @property
    def interleaved(self) -> bool:
        """Gate/up rows interleaved (``gate0, up0, gate1, ...``) instead of ``[gate; up]``."""
        concatenated = getattr(self, "is_concatenated", not self.default_interleaved)
        return not concatenated

    def canonical_weight(self, projection: str) -> torch.Tensor:
        """``gate_up_proj`` or ``down_proj`` as ``[E, out, in]`` (a view, no copy)."""
        weight: torch.Tensor = getattr(self, projection)
        return weight.transpose(-1, -2) if self.transposed else weight

    def input_quantizer_of(self, projection: str) -> TensorQuantizer:
        """The input quantizer shared by every expert's ``projection``."""
        quantizer: TensorQuantizer = getattr(self, f"{projection}_input_quantizer")
        return quantizer

    def weight_quantizer_of(self, projection: str) -> TensorQuantizer:
        """The per-expert weight quantizer of ``projection``."""
        quantizer: TensorQuantizer = getattr(self, f"{projection}_weight_quantizer")
        return quantizer

    def effective_weight(self, projection: str) -> torch.Tensor:
        """:meth:`canonical_weight` divided by the AWQ ``pre_quant_scale`` when there is one
        (``[in]`` shared by the experts, or ``[E, in]``: one per expert)."""
        weight = self.canonical_weight(projection)
        pqs = self.input_quantizer_of(projection).pre_quant_scale
        if pqs is None:
            return weight
        per_expert = pqs[:, None, :] if pqs.dim() == 2 else pqs
        return weight / per_expert.to(weight.dtype)

    def expert_weights(self, projection: str) -> Callable[[int], torch.Tensor]:
        """``expert -> its fake-quantized [out, in] weight``: one expert at a time where that
        gives the whole stack's values and layout (one copy alive, not the stack's: what a
        streamed MoE layer peaked on), else the whole stack at once (a calibrating quantizer)."""
        quantizer = self.weight_quantizer_of(projection)
        weight = self.canonical_weight(projection)
        pqs = self.input_quantizer_of(projection).pre_quant_scale
        alone = pqs is None or _quotient_keeps_layout(weight, pqs)
        if alone and quantizer.quantizes_experts_alone(weight):
            return lambda expert: quantizer.fake_quant_expert(
                weight, expert, self.effective_expert(projection, expert)
            )
        whole = quantizer(self.effective_weight(projection))
        return lambda expert: whole[expert]

    def effective_expert(self, projection: str, expert: int) -> torch.Tensor:
        """``effective_weight(projection)[expert]`` computed for that expert alone: the same
        values (an elementwise quotient) and layout, with one expert's copy alive, not the
        stack's (what exporting a streamed MoE layer under AWQ peaked on)."""
        return self.awq_divided(projection, expert, self.expert_weight(projection, expert))

    def expert_weight(self, projection: str, expert: int) -> torch.Tensor:
        """``canonical_weight(projection)[expert]`` (a layout whose canonical stack is a copy
        builds that expert's rows alone instead)."""
        return self.canonical_weight(projection)[expert]

    def awq_divided(self, projection: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of ``expert``'s ``projection`` weight (``[..., in]``) divided by its AWQ
        ``pre_quant_scale`` (``[in]`` shared by the experts, or ``[E, in]``), else as they are."""
        pqs = self.input_quantizer_of(projection).pre_quant_scale
        scale = None if pqs is None else pqs[expert] if pqs.dim() == 2 else pqs
        return rows if scale is None else rows / scale.to(rows.dtype)

    def expert_input(self, projection: str, tokens: torch.Tensor, expert: int) -> torch.Tensor:
        """``tokens`` routed to ``expert``, times its per-expert AWQ ``pre_quant_scale``.

        A shared (1-D) scale is applied by the input quantizer itself; without a
        per-expert one the tokens are returned as they are.
        """
        pqs = self.input_quantizer_of(projection).pre_quant_scale
        if pqs is None or pqs.dim() != 2:
            return tokens
        return tokens * pqs[expert].to(tokens.dtype)

    def routed_tokens(self, *args: Any, **kwargs: Any) -> list[tuple[int, torch.Tensor]]:
        """``(expert, tokens routed to it [T_e, H])`` for each expert hit by a forward's
        arguments ``(hidden_states, top_k_index, top_k_weights)`` (positional or named):
        the tokens the experts' own forward computes each expert on."""
        hidden_states: torch.Tensor = kwargs["hidden_states"] if not args else args[0]
        top_k_index: torch.Tensor = kwargs["top_k_index"] if len(args) < 2 else args[1]
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        routed = []
        for expert in range(self.num_experts):
            token_idx, _slot = torch.where(top_k_index == expert)
            if token_idx.numel():
                routed.append((expert, flat[token_idx]))
        return routed

    def expert_hidden(self, expert: int, tokens: torch.Tensor) -> torch.Tensor:
        """The float input of ``down_proj`` of ``expert`` for ``tokens`` (gate, up, activation)."""
        gate_up = self.canonical_weight("gate_up_proj")[expert]
        product = F.linear(tokens, gate_up)
        return self._apply_gate(_add_bias(product, self.bias_of("gate_up_proj"), expert))

    def bias_of(self, projection: str) -> torch.Tensor | None:
        """The ``[E, out]`` bias of a projection, or ``None``."""
        bias = getattr(self, f"{projection}_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def split_gate_up(self, rows: torch.Tensor, *, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split gate/up along ``dim`` (``-2`` of a ``[2I, H]`` weight, ``-1`` of a bias)."""
        if self.interleaved:
            index: list[slice] = [slice(None)] * rows.dim()
            index[dim] = slice(0, None, 2)
            gate = rows[tuple(index)]
            index[dim] = slice(1, None, 2)
            return gate, rows[tuple(index)]
        gate, up = rows.chunk(2, dim=dim)
        return gate, up

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Route tokens through fake-quantized experts (an eager loop over the experts hit).

        With every quantizer transparent this is transformers' experts forward bit for bit,
        for the implementation the model's config selects (``_experts_implementation``):
        ``eager`` adds each expert's share into the hidden dtype, as its loop does; its
        grouped / batched kernels keep every (token, slot) share in the dtype of the routing
        weights times the hidden states (float32 for Mixtral's router), sum them over the
        slots and cast once.
        """
        gate_up, down = self.expert_weights("gate_up_proj"), self.expert_weights("down_proj")
        gate_up_bias, down_bias = self.bias_of("gate_up_proj"), self.bias_of("down_proj")
        x = self.gate_up_proj_input_quantizer(hidden_states)
        config = getattr(self, "config", None)
        eager = getattr(config, "_experts_implementation", None) in (None, "eager")
        if eager:  # [T, H]: each expert's share added in
            out = torch.zeros_like(hidden_states)
        else:  # [T, k, H]: each (token, slot) share, summed over the slots at the end
            dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
            out = hidden_states.new_zeros(
                (*top_k_index.shape, hidden_states.shape[-1]), dtype=dtype
            )
        for expert in range(self.num_experts):
            # transformers' own order and ops, so that with every quantizer transparent this
            # is its forward bit for bit: tokens by (top-k slot, token), the bias added
            # after the product (``x @ W + b``: two roundings in bf16, not addmm's one)
            slot, token_idx = torch.where(top_k_index.transpose(0, 1) == expert)
            if token_idx.numel() == 0:
                continue
            tokens = self.expert_input("gate_up_proj", x[token_idx], expert)
            h = _add_bias(F.linear(tokens, gate_up(expert)), gate_up_bias, expert)
            h = self.expert_input("down_proj", self._apply_gate(h), expert)
            h = self.down_proj_input_quantizer(h)
            y = _add_bias(F.linear(h, down(expert)), down_bias, expert)
            y = y * top_k_weights[token_idx, slot, None]
            if eager:
                out.index_add_(0, token_idx, y.to(out.dtype))
            else:
                out[token_idx, slot] = y.to(out.dtype)
        return out if eager else out.sum(dim=1).to(hidden_states.dtype)


def _quotient_keeps_layout(weight: torch.Tensor, pqs: torch.Tensor) -> bool:
    """Whether :meth:`QuantExperts.effective_weight` (``weight`` divided by the AWQ scale
    ``pqs``) is laid out as ``weight``: decided on meta tensors, nothing computed."""
    meta = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device="meta")
    scale = pqs.to("meta", weight.dtype)
    quotient = meta / (scale[:, None, :] if scale.dim() == 2 else scale)
    return quotient.stride() == torch.empty_like(meta).stride()


def _add_bias(product: torch.Tensor, bias: torch.Tensor | None, expert: int) -> torch.Tensor:
    return product if bias is None else product + bias[expert]


class QuantFusedExperts(QuantExperts):
    """Mixtral / Qwen-MoE experts: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows),
    ``down_proj [E, H, I]``, no biases."""


class QuantBMMExperts(QuantExperts):
    """Batched-matmul experts (GptOss, Llama4): weights stored transposed,
    ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``; GptOss interleaves gate/up
    columns and has biases ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``."""

    default_transposed = True
    default_interleaved = True
