"""AWQ's weight clipping: each INT4 group's range searched after the smoothing scale.

Round-to-nearest INT4 spends its 16 codes on a group's whole range ``[-amax, amax]``;
a group with one large weight rounds the others coarsely. AWQ's second search (AutoAWQ's
``auto_clip``, ModelOpt's ``awq_clip``, run by its ``awq_full``) shrinks each group's
range to ``ratio * amax`` where that lowers the error of the linear's *output* on the
calibration inputs. After the smoothing scale ``p`` of :mod:`exportlm.quant._awq` is
chosen, for every row ``r`` and group ``g`` of a linear's weight and every ratio of
:data:`CLIP_RATIOS`:

* the weight is clamped to ``± ratio * amax[r, g] * p`` (so the effective weight
  ``W / p`` the quantizer sees has the group amax ``ratio * amax``), then fake-quantized
  by the module's own quantizer (its scale convention included);
* the loss is ``d^T G_g d`` with ``d = Q(W_c / p) * p - W`` over the group's inputs
  and ``G_g`` the group's diagonal block of the calibration inputs' Gram matrix
  ``X^T X``: the squared error that group adds to the output over every calibration
  token, exactly (the cross terms between groups are left out, as both tools leave
  them out).

Each (row, group) takes its lowest loss (ratio 1, the weight unchanged, on a tie), and
the weight is kept clamped: the group scales every layout writes (``amax / 7``,
compressed-tensors' ``/ 7.5``) then come from the clipped range, and no layout needs a
new tensor. A weight another module also uses (a tied one) is left alone. Stacked experts
(:func:`clip_experts`) are searched per expert, on the tokens routed to it and that
expert's AWQ scale. The clamp is written in place, a slice of rows at a time, journaled
so that a failed ``quantize`` writes the old values back: a new ``Parameter`` would keep
the old weight alive beside it until ``quantize`` returns (a streamed MoE layer's peak
grew by a layer).

On SmolLM2-135M (``int4_awq:group_size=64``, 32 x 512 calibration tokens) the clip
took the in-memory perplexity from 29.42 to 27.81 (docs/quality.md). ``clip=false``
(a recipe option) skips it: ModelOpt's ``INT4_AWQ_CFG`` runs ``awq_lite``, which does
not clip.

**Portability.** Every (row, group) decision compares float losses from the calibration
forwards, so on another machine (CPU kernels, thread counts, a GPU) a decision whose two
best ratios lie within float noise may take the other one: the checkpoint's bytes
differ there, its output error does not (the two losses agree to that noise). The
decisions within :data:`~exportlm.quant._awq_search.PORTABLE_MARGIN` are counted and
logged; they do not enter :func:`~exportlm.quant.awq_margin`, which is about the
smoothing scales.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from exportlm.quant import _tensor
from exportlm.quant._awq_fake import fake_quant_fresh
from exportlm.quant._awq_gram import OncePerInput
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._modules import QuantLinear, smoothing_of
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._tensor import QuantFormat
from exportlm.quant._transaction import overwrite

__all__ = [
    "CLIP_RATIOS",
    "BlockGram",
    "ClipResult",
    "clip_experts",
    "clip_linear",
    "clips",
    "clips_experts",
]

logger = logging.getLogger(__name__)

#: The ratios of a group's amax tried, largest first: ModelOpt's ``awq_clip`` grid
#: (``min_clip_ratio=0.5``, ``shrink_step=0.05``) and AutoAWQ's (``max_shrink=0.5``,
#: ``n_grid=20``: its first eleven steps).
CLIP_RATIOS: tuple[float, ...] = tuple(round(1 - i / 20, 2) for i in range(11))


class BlockGram(OncePerInput):
    """The diagonal blocks ``[groups, block, block]`` of ``X^T X`` of one input, float64.

    A search that keeps the whole ``X^T X`` (:class:`~exportlm.quant._awq_gram.GramLoss`)
    hands its blocks over (:meth:`take_from`) instead of accumulating them again; the
    others (``down_proj``) :meth:`add` each forward's input.
    """

    def __init__(self, block: int) -> None:
        self.block = block
        self.blocks: torch.Tensor | None = None

    def take_from(self, gram: torch.Tensor) -> None:
        """The diagonal blocks of the whole ``X^T X`` (``[in, in]``), copied out of it."""
        groups = int(gram.shape[0]) // self.block
        view = gram.reshape(groups, self.block, groups, self.block)
        self.blocks = view.diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()

    def input_hook(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """A forward pre-hook that :meth:`add` s the module's input."""
        if args and isinstance(args[0], torch.Tensor):
            self.add(args[0])

    def add(self, x: torch.Tensor) -> None:
        """Add one forward's input ``x`` (``[..., in]``); the same tensor again (the next
        member of a group that reads it) is counted once."""
        if not self.first_time(x):
            return
        cols = int(x.shape[-1])
        if cols % self.block:
            return  # INT4 refuses such a weight itself
        rows = x.detach().reshape(-1, cols)
        step = max(1, _tensor.CHUNK_ELEMENTS // max(cols, 1))
        for start in range(0, int(rows.shape[0]), step):
            part = rows[start : start + step].double().reshape(-1, cols // self.block, self.block)
            g = torch.einsum("tgi,tgj->gij", part, part)
            self.blocks = g if self.blocks is None else self.blocks.add_(g)


class ClipResult:
    """How many (row, group) decisions took each ratio, and how many were within noise."""

    def __init__(self) -> None:
        self.taken = torch.zeros(len(CLIP_RATIOS), dtype=torch.int64)
        self.close = 0  # decisions whose two best losses lie within PORTABLE_MARGIN
        self.linears = 0

    def add(self, other: ClipResult) -> None:
        """Count ``other``'s decisions too."""
        self.taken += other.taken
        self.close += other.close
        self.linears += other.linears


def clips(module: nn.Module) -> bool:
    """Whether ``module``'s weight is searched for clipping: a :class:`QuantLinear` whose
    weight quantizer is INT4 by groups (W4A8: searched as its INT4 stage, as AWQ searches
    it) and asks for it (the recipe's ``clip`` option)."""
    if not isinstance(module, QuantLinear) or module.weight.dim() != 2:
        return False
    return _clips_with(module.weight_quantizer, int(module.weight.shape[-1]))


def _clips_with(quantizer: TensorQuantizer, in_features: int) -> bool:
    """Whether a weight of ``in_features`` columns that ``quantizer`` quantizes is clipped:
    INT4 by groups that divide it (W4A8: its INT4 stage), the recipe's ``clip`` on."""
    searched = quantizer.spec.search_format or quantizer.format  # w4a8: its INT4 stage
    block = quantizer.block_size
    return bool(
        quantizer.awq_clip
        and quantizer.enabled
        and searched == QuantFormat.INT4
        and block
        and in_features % block == 0
    )


def shared_weights(model: nn.Module) -> set[int]:
    """``id`` of every parameter that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def clip_linear(module: QuantLinear, gram: torch.Tensor, margin: float) -> ClipResult:
    """Search the clip of every (row, group) of ``module``'s weight and clamp the weight in
    place (through :func:`~exportlm.quant._transaction.overwrite`: a failed ``quantize``
    writes the old values back).

    ``gram``: the :class:`BlockGram` blocks of the module's input. ``margin``: the
    relative gap under which a decision counts as within float noise.
    """
    pqs = smoothing_of(module.input_quantizer)
    return _clip_weight(module.weight_quantizer, module.weight, pqs, gram, margin)


def clips_experts(module: nn.Module, projection: str) -> bool:
    """Whether ``projection`` of the stacked experts ``module`` is searched for clipping, as
    :func:`clips` says of a linear: experts that keep their 3-D parameters (transformers-5
    fused experts) with an INT4 group quantizer that asks for it."""
    if not isinstance(module, QuantExperts) or not module.stores_fused_parameters:
        return False
    in_features = int(module.canonical_weight(projection).shape[-1])
    return _clips_with(module.weight_quantizer_of(projection), in_features)


def clip_experts(
    module: QuantExperts, projection: str, grams: list[torch.Tensor | None], margin: float
) -> ClipResult:
    """:func:`clip_linear` for each expert of ``projection`` that has blocks (``grams[e]``:
    the :class:`BlockGram` blocks of the tokens routed to expert ``e``; ``None``: an expert
    no token reached, left as it is), on that expert's AWQ scale, clamped in place in the
    layout the experts store."""
    result = ClipResult()
    quantizer = module.weight_quantizer_of(projection)
    pqs = module.input_quantizer_of(projection).pre_quant_scale
    for expert, gram in enumerate(grams):
        if gram is not None:
            scale = None if pqs is None else pqs[expert] if pqs.dim() == 2 else pqs
            weight = module.canonical_weight(projection)[expert]  # a view of the stack
            result.add(_clip_weight(quantizer, weight, scale, gram, margin))
    return result


def _clip_weight(
    quantizer: TensorQuantizer,
    weight: torch.Tensor,
    pqs: torch.Tensor | None,
    gram: torch.Tensor,
    margin: float,
) -> ClipResult:
    """Clip the ``[out, in]`` ``weight`` (a parameter or a view of one) in place, a slice of
    rows at a time; ``pqs``: the AWQ ``pre_quant_scale`` its input is multiplied by."""
    result = ClipResult()
    result.linears = 1
    block = int(quantizer.block_size or 0)
    rows, cols = weight.shape
    scale = None if pqs is None else pqs.to(weight.dtype)
    # slices of an even number of rows: INT4 packs pairs of rows
    step = max(2, _tensor.CHUNK_ELEMENTS // max(cols, 1) // 2 * 2)
    gram = gram.to(weight.device)  # summed over data-parallel ranks on the CPU
    with torch.no_grad():
        for start in range(0, rows, step):
            part = weight[start : start + step]
            best, close, taken = _clip_rows(quantizer, part.detach(), scale, gram, block, margin)
            overwrite(part, best)
            result.close += close
            result.taken += taken
    return result


def _clip_rows(
    quantizer: TensorQuantizer,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    gram: torch.Tensor,
    block: int,
    margin: float,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The clipped rows, the decisions within ``margin`` and the count of each ratio taken."""
    rows, cols = weight.shape
    groups = cols // block
    effective = weight if scale is None else weight / scale
    amax = effective.float().abs().reshape(rows, groups, block).amax(dim=-1)
    p = (
        torch.ones(cols, dtype=torch.float64) if scale is None else scale.to(torch.float64)
    ).reshape(1, groups, block)
    original = weight.double().reshape(rows, groups, block)
    best = weight.clone().reshape(rows, groups, block)
    losses: list[torch.Tensor] = []
    for ratio in CLIP_RATIOS:
        clamped = weight if ratio == 1.0 else _clamped(weight, amax * ratio, scale, block)
        seen = clamped if scale is None else clamped / scale
        q = fake_quant_fresh(quantizer, seen)
        d = q.double().reshape(rows, groups, block) * p - original
        loss = torch.einsum("rgi,gij,rgj->rg", d, gram, d)
        if losses:  # strictly lower: a tie keeps the larger ratio
            better = loss < torch.stack(losses).amin(dim=0)
            best = torch.where(better[:, :, None], clamped.reshape(rows, groups, block), best)
        losses.append(loss)
    loss = torch.stack(losses)  # [ratios, rows, groups]
    choice = loss.argmin(dim=0)  # the first lowest, as the updates above
    ordered = loss.sort(dim=0).values
    low, runner_up = ordered[0], ordered[1]
    gap = (runner_up - low) / low.abs().clamp(min=torch.finfo(torch.float64).tiny)
    close = int(((gap <= margin) & (runner_up != low)).sum())
    taken = torch.bincount(choice.flatten(), minlength=len(CLIP_RATIOS))
    return best.reshape(rows, cols), close, taken


def _clamped(
    weight: torch.Tensor, bound: torch.Tensor, scale: torch.Tensor | None, block: int
) -> torch.Tensor:
    """``weight`` clamped per element to ``± bound[row, group] * scale[col]`` (its dtype)."""
    rows, cols = weight.shape
    limit = bound[:, :, None].expand(rows, cols // block, block).reshape(rows, cols)
    if scale is not None:
        limit = limit * scale.float()
    limit = limit.to(weight.dtype)
    return torch.minimum(torch.maximum(weight, -limit), limit)


def log_clips(results: Iterable[ClipResult]) -> ClipResult:
    """The decisions of every clipped linear summed, logged at INFO level."""
    total = ClipResult()
    for result in results:
        total.add(result)
    decisions = int(total.taken.sum())
    if decisions:
        shares = ", ".join(
            f"{ratio:g}: {100 * int(n) / decisions:.1f}%"
            for ratio, n in zip(CLIP_RATIOS, total.taken.tolist(), strict=True)
            if n
        )
        logger.info(
            "AWQ clipping of %d linear(s), %d group(s): the ratio of each group's amax kept "
            "(%s); %d decided within float noise (another machine may take the neighbouring "
            "ratio there: the same output error, other bytes)",
            total.linears,
            decisions,
            shares,
            total.close,
        )
    return total
