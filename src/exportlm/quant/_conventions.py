"""A recipe's scale convention on the quantizers of one converted module.

The ``scales`` recipe option (:mod:`exportlm.quant._options`): under
``"compressed-tensors"`` a format with a global scale (NVFP4) quantizes with it, and the
other calibrated scales are rounded to, and stored in, the dtype of the module's weight
when that is a half float, as compressed-tensors initializes a module's scales
(``initialize_qparams``: the scale's dtype is the observed weight's).
"""

from __future__ import annotations

import torch
from torch import nn

from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import Algorithm

__all__ = ["apply_convention"]


def apply_convention(module: nn.Module, algo: Algorithm | None) -> None:
    """Give the weight and input quantizers of ``module`` the scale convention of ``algo``.

    KV-cache quantizers keep ModelOpt's (the KV-cache recipe has no option).
    """
    if algo is None or algo.scales == "modelopt":
        return
    dtype = next((p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), None)
    half = dtype in (torch.bfloat16, torch.float16)
    for quantizer in module.modules():
        if isinstance(quantizer, TensorQuantizer) and not quantizer.kv_role:
            quantizer.scales = algo.scales
            quantizer.scale_dtype = dtype if half else None
