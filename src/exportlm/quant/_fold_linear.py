"""Fold AWQ scales into the linear before a linear (the compressed-tensors convention).

compressed-tensors has no ``pre_quant_scale`` tensor: llm-compressor's AWQ smooths every
scale into the op before the layer. A norm takes the scales of ``q/k/v`` and ``gate/up``
(:mod:`exportlm.quant._fold`); ``o_proj`` and ``down_proj`` take theirs from the linear
whose output their input is: ``v_proj`` (attention is linear in ``v``, channel by
channel, when ``v``'s output channels are ``o``'s input channels: no grouped-query
attention) and ``up_proj`` (``act(gate) * up`` is linear in ``up``). The fold scales the
predecessor's weight rows (and bias) by the scale; the consumer keeps it as
``folded_pre_quant_scale``, as the norm fold does, so its weight quantizer sees
``W / s``. Weight scales of INT4 are computed at export from the module's weight, so the
predecessor's own quantization sees the folded weight.

Nothing is guessed by name. :func:`trace_blocks` records, during calibration, the first
inputs of the module around each AWQ linear of the convention (its parent: the attention
or MLP block). A linear ``L`` of that block is ``C``'s predecessor when replaying the
block on the recorded inputs with ``L``'s output multiplied by a probe scale of powers of
two (exact in floating point) multiplies ``C``'s input by the same scale within a few
ulps, and dividing ``C``'s input by it again gives the block's output within a few ulps
(so ``L``'s output reaches nothing else). ``q_proj`` and ``k_proj`` fail it (softmax),
so does ``gate_proj`` (SiLU). Exactly one predecessor must pass.

Under the convention a scale that folds nowhere is not searched (:func:`prune_unfoldable`)
and none is kept (:func:`fold_into_linears`): the linear is plain round-to-nearest with
its group size, as llm-compressor quantizes a linear no mapping smooths.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from exportlm.quant._awq import AWQPlan
from exportlm.quant._fold import NormTrace, can_fold_norm
from exportlm.quant._modules import QuantLinear

__all__ = ["BlockTrace", "fold_into_linears", "prune_unfoldable", "trace_blocks"]

logger = logging.getLogger(__name__)

#: The probe scale's values: powers of two, so scaling is exact in floating point.
_PROBE = (0.25, 4.0, 0.5, 2.0, 8.0, 0.125)
#: The check's tolerance in ulps of the compared values.
_ULPS = 8


@dataclass
class BlockTrace:
    """The first recorded inputs of the block around each linear of the convention."""

    blocks: dict[str, nn.Module] = field(default_factory=dict)
    samples: dict[str, tuple[tuple[object, ...], dict[str, object]]] = field(default_factory=dict)
    #: ``consumer linear name -> its predecessor's name`` (verified), or ``None``.
    found: dict[str, str | None] = field(default_factory=dict)


def _convention(module: nn.Module) -> bool:
    """An AWQ linear (its input tracks channels) of the compressed-tensors convention, read
    on the weight quantizer: an input quantized at run time (``w4afp8``'s FP8 per token)
    keeps ModelOpt's convention (:func:`~exportlm.quant._conventions.apply_convention`)."""
    if not isinstance(module, QuantLinear):
        return False
    weights = module.weight_quantizer
    return module.input_quantizer.track_channels and weights.scales == "compressed-tensors"


@contextmanager
def trace_blocks(model: nn.Module) -> Iterator[BlockTrace]:
    """Record the first call's inputs of the parent of every linear of the convention."""
    trace = BlockTrace()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if _convention(module) and "." in name:
            parent = name.rsplit(".", 1)[0]
            trace.blocks[parent] = modules[parent]
    handles = [
        block.register_forward_pre_hook(_sample_hook(trace, name), with_kwargs=True)
        for name, block in trace.blocks.items()
    ]
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()


def _sample_hook(trace: BlockTrace, name: str):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if name not in trace.samples:
            trace.samples[name] = (
                tuple(_kept(a) for a in args),
                {k: _kept(v) for k, v in kwargs.items()},
            )

    return hook


def _kept(value: object) -> object:
    """Tensors (and tuples of them) cloned, plain values kept; other objects (a KV cache,
    which a replay would extend) dropped as ``None``."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(v.detach().clone() for v in value)
    return value if value is None or isinstance(value, bool | int | float | str) else None


def _replay(
    trace: BlockTrace, block: str, pred: nn.Module | None, cons: nn.Module, scale: torch.Tensor
) -> tuple[object, torch.Tensor | None]:
    """The block's output on its sample and the consumer's input, with ``pred``'s output
    times ``scale`` and the consumer's input divided by it (``pred=None``: plain)."""
    seen: list[torch.Tensor] = []

    def scaled(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        return output * scale.to(output.dtype)

    def record(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...] | None:
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return None
        seen.append(x.detach().clone())
        return (x / scale.to(x.dtype), *args[1:]) if pred is not None else None

    handles = [cons.register_forward_pre_hook(record)]
    if pred is not None:
        handles.append(pred.register_forward_hook(scaled))
    args, kwargs = trace.samples[block]
    try:
        with torch.no_grad():
            out = trace.blocks[block](*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return out, (seen[0] if len(seen) == 1 else None)


def _close(got: object, want: object, scale: torch.Tensor | None = None) -> bool:
    if isinstance(got, tuple | list) and isinstance(want, tuple | list):
        got, want = got[0], want[0]
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return False
    if got.shape != want.shape:
        return False
    if scale is not None:
        want = want * scale.to(want.dtype)
    bound = _ULPS * torch.finfo(want.dtype).eps * (want.abs() + want.abs().mean() * 1e-3)
    return bool(((got - want).abs() <= bound).all())


def _predecessor(trace: BlockTrace, name: str, cons: QuantLinear) -> str | None:
    """The one linear of ``name``'s block whose output is ``cons``'s input channel by
    channel (verified on the block's recorded inputs), or ``None``."""
    if name in trace.found:
        return trace.found[name]
    block = name.rsplit(".", 1)[0]
    found: list[str] = []
    if block in trace.samples:
        n = cons.in_features
        probe = torch.tensor(_PROBE).repeat(n // len(_PROBE) + 1)[:n]
        try:
            base_out, base_in = _replay(trace, block, None, cons, probe)
            for sub, pred in trace.blocks[block].named_modules(prefix=block):
                if pred is cons or not isinstance(pred, nn.Linear) or pred.out_features != n:
                    continue
                out, x = _replay(trace, block, pred, cons, probe)
                if x is not None and _close(x, base_in, probe) and _close(out, base_out):
                    found.append(sub)
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as e:
            # a block that cannot replay on its recorded inputs folds nothing
            logger.info("AWQ: %s cannot be replayed (%s); %s keeps no scale", block, e, name)
            found = []
    trace.found[name] = found[0] if len(found) == 1 else None
    return trace.found[name]


@torch.no_grad()
def prune_unfoldable(model: nn.Module, plan: AWQPlan, norms: NormTrace, trace: BlockTrace) -> None:
    """Under the convention, search only the scales a norm or a linear can take."""
    names = {id(m): n for n, m in model.named_modules()}
    for index, (members, search) in enumerate(plan.linears):
        if not all(map(_convention, members)):
            continue
        member_names = [names[id(m)] for m in members]
        norm = norms.norm_of(member_names)
        probe = torch.tensor(_PROBE).repeat(members[0].in_features)[: members[0].in_features]
        if norm is not None and can_fold_norm(model, norm, probe, norms):
            continue
        if len(members) == 1 and _foldable_into(model, trace, member_names[0], members[0]):
            continue
        logger.info("AWQ: %s: no op before it takes a scale; round-to-nearest", member_names)
        plan.linears[index] = (members, None)
        if search is not None and search.clip is not None:  # its groups are still clipped
            plan.clip_only.append((members, search.clip))


def _foldable_into(model: nn.Module, trace: BlockTrace, name: str, cons: QuantLinear) -> bool:
    pred = _predecessor(trace, name, cons)
    if pred is None:
        return False
    weight = model.get_submodule(pred).weight
    shared = sum(p is weight for _, p in model.named_parameters(remove_duplicate=False))
    return shared == 1 and isinstance(weight, nn.Parameter) and weight.dim() == 2


def fold_into_linears(model: nn.Module, trace: BlockTrace) -> int:
    """Fold every remaining scale of the convention into its verified predecessor; a scale
    with none is dropped (round-to-nearest). Returns how many were folded."""
    folded = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not _convention(module) or not isinstance(module, QuantLinear):
                continue
            quantizer = module.input_quantizer
            scale = quantizer.pre_quant_scale
            if scale is None:
                continue
            quantizer.pre_quant_scale = None
            if scale.dim() != 1 or not _foldable_into(model, trace, name, module):
                continue
            pred = model.get_submodule(trace.found[name] or "")
            for attr, param in list(pred.named_parameters(recurse=False)):
                if attr in ("weight", "bias"):
                    factor = scale.float().reshape(-1, *([1] * (param.dim() - 1)))
                    value = (param.detach().float() * factor).to(param.dtype)
                    setattr(pred, attr, nn.Parameter(value, requires_grad=param.requires_grad))
            quantizer.folded_pre_quant_scale = scale
            folded += 1
    return folded
