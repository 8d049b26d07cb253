"""A recipe's scale convention on the quantizers of one converted module.

The ``scales`` recipe option (:mod:`exportlm.quant._options`): under
``"compressed-tensors"`` a format with a global scale (NVFP4) quantizes with it, and the
other calibrated scales are rounded to, and stored in, the dtype of the module's weight
when that is a half float, as compressed-tensors initializes a module's scales
(``initialize_qparams``: the scale's dtype is the observed weight's). A row / group
format whose compressed-tensors scheme has a ``scale_divisor`` (INT4, INT8, ``w8a8``,
``fp8_dynamic``) takes compressed-tensors' weight scales, ``amax / divisor`` in that
dtype, and the codes of the quotient in it (:func:`~exportlm.quant._formats.convention_scale`).
"""

from __future__ import annotations

import torch
from torch import nn

from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import Algorithm

__all__ = ["apply_convention"]


def apply_convention(module: nn.Module, algo: Algorithm | None) -> None:
    """Give the weight and input quantizers of ``module`` the scale convention of ``algo``.

    KV-cache quantizers keep ModelOpt's (the KV-cache recipe has no option), and so do
    inputs quantized at run time (per token or group: ``fp8_dynamic``'s, ``w8a8``'s), whose
    scales no checkpoint stores: an engine computes them in float32.
    """
    if algo is None or algo.scales == "modelopt":
        return
    dtype = next((p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), None)
    half = dtype in (torch.bfloat16, torch.float16)
    for name, quantizer in module.named_modules():
        if not isinstance(quantizer, TensorQuantizer) or quantizer.kv_role:
            continue
        if name.endswith("input_quantizer") and not quantizer.spec.calibrated:
            continue  # quantized at run time
        quantizer.scales = algo.scales
        quantizer.scale_dtype = dtype if half else None
