"""A peft-like LoRA wrapper for QLoRA export tests (shared by several test modules)."""

from __future__ import annotations

import torch
from torch import nn


class LoraLinear(nn.Module):
    """A peft-like LoRA wrapper: ``base_layer`` plus ``lora_A`` / ``lora_B`` adapters."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, base.out_features, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))
        return out
