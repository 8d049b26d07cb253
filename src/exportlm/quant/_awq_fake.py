"""The fake quantization of a weight candidate in the AWQ search, without packing it.

The search scores every candidate scale by the output of ``Q(W * s)``, the weight as a
loader dequantizes it. The generic way, ``dequantize(quantize(...))``, packs the INT4
codes into bytes and unpacks them again for every candidate of every forward: profiled
on SmolLM2-135M (8 x 256 calibration tokens), packing, unpacking and the dtype
conversions around them took 80 % of the search. :func:`fake_quant_fresh` computes the
same values directly for INT4 (the codes as float32 integers times their group scale:
exactly what ``dequantize_int4`` multiplies, so the result is bit-identical) and falls
back to the generic path for every other format and shape.
"""

from __future__ import annotations

import torch

from exportlm.quant._formats import convention_scale, dequantize
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._tensor import INT4_MAX, QuantFormat, safe_scale, scaled_quotient, split_blocks

__all__ = ["fake_quant_fresh"]


def fake_quant_fresh(
    quantizer: TensorQuantizer, weight: torch.Tensor, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight`` fake-quantized by ``quantizer``'s format; a calibrated format's per-tensor
    amax is ``amax`` when given, else taken from ``weight``."""
    fast = _int4_fake_quant(quantizer, weight)
    if fast is not None:
        return fast
    if quantizer.spec.calibrated and amax is None:
        amax = weight.detach().abs().float().amax()
    elif not quantizer.spec.calibrated:
        amax = None
    return dequantize(quantizer.quantize(weight, amax=amax), weight.dtype)


def _int4_fake_quant(quantizer: TensorQuantizer, weight: torch.Tensor) -> torch.Tensor | None:
    """``dequantize(quantize_int4(weight))`` in ``weight``'s dtype, or ``None`` where the
    generic path must run (another format, or a shape it refuses with its own message)."""
    block = quantizer.block_size
    if (
        quantizer.format != QuantFormat.INT4
        or not block
        or weight.dim() < 2
        or weight.shape[-2] % 2
        or weight.shape[-1] % block
    ):
        return None
    where = quantizer.label or "quantizer"
    groups = split_blocks(weight, block, "int4", where)  # float32 [..., in / block, block]
    given = None  # compressed-tensors' group scales under its convention, in their dtype
    if quantizer.scales != "modelopt":
        given = convention_scale(weight, quantizer.spec, block, quantizer.scale_dtype, where)
    if given is None:
        given = safe_scale(groups.abs().amax(dim=-1), INT4_MAX, where=where)
    scale = given.unsqueeze(-1)
    # the codes of quantize_int4 (round, clamp to [-8, 7]) kept as float32 integers: the
    # int8 round trip of pack / unpack is exact for them, so the product is the same
    values = scaled_quotient(groups, scale).round_().clamp_(-8, 7).mul_(scale.float())
    return values.reshape(weight.shape).to(weight.dtype)
