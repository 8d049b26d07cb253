"""Deterministic weight initialization that does not depend on torch's RNG.

Goldens (exported artifacts, quantized checkpoints, logits) are compared across
torch versions and devices, so the weights of every toy model come from numpy's
PCG64 bit generator, whose stream is specified and stable, and never from
``torch.manual_seed``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from exportlm.errors import InvalidConfigError

__all__ = ["seeded_init_"]


def _is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer whose 1-D weight is a gain around 1.

    ``nn.LayerNorm``/``nn.RMSNorm``/``nn.GroupNorm`` and Hugging Face's own
    ``LlamaRMSNorm``-style classes (which do not subclass torch's) all end in ``Norm``.
    """
    return type(module).__name__.endswith("Norm")


def _norm_param_names(module: nn.Module) -> set[str]:
    """Qualified names of the 1-D weights of every norm module in ``module``."""
    names: set[str] = set()
    for module_name, sub in module.named_modules():
        if not _is_norm(sub):
            continue
        for param_name, param in sub.named_parameters(recurse=False):
            if param.dim() == 1 and param_name == "weight":
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def seeded_init_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Fill every floating-point parameter of ``module`` in place, deterministically.

    One ``numpy.random.Generator(PCG64(seed))`` stream is consumed in
    ``module.named_parameters()`` order (a tied parameter is visited once, so it
    keeps one value). Values are drawn in float64, scaled, rounded to float32 by
    numpy and only then converted to the parameter's dtype and device, so the same
    seed gives the same bytes on every torch version and device:

    - weights of normalization layers (1-D ``weight`` of a module whose class name
      ends in ``Norm``): ``1 + N(0, std)``;
    - every other parameter, biases included: ``N(0, std)``.

    Integer parameters and buffers are left alone; so are derived float buffers
    such as rotary ``inv_freq``, which the model computes deterministically itself.

    Returns ``module`` so the call can be chained.
    """
    if seed < 0:
        raise InvalidConfigError(
            f"seed must be a non-negative integer (numpy's PCG64 takes 0 and up), got {seed}"
        )
    rng = np.random.Generator(np.random.PCG64(seed))
    norm_weights = _norm_param_names(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_floating_point():
                continue
            values = rng.standard_normal(tuple(param.shape)) * std
            if name in norm_weights:
                values = values + 1.0
            host = torch.from_numpy(values.astype(np.float32))
            # Cast on the CPU, then move: the rounding never depends on the device.
            param.copy_(host.to(dtype=param.dtype).to(device=param.device))
    return module
