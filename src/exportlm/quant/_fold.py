"""Fold AWQ ``pre_quant_scale`` into the norm that feeds a group of linears (as ModelOpt exports).

``norm(x) * s`` equals the same norm with its weight (and bias) multiplied by ``s``
when the norm ends with an elementwise affine ``y * weight + bias``. The fold is
done in the model itself (the norm gets a new weight ``Parameter``; the original
object is untouched, so a rolled-back ``quantize`` restores it), and the linears
keep the scale as ``folded_pre_quant_scale``: their weight quantizer still sees
``W / s``, their input is not multiplied again. The exported state dict then holds
the folded norm weight and no ``pre_quant_scale`` for those linears.

Nothing is guessed: :class:`NormTrace` records, during calibration, which modules
received each norm's output (by tensor identity, positional or keyword). A group
is folded only when

* the norm's output reached the group's linears and nothing else (modules that
  merely contain the linears, such as the attention or MLP block, aside): a norm
  that also feeds an unquantized router, or another group, keeps the scales;
* the norm's weight is one ``[in]`` parameter no other module shares;
* on a sample of the norm's recorded input, the folded norm equals ``norm(x) * s``
  within a few ulps (a norm computing ``y * (1 + weight)``, as Gemma's, fails it).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from exportlm.quant._modules import QuantLinear, QuantModule
from exportlm.quant._quantizer import TensorQuantizer

__all__ = ["NormTrace", "can_fold_norm", "fold_into_norms", "trace_norms"]

logger = logging.getLogger(__name__)

_SAMPLE_ROWS = 16


@dataclass
class NormTrace:
    """Which modules received each norm's output during calibration."""

    norms: dict[str, nn.Module] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``id(output) -> (a weak reference to the output, norm name)``: a norm's output is
    #: recognized while it is alive, and no output is kept alive for it (an ``id`` reused
    #: by a later tensor fails the reference check).
    outputs: dict[int, tuple[weakref.ref[torch.Tensor], str]] = field(default_factory=dict)

    def norm_of_output(self, value: torch.Tensor) -> str | None:
        """The norm whose (still alive) output ``value`` is, or ``None``."""
        entry = self.outputs.get(id(value))
        return entry[1] if entry is not None and entry[0]() is value else None

    def norm_of(self, members: list[str]) -> str | None:
        """The norm whose output fed exactly ``members`` (their containers and their own
        submodules aside), or ``None``."""
        wanted = set(members)
        containers = {m.rsplit(".", i)[0] for m in members for i in range(1, m.count(".") + 1)}
        containers.add("")
        inside = tuple(f"{m}." for m in members)  # the linears' own quantizers
        for norm, consumers in self.consumers.items():
            outside = {c for c in consumers - containers if not c.startswith(inside)}
            if wanted <= consumers and outside == wanted:
                return norm
        return None


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, QuantModule | TensorQuantizer) or next(module.children(), None):
        return False
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return weight is not None and weight.dim() == 1 and set(params) <= {"weight", "bias"}


@contextmanager
def trace_norms(model: nn.Module, enabled: bool = True) -> Iterator[NormTrace]:
    """Record norm outputs and who consumes them for the forwards run inside the block."""
    trace = NormTrace()
    if not enabled:
        yield trace
        return
    handles = []
    for name, module in model.named_modules():
        if _is_norm(module):
            trace.norms[name] = module
            handles.append(module.register_forward_hook(_output_hook(trace, name)))
        handles.append(
            module.register_forward_pre_hook(_consumer_hook(trace, name), with_kwargs=True)
        )
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()
        trace.outputs.clear()


def _output_hook(trace: NormTrace, name: str):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if isinstance(output, torch.Tensor):
            trace.outputs[id(output)] = (weakref.ref(output), name)
            trace.consumers.setdefault(name, set())
            if name not in trace.samples and args and isinstance(args[0], torch.Tensor):
                x = args[0].detach()
                trace.samples[name] = x.reshape(-1, x.shape[-1])[:_SAMPLE_ROWS].clone()

    return hook


def _consumer_hook(trace: NormTrace, name: str):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        for value in (*args, *kwargs.values()):
            norm = trace.norm_of_output(value) if isinstance(value, torch.Tensor) else None
            if norm is not None:
                trace.consumers[norm].add(name)

    return hook


def fold_into_norms(model: nn.Module, trace: NormTrace) -> int:
    """Fold the ``pre_quant_scale`` of every group fed by a foldable norm; returns how many."""
    names = {id(m): n for n, m in model.named_modules()}
    shared = _shared_parameters(model)
    groups: dict[int, list[QuantLinear]] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            pqs = module.input_quantizer.pre_quant_scale
            if pqs is not None and pqs.dim() == 1:
                groups.setdefault(id(pqs), []).append(module)
    folded = 0
    with torch.no_grad():
        for members in groups.values():
            norm_name = trace.norm_of([names[id(m)] for m in members])
            if norm_name is None:
                continue
            norm = trace.norms[norm_name]
            scale = members[0].input_quantizer.pre_quant_scale
            if scale is None or not _can_fold(norm_name, norm, scale, trace, shared):
                continue
            _fold(norm, scale)
            for member in members:
                member.input_quantizer.folded_pre_quant_scale = scale
                member.input_quantizer.pre_quant_scale = None
            folded += 1
    return folded


def can_fold_norm(model: nn.Module, name: str, scale: torch.Tensor, trace: NormTrace) -> bool:
    """The norm ``name`` of ``trace`` can absorb ``scale`` (checked as the fold checks it)."""
    return _can_fold(name, trace.norms[name], scale, trace, _shared_parameters(model))


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _can_fold(
    name: str, norm: nn.Module, scale: torch.Tensor, trace: NormTrace, shared: set[int]
) -> bool:
    params = dict(norm.named_parameters(recurse=False))
    weight = params["weight"]
    if weight.shape != scale.shape or any(id(p) in shared for p in params.values()):
        logger.info("AWQ: %s cannot absorb the scales (shape or shared weight)", name)
        return False
    sample = trace.samples.get(name)
    if sample is None:
        return False
    folded = {k: v * scale.to(v.dtype) for k, v in params.items()}
    expected = norm(sample) * scale.to(sample.dtype)
    actual = functional_call(norm, folded, (sample,))
    eps = torch.finfo(expected.dtype).eps
    bound = 16 * eps * (1.0 + float(expected.abs().amax()))
    same = isinstance(actual, torch.Tensor) and float((actual - expected).abs().amax()) <= bound
    if not same:
        logger.info("AWQ: %s is not `y * weight (+ bias)`; the scales stay pre_quant_scale", name)
    return same


def _fold(norm: nn.Module, scale: torch.Tensor) -> None:
    for attr, param in list(norm.named_parameters(recurse=False)):
        value = (param.detach().float() * scale.float()).to(param.dtype)
        setattr(norm, attr, nn.Parameter(value, requires_grad=param.requires_grad))
