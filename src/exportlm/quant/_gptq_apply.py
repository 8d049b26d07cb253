"""GPTQ inside :func:`~exportlm.quant.quantize`: the Hessians of the linears' inputs are
gathered during the calibration forwards, then each linear's weight is quantized by
:func:`~exportlm.quant._gptq.gptq_quantize`.

* :func:`mark_gptq` (at conversion) records a GPTQ recipe's options on each linear it
  quantizes; :func:`refuse_gptq` refuses what GPTQ cannot quantize (stacked experts,
  embeddings) before anything is converted.
* :func:`collect_hessians` hooks every marked linear: each calibration forward adds its
  input's ``X^T X`` (float64) and its token count. The hooks see the inputs the
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exportlm.errors import QuantizationError, UnsupportedFormatError
from exportlm.quant._distributed import data_parallel_world
from exportlm.quant._gptq import gptq_quantize, int4_group_scales
from exportlm.quant._modules import QuantLinear
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._tensor import INT4_MAX, QuantFormat, QuantizedTensor
from exportlm.quant.formats._int4 import pack_int4_rows

__all__ = [
    "GPTQWeightQuantizer",
    "HessianStat",
    "apply_gptq",
    "collect_hessians",
    "mark_gptq",
    "refuse_gptq",
]

logger = logging.getLogger(__name__)


#: compressed-tensors' symmetric INT4 scale divisor: ``(q_max - q_min) / 2`` of [-8, 7].
CT_INT4_DIVISOR = 7.5
#: The attribute of a converted linear holding its GPTQ options.
_MARK = "gptq_options"


@dataclass(frozen=True)
class _Options:
    actorder: str
    dampening: float


def refuse_gptq(name: str, kind: str, algo: Any) -> None:
    """Refuse a GPTQ recipe on a module that is not a linear (before any conversion)."""
    if algo is not None and getattr(algo, "gptq", False) and kind not in ("linear", "moe_linear"):
        raise UnsupportedFormatError(
            f"module {name!r}: recipe {algo.spelling!r} runs GPTQ, which quantizes linear "
            f"layers from their inputs' Hessian; a {kind} module has no such input. Exclude "
            f"it (exclude=[{name!r}]) or give it another recipe ({{{name!r}: 'int4_awq'}})."
        )


def mark_gptq(module: nn.Module, algo: Any) -> None:
    """Record ``algo``'s GPTQ options on a converted linear (nothing for other recipes)."""
    if isinstance(module, QuantLinear) and algo is not None and getattr(algo, "gptq", False):
        setattr(module, _MARK, _Options(algo.gptq_actorder, algo.gptq_dampening))


class HessianStat:
    """``sum X^T X`` (float64) of one linear's calibration inputs and their token count."""

    def __init__(self) -> None:
        self.gram: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Add one forward's input ``x`` (``[..., in]``)."""
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        if rows.shape[0] == 0:
            return
        g = rows.T @ rows
        self.gram = g if self.gram is None else self.gram.add_(g)
        self.tokens += int(rows.shape[0])

    def hessian(self) -> torch.Tensor | None:
        """``2 X^T X / n``, float64, or ``None`` when no token was seen."""
        if self.gram is None or self.tokens == 0:
            return None
        return self.gram * (2.0 / self.tokens)


def collect_hessians(
    model: nn.Module, handles: list[torch.utils.hooks.RemovableHandle]
) -> dict[str, tuple[QuantLinear, HessianStat]]:
    """Hook every linear marked by :func:`mark_gptq` (the hooks appended to ``handles``);
    returns ``{name: (linear, its statistics)}`` (empty without a GPTQ recipe)."""
    stats: dict[str, tuple[QuantLinear, HessianStat]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and getattr(module, _MARK, None):
            stat = HessianStat()
            stats[name] = (module, stat)
            handles.append(module.register_forward_pre_hook(_hook(stat)))
    return stats


def _hook(stat: HessianStat) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            stat.add(args[0])

    return hook


def _reduce(stats: list[HessianStat]) -> None:
    """Each statistic summed over the data-parallel ranks, in rank order (alone: nothing)."""
    world = data_parallel_world()
    if world is None:
        return
    import torch.distributed as dist

    counts: list[list[int] | None] = [None] * world[1]
    dist.all_gather_object(counts, [s.tokens for s in stats])
    for index, stat in enumerate(stats):
        size = int(stat.gram.shape[0]) if stat.gram is not None else 0
        sizes: list[int | None] = [None] * world[1]
        dist.all_gather_object(sizes, size)
        width = max(int(s or 0) for s in sizes)
        if width == 0:
            continue
        local = torch.zeros(width, width, dtype=torch.float64)
        if stat.gram is not None:
            local = stat.gram.cpu()
        parts = [torch.empty_like(local) for _ in range(world[1])]
        dist.all_gather(parts, local.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        device = stat.gram.device if stat.gram is not None else torch.device("cpu")
        stat.gram = total.to(device)
        stat.tokens = sum(int((c or [0] * len(stats))[index]) for c in counts)


def apply_gptq(stats: dict[str, tuple[QuantLinear, HessianStat]]) -> int:
    """GPTQ every collected linear (see the module docstring); returns how many were."""
    _reduce([stat for _, stat in stats.values()])
    done = 0
    with torch.no_grad():
        for name, (module, stat) in stats.items():
            hessian = stat.hessian()
            stat.gram = None  # the memory of one Hessian at a time
            if hessian is None:
                logger.warning(
                    "GPTQ: no calibration token reached %s; its weight is rounded to nearest",
                    name,
                )
                continue
            _quantize_linear(name, module, hessian)
            done += 1
    logger.info("GPTQ quantized %d of %d linear(s)", done, len(stats))
    return done


def _quantize_linear(name: str, module: QuantLinear, hessian: torch.Tensor) -> None:
    options: _Options = getattr(module, _MARK)
    quantizer = module.weight_quantizer
    block = quantizer.block_size
    if not block:  # pragma: no cover - a GPTQ recipe's format is a block format
        raise QuantizationError(f"{name}: GPTQ needs the INT4 group size")
    weight = module.weight
    ct = quantizer.scales == "compressed-tensors"
    scales = int4_group_scales(
        weight,
        block,
        name,
        divisor=CT_INT4_DIVISOR if ct else INT4_MAX,
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
    )
    # a new Parameter, never a write into the old one (quantize restores parameters by identity)
    module.weight = nn.Parameter(
        result.dequantized(weight.dtype), requires_grad=weight.requires_grad
    )
    quantizer.__class__ = GPTQWeightQuantizer
    quantizer.register_buffer("gptq_scale", result.scales)


class GPTQWeightQuantizer(TensorQuantizer):
    """An INT4 weight quantizer whose group scales are fixed (GPTQ's, in ``gptq_scale``).

    Codes are ``clamp(round(x / s), -8, 7)`` with those scales instead of scales from the
    tensor's group maxima, so the dequantized GPTQ weight gives back GPTQ's codes and
    scales exactly (its group maxima need not be ``7 s``: a group's largest code may be
    6 or -8 after the error updates).
    """

    gptq_scale: torch.Tensor

    def quantize(
        self, x: torch.Tensor, *, index: int | None = None, amax: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """``x`` (the ``[out, in]`` weight) quantized with the fixed group scales."""
        scale, block = self.gptq_scale, self.block_size or 0
        rows, cols = (int(n) for n in x.shape[-2:]) if x.dim() == 2 else (0, 0)
        if x.dim() != 2 or block == 0 or tuple(scale.shape) != (rows, cols // max(block, 1)):
            raise QuantizationError(
                f"{self.label or 'quantizer'}: GPTQ's group scales {tuple(scale.shape)} do not "
                f"fit a tensor of shape {tuple(x.shape)}; quantize the model again"
            )
        s = scale.to(x.device)  # kept in its dtype (bfloat16 under compressed-tensors')
        groups = x.detach().float().reshape(rows, cols // block, block) / s.float()[:, :, None]
        codes = groups.round_().clamp_(-8, 7).to(torch.int8).reshape(rows, cols)
        return QuantizedTensor(
            QuantFormat.INT4, pack_int4_rows(codes), s, None, block, (rows, cols), x.dtype
        )

    def _row_chunks(self, x: torch.Tensor) -> list[slice]:
        return [slice(None)]  # the scales are the whole weight's
