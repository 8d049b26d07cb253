"""GPTQ: a linear's weight quantized column by column, each column's error spread onto
the columns not yet quantized through the inverse Hessian of its inputs.

The algorithm of Frantar et al. (arXiv:2210.17323) as llm-compressor 0.14 runs it
(``llmcompressor/modifiers/gptq/gptq_quantize.py`` and ``helpers.py``):

1. ``H = 2 X^T X / n`` of the linear's calibration inputs (only its shape matters: the
   result is invariant to a positive factor on ``H``); a *dead* column (``H_ii == 0``,
   an input channel that was zero on every token) gets ``H_ii = 1`` and its weights 0;
2. dampening: ``dampening * mean(diag(H))`` added to the diagonal (default 0.01);
3. ``U = cholesky(H^-1, upper)`` (the Cholesky factor of the inverse Hessian); where ``H``
   is not positive definite even so, ``U = I``: round-to-nearest (logged as a warning);
4. activation order (``actorder="weight"``, llm-compressor's default ``static``, an alias
   of ``weight``): the columns are visited by descending ``H_ii``, each still quantized
   with the scale of *its own* group, so the checkpoint needs no ``g_idx``;
5. blocks of 128 columns: inside a block each column ``w`` is rounded,
   ``q = clamp(round(w / s), -8, 7) * s``, its error ``e = (w - q) / U_ii`` is subtracted
   from the block's later columns (``e * U_i,j``); at the end of a block from every later
   column at once (``E @ U[block, later]``).

The group scales ``s`` are fixed before the first column is visited: the INT4 scales of
the original weight, as llm-compressor takes its min-max observer's scales of the original
weight. GPTQ changes the codes only. Under the ``modelopt`` scale convention (the
default) a scale is ``group_amax / 7`` in float32, as every INT4 recipe of exportlm;
under ``scales=compressed-tensors`` (what ``format="compressed-tensors"`` picks in the
CLI) the same ``group_amax / 7`` rounded to the weight's dtype, so a bfloat16 model's
checkpoint holds bfloat16 scales, as llm-compressor writes them. Not llm-compressor's
``group_amax / 7.5``: that clips each group's largest positive weight to ``7 s`` and leaves
GPTQ's error updates no room above it, and measured worse (``_gptq_apply._DIVISORS``).

Precision: the Hessian arrives in float64 (a float64 sum of float64 products of the
inputs); the factorization and the updates run in float32, as llm-compressor's
``GPTQ_PRECISION``. It runs on one thread (:func:`_one_thread`), so given a Hessian the
result does not depend on the thread count; the Hessian's own matmuls do, by float rounding.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from exportlm.quant._tensor import INT4_MAX, safe_scale

__all__ = ["ACTORDERS", "GPTQ_BLOCK", "GPTQResult", "gptq_quantize", "int4_group_scales"]

logger = logging.getLogger(__name__)

#: The values of the ``actorder`` option: ``none`` (columns left to right) and
#: ``weight`` (by descending ``H_ii``, each column keeping its own group's scale).
ACTORDERS: tuple[str, ...] = ("none", "weight")
#: Columns per block of lazy updates (llm-compressor's ``block_size`` default).
GPTQ_BLOCK = 128
_PRECISION = torch.float32


@dataclass(frozen=True)
class GPTQResult:
    """One weight quantized by GPTQ: ``codes`` (int8 in [-8, 7], ``[out, in]``), the group
    ``scales`` (float32 ``[out, in / group]``), the GPTQ loss (``sum e^2 / 2``) and whether
    the Hessian could not be factorized (round-to-nearest was used)."""

    codes: torch.Tensor
    scales: torch.Tensor
    loss: float
    fallback: bool

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``codes * scale`` per group, in ``dtype``."""
        rows, cols = self.codes.shape
        groups = self.codes.float().reshape(rows, self.scales.shape[1], -1)
        groups.mul_(self.scales.float()[:, :, None])  # in place: one float32 copy, not two
        return groups.reshape(rows, cols).to(dtype)


def int4_group_scales(
    weight: torch.Tensor,
    group_size: int,
    where: str,
    *,
    divisor: float = INT4_MAX,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``group_amax / divisor`` of ``weight`` (``[out, in]``): float32 rounded once to ``dtype``.

    ``divisor`` 7 is the INT4 format's (ModelOpt's ``amax / 7``); ``dtype`` rounds the
    scales once, as llm-compressor keeps them in the weight's dtype (bfloat16 for a
    bfloat16 model).
    """
    rows, cols = weight.shape
    amax = weight.detach().float().reshape(rows, cols // group_size, group_size).abs().amax(-1)
    scales = safe_scale(amax, divisor, where=where)
    return scales if dtype is None else scales.to(dtype)


def _inverse_factor(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, bool]:
    """``cholesky(H^-1, upper)`` of the dampened ``H`` (in place), or ``(I, True)``."""
    diagonal = torch.diagonal(hessian)
    diagonal.add_(dampening * diagonal.mean())
    factor, info = torch.linalg.cholesky_ex(hessian)
    if int(info) != 0:
        return torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device), True
    inverse = torch.cholesky_inverse(factor)
    del factor  # before the next factor: three [in, in] matrices here at most, not four
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    if int(info) != 0:
        return torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device), True
    return upper, False


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    group_size: int,
    actorder: str = "weight",
    dampening: float = 0.01,
    block_size: int = GPTQ_BLOCK,
    scales: torch.Tensor | None = None,
    where: str = "weight",
    bits: int = 4,
) -> GPTQResult:
    """GPTQ of ``weight`` (``[out, in]``) under ``hessian`` (``[in, in]``, any positive
    multiple of ``X^T X``): symmetric INT4 codes in groups of ``group_size`` (see the module
    docstring for every step), with the group ``scales`` given (default:
    :func:`int4_group_scales` of ``weight``; kept in their dtype, used as float32).
    ``bits=8``: INT8 codes in [-128, 127] (per row: ``group_size`` the input width, the
    ``scales`` ``[out, 1]``). ``weight`` and ``hessian`` are not modified."""
    if actorder not in ACTORDERS:
        raise ValueError(f"{where}: actorder={actorder!r} is not one of {', '.join(ACTORDERS)}")
    if scales is None:
        scales = int4_group_scales(weight, group_size, where)
    with _one_thread():
        bounds = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        result = _gptq(weight, hessian, scales, group_size, actorder, dampening, block_size, bounds)
    if result.fallback:
        logger.warning(
            "GPTQ: the Hessian of %s is not positive definite even with dampening %s; its "
            "weight is rounded to nearest. Raise the dampening option or calibrate on more "
            "data.",
            where,
            dampening,
        )
    return result


def _gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    actorder: str,
    dampening: float,
    block_size: int,
    bounds: tuple[int, int],
) -> GPTQResult:
    cols = int(weight.shape[1])
    w = weight.detach().to(_PRECISION, copy=True)
    h = hessian.detach().to(_PRECISION, copy=True)  # one copy (a float64 H: no float32 twice)
    perm = None
    if actorder == "weight":  # ordered before dead columns are filled, as llm-compressor
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm]  # rows, then columns: two [in, in] copies at a time, not three
        h = h[:, perm]
    dead = torch.diagonal(h) == 0
    if bool(dead.any()):
        torch.diagonal(h).masked_fill_(dead, 1.0)
        w[:, dead] = 0
    u, fallback = _inverse_factor(h, dampening)
    del h
    group_of = torch.arange(cols, device=w.device) // group_size
    if perm is not None:
        group_of = group_of[perm]
    group_scales = scales.to(w.device, _PRECISION)
    loss = torch.zeros((), dtype=torch.float64)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        # each column's scale gathered per block: no [out, in] float32 copy of the scales
        errors = _block(w[:, i1:i2], u[i1:i2, i1:i2], group_scales[:, group_of[i1:i2]], bounds)
        loss += errors.double().square().sum() / 2
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    del u
    if perm is not None:
        w = w[:, torch.argsort(perm)]
    codes = _codes(w, scales.to(w.device, _PRECISION), group_size, bounds)
    return GPTQResult(codes, scales, float(loss), fallback)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one while a weight is quantized: each column's step
    is a few thousand elements, too little to share, and on a loaded machine the waiting
    workers spin. Two threads took 50x the CPU time of one on a 1536 x 576 weight (3.57 s
    against 0.07 s, a 2-core machine shared with other jobs), and ``cholesky_inverse`` of a
    576 x 576 Hessian 2.4 s of wall time each."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _block(
    w: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, bounds: tuple[int, int]
) -> torch.Tensor:
    """Quantize the columns of one block of ``w`` in place (their dequantized values) and
    return the block's scaled errors ``(w - q) / U_ii``."""
    errors = torch.empty_like(w)
    for i in range(w.shape[1]):
        column = w[:, i]
        s = scales[:, i]
        q = (column / s).round_().clamp_(*bounds).mul_(s)
        error = (column - q) / u[i, i]
        w[:, i:] -= error[:, None] * u[i, i:][None, :]
        w[:, i] = q
        errors[:, i] = error
    return errors


def _codes(
    w: torch.Tensor, scales: torch.Tensor, group_size: int, bounds: tuple[int, int]
) -> torch.Tensor:
    """The int8 codes of the dequantized values ``w`` (exact: ``q * s / s`` rounds to ``q``),
    computed in ``w`` (overwritten: no second float32 copy)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size).div_(scales[:, :, None])
    return groups.round_().clamp_(*bounds).to(torch.int8).reshape(rows, cols)
