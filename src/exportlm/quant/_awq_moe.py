"""Compressed-tensors AWQ on a MoE block's input: one scale for the router and every expert.

llm-compressor's AWQ mapping for MoE models (``post_attention_layernorm`` -> the router and
every expert's ``gate_proj`` / ``up_proj``) smooths the norm with one scale shared by every
consumer of its output. Here, under the compressed-tensors convention (no
``pre_quant_scale`` to store), for each block that holds stacked experts:

1. calibration records ``mean(|x|)`` of the block's input over every token (llm-compressor's
   ``x_mean``, taken at the router's input) and which modules read that input (a view of
   it: the router, the experts' ``gate_up_proj``, a shared expert's gate / up and
   ``shared_expert_gate``);
2. another pass of the calibration forwards (every quantizer transparent) scores no scale
   (round-to-nearest, llm-compressor's ``(0.0, duo_scaling=False)`` point of its grid) and
   each ``alpha`` of :data:`~exportlm.quant._awq_search.AWQ_ALPHAS`: ``s = act^alpha /
   w^(1-alpha)`` (``w``: the weight statistic of every quantized reader's rows together,
   llm-compressor's ``duo_scaling``), the quantized readers' weights replaced by
   ``Q(W * s) / s`` and the loss the squared error of the *block's output* against the
   float block's (llm-compressor's loss over the mapping's parent module). The router and
   other unquantized readers keep their float weights, so routing is the float model's;
3. the best ``s`` is folded: the norm's weight (and bias) times ``1 / s``, every reader's
   weight columns times ``s`` (a router's bias is untouched: ``x W^T + b``). The fold is
   kept only where the norm is ``y * weight (+ bias)`` fed to this block alone and, on a
   recorded sample with every quantizer off, the block's output on the scaled input equals
   the original within 1 % (relative norm): a reader missed (Llama4's experts read the
   input times the router's scores, not the input) rolls it back to round-to-nearest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from exportlm.quant._awq_fake import fake_quant_fresh
from exportlm.quant._awq_search import AWQ_ALPHAS, awq_scale, awq_weight_scale
from exportlm.quant._calibrate import run_transparent_forwards
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._fold import NormTrace, can_fold_norm
from exportlm.quant._modules import QuantLinear
from exportlm.quant._quantizer import TensorQuantizer

__all__ = ["MoEInput", "smooth_moe_inputs", "trace_moe_inputs"]

logger = logging.getLogger(__name__)

_SAMPLE_TOKENS = 16
#: The folded block's output on the scaled sample against the original's (relative norm):
#: float rounding of ``W * s`` and ``y * (w / s)`` is ~1e-7 (float32) / ~4e-3 (bf16); a
#: reader left unscaled is off by the scale's spread (order 1).
_FOLD_RTOL = 1e-2


@dataclass
class MoEInput:
    """A MoE block's input as calibration saw it."""

    name: str
    block: nn.Module
    experts: QuantExperts
    readers: dict[str, nn.Module] = field(default_factory=dict)
    total: torch.Tensor | None = None  # sum of |x| per channel, float64
    count: int = 0
    sample: torch.Tensor | None = None
    current: tuple[int, int] | None = None  # (data_ptr, numel) of the input in flight


def _convention(experts: QuantExperts) -> bool:
    weights = experts.weight_quantizer_of("gate_up_proj")
    inputs = experts.input_quantizer_of("gate_up_proj")
    return (
        experts.stores_fused_parameters
        and weights.enabled
        and inputs.track_channels
        and weights.scales == "compressed-tensors"
    )


@contextmanager
def trace_moe_inputs(model: nn.Module, enabled: bool = True) -> Iterator[list[MoEInput]]:
    """Record the input statistic and readers of every convention MoE block's forwards."""
    entries: list[MoEInput] = []
    handles = []
    if enabled:
        for name, module in model.named_modules():
            if isinstance(module, QuantExperts) and "." in name and _convention(module):
                parent = name.rsplit(".", 1)[0]
                entry = MoEInput(parent, model.get_submodule(parent), module)
                entries.append(entry)
                handles += _register(entry)
    try:
        yield entries
    finally:
        for handle in handles:
            handle.remove()
        for entry in entries:
            entry.current = None


def _register(entry: MoEInput) -> list[torch.utils.hooks.RemovableHandle]:
    def enter(module: nn.Module, args: tuple[object, ...]) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return
        flat = x.detach().reshape(-1, x.shape[-1])
        total = flat.abs().double().sum(dim=0)
        entry.total = total if entry.total is None else entry.total + total.to(entry.total)
        entry.count += int(flat.shape[0])
        if entry.sample is None:
            entry.sample = x.detach()[..., :_SAMPLE_TOKENS, :].clone()
        entry.current = (x.data_ptr(), x.numel())

    def leave(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        entry.current = None

    def reader(name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and (x.data_ptr(), x.numel()) == entry.current:
                entry.readers[name] = module

        return hook

    handles = [
        entry.block.register_forward_pre_hook(enter),
        entry.block.register_forward_hook(leave),
    ]
    for name, module in entry.block.named_modules():
        if name and _weight_of(module) is not None:
            handles.append(module.register_forward_pre_hook(reader(name)))
    return handles


def _weight_of(module: nn.Module) -> str | None:
    """The attribute of ``module``'s own 2-D or 3-D weight on the block's input, or ``None``."""
    if isinstance(module, TensorQuantizer):
        return None
    if isinstance(module, QuantExperts):
        return "gate_up_proj"
    weight = module._parameters.get("weight")
    return "weight" if weight is not None and weight.dim() == 2 else None


def _columns(module: nn.Module) -> torch.Tensor:
    """The reader's weight with the input's channels last (a view)."""
    if isinstance(module, QuantExperts):
        return module.canonical_weight("gate_up_proj")
    return module.get_parameter("weight")


def _quantizer(module: nn.Module) -> TensorQuantizer | None:
    if isinstance(module, QuantExperts):
        return module.weight_quantizer_of("gate_up_proj")
    if isinstance(module, QuantLinear) and module.weight_quantizer.enabled:
        return module.weight_quantizer
    return None


def smooth_moe_inputs(
    model: nn.Module,
    entries: list[MoEInput],
    norms: NormTrace,
    calibrate: Callable[[nn.Module], object] | None,
) -> int:
    """Search and fold each block's shared scale (see the module docstring); returns how many
    blocks were smoothed (the others keep round-to-nearest ``gate_up``)."""
    todo = [(e, norm) for e in entries if (norm := _foldable_norm(model, e, norms)) is not None]
    if not todo:
        return 0
    searches = [_BlockSearch(entry) for entry, _ in todo]
    handles = [s.entry.block.register_forward_hook(s.hook, with_kwargs=True) for s in searches]
    run_transparent_forwards(model, calibrate, handles)
    smoothed = 0
    for search, (entry, norm) in zip(searches, todo, strict=True):
        scale = search.best()
        if scale is not None and _fold(model, entry, norm, scale, norms):
            smoothed += 1
    return smoothed


@torch.no_grad()
def _foldable_norm(model: nn.Module, entry: MoEInput, norms: NormTrace) -> str | None:
    """The norm that feeds ``entry``'s block alone and can absorb a scale, else ``None``."""
    why = None
    norm = norms.norm_of([entry.name])
    readers = {id(m) for m in entry.readers.values()}
    if entry.total is None or entry.sample is None or not entry.count:
        why = "no calibration token reached it"
    elif id(entry.experts) not in readers:
        why = "its experts do not read the block's input itself"
    elif norm is None:
        why = "no norm feeds it alone"
    else:
        probe = torch.full((entry.total.shape[0],), 0.5)
        if not can_fold_norm(model, norm, probe, norms):
            why = f"{norm} is not `y * weight (+ bias)` with a weight of its own"
    if why is not None:
        logger.info("AWQ: %s: %s; its experts' gate_up is round-to-nearest", entry.name, why)
        return None
    return norm


class _BlockSearch:
    """The losses of every ``alpha`` over one block's outputs."""

    def __init__(self, entry: MoEInput) -> None:
        self.entry = entry
        assert entry.total is not None  # checked by _foldable_norm
        self.act = (entry.total / entry.count).float()
        self.quantized = [(m, q) for m in entry.readers.values() if (q := _quantizer(m))]
        rows = [w for m, _ in self.quantized for w in _rows(_columns(m))]
        block = self.quantized[0][1].block_size if self.quantized else None
        self.wscale = awq_weight_scale(rows, block)
        self.sse = torch.zeros(1 + len(AWQ_ALPHAS), dtype=torch.float64)
        self.active = False

    def scale(self, index: int) -> torch.Tensor:
        """Candidate 0 is no scale (round-to-nearest), then one per ``alpha``."""
        if index == 0:
            return torch.ones_like(self.act)
        return awq_scale(self.act, self.wscale, AWQ_ALPHAS[index - 1]).to(torch.float32)

    def hook(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], out: object
    ) -> None:
        if self.active or not args or not isinstance(args[0], torch.Tensor):
            return
        reference = _first(out).float()
        self.active = True
        try:
            for i in range(len(self.sse)):
                with _patched(self.quantized, self.scale(i)):
                    got = _first(module(*args, **kwargs)).float()
                self.sse[i] += float((got - reference).pow(2).sum())
        finally:
            self.active = False

    def best(self) -> torch.Tensor | None:
        """The scale of the lowest loss; ``None`` where no scale beats round-to-nearest."""
        best = int(torch.argmin(self.sse))
        logger.debug("AWQ: %s: losses %s", self.entry.name, self.sse.tolist())
        if not bool(self.sse.gt(0).any()) or best == 0:
            logger.info("AWQ: %s: no scale beats round-to-nearest", self.entry.name)
            return None
        return self.scale(best)


def _rows(weight: torch.Tensor) -> list[torch.Tensor]:
    return list(weight) if weight.dim() == 3 else [weight]


def _first(output: object) -> torch.Tensor:
    value = output[0] if isinstance(output, tuple) else output
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a MoE block returned {type(value).__name__}, expected a tensor")
    return value


@contextmanager
def _patched(quantized: list[tuple[nn.Module, TensorQuantizer]], s: torch.Tensor) -> Iterator[None]:
    """Every quantized reader's weight ``Q(W * s) / s`` for the duration (its stored layout)."""
    saved = []
    try:
        for module, quantizer in quantized:
            param = module.get_parameter(_weight_of(module) or "weight")
            columns = _columns(module)
            scale = s.to(columns.device, columns.dtype)
            candidate = fake_quant_fresh(quantizer, columns * scale) / scale
            if isinstance(module, QuantExperts) and module.transposed:
                candidate = candidate.transpose(-1, -2)
            saved.append((param, param.data))
            param.data = candidate.to(param.dtype)
        yield
    finally:
        for param, data in saved:
            param.data = data


@torch.no_grad()
def _fold(
    model: nn.Module, entry: MoEInput, norm_name: str, s: torch.Tensor, norms: NormTrace
) -> bool:
    """Fold ``s`` (norm / s, readers' columns * s), verified on the sample; else roll back."""
    pre = 1.0 / s
    if not can_fold_norm(model, norm_name, pre, norms):
        return False
    sample = entry.sample
    assert sample is not None
    block, norm = entry.block, norms.norms[norm_name]
    with _quantizers_off(block):
        want = _first(block(sample)).float()
        undo = [_scaled(norm, attr, pre) for attr, _ in list(norm.named_parameters(recurse=False))]
        undo += [_scaled(m, _weight_of(m) or "weight", s) for m in entry.readers.values()]
        got = _first(block(sample * pre.to(sample))).float()
    error = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if error <= _FOLD_RTOL:
        logger.info("AWQ: %s's input scale folded into %s", entry.name, norm_name)
        return True
    for module, attr, param in reversed(undo):
        setattr(module, attr, param)
    logger.info(
        "AWQ: %s: the block on its scaled input is %.3g off (relative); a reader of its input "
        "was not scaled; its experts' gate_up is round-to-nearest",
        entry.name,
        error,
    )
    return False


def _scaled(module: nn.Module, attr: str, s: torch.Tensor) -> tuple[nn.Module, str, nn.Parameter]:
    """``module.attr`` replaced by a new Parameter times ``s`` on its input channels (the
    last dim of the canonical view); returns what restores the original."""
    param = module.get_parameter(attr)
    value = param.detach().float()
    if isinstance(module, QuantExperts) and module.transposed:
        value = value * s.float()[:, None]  # stored [E, in, out]
    else:
        value = value * s.float()
    setattr(module, attr, nn.Parameter(value.to(param.dtype), requires_grad=param.requires_grad))
    return module, attr, param


@contextmanager
def _quantizers_off(block: nn.Module) -> Iterator[None]:
    on = [m for m in block.modules() if isinstance(m, TensorQuantizer) and m.enabled]
    for quantizer in on:
        quantizer.enabled = False
    try:
        yield
    finally:
        for quantizer in on:
            quantizer.enabled = True
