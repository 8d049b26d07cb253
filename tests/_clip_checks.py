"""What the AWQ clip tests share: a tiny model quantized on four seeded batches, and each
INT4 group's squared output error by brute force."""

from __future__ import annotations

import torch
from torch import nn

from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


def calibration_batches(vocab: int) -> list[torch.Tensor]:
    """Four seeded ``[2, 32]`` batches of token ids."""
    return [
        torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(i))
        for i in range(4)
    ]


def quantized_tiny(
    family: str, recipe: str, dtype: torch.dtype | None = None
) -> tuple[nn.Module, list[torch.Tensor]]:
    """``family``'s tiny model (seed 0, cast to ``dtype``) quantized with ``recipe`` on
    :func:`calibration_batches`, and those batches."""
    model = tiny_hf_model(family, seed=0).eval()
    if dtype is not None:
        model = model.to(dtype)
    batches = calibration_batches(model.config.vocab_size)

    def calibrate(m: nn.Module) -> None:
        for batch in batches:
            m(batch)

    quantize(model, recipe, calibrate=calibrate)
    return model, batches


def group_losses(delta: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """``sum_t (x_t,g . delta_r,g)^2`` per row ``r`` and group ``g`` of ``block`` columns,
    by brute force in float64: what a weight error ``delta`` adds to the output on ``x``."""
    rows, cols = delta.shape
    xs = x.double().reshape(-1, cols // block, block)  # [T, G, B]
    ds = delta.double().reshape(rows, cols // block, block)  # [R, G, B]
    return torch.einsum("tgb,rgb->trg", xs, ds).pow(2).sum(dim=0)
