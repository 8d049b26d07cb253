"""Calibration: max calibration of activations and shared amax.

The steps :func:`~exportlm.quant.quantize` runs once the modules are converted:
:func:`run_calibration` (one pass of the user's forwards, every quantizer transparent),
the AWQ search (:mod:`exportlm.quant._awq`), :func:`unify_groups` (fused linears share amax as the format's
spec says), :func:`check_calibrated` and :func:`check_finite`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from exportlm.errors import QuantizationError
from exportlm.inputs import infer_vocab_size, make_input_ids
from exportlm.quant._distributed import (
    reduce_channel_statistics,
    reduce_groups,
    reduce_max_statistics,
)
from exportlm.quant._heap import released_per_block
from exportlm.quant._modules import QuantLinear, QuantModule, QuantMoELinear
from exportlm.quant._quantizer import TensorQuantizer

__all__ = [
    "check_calibrated",
    "check_finite",
    "default_calibrate",
    "run_calibration",
    "run_transparent_forwards",
    "unify_expert_input_amax",
    "unify_groups",
]

logger = logging.getLogger(__name__)


def default_calibrate(model: nn.Module) -> None:
    """One forward on deterministic ``input_ids`` (the calibration when none is given)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model(make_input_ids(infer_vocab_size(model), device=device))


def run_transparent_forwards(
    model: nn.Module,
    calibrate: Callable[[nn.Module], object] | None,
    handles: list[torch.utils.hooks.RemovableHandle],
    *,
    keep: Collection[TensorQuantizer] = (),
) -> None:
    """Run the calibration forwards with every enabled quantizer but ``keep`` switched off.

    The forwards (``calibrate``, else :func:`default_calibrate`) run without autograd,
    and the heap pages their temporaries freed go back to the system after each decoder
    layer (:mod:`exportlm.quant._heap`: without it the RSS of SmolLM2-135M's SmoothQuant
    calibration grew to 2.5 GB beside 0.29 GB of live tensors). Afterwards, even on an
    exception, the quantizers are re-enabled and the hook ``handles`` (which observe the
    forwards) removed.
    """
    kept = {id(q) for q in keep}
    paused = [
        m
        for m in model.modules()
        if isinstance(m, TensorQuantizer) and m.enabled and id(m) not in kept
    ]
    for quantizer in paused:
        quantizer.enabled = False
    try:
        with torch.no_grad(), released_per_block(model):
            (calibrate or default_calibrate)(model)
    finally:
        for quantizer in paused:
            quantizer.enabled = True
        for handle in handles:
            handle.remove()


def _activation_quantizers(model: nn.Module) -> Iterator[TensorQuantizer]:
    for module in model.modules():
        if isinstance(module, QuantModule):
            for attr, quantizer in module.quantizers():
                if "weight_quantizer" not in attr and (
                    quantizer.enabled or quantizer.track_channels
                ):
                    yield quantizer


def run_calibration(
    model: nn.Module, calibrate: Callable[[nn.Module], object] | None
) -> list[list[QuantLinear]]:
    """Run calibration; returns groups of linears that read the same input in one parent."""
    quantizers = list(_activation_quantizers(model))
    readers = _SharedInputs()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            handles.append(module.register_forward_pre_hook(_group_hook(readers, parent)))
    # As ModelOpt's max calibration: every quantizer is transparent while the
    # statistics are collected, so activations downstream are full precision
    # (weight fake-quant during calibration would shift every later amax).
    for quantizer in quantizers:
        quantizer.calibrating = True
    try:
        run_transparent_forwards(model, calibrate, handles, keep=quantizers)
    finally:
        for quantizer in quantizers:
            quantizer.calibrating = False
    # Data-parallel calibration: each rank saw its share of the batches (a no-op alone).
    device = next((p.device for p in model.parameters()), None)
    reduce_max_statistics(quantizers, device)
    reduce_channel_statistics(quantizers, device)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return reduce_groups(linears, readers.groups())


class _SharedInputs:
    """Which linears of one parent read the very same input tensor (one fused GEMM).

    A tensor is recognized by its identity while it is alive: each entry holds a weak
    reference, so an ``id`` reused by a later tensor (once the first is freed) starts a
    new entry instead of joining the old one. No input is kept alive: the memory of a
    calibration does not grow with the number of batches (keeping every linear's input
    of every batch cost about 100 MB per 512-token row on a 135M model).
    """

    def __init__(self) -> None:
        self._live: dict[tuple[str, int], tuple[weakref.ref[torch.Tensor], list[QuantLinear]]] = {}
        self._readers: list[list[QuantLinear]] = []  # one list per input tensor seen

    def add(self, parent: str, tensor: torch.Tensor, module: QuantLinear) -> None:
        """Record that ``module`` (a child of ``parent``) reads ``tensor``."""
        key = (parent, id(tensor))
        entry = self._live.get(key)
        if entry is None or entry[0]() is not tensor:
            entry = (weakref.ref(tensor), [])
            self._live[key] = entry
            self._readers.append(entry[1])
        if module not in entry[1]:
            entry[1].append(module)

    def groups(self) -> list[list[QuantLinear]]:
        """The groups of two or more linears that read one input, each group once."""
        groups: dict[tuple[int, ...], list[QuantLinear]] = {}
        for members in self._readers:
            if len(members) > 1:
                groups.setdefault(tuple(sorted(map(id, members))), members)
        return list(groups.values())


def _group_hook(
    readers: _SharedInputs, parent: str
) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and isinstance(module, QuantLinear):
            readers.add(parent, args[0], module)

    return hook


def unify_groups(model: nn.Module, groups: list[list[QuantLinear]]) -> None:
    """Give linears that read one input (one fused GEMM) a shared amax, as their format says.

    Inputs of a calibrated format share one input amax; weights share one per-tensor
    amax only when the spec sets ``share_fused_weight_amax``. Groups that mix
    algorithms are left alone.
    """
    for group in groups:
        algos = {m.quant_algo for m in group}
        if len(algos) != 1 or None in algos:
            logger.debug("not fusing %d linears with algorithms %s", len(group), algos)
            continue
        for attr in ("input_quantizer", "weight_quantizer"):
            quantizers = [getattr(m, attr) for m in group]
            if not all(q.enabled and q.amax is not None and q.amax.dim() == 0 for q in quantizers):
                continue
            # Inputs are shared for every calibrated format (FP8, NVFP4); the per-tensor
            # weight amax only where the spec says so (NVFP4: one weight_scale_2 per fused
            # GEMM). FP8 keeps one weight_scale per layer, as ModelOpt 0.47 writes it
            # (tests/test_interop.py compares the bytes).
            spec = quantizers[0].spec
            if attr == "weight_quantizer" and not spec.share_fused_weight_amax:
                continue
            if not spec.calibrated:
                continue
            shared = torch.stack([q.amax for q in quantizers]).amax()
            for quantizer in quantizers:
                quantizer.amax = shared.clone()


def unify_expert_input_amax(experts: nn.ModuleList) -> dict[TensorQuantizer, torch.Tensor]:
    """The shared input amax of each projection across the experts of one block.

    Returns ``{input_quantizer: block max amax}`` for every enabled input quantizer
    of a :class:`QuantMoELinear` in ``experts`` (an expert that calibration never
    routed a token to gets the block's amax). Nothing is modified.
    """
    by_projection: dict[str, list[TensorQuantizer]] = {}
    for expert in experts:
        for name, module in expert.named_modules():
            if isinstance(module, QuantMoELinear) and module.input_quantizer.enabled:
                by_projection.setdefault(name, []).append(module.input_quantizer)
    result: dict[TensorQuantizer, torch.Tensor] = {}
    for quantizers in by_projection.values():
        amaxes = [q.amax for q in quantizers if q.amax is not None]
        if not amaxes:
            continue
        shared = torch.stack(amaxes).amax()
        for quantizer in quantizers:
            result[quantizer] = shared
    return result


def check_calibrated(model: nn.Module) -> None:
    """Raise :class:`QuantizationError` naming the activation quantizers calibration missed."""
    missing = [
        q.label
        for q in _activation_quantizers(model)
        if q.enabled and q.spec.calibrated and q.amax is None
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise QuantizationError(
            f"calibration never reached {len(missing)} activation quantizer(s): {shown}. Pass a "
            "calibrate(model) function whose forwards run every quantized module, or exclude "
            "those modules."
        )


def check_finite(model: nn.Module) -> None:
    """Raise :class:`QuantizationError` naming the quantizers with a NaN or infinite statistic.

    A weight with a NaN or an infinity, or a calibration forward that produced
    one, gives an amax (or AWQ ``pre_quant_scale``) no scale can be derived from:
    refused here, before ``quantize`` returns a model whose forward would raise.
    """
    bad = [
        f"{m.label or 'quantizer'}.{attr}"
        for m in model.modules()
        if isinstance(m, TensorQuantizer) and (m.enabled or m.pre_quant_scale is not None)
        for attr in ("amax", "pre_quant_scale")
        if (value := getattr(m, attr)) is not None and not bool(torch.isfinite(value).all())
    ]
    if bad:
        raise QuantizationError(
            f"{len(bad)} quantizer statistic(s) are NaN or infinite: {_shown(bad)}. The "
            "weights of those modules or the activations of the calibration forwards hold "
            "NaN/inf values; fix the model or the calibration data, or exclude those modules."
        )


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more
