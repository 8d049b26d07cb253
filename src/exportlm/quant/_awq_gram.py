"""The AWQ search's loss from the Gram matrix of the calibration inputs, not per forward.

A candidate's loss is the squared error of a linear's output over the calibration
tokens, ``sum_t ||x_t (W_c - W)^T||^2`` with ``W_c = Q(W * s) / s`` the weight the
candidate makes effective. That is the quadratic form ``sum((D @ G) * D)`` of
``D = W_c - W`` with ``G = sum_t x_t^T x_t`` (``[in, in]``): exactly, not an
approximation. Scoring every candidate on every forward (ModelOpt's ``awq_lite``) costs
11 fake quantizations and 11 matmuls per member, candidate family and forward; with
``G`` the forwards only add ``X^T X`` (one matmul per input, shared by the group's
members) and each candidate is fake-quantized and scored once, at the end. The cost of
the forwards then grows with ``in^2`` per token instead of 11 x 2 x ``out x in``; the
scoring's ``out x in^2`` per candidate is paid once (:func:`gram_fits` says which groups).

Everything is float64: ``G`` (the products of float32 / bf16 inputs are exact in
float64, and the sums are ~1e-16 relative off), ``D`` and the form. The losses are
those of the float computation to ~1e-15 relative, where the forward-by-forward loss
carried the rounding of the model dtype's matmuls (bf16: ~4e-3 per output); a decision
whose margin exceeds :data:`~exportlm.quant._awq_search.PORTABLE_MARGIN` takes the same
outcome either way. Two ranks' ``G`` summed is one process's ``G`` to float64 rounding,
which is what makes data-parallel AWQ agree with one process
(:mod:`exportlm.quant._distributed`).

ModelOpt's per-linear candidates are scored by *the sum over forwards of each forward's
mean* squared error: ``H = sum_f G_f / tokens_f`` is kept beside ``G`` once two forwards
had different token counts (before that, ``H = G / tokens``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from exportlm.quant import _tensor

__all__ = ["GramLoss", "OncePerInput", "candidate_loss", "gram_fits"]


class OncePerInput:
    """A statistic of a group's input that its members each pass on: counted once."""

    _last: weakref.ref[torch.Tensor] | None = None

    def first_time(self, x: torch.Tensor) -> bool:
        """False when ``x`` is the tensor the previous call saw (the next member's)."""
        if self._last is not None and self._last() is x:
            return False
        self._last = weakref.ref(x)
        return True


class GramLoss(OncePerInput):
    """``G = sum X^T X`` (and ``H = sum X^T X / tokens``) of one search's inputs, float64."""

    def __init__(self) -> None:
        self.gram: torch.Tensor | None = None
        self.mean_gram: torch.Tensor | None = None  # H, once token counts differed
        self.tokens: int | None = None  # every forward's token count while they agree
        self.forwards = 0

    def add(self, x: torch.Tensor) -> None:
        """Add one forward's input ``x`` (``[..., in]``); the same tensor again (the next
        member of a group that reads it) is counted once."""
        if not self.first_time(x):
            return
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        tokens = int(rows.shape[0])
        if tokens == 0:
            return
        g = rows.T @ rows
        if self.gram is None:
            self.gram, self.tokens = g, tokens
        else:
            if self.mean_gram is None and tokens != self.tokens:
                self.mean_gram = self.gram / float(self.tokens or 1)
            self.gram += g
        if self.mean_gram is not None:
            self.mean_gram += g / float(tokens)
        self.forwards += 1

    def per_forward_mean(self) -> torch.Tensor | None:
        """``H``: the Gram matrices of the forwards, each over its token count."""
        if self.mean_gram is not None or self.gram is None:
            return self.mean_gram
        return self.gram / float(self.tokens or 1)

    def release(self) -> None:
        """Forget the matrices (after the losses were taken)."""
        self.gram = self.mean_gram = None


def gram_fits(members: list[Any]) -> bool:
    """Whether a group's Gram matrix (``in x in`` float64) is no larger than its weights
    in float32 twice over (``in <= sum(out)``): ``q/k/v``, ``o_proj`` and ``gate/up`` of
    a transformer layer, not ``down_proj`` (``in`` = the intermediate size), which keeps
    the forward-by-forward scoring. So the matrices held during a search stay about the
    size of the model's bf16 weights."""
    cols = int(members[0].weight.shape[-1])
    return cols <= sum(int(m.weight.shape[0]) for m in members)


def candidate_loss(
    quantized: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, gram: torch.Tensor
) -> float:
    """``sum((D @ gram) * D)`` of ``D = Q(W * s) / s - W``, float64, a slice of rows at a time.

    ``s`` is the scale as the forward applies it (in the weight's dtype): the input is
    divided by it, so ``(x / s) @ Q^T = x @ (Q / s)^T``. No float64 copy of the whole
    weight exists at once.
    """
    rows, cols = weight.shape
    step = max(1, _tensor.CHUNK_ELEMENTS // max(cols, 1))
    scale = s.double()[None, :]
    total = 0.0
    for start in range(0, rows, step):
        d = quantized[start : start + step].double() / scale
        d -= weight[start : start + step].double()
        total += float(((d @ gram) * d).sum())
    return total
