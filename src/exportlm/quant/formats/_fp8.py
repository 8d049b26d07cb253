"""FP8 (E4M3) per-tensor: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` fp32 0-d.

``weight = w / weight_scale`` with ``weight_scale = amax / 448`` (ModelOpt's
``FP8_DEFAULT_CFG``: weights and inputs, ``input_scale = activation amax / 448``);
also the format of the FP8 KV cache (``k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import FP8_MAX, QuantFormat, QuantizedTensor
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    KVCacheScheme,
    Leaf,
    ModelOptScheme,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["FP8"]

#: Elements per step of the chunked CPU FP8 cast: a 1 MiB float32 scratch that stays in cache.
_FP8_CHUNK = 1 << 18

_MODELOPT_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
_COMPRESSED_TENSORS_ARGS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "symmetric": True,
    "dynamic": False,
}


def quantize_fp8(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """``(x / scale)`` cast to float8_e4m3fn (saturating at 448); ``block_size`` is unused.

    In float32, except with a bfloat16 / float16 ``scale`` (the ``compressed-tensors``
    scale convention of a half-precision model): then ``x / scale`` in the promoted dtype
    of the two, clamped and cast, as compressed-tensors quantizes (and transformers runs
    its checkpoints), a rounding to the half float before the one to float8.
    """
    if scale is None:
        raise ValueError(f"{where}: fp8 quantization needs the per-tensor scale")
    x = x.detach()
    if scale.dtype in (torch.bfloat16, torch.float16):
        scaled = x / scale.to(x.device)
        data = torch.clamp(scaled, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedTensor(QuantFormat.FP8, data, scale, shape=tuple(x.shape), dtype=x.dtype)
    if (
        x.device.type == "cpu"
        and scale.numel() == 1
        and x.is_contiguous()
        and x.numel() > _FP8_CHUNK
    ):
        data = _fp8_codes_chunked(x, scale)
    else:
        # The scale on x's device: CUDA divides by a CPU scalar through its reciprocal.
        data = (x.to(torch.float32) / scale.to(x.device)).to(torch.float8_e4m3fn)
    return QuantizedTensor(QuantFormat.FP8, data, scale, shape=tuple(x.shape), dtype=x.dtype)


def _fp8_codes_chunked(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x.float() / scale).to(float8_e4m3fn)`` through one small reused float32 scratch.

    The same elementwise float32 division and cast, so the same bytes; but no
    full-size float32 temporaries, whose fresh pages (zeroed by the kernel on
    first touch) cost more than the arithmetic on a large weight.
    """
    flat = x.reshape(-1)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    codes = data.view(-1)
    scratch = torch.empty(_FP8_CHUNK, dtype=torch.float32)
    for start in range(0, flat.numel(), _FP8_CHUNK):
        chunk = flat[start : start + _FP8_CHUNK]
        buf = scratch[: chunk.numel()]
        if chunk.dtype == torch.float32:
            torch.div(chunk, scale, out=buf)
        else:  # widen first: a float32 0-d scale would not promote a bf16 chunk
            buf.copy_(chunk).div_(scale)
        codes[start : start + chunk.numel()].copy_(buf)
    return data


def dequantize_fp8(q: QuantizedTensor) -> torch.Tensor:
    """``codes * scale`` in float32."""
    return q.data.to(torch.float32).mul_(q.scale)  # in place: one float32 copy, not two


FP8 = FormatSpec(
    format=QuantFormat.FP8,
    quantize=quantize_fp8,
    dequantize=dequantize_fp8,
    maxbound=FP8_MAX,
    amax_divisor=FP8_MAX,
    granularity="tensor",
    leaves=(
        Leaf("weight", torch.float8_e4m3fn, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
        Leaf("input_scale", torch.float32, role="activation"),
        Leaf("k_scale", torch.float32, role="kv_cache"),
        Leaf("v_scale", torch.float32, role="kv_cache"),
    ),
    calibrated=True,
    activations=QuantFormat.FP8,
    modelopt=ModelOptScheme("FP8", weights=_MODELOPT_ARGS, input_activations=_MODELOPT_ARGS),
    compressed_tensors=CompressedTensorsScheme(
        "float-quantized",
        weights=_COMPRESSED_TENSORS_ARGS,
        input_activations=_COMPRESSED_TENSORS_ARGS,
    ),
    kv_cache=KVCacheScheme(
        "fp8_kv", "FP8", modelopt=_MODELOPT_ARGS, compressed_tensors=_COMPRESSED_TENSORS_ARGS
    ),
    share_expert_gate_up_amax=True,
)
