"""One AWQ scale search: the candidates, their losses, and the rule that picks one.

A :class:`ScaleSearch` is one scale shared by a group of linears that read one input
(or by one expert's projection). Two families of candidates are scored on the same
calibration inputs:

* the *joint* candidates ``s(alpha) = act^alpha / w^(1-alpha)`` (``w``: the statistic
  of the group's weights taken as one fused weight), scored by one loss over the
  outputs of all members: the sum of their squared errors;
* ModelOpt's ``awq_lite`` candidate (groups of linears only): every member searched
  alone with its own weight statistic and ModelOpt's loss (the sum over forwards of
  the mean squared output error), then the members' ``pre_quant_scale`` (``1 / s``)
  averaged, as ModelOpt's export resmooths a fused group.

**The rule** (:meth:`ScaleSearch.choose`): each candidate's *weight reconstruction
error* is, per member, ``||Q(W / p) * p - W|| / ||W||`` (``p``: the ``pre_quant_scale``,
``Q``: fake quantization in the member's format, the per-tensor amax shared by the
group as the export shares it). The joint candidates are tried from the lowest joint
loss up, and the first one whose error is no greater than that of ModelOpt's candidate
on *every* member is taken; when none is, ModelOpt's candidate is. So every layer
reconstructs its weight at least as well as under ModelOpt's scales, and the joint
search is kept wherever it does so.

**The compressed-tensors convention** (``scales=compressed-tensors``) scores the joint
candidates alone, on the finer grid :data:`CT_AWQ_ALPHAS`, and takes the lowest loss:
no ModelOpt export averages its scales. On SmolLM2-135M (in-memory perplexity, 8 x 512
calibration tokens) the rule measured no gain there (30.83 with it, 30.94 without) at twice
the search's time, and the finer grid without it 29.96 (docs/quality.md).

**Portability.** The rule takes discrete decisions from float losses and errors (an
ordering, per-member argmins, ``<=`` comparisons), and a forward pass's floats differ
in their last bits between machines (CPU kernels, thread counts, GPUs). Every decision
records its relative margin (:attr:`ScaleSearch.margins`): a decision whose margin
exceeds :data:`PORTABLE_MARGIN` takes the same outcome on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F

from exportlm.quant import _tensor
from exportlm.quant._awq_clip import BlockGram
from exportlm.quant._awq_fake import fake_quant_fresh
from exportlm.quant._awq_gram import GramLoss, candidate_loss
from exportlm.quant._quantizer import TensorQuantizer, row_chunks

__all__ = [
    "AWQ_ALPHA",
    "AWQ_ALPHAS",
    "CT_AWQ_ALPHAS",
    "PORTABLE_MARGIN",
    "Choice",
    "ScaleSearch",
    "awq_scale",
    "awq_weight_scale",
    "fake_quant_fresh",
]

#: The smoothing strength used when statistics do not come from data (no search).
AWQ_ALPHA = 0.5
#: The grid searched, as ModelOpt's ``awq_lite`` (``alpha_step=0.1``).
AWQ_ALPHAS: tuple[float, ...] = tuple(i / 10 for i in range(11))
#: The grid of the compressed-tensors convention: llm-compressor's ``n_grid=20`` with
#: ``duo_scaling`` (ratios ``i / 18``). On SmolLM2-135M its optima lie between ModelOpt's
#: steps (0.17-0.28 where the 0.1 grid takes 0.2), and the finer grid measured 3.2% lower
#: perplexity (docs/quality.md, "compressed-tensors AWQ: the search").
CT_AWQ_ALPHAS: tuple[float, ...] = tuple(i / 18 for i in range(19))
#: The relative margin above which a decision of the search cannot flip on another
#: machine. The losses and reconstruction errors are sums over float32 forward passes
#: and matmuls: across CPU kernel sets, thread counts and GPUs (TF32 off) they move by
#: about 1e-6 relative, so two values further apart than 1e-4 (relative) keep their
#: order everywhere, with two orders of magnitude to spare.
PORTABLE_MARGIN = 1e-4
_TINY = torch.finfo(torch.float32).tiny


def _gap(values: torch.Tensor, first: int, second: int) -> float:
    """``(values[second] - values[first]) / values[first]``: how far ``second`` is above ``first``."""
    low, high = float(values[first]), float(values[second])
    return (high - low) / max(abs(low), _TINY)


def _runner_up_gap(loss: torch.Tensor) -> float:
    """The relative gap between the lowest value of ``loss`` and the next one."""
    order = torch.argsort(loss, stable=True).tolist()
    return _gap(loss, order[0], order[1]) if len(order) > 1 else math.inf


class Choice(Enum):
    """Which candidate a search took (see the module docstring for the rule)."""

    FIXED = "the fixed alpha (statistics not from data, or never scored)"
    JOINT_BEST = "the joint search's lowest loss"
    JOINT_OTHER = "another alpha of the joint search (its best reconstructed a weight worse)"
    AVERAGE = "ModelOpt's average of per-linear scales"


def awq_weight_scale(weights: list[torch.Tensor], block_size: int | None) -> torch.Tensor:
    """Mean over the rows of ``|W|`` divided by each block's amax (ModelOpt's weight statistic).

    ``weights`` are the ``[out, in]`` weights of one group, scored as one fused weight.
    Computed in float64 (see :func:`awq_scale`): a float32 mean's last bit depends on
    the CPU's reduction kernel, and these values reach the checkpoint's bytes.

    Each row's values depend on that row alone, so a group larger than one slice of
    :data:`~exportlm.quant._tensor.CHUNK_ELEMENTS` is summed a slice of rows at a
    time: no float64 copy of the whole group (for ``gate/up`` eight times one weight's
    bf16 size). The float64 sums differ from one whole reduction by rounding (about
    1e-16 relative), far below the float32 step the statistic is finally rounded to.
    """
    cols = int(weights[0].shape[-1])
    step = max(1, _tensor.CHUNK_ELEMENTS // max(cols, 1))
    if sum(int(w.shape[0]) for w in weights) <= step:
        return _scaled_rows(torch.cat([w.detach().double() for w in weights]), block_size).mean(
            dim=0
        )
    total = torch.zeros(cols, dtype=torch.float64, device=weights[0].device)
    for weight in weights:
        for start in range(0, int(weight.shape[0]), step):
            rows = weight[start : start + step].detach().double()
            total += _scaled_rows(rows, block_size).sum(dim=0)
    return total / sum(int(w.shape[0]) for w in weights)


def _scaled_rows(weight: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """``|W|`` over its block's amax (over its row's amax without whole blocks), float64."""
    rows, cols = weight.shape
    if block_size and cols % block_size == 0:
        blocks = weight.abs().reshape(-1, block_size)
        scaled = blocks / (blocks.amax(dim=1, keepdim=True) + _TINY)
    else:
        scaled = weight.abs() / (weight.abs().amax(dim=1, keepdim=True) + _TINY)
    return scaled.reshape(rows, cols)


def awq_scale(act: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = act^alpha / weight^(1-alpha)``, clamped to [1e-4, 1e4], normalised (ModelOpt's).

    Computed in float64 and returned in float64; callers round once to float32. In
    float32, ``pow`` and the mean of :func:`awq_weight_scale` differ in the last bit
    between CPU kernels (measured: Intel vs AMD, AVX-512 vs default), and with a fixed
    ``alpha`` (:func:`~exportlm.quant.synthetic_calibration`) those bits are the
    checkpoint's ``pre_quant_scale`` / ``weight_scale``, which goldens compare by hash.
    A float64 result is ~1e-16 off in relative terms, far below float32's rounding step,
    so the float32 value it rounds to is the same on every machine (except for a value
    within 1e-16 of a float32 rounding boundary).
    """
    s = (act.double().pow(alpha) / (weight.double().pow(1 - alpha) + _TINY)).clamp(1e-4, 1e4)
    return s / (s.max() * s.min()).sqrt()


def _chunks(weight: torch.Tensor, quantizer: TensorQuantizer) -> list[slice]:
    """The slices of rows to fake-quantize ``weight`` in: one (the whole) unless it is
    contiguous, so every result has the layout the whole tensor's computation gives."""
    return row_chunks(weight.shape, quantizer.spec) if weight.is_contiguous() else [slice(None)]


def _fake_quant_scaled(
    quantizer: TensorQuantizer, weight: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """``fake_quant_fresh(quantizer, weight * s)``, written into ``out`` a slice of rows at
    a time where :func:`_chunks` allows it (``out``: a contiguous tensor like ``weight``,
    reused across candidates): the same values, but neither the scaled weight nor its
    float32 codes and dequantized values exist whole at once."""
    chunks = _chunks(weight, quantizer)
    if len(chunks) == 1 or out is None:
        return fake_quant_fresh(quantizer, weight * s)
    amax = None
    if quantizer.spec.calibrated:  # the max is exact, so the slices' max is the whole's
        amax = torch.stack([(weight[r] * s).abs().float().amax() for r in chunks]).amax()
    for rows in chunks:
        out[rows] = fake_quant_fresh(quantizer, weight[rows] * s, amax)
    return out


@dataclass
class ScaleSearch:
    """One scale being searched: the weights that share it and the running losses.

    ``own_wscales`` (groups of linears) holds each member's own weight statistic: it
    enables ModelOpt's per-linear candidates and the rule of :meth:`choose`. Without
    it (per-expert searches) the joint search's best is taken. ``name`` labels the
    search in logs (the layer or ``<experts>.<proj>[<expert>]``).

    :meth:`choose` records every decision it takes in :attr:`margins`, as
    ``(what, relative margin)``; :attr:`margin` is the smallest.
    """

    weights: list[Callable[[], torch.Tensor]]
    quantizers: list[TensorQuantizer]
    act: torch.Tensor
    wscale: torch.Tensor
    from_data: bool
    own_wscales: list[torch.Tensor] | None = None
    sse: torch.Tensor = field(init=False)  # [alphas]: the joint loss of each candidate
    own_loss: torch.Tensor | None = None  # [members, alphas]: ModelOpt's loss per member
    #: The inputs as a Gram matrix (linear groups): the losses are taken from it once,
    #: by :meth:`settle`, instead of per forward (:mod:`exportlm.quant._awq_gram`).
    gram: GramLoss | None = None
    #: The diagonal blocks of the inputs' Gram matrix, for the clip search of the
    #: members' INT4 groups (:mod:`exportlm.quant._awq_clip`); ``None``: no clip.
    clip: BlockGram | None = None
    count: int = 0
    name: str = ""
    margins: list[tuple[str, float]] = field(default_factory=list)
    norms: list[torch.Tensor] | None = None  # ||W|| per member, once :meth:`weight_errors` ran
    #: The joint candidates' ``alpha`` values (the compressed-tensors convention's are
    #: :data:`CT_AWQ_ALPHAS`).
    alphas: tuple[float, ...] = AWQ_ALPHAS

    @property
    def margin(self) -> float:
        """The smallest relative margin of :meth:`choose`'s decisions (inf: none taken)."""
        return min((m for _, m in self.margins), default=math.inf)

    def __post_init__(self) -> None:
        self.sse = torch.zeros(len(self.alphas), dtype=torch.float64)
        if self.own_wscales is not None:
            self.own_loss = torch.zeros(
                len(self.own_wscales), len(self.alphas), dtype=torch.float64
            )

    def _scores(
        self, x: torch.Tensor, weight: torch.Tensor, member: int, wscale: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Squared output error summed, per alpha, and the number of output elements."""
        reference = F.linear(x, weight).float()
        sse = torch.zeros(len(self.alphas))
        quantized = None  # the candidates' fake-quantized weight, when made in slices
        if len(_chunks(weight, self.quantizers[member])) > 1:
            quantized = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        for i, alpha in enumerate(self.alphas):
            s = awq_scale(self.act, wscale, alpha).to(torch.float32)
            q = _fake_quant_scaled(self.quantizers[member], weight, s.to(weight.dtype), quantized)
            out = F.linear(x / s.to(x.dtype), q).float()
            sse[i] = (out - reference).pow(2).sum().cpu()
        return sse, reference.numel()

    def score(self, x: torch.Tensor, member: int) -> None:
        """Add the losses of every candidate on input ``x`` of one member (one forward);
        a Gram search adds ``x`` to its Gram matrix (once for the group's members)."""
        weight = self.weights[member]().detach()
        if self.gram is not None:
            self.gram.add(x)
            self.count += (x.numel() // max(int(x.shape[-1]), 1)) * int(weight.shape[0])
            return
        x = x.detach().reshape(-1, x.shape[-1])
        if x.numel() == 0:
            return
        joint, numel = self._scores(x, weight, member, self.wscale)
        self.sse += joint
        self.count += numel
        if self.own_wscales is not None and self.own_loss is not None:
            own = joint
            if len(self.weights) > 1:  # a single member's own candidates are the joint ones
                own, _ = self._scores(x, weight, member, self.own_wscales[member])
            self.own_loss[member] += own / numel  # ModelOpt: the mean, summed over forwards

    def settle(self) -> None:
        """A Gram search's losses from its Gram matrices (once; then they are freed)."""
        gram = self.gram
        if gram is None or gram.gram is None:
            return
        mean = gram.per_forward_mean() if self.own_loss is not None else None
        for member, weight_of in enumerate(self.weights):
            weight = weight_of().detach()
            alone = len(self.weights) == 1
            grams = [gram.gram] + ([mean] if alone and mean is not None else [])
            losses = self._form_losses(weight, member, self.wscale, grams)
            self.sse += losses[0]
            if mean is None or self.own_loss is None or self.own_wscales is None:
                continue
            own = losses[1] if alone else None  # one member's own candidates are the joint ones
            if own is None:
                own = self._form_losses(weight, member, self.own_wscales[member], [mean])[0]
            self.own_loss[member] += own / int(weight.shape[0])  # ModelOpt: the mean
        if self.clip is not None:  # the clip search's blocks, before G is freed
            self.clip.take_from(gram.gram)
        gram.release()

    def _form_losses(
        self, weight: torch.Tensor, member: int, wscale: torch.Tensor, grams: list[torch.Tensor]
    ) -> torch.Tensor:
        """``[len(grams), alphas]``: each candidate's squared output error under each Gram."""
        losses = torch.zeros(len(grams), len(self.alphas), dtype=torch.float64)
        quantized = None  # the candidates' fake-quantized weight, when made in slices
        if len(_chunks(weight, self.quantizers[member])) > 1:
            quantized = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        for i, alpha in enumerate(self.alphas):
            s = awq_scale(self.act, wscale, alpha).to(torch.float32).to(weight.dtype)
            q = _fake_quant_scaled(self.quantizers[member], weight, s, quantized)
            for k, g in enumerate(grams):
                losses[k, i] = candidate_loss(q, weight, s, g.to(weight.device))
        return losses

    def _joint(self, alpha: float) -> torch.Tensor:
        return (1.0 / awq_scale(self.act, self.wscale, alpha)).to(torch.float32)

    def average_candidate(self) -> torch.Tensor:
        """ModelOpt's candidate: each member's best ``1 / s`` by its own loss, averaged.

        Records each member's argmin in :attr:`margins` (its gap to the runner-up).
        """
        if self.own_wscales is None or self.own_loss is None:
            raise ValueError("no per-linear candidates were scored for this search")
        rows = []
        for member, (wscale, loss) in enumerate(zip(self.own_wscales, self.own_loss, strict=True)):
            rows.append(1.0 / awq_scale(self.act, wscale, self.alphas[int(torch.argmin(loss))]))
            self.margins.append((f"member {member}'s own best alpha", _runner_up_gap(loss)))
        return torch.stack(rows).mean(dim=0).to(torch.float32)

    def weight_errors(self, pqs: torch.Tensor) -> list[float]:
        """Per member, ``||Q(W / pqs) * pqs - W|| / ||W||`` (the group shares one amax).

        One member at a time, and its error ``Q(W / pqs) * pqs - W`` filled a slice of
        rows at a time: the float32 working memory is one weight's error, not the
        group's weights, their smoothed copies and their dequantized values together.
        The values and the norms are those of the whole float32 tensors.
        """
        weights = [w().detach() for w in self.weights]
        p = pqs.to(weights[0].device, torch.float32)
        pieces = [(w, _chunks(w, q)) for w, q in zip(weights, self.quantizers, strict=True)]
        amax = torch.stack(
            [(w[r].float() / p).abs().amax() for w, chunks in pieces for r in chunks]
        ).amax()
        errors = []
        for (weight, chunks), quantizer, norm in zip(
            pieces, self.quantizers, self._weight_norms(), strict=True
        ):
            if len(chunks) == 1:  # the whole tensor, in its own layout
                w = weight.float()
                error = fake_quant_fresh(quantizer, w / p, amax).float() * p - w
            else:
                error = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
                for rows in chunks:
                    w = weight[rows].float()
                    effective = fake_quant_fresh(quantizer, w / p, amax).float() * p
                    torch.sub(effective, w, out=error[rows])
            errors.append(float(error.norm() / (norm + _TINY)))
            del error  # before the next member's is allocated: one weight's error at a time
        return errors

    def _weight_norms(self) -> list[torch.Tensor]:
        """``||W||`` of every member, in float32 (computed once per search)."""
        if self.norms is None:
            self.norms = [w().detach().float().norm() for w in self.weights]
        return self.norms

    def choose(self) -> tuple[torch.Tensor, Choice]:
        """The ``pre_quant_scale`` to use and which candidate it is (the module's rule).

        Resets and fills :attr:`margins`: the gap of the chosen joint loss to the next
        one in the ranking, each member's argmin of ModelOpt's candidate, and each
        weight-error comparison that decided a candidate (``|e - b| / b``).
        """
        self.margins = []
        self.settle()
        if not (self.from_data and self.count > 0):
            return self._joint(AWQ_ALPHA), Choice.FIXED
        order = torch.argsort(self.sse, stable=True).tolist()
        if self.own_wscales is None:
            self._rank_margin(order, 0)
            return self._joint(self.alphas[order[0]]), Choice.JOINT_BEST
        average = self.average_candidate()
        bound = self.weight_errors(average)
        for rank, index in enumerate(order):
            pqs, alpha = self._joint(self.alphas[index]), self.alphas[index]
            if torch.equal(pqs, average):  # the same bits give the same errors everywhere
                self._rank_margin(order, rank)
                return pqs, Choice.JOINT_BEST if rank == 0 else Choice.JOINT_OTHER
            errors = self.weight_errors(pqs)
            gaps = [abs(e - b) / max(b, _TINY) for e, b in zip(errors, bound, strict=True)]
            worse = [g for g, e, b in zip(gaps, errors, bound, strict=True) if e > b]
            if not worse:  # every comparison decided the acceptance: the closest one counts
                self.margins.append((f"alpha={alpha}'s weight errors <= the average's", min(gaps)))
                self._rank_margin(order, rank)
                return pqs, Choice.JOINT_BEST if rank == 0 else Choice.JOINT_OTHER
            # one worse member suffices to reject: the clearest one counts
            self.margins.append((f"alpha={alpha}'s weight errors > the average's", max(worse)))
        return average, Choice.AVERAGE

    def _rank_margin(self, order: list[int], rank: int) -> None:
        """Record how far the joint loss of the candidate at ``rank`` is below the next one."""
        if rank + 1 < len(order):
            chosen, runner_up = order[rank], order[rank + 1]
            self.margins.append(
                (
                    f"joint loss of alpha={self.alphas[chosen]} < alpha={self.alphas[runner_up]}",
                    _gap(self.sse, chosen, runner_up),
                )
            )
