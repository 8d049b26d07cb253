"""AWQ: a search of the smoothing scales, as ModelOpt's ``awq_lite``, and their fold into norms.

For each group of linears that read one input (``q/k/v_proj``; ``gate/up_proj``; a
single ``o_proj`` / ``down_proj``) and for each expert of stacked experts:

1. calibration records the per-channel activation statistic ``act = mean(|x|)``
   (averaged over the calibration forwards), as ModelOpt does;
2. a second pass of the calibration forwards (every quantizer transparent, so each
   layer sees the float model's activations) scores every ``alpha`` of
   :data:`~exportlm.quant._awq_search.AWQ_ALPHAS`: ``s = act^alpha / w^(1-alpha)``
   (``w``: the mean over the rows of ``|W|`` over its block amax), normalised by
   ``sqrt(max(s) * min(s))``; the loss is the squared error of the quantized layer's
   output ``(x / s) @ Q(W * s)^T`` against the float output ``x @ W^T``;
3. one scale is chosen and gives ``pre_quant_scale = 1 / s``;
4. each INT4 group's range is searched on the same inputs and the weight kept clipped
   (:mod:`exportlm.quant._awq_clip`; the recipes' ``clip`` option, on by default).

A group is searched jointly (one loss over the outputs of all its members, so the
scale finally shared is one that was scored) *and* as ModelOpt does it (each member
alone, the members' scales averaged). The joint scale is kept only where it
reconstructs every member's weight at least as well as ModelOpt's average, else the
average is taken: the rule of :mod:`exportlm.quant._awq_search`. Under the
compressed-tensors convention a group takes its joint search's best on the finer grid
:data:`~exportlm.quant._awq_search.CT_AWQ_ALPHAS` (llm-compressor's). Each expert gets its
own scale, searched on the tokens routed to it (ModelOpt cannot quantize
transformers-5 fused experts with AWQ).

Statistics that do not come from data (:func:`~exportlm.quant.synthetic_calibration`
draws ``channel_amax`` and keeps no ``mean(|x|)``) are not searched: the fixed
``AWQ_ALPHA`` is used, so the scales stay a pure function of the drawn values.

The search's discrete decisions carry their relative margins (see
:data:`~exportlm.quant._awq_search.PORTABLE_MARGIN`): :func:`apply_awq` logs a warning
for a scale decided within float noise (another machine may choose another) and
records each quantizer's smallest margin in ``TensorQuantizer.awq_margin``
(:func:`awq_margin` of a model).

Scales of a group fed by a norm that feeds nothing else are folded into the norm
(:mod:`exportlm.quant._fold`); the others stay as ``pre_quant_scale``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from exportlm.quant._awq_clip import (
    BlockGram,
    ClipResult,
    clip_experts,
    clip_linear,
    clips,
    clips_experts,
    log_clips,
    shared_weights,
)
from exportlm.quant._awq_gram import GramLoss, gram_fits
from exportlm.quant._awq_search import (
    AWQ_ALPHA,
    AWQ_ALPHAS,
    CT_AWQ_ALPHAS,
    PORTABLE_MARGIN,
    Choice,
    ScaleSearch,
    awq_weight_scale,
)
from exportlm.quant._calibrate import run_transparent_forwards
from exportlm.quant._distributed import reduce_clip_blocks, reduce_searches
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._modules import QuantLinear
from exportlm.quant._quantizer import TensorQuantizer

__all__ = [
    "AWQPlan",
    "apply_awq",
    "awq_margin",
    "clip_awq",
    "collect_expert_statistics",
    "plan_awq",
    "search_awq",
]

logger = logging.getLogger(__name__)


def _statistic(quantizer: TensorQuantizer) -> tuple[torch.Tensor | None, bool]:
    """``(act, from data)``: ``mean(|x|)`` when data gave one, else a drawn ``channel_amax``."""
    mean = quantizer.channel_mean
    if mean is not None:
        return mean, True
    return quantizer.channel_amax, False


@dataclass
class AWQPlan:
    """Every scale to search: linear groups and per-expert projections."""

    linears: list[tuple[list[QuantLinear], ScaleSearch | None]] = field(default_factory=list)
    experts: list[tuple[QuantExperts, str, list[ScaleSearch | None]]] = field(default_factory=list)
    #: Linears whose scale search was dropped (round-to-nearest: the compressed-tensors
    #: convention's ``o_proj`` under GQA) but whose INT4 groups are still clipped: the
    #: blocks of their input gathered in the same pass.
    clip_only: list[tuple[list[QuantLinear], BlockGram]] = field(default_factory=list)

    @property
    def searched(self) -> list[ScaleSearch]:
        """The searches that have statistics from data."""
        out = [s for _, s in self.linears if s is not None]
        out += [s for _, _, per in self.experts for s in per if s is not None]
        return [s for s in out if s.from_data]


def plan_awq(model: nn.Module, groups: list[list[QuantLinear]]) -> AWQPlan:
    """What to search, from the calibrated statistics and the groups of shared inputs."""
    grouped = {id(m): group for group in groups for m in group}
    plan, done = AWQPlan(), set[int]()
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.input_quantizer.track_channels:
            if id(module) in done:
                continue
            members = [
                m for m in grouped.get(id(module), [module]) if m.input_quantizer.track_channels
            ]
            done.update(map(id, members))
            act, real = _statistic(members[0].input_quantizer)
            search = None
            block = members[0].weight_quantizer.block_size
            # compressed-tensors: the joint search alone, on llm-compressor's finer grid
            ct = members[0].weight_quantizer.scales == "compressed-tensors"
            if act is not None:
                search = ScaleSearch(
                    [_getter(m) for m in members],
                    [m.weight_quantizer for m in members],
                    act,
                    awq_weight_scale([m.weight for m in members], block),
                    real,
                    own_wscales=None
                    if ct
                    else [awq_weight_scale([m.weight], block) for m in members],
                    name="/".join(names[id(m)] for m in members),
                    gram=GramLoss() if gram_fits(members) else None,
                    alphas=CT_AWQ_ALPHAS if ct else AWQ_ALPHAS,
                    clip=BlockGram(block) if real and block and any(map(clips, members)) else None,
                )
            plan.linears.append((members, search))
        elif isinstance(module, QuantExperts):
            for proj in module.PROJECTIONS:
                if module.input_quantizer_of(proj).track_channels:
                    plan.experts.append((module, proj, _expert_searches(module, proj, name)))
    return plan


def _getter(module: QuantLinear) -> Callable[[], torch.Tensor]:
    return lambda: module.weight


def _expert_searches(module: QuantExperts, proj: str, name: str) -> list[ScaleSearch | None]:
    quantizer = module.input_quantizer_of(proj)
    weight_q = module.weight_quantizer_of(proj)
    act, real = _statistic(quantizer)
    steps = quantizer.channel_steps
    out: list[ScaleSearch | None] = []
    clipped = real and clips_experts(module, proj)
    for expert in range(module.num_experts):
        if act is None or (real and steps is not None and float(steps[expert]) == 0):
            out.append(None)  # never routed a token: a neutral scale, as ModelOpt
            continue
        row = act[expert] if act.dim() == 2 else act
        weight = module.canonical_weight(proj)[expert]
        out.append(
            ScaleSearch(
                [_expert_getter(module, proj, expert)],
                [weight_q],
                row,
                awq_weight_scale([weight], weight_q.block_size),
                real,
                name=f"{name}.{proj}[{expert}]",
                clip=BlockGram(int(weight_q.block_size or 0)) if clipped else None,
            )
        )
    return out


def _expert_getter(module: QuantExperts, proj: str, expert: int) -> Callable[[], torch.Tensor]:
    return lambda: module.canonical_weight(proj)[expert]


def collect_expert_statistics(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that record per-expert ``mean(|x|)`` of stacked experts under AWQ while calibrating.

    The tokens are those each expert computes on (its routed tokens); the input of
    ``down_proj`` is recomputed in float from them. Returns the hook handles.
    """
    handles = []
    for module in model.modules():
        if isinstance(module, QuantExperts) and any(
            module.input_quantizer_of(p).channel_experts is not None for p in module.PROJECTIONS
        ):
            handles.append(module.register_forward_pre_hook(_expert_stats_hook, with_kwargs=True))
    return handles


def _expert_stats_hook(
    module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    if not isinstance(module, QuantExperts):  # pragma: no cover - registered on experts only
        return
    gate_up, down = (module.input_quantizer_of(p) for p in module.PROJECTIONS)
    if not gate_up.calibrating:
        return
    with torch.no_grad():
        for expert, tokens in module.routed_tokens(*args, **kwargs):
            # the statistics in float32, the expert's own computation in its dtype (bf16)
            gate_up.add_channel_mean(tokens.float().abs().mean(dim=0), expert)
            hidden = module.expert_hidden(expert, tokens)
            down.add_channel_mean(hidden.abs().float().mean(dim=0), expert)


def search_awq(
    model: nn.Module, plan: AWQPlan, calibrate: Callable[[nn.Module], object] | None
) -> None:
    """Run the calibration forwards once more and score every candidate scale of ``plan``.

    Every quantizer is transparent during the pass (each layer sees the float
    model's activations). Skipped when no statistic came from data.
    """
    if not plan.searched and not plan.clip_only:
        return
    handles = []
    for members, clip in plan.clip_only:  # one hook: the members read one tensor
        handles.append(members[0].register_forward_pre_hook(clip.input_hook))
    for members, search in plan.linears:
        if search is not None and search.from_data:
            for index, member in enumerate(members):
                handles.append(member.register_forward_pre_hook(_linear_hook(search, index)))
    for module in {id(m): m for m, _, _ in plan.experts}.values():
        searches = {p: per for m, p, per in plan.experts if m is module}
        handles.append(module.register_forward_pre_hook(_experts_hook(searches), with_kwargs=True))
    run_transparent_forwards(model, calibrate, handles)
    reduce_searches(plan.searched)  # data-parallel ranks: every rank's share (else a no-op)
    for members, clip in plan.clip_only:
        reduce_clip_blocks(clip, members[0].in_features)
    missed = [s for s in plan.searched if s.count == 0]
    if missed:
        logger.warning(
            "AWQ: the second pass of the calibration forwards missed %d searched scale(s); "
            "they use alpha=%s. Pass a calibrate function that runs the same forwards each call.",
            len(missed),
            AWQ_ALPHA,
        )


def _linear_hook(
    search: ScaleSearch, index: int
) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            search.score(args[0], index)
            if search.clip is not None and search.gram is None:  # else settle() derives them
                search.clip.add(args[0])

    return hook


def _experts_hook(
    searches: dict[str, list[ScaleSearch | None]],
) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if not isinstance(module, QuantExperts):  # pragma: no cover - registered on experts only
            return
        for expert, tokens in module.routed_tokens(*args, **kwargs):
            hidden = module.expert_hidden(expert, tokens)
            for proj, x in (("gate_up_proj", tokens), ("down_proj", hidden)):
                search = searches.get(proj, [None] * (expert + 1))[expert]
                if search is not None and search.from_data:
                    search.score(x, 0)
                    if search.clip is not None:
                        search.clip.add(x)

    return hook


def apply_awq(plan: AWQPlan) -> dict[Choice, int]:
    """Set the chosen scale of every search as ``pre_quant_scale`` (per expert: ``[E, in]``).

    Each input quantizer's ``awq_margin`` is set to the smallest relative margin of
    the decisions behind its scale (``inf`` where none was taken); a search from data
    that decided something within :data:`PORTABLE_MARGIN` is logged as a warning.
    Returns how many groups of linears took each candidate (logged at INFO level).
    """
    chosen = dict.fromkeys(Choice, 0)
    with torch.no_grad():
        for members, search in plan.linears:
            pqs, margin = torch.ones(members[0].in_features), math.inf
            if search is not None:
                pqs, choice = _choose(search)
                chosen[choice] += 1
                margin = search.margin
            pqs = pqs.to(members[0].weight.device)  # one object: the group shares it
            for member in members:
                member.input_quantizer.pre_quant_scale = pqs
                member.input_quantizer.awq_margin = margin
                member.input_quantizer.reset_channels()
                member.input_quantizer.amax = None  # a disabled (weight-only) quantizer keeps none
        for module, proj, per_expert in plan.experts:
            weight = module.canonical_weight(proj)
            rows = [
                torch.ones(weight.shape[-1]) if s is None else _choose(s)[0].cpu()
                for s in per_expert
            ]
            quantizer = module.input_quantizer_of(proj)
            quantizer.pre_quant_scale = torch.stack(rows).to(weight.device)
            quantizer.awq_margin = min(
                (s.margin for s in per_expert if s is not None), default=math.inf
            )
            quantizer.reset_channels()
            quantizer.amax = None
    logger.info(
        "AWQ scales of %d linear group(s): %s",
        len(plan.linears),
        "; ".join(f"{count} took {choice.value}" for choice, count in chosen.items() if count),
    )
    return chosen


def clip_awq(model: nn.Module, plan: AWQPlan) -> ClipResult:
    """The clip search of every linear :func:`~exportlm.quant._awq_clip.clips` names, on
    its group's calibration inputs, after :func:`apply_awq` set the smoothing scales (and
    before they are folded: a fold scales whole rows or columns, which the clipped ranges
    follow). A tied weight is left alone. Returns the decisions, logged at INFO level."""
    shared = shared_weights(model)
    results = []
    for members, search in plan.linears:
        if search is None or search.clip is None or search.clip.blocks is None:
            continue
        for member in members:
            if clips(member) and id(member.weight) not in shared:
                results.append(clip_linear(member, search.clip.blocks, PORTABLE_MARGIN))
        search.clip = None  # the blocks are not needed again
    for members, clip in plan.clip_only:  # round-to-nearest: no AWQ scale
        if clip.blocks is not None:
            results += [
                clip_linear(m, clip.blocks, PORTABLE_MARGIN)
                for m in members
                if clips(m) and id(m.weight) not in shared
            ]
    plan.clip_only.clear()
    for module, proj, per_expert in plan.experts:
        grams = [None if s is None or s.clip is None else s.clip.blocks for s in per_expert]
        if any(g is not None for g in grams) and id(module.get_parameter(proj)) not in shared:
            results.append(clip_experts(module, proj, grams, PORTABLE_MARGIN))
        for search in per_expert:
            if search is not None:
                search.clip = None
    return log_clips(results)


def _choose(search: ScaleSearch) -> tuple[torch.Tensor, Choice]:
    """``search.choose()``, with a warning when a decision from data is not portable."""
    pqs, choice = search.choose()
    if search.from_data and search.margin <= PORTABLE_MARGIN:
        what, margin = min(search.margins, key=lambda item: item[1])
        logger.warning(
            "AWQ: the scale of %s was decided within float noise (%s: relative margin "
            "%.3g <= %g); another machine (CPU kernels, thread count, GPU) may choose "
            "another scale. Calibrate on other or more data to make it portable.",
            search.name or "a layer",
            what,
            margin,
            PORTABLE_MARGIN,
        )
    return pqs, choice


def awq_margin(model: nn.Module) -> float:
    """The smallest relative margin of the AWQ search decisions behind ``model``'s scales.

    ``inf`` when no AWQ search took a decision (no AWQ recipe, or statistics not from
    data). A value above :data:`~exportlm.quant._awq_search.PORTABLE_MARGIN` means every
    decision takes the same outcome on every machine, so the scales agree to float noise.
    """
    margins = [
        m.awq_margin
        for m in model.modules()
        if isinstance(m, TensorQuantizer) and m.awq_margin is not None
    ]
    return min(margins, default=math.inf)
