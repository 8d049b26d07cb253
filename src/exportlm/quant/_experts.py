"""Stacked-expert layouts and their quantized wrappers: which base wraps which experts module.

Every layout is seen through :class:`~exportlm.quant.QuantExperts`' canonical
per-expert view ``[E, out, in]`` with two projections: ``gate_up_proj`` (gate
rows, then up rows) and ``down_proj``. How each family stores them (measured on
transformers 5.24):

==================  =============================  =======================  ====================
family              ``gate_up`` as stored          ``down`` as stored       wrapper base
==================  =============================  =======================  ====================
Mixtral, Qwen-MoE   ``gate_up_proj [E, 2I, H]``    ``down_proj [E, H, I]``  QuantFusedExperts
GptOss              ``gate_up_proj [E, H, 2I]``,   ``down_proj [E, I, H]``  QuantBMMExperts
                    gate/up interleaved, biases
Llama4              ``gate_up_proj [E, H, 2I]``,   ``down_proj [E, I, H]``  QuantLlama4Experts
                    gate columns then up columns
DBRX                ``mlp.w1``, ``mlp.v1``         ``mlp.w2 [E*I, H]``      QuantDbrxExperts
                    ``[E*I, H]`` (gate, up rows)   (``[in, out]`` per e.)
==================  =============================  =======================  ====================

A module with stacked expert weights in none of these layouts has no wrapper:
:func:`has_stacked_weights` lets ``quantize`` refuse it instead of leaving it
silently in full precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from exportlm.quant._expert_modules import QuantBMMExperts, QuantExperts, QuantFusedExperts

if TYPE_CHECKING:
    from exportlm.quant._recipe import Algorithm

__all__ = [
    "quant_experts_class",
    "QuantDbrxExperts",
    "QuantLlama4Experts",
    "experts_base",
    "has_stacked_weights",
    "is_fused_experts",
]


def _mro_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _own_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters(recurse=False))


class QuantLlama4Experts(QuantBMMExperts):
    """transformers' ``Llama4TextExperts``: ``gate_up_proj [E, H, 2I]`` (transposed, gate
    columns then up columns, not interleaved), ``down_proj [E, I, H]``, no biases.

    Its forward takes the tokens already routed, ``[E * T, H]``: every expert sees
    every token, scaled by its router score (zero for the experts not chosen).
    Exported like the other BMM experts, split per expert into
    ``experts.{e}.{gate,up,down}_proj`` (the per-expert names vLLM's Llama4 loader reads).
    """

    default_transposed = True
    default_interleaved = False

    act_fn: Callable[[torch.Tensor], torch.Tensor]
    hidden_size: int

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return up * self.act_fn(gate)

    def _per_expert(self, projection: str, x: torch.Tensor) -> torch.Tensor:
        """``x [E, T, in]`` times the per-expert AWQ ``pre_quant_scale`` when there is one."""
        pqs = self.input_quantizer_of(projection).pre_quant_scale
        return x if pqs is None or pqs.dim() != 2 else x * pqs[:, None, :].to(x.dtype)

    def routed_tokens(self, *args: Any, **kwargs: Any) -> list[tuple[int, torch.Tensor]]:
        """Every expert sees every token (scaled by its router score, zero when not chosen)."""
        hidden_states: torch.Tensor = kwargs["hidden_states"] if not args else args[0]
        x = hidden_states.reshape(self.num_experts, -1, self.hidden_size)
        return [(expert, x[expert]) for expert in range(self.num_experts)]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Llama4's batched experts with fake-quantized weights and inputs, each expert's
        weight fake-quantized alone (:meth:`expert_weights`), not the whole stack."""
        x = hidden_states.view(self.num_experts, -1, self.hidden_size)
        x = self._per_expert("gate_up_proj", self.gate_up_proj_input_quantizer(x))
        h = self._apply_gate(_batched(x, self.expert_weights("gate_up_proj")))
        h = self.down_proj_input_quantizer(self._per_expert("down_proj", h))
        out = _batched(h, self.expert_weights("down_proj"))
        return out.view(-1, self.hidden_size)


def _batched(x: torch.Tensor, weights: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``torch.bmm(x, W.transpose(-1, -2))`` for ``x [E, T, in]`` and the stack ``W`` whose
    expert ``e`` is ``weights(e) [out, in]``, with one expert's weight alive at a time: a
    batch-of-one ``bmm`` per expert (the bits of the whole ``bmm`` on the CPUs measured,
    within float rounding anywhere)."""
    first = torch.bmm(x[:1], weights(0).T[None])
    out = first.new_empty((x.shape[0], *first.shape[1:]))
    out[:1] = first
    for expert in range(1, x.shape[0]):
        out[expert : expert + 1] = torch.bmm(x[expert : expert + 1], weights(expert).T[None])
    return out


class QuantDbrxExperts(QuantExperts):
    """transformers' ``DbrxExperts``: its child ``mlp`` (``DbrxExpertGLU``) holds 2-D
    ``w1`` (gate) and ``v1`` (up), ``[E * I, H]`` with ``[out, in]`` rows per expert,
    and ``w2`` (down), ``[E * I, H]`` with ``[in, out]`` rows per expert.

    The canonical ``gate_up_proj`` is ``[w1; v1]`` per expert (a copy), ``down_proj``
    the per-expert transpose of ``w2`` (a view). Exported in DBRX's own fused
    layout, with one FP8 scale per expert (what vLLM's DBRX loader reads), so the
    only weight format is FP8 (:meth:`refuses`).
    """

    stores_fused_parameters = False

    mlp: nn.Module
    hidden_size: int
    ffn_hidden_size: int

    @classmethod
    def refuses(cls, algo: Algorithm) -> str | None:
        """Why ``algo`` cannot quantize these experts, or ``None``."""
        if str(getattr(algo.weight, "value", algo.weight)) == "fp8" and not algo.weight_block:
            return None
        return (
            f"DBRX experts are exported in DBRX's own fused layout (mlp.w1 / v1 / w2 as "
            f"[E*I, H] tensors, one scale per expert, as vLLM's DBRX loader reads them), which "
            f"holds per-tensor FP8 only; recipe {algo.name!r} needs per-block or per-row scales"
        )

    @classmethod
    def weight_dims(cls, module: nn.Module) -> list[tuple[str, int, int]]:
        """``(projection, out features, in features)`` of each canonical weight."""
        config: Any = module  # DbrxExperts keeps its sizes as plain int attributes
        hidden, inner = int(config.hidden_size), int(config.ffn_hidden_size)
        return [("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner)]

    @classmethod
    def stored_weights(
        cls, module: nn.Module, projection: str, canonical: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-expert linears back in DBRX's layout: ``mlp.w1`` + ``mlp.v1`` or ``mlp.w2``,
        each ``[E*I, H]`` (see :meth:`QuantExperts.stored_weights`)."""
        if projection == "gate_up_proj":
            gate, up = canonical.chunk(2, dim=1)
            return {
                "mlp.w1": gate.reshape(-1, gate.shape[-1]).contiguous(),
                "mlp.v1": up.reshape(-1, up.shape[-1]).contiguous(),
            }
        if projection == "down_proj":
            return {
                "mlp.w2": canonical.transpose(1, 2).reshape(-1, canonical.shape[1]).contiguous()
            }
        raise KeyError(f"DBRX experts have projections {cls.PROJECTIONS}, not {projection!r}")

    def _split(self, name: str) -> torch.Tensor:
        """``mlp.<name>`` viewed ``[E, I, H]``."""
        weight: torch.Tensor = self.mlp.get_parameter(name)
        return weight.view(self.num_experts, self.ffn_hidden_size, self.hidden_size)

    def canonical_weight(self, projection: str) -> torch.Tensor:
        """``gate_up_proj`` as ``[E, 2I, H]`` (a copy) or ``down_proj`` as ``[E, H, I]`` (a view)."""
        if projection == "gate_up_proj":
            return torch.cat((self._split("w1"), self._split("v1")), dim=1)
        if projection == "down_proj":
            return self._split("w2").transpose(1, 2)
        raise KeyError(f"DBRX experts have projections {self.PROJECTIONS}, not {projection!r}")

    def bias_of(self, projection: str) -> torch.Tensor | None:
        """DBRX experts have no biases."""
        return None

    def expert_weight(self, projection: str, expert: int) -> torch.Tensor:
        """``canonical_weight(projection)[expert]`` built from that expert's rows alone:
        ``gate_up_proj``'s canonical stack is a copy (``[w1; v1]`` per expert), which
        :meth:`QuantExperts.expert_weight` would make whole for each expert."""
        if projection != "gate_up_proj":
            return super().expert_weight(projection, expert)
        return torch.cat((self._split("w1")[expert], self._split("v1")[expert]))

    def stored_expert(self, tensor: str, expert: int) -> torch.Tensor:
        """``expert``'s part of ``mlp.<tensor>`` as its projection's weight quantizer takes it:
        ``w1`` / ``v1``: its gate / up rows ``[I, H]`` of :meth:`effective_expert`
        (``gate_up_proj``, AWQ-divided), without the other half; ``w2``: ``down_proj``'s
        ``[H, I]`` (the transpose of its rows)."""
        if tensor == "w2":
            return self.effective_expert("down_proj", expert)
        if tensor not in ("w1", "v1"):
            raise KeyError(f"DBRX experts store mlp.w1, mlp.v1 and mlp.w2, not mlp.{tensor}")
        return self.awq_divided("gate_up_proj", expert, self._split(tensor)[expert])

    def expert_weights(self, projection: str) -> Callable[[int], torch.Tensor]:
        """:meth:`QuantExperts.expert_weights` without ``gate_up_proj``'s stack-sized copy:
        each expert's own weight where the quantizer is the identity (calibration pauses it),
        each fake-quantized alone where it quantizes experts alone (measured against a
        zero-byte stand-in of the stack's shape), else the whole stack as there."""
        quantizer = self.weight_quantizer_of(projection)
        own = functools.partial(self.effective_expert, projection)
        if self.input_quantizer_of(projection).pre_quant_scale is not None:
            return super().expert_weights(projection)
        if quantizer.pre_quant_scale is None and not (quantizer.enabled or quantizer.calibrating):
            return own
        stack = self._stack_like(projection)
        if quantizer.quantizes_experts_alone(stack):
            return lambda expert: quantizer.fake_quant_expert(stack, expert, own(expert))
        return super().expert_weights(projection)

    def _stack_like(self, projection: str) -> torch.Tensor:
        """The canonical stack of ``projection`` (a view) or, for ``gate_up_proj`` (a copy),
        a zero-byte stand-in of its shape and dtype that a quantizer's result of it is laid
        out like (contiguous: ``empty_like`` of an expanded tensor)."""
        if projection != "gate_up_proj":
            return self.canonical_weight(projection)
        w1 = self._split("w1")
        return w1.new_empty(()).expand(w1.shape[0], 2 * w1.shape[1], w1.shape[2])

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """DBRX's expert loop with fake-quantized weights and inputs (same ops, same order)."""
        batch_size = hidden_states.shape[0]
        x = self.gate_up_proj_input_quantizer(hidden_states.reshape(-1, self.hidden_size))
        gate_up, down = self.expert_weights("gate_up_proj"), self.expert_weights("down_proj")
        activation: Any = self.mlp.get_submodule("activation_fn")
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            slot, token_idx = torch.where(top_k_index.transpose(0, 1) == expert)
            if token_idx.numel() == 0:
                continue
            w1, v1 = gate_up(expert).split(self.ffn_hidden_size, dim=0)
            tokens = x[token_idx]
            inner = activation(tokens.matmul(w1.T)) * tokens.matmul(v1.T)
            states = self.down_proj_input_quantizer(inner).matmul(down(expert).T)
            out.index_add_(0, token_idx, states * top_k_weights[token_idx, slot, None])
        return out.view(batch_size, -1, self.hidden_size)


def _is_fused(module: nn.Module) -> bool:
    params = _own_parameters(module)
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    return gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3


def _is_dbrx(module: nn.Module) -> bool:
    mlp = getattr(module, "mlp", None)
    if "DbrxExperts" not in _mro_names(module) or not isinstance(mlp, nn.Module):
        return False
    params = _own_parameters(mlp)
    return all(params.get(n) is not None and params[n].dim() == 2 for n in ("w1", "v1", "w2"))


def experts_base(module: nn.Module) -> type[QuantExperts] | None:
    """The quantized wrapper base for an experts module, or ``None`` when it is not one.

    Matched by exact class name in the MRO (never a substring) and the stored
    shapes; see the module docstring for the layouts.
    """
    if _is_fused(module):
        if "Llama4TextExperts" in _mro_names(module):
            return QuantLlama4Experts
        if hasattr(module, "_apply_gate"):  # transformers-5 experts (Mixtral, Qwen-MoE, GptOss)
            transposed = bool(getattr(module, "is_transposed", False))
            return QuantBMMExperts if transposed else QuantFusedExperts
        return None
    if _is_dbrx(module):
        return QuantDbrxExperts
    return None


def has_stacked_weights(module: nn.Module) -> bool:
    """True for a module holding expert weights stacked in one 3-D (or higher) parameter."""
    return any(p.dim() >= 3 for p in _own_parameters(module).values())


def is_fused_experts(module: nn.Module) -> bool:
    """True for experts stored as 3-D ``gate_up_proj`` and ``down_proj`` parameters that
    have a quantized wrapper (transformers-5 Mixtral / Qwen-MoE / GptOss, Llama4)."""
    base = experts_base(module)
    return base is not None and base.stores_fused_parameters


_EXPERT_CLASSES: dict[tuple[type[nn.Module], type[QuantExperts]], type[nn.Module]] = {}


def quant_experts_class(original: type[nn.Module], base: type[QuantExperts]) -> type[nn.Module]:
    """The (cached) wrapper class ``Quant<Original>(base, original)``."""
    key = (original, base)
    cls = _EXPERT_CLASSES.get(key)
    if cls is None:
        namespace: dict[str, Any] = {
            "__module__": QuantExperts.__module__,  # where the classes always lived
            "__qualname__": f"Quant{original.__name__}",
        }
        cls = type(f"Quant{original.__name__}", (base, original), namespace)
        _EXPERT_CLASSES[key] = cls
    return cls
