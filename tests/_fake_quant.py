"""What the format tests share: fixed token ids, a model's logits, its quantized linears."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exportlm.quant import QuantLinear

#: Two rows of 12 token ids below 256 (every toy family's vocabulary), seeded.
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    """``model(ids)``'s logits without autograd (a transformers output or a bare tensor)."""
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    """Every :class:`~exportlm.quant.QuantLinear` of ``model`` by its qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
