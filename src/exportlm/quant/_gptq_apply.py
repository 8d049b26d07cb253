"""GPTQ inside :func:`~exportlm.quant.quantize`: the Hessians of the linears' inputs are
gathered during the calibration forwards, then each linear's weight is quantized by
:func:`~exportlm.quant._gptq.gptq_quantize`.

* :func:`mark_gptq` (at conversion) records a GPTQ recipe's options on each linear it
  quantizes (:func:`exportlm.quant._refusals.refuse_gptq` has refused what GPTQ cannot
  quantize, stacked experts and embeddings, before anything is converted).
* :func:`collect_hessians` hooks every marked linear: each calibration forward adds its
  input's ``X^T X`` (float64) and its token count, once per input tensor however many
  linears read it (:mod:`exportlm.quant._gptq_hessian`). The hooks see the inputs the
  calibration pass sees (every quantizer transparent), so in memory GPTQ runs on the
  float model's activations; the streamed export calibrates each decoder layer on the
  outputs of the layers already quantized (llm-compressor's sequential pipeline).
* :func:`apply_gptq` sums the statistics over data-parallel ranks (in rank order, so
  every rank quantizes from the same float64 Hessian), runs GPTQ, stores the dequantized
  result as the linear's weight and fixes the weight quantizer's group scales
  (:class:`GPTQWeightQuantizer`), so fake quantization, every module exporter and both
  checkpoint layouts give exactly GPTQ's codes and scales. A linear no calibration token
  reached keeps round-to-nearest (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exportlm.errors import QuantizationError
from exportlm.quant._gptq import gptq_quantize, int4_group_scales
from exportlm.quant._gptq_hessian import Hessians, reduce_hessians
from exportlm.quant._gptq_hessian import collect_hessians as _collect
from exportlm.quant._modules import QuantLinear
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._tensor import INT4_MAX, INT8_MAX, QuantFormat, QuantizedTensor
from exportlm.quant.formats._int4 import pack_int4_rows

__all__ = [
    "GPTQWeightQuantizer",
    "apply_gptq",
    "collect_hessians",
    "mark_gptq",
]

logger = logging.getLogger(__name__)


#: The scale divisors ``[int8][compressed-tensors]``: ``amax / 7`` for INT4 under both
#: conventions (compressed-tensors' own ``(q_max - q_min) / 2 = 7.5`` leaves no room above
#: a group's largest positive weight, which GPTQ's error updates push past it: on
#: SmolLM2-135M, 8 x 512 calibration tokens, it cost 5% perplexity, 29.39 against 28.07,
#: while round-to-nearest alone gains from it; docs/quality.md); INT8 ``amax / 127``
#: (int8_wo's) and compressed-tensors' ``amax / 127.5``.
_DIVISORS = ((INT4_MAX, INT4_MAX), (INT8_MAX, 127.5))
#: The attribute of a converted linear holding its GPTQ options.
_MARK = "gptq_options"


@dataclass(frozen=True)
class _Options:
    actorder: str
    dampening: float


def mark_gptq(module: nn.Module, algo: Any) -> None:
    """Record ``algo``'s GPTQ options on a converted linear (nothing for other recipes)."""
    if isinstance(module, QuantLinear) and algo is not None and getattr(algo, "gptq", False):
        setattr(module, _MARK, _Options(algo.gptq_actorder, algo.gptq_dampening))


def collect_hessians(
    model: nn.Module, handles: list[torch.utils.hooks.RemovableHandle]
) -> Hessians:
    """Hook every linear marked by :func:`mark_gptq` (the hooks appended to ``handles``):
    one statistic per input (:mod:`exportlm.quant._gptq_hessian`); empty without GPTQ."""
    return _collect(model, handles, _MARK)


def apply_gptq(hessians: Hessians) -> int:
    """GPTQ every collected linear (see the module docstring); returns how many were.

    One input's Hessian is computed once and serves each linear that reads it, then freed.
    """
    hessians.check()
    reduce_hessians(hessians)
    done = 0
    with torch.no_grad():
        for stat in hessians.stats:
            hessian = stat.hessian()
            stat.gram = None  # the memory of one Hessian at a time
            if hessian is not None:  # GPTQ factorizes in float32: the same values, half held
                hessian = hessian.to(torch.float32)
            if hessian is not None:
                for name in stat.readers:
                    _quantize_linear(name, hessians.linears[name], hessian)
                    done += 1
    for name in hessians.linears:
        seen = hessians.stat_of.get(name)
        if seen is None or seen.tokens == 0:
            logger.warning(
                "GPTQ: no calibration token reached %s; its weight is rounded to nearest", name
            )
    logger.info(
        "GPTQ quantized %d of %d linear(s) from %d input Hessian(s)",
        done,
        len(hessians.linears),
        len(hessians.stats),
    )
    return done


def _quantize_linear(name: str, module: QuantLinear, hessian: torch.Tensor) -> None:
    options: _Options = getattr(module, _MARK)
    quantizer = module.weight_quantizer
    weight = module.weight
    int8 = quantizer.format == QuantFormat.INT8
    block = int(weight.shape[1]) if int8 else quantizer.block_size
    if not block:  # pragma: no cover - a GPTQ recipe's format is INT4 groups or INT8 rows
        raise QuantizationError(f"{name}: GPTQ needs the INT4 group size")
    ct = quantizer.scales == "compressed-tensors"
    scales = int4_group_scales(
        weight,
        block,
        name,
        divisor=_DIVISORS[int8][ct],
        dtype=quantizer.scale_dtype if ct else None,
    )
    result = gptq_quantize(
        weight,
        hessian.to(weight.device),
        group_size=block,
        actorder=options.actorder,
        dampening=options.dampening,
        scales=scales,
        where=name,
        bits=8 if int8 else 4,
    )
    # a new Parameter, never a write into the old one (quantize restores parameters by identity)
    module.weight = nn.Parameter(
        result.dequantized(weight.dtype), requires_grad=weight.requires_grad
    )
    quantizer.__class__ = GPTQWeightQuantizer
    quantizer.register_buffer("gptq_scale", result.scales)


class GPTQWeightQuantizer(TensorQuantizer):
    """An INT4 / INT8 weight quantizer whose group (INT8: row) scales are fixed (GPTQ's,
    in ``gptq_scale``).

    Codes are ``clamp(round(x / s), -8, 7)`` (INT8: ``-128, 127``) with those scales
    instead of scales from the tensor's group maxima, so the dequantized GPTQ weight gives
    back GPTQ's codes and scales exactly (its group maxima need not be ``7 s``: a group's
    largest code may be 6 or -8 after the error updates).
    """

    gptq_scale: torch.Tensor

    def quantize(
        self, x: torch.Tensor, *, index: int | None = None, amax: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """``x`` (the ``[out, in]`` weight) quantized with the fixed group scales."""
        int8 = self.format == QuantFormat.INT8
        rows, cols = (int(n) for n in x.shape[-2:]) if x.dim() == 2 else (0, 0)
        scale, block = self.gptq_scale, (cols if int8 else self.block_size or 0)
        if x.dim() != 2 or block == 0 or tuple(scale.shape) != (rows, cols // max(block, 1)):
            raise QuantizationError(
                f"{self.label or 'quantizer'}: GPTQ's group scales {tuple(scale.shape)} do not "
                f"fit a tensor of shape {tuple(x.shape)}; quantize the model again"
            )
        s = scale.to(x.device)  # kept in its dtype (bfloat16 under compressed-tensors')
        groups = x.detach().float().reshape(rows, cols // block, block) / s.float()[:, :, None]
        low, high = (-128, 127) if int8 else (-8, 7)
        codes = groups.round_().clamp_(low, high).to(torch.int8).reshape(rows, cols)
        if int8:  # int8_wo's tensor: the codes as they are, one scale per row
            return QuantizedTensor(
                QuantFormat.INT8, codes, s[:, 0], shape=(rows, cols), dtype=x.dtype
            )
        return QuantizedTensor(
            QuantFormat.INT4, pack_int4_rows(codes), s, None, block, (rows, cols), x.dtype
        )

    def _row_chunks(self, x: torch.Tensor) -> list[slice]:
        return [slice(None)]  # the scales are the whole weight's
