"""The static input amax of an AWQ recipe that also quantizes its inputs (``w4a8_awq``).

Calibration measures each input channel's ``max |x|`` before the AWQ search picks the
``pre_quant_scale`` the input is multiplied by (by the linear, or by the norm it was
folded into). The input the FP8 quantizer then sees is ``x * pre_quant_scale``, so its
amax is ``max_c(channel_amax_c * pre_quant_scale_c)``: what ModelOpt's ``awq_lite`` sets
(``apply_pre_quant_scale_and_smooth``: ``(_amax_for_smoothing * pre_quant_scale).amax()``).
:func:`keep_channel_amax` saves the per-channel statistics before the AWQ step forgets
them, :func:`set_smoothed_input_amax` sets the amax from them afterwards.

:func:`search_formats` runs the AWQ search on a two-stage weight format's first stage
(:attr:`~exportlm.quant.formats.FormatSpec.search_format`: W4A8 searches on INT4), as
ModelOpt's ``awq_lite`` runs inside ``SequentialQuantizer.convert_to_single_quantizer``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from exportlm.quant._modules import QuantModule, smoothing_of
from exportlm.quant._quantizer import TensorQuantizer

__all__ = ["keep_channel_amax", "search_formats", "set_smoothed_input_amax"]


def keep_channel_amax(model: nn.Module) -> dict[TensorQuantizer, torch.Tensor]:
    """``{input quantizer: channel_amax}`` of every enabled calibrated input quantizer
    that tracked per-channel statistics (the AWQ search's inputs)."""
    kept: dict[TensorQuantizer, torch.Tensor] = {}
    for module in model.modules():
        if not isinstance(module, QuantModule):
            continue
        for attr, quantizer in module.quantizers():
            if (
                "input_quantizer" in attr
                and quantizer.enabled
                and quantizer.spec.calibrated
                and quantizer.channel_amax is not None
            ):
                kept[quantizer] = quantizer.channel_amax.clone()
    return kept


def set_smoothed_input_amax(kept: dict[TensorQuantizer, torch.Tensor]) -> None:
    """Each kept quantizer's amax: its channel amax times the AWQ scale it applies (or the
    scale folded into the norm before it), the max over channels (and experts)."""
    with torch.no_grad():
        for quantizer, channel_amax in kept.items():
            if quantizer.awq_margin is None:
                continue  # not in the AWQ plan (SmoothQuant's inputs set their own amax)
            scale = smoothing_of(quantizer)
            amax = channel_amax.to(torch.float32)
            if scale is not None:
                amax = amax * scale.to(device=amax.device, dtype=torch.float32)
            quantizer.amax = amax.amax()


@contextmanager
def search_formats(model: nn.Module) -> Iterator[None]:
    """Every weight quantizer whose format names a ``search_format`` switched to it
    for the duration (restored afterwards, also on an exception)."""
    switched: list[tuple[TensorQuantizer, object]] = []
    for module in model.modules():
        if isinstance(module, QuantModule):
            for attr, quantizer in module.quantizers():
                target = quantizer.spec.search_format
                if "weight_quantizer" in attr and target is not None:
                    switched.append((quantizer, quantizer.format))
                    quantizer.format = target
    try:
        yield
    finally:
        for quantizer, fmt in switched:
            quantizer.format = fmt  # type: ignore[assignment]
