"""``synthetic_calibration``: calibration statistics that are the same bytes on every machine.

Max calibration runs a forward pass, and the last bit of an activation's amax
depends on the CPU's vector kernels, the thread count and the device. That is
fine for a real model, but it makes any exact comparison of an exported scale
machine-bound. ``synthetic_calibration(seed)`` is a ``calibrate`` function for
:func:`~exportlm.quant.quantize` whose statistics come from numpy's PCG64
stream instead of from data: the forward pass still runs (it discovers which
linears read the same input, so fused-QKV / gate-up groups share their scales
exactly as after a real calibration), and then every statistic it collected is
replaced. AWQ scales are not searched (a search scores real outputs): they use the
fixed ``AWQ_ALPHA`` on the drawn statistics, and are folded into the norms exactly as
after a real calibration. Everything downstream (AWQ pre-quant scales, weight amax,
exported weights and scales) is elementwise IEEE arithmetic and maxima on
those values and on the seeded weights, so the quantized model, and every byte
an exporter writes for it, is a pure function of the seeds.

Use it for goldens and tests, never to ship a model: the scales have nothing to
do with the model's real activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from exportlm.quant._calibrate import default_calibrate as _default_calibrate
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._modules import QuantLinear, QuantModule
from exportlm.quant._quantizer import TensorQuantizer

__all__ = ["AMAX_RANGE", "CHANNEL_AMAX_RANGE", "synthetic_calibration"]

#: Per-tensor activation amax values are drawn uniformly from this range.
AMAX_RANGE = (0.5, 8.0)
#: Per-channel activation amax values (AWQ statistics) are drawn from this range.
CHANNEL_AMAX_RANGE = (0.05, 4.0)


def synthetic_calibration(
    seed: int = 0, *, run_forward: Callable[[nn.Module], object] | None = None
) -> Callable[[nn.Module], None]:
    """A ``calibrate(model)`` for :func:`~exportlm.quant.quantize` with machine-independent statistics.

    Args:
        seed: seed of the PCG64 stream the statistics are drawn from.
        run_forward: the forward that reaches every quantized module (default:
            one forward on deterministic ``input_ids``, as ``quantize`` does by
            default). Its activations are discarded; it only exercises the
            model so that quantize can see which linears share an input.

    Every activation quantizer that is calibrating gets a per-tensor amax drawn
    uniformly from :data:`AMAX_RANGE`, and every AWQ channel statistic a vector
    drawn from :data:`CHANNEL_AMAX_RANGE`, in ``model.named_modules()`` order,
    whether or not the forward reached it (so MoE routing cannot change the
    result). Values are made with numpy's PCG64 ``random()`` (53 random bits,
    one multiply and one add in float64, then one rounding to float32): the same
    bits on every platform.
    """

    def calibrate(model: nn.Module) -> None:
        forward = run_forward or _default_calibrate
        forward(model)
        rng = np.random.Generator(np.random.PCG64(seed))
        # Drawn onto the model's device even for a quantizer the forward did not reach
        # (no amax yet), so every statistic lives beside the weights (CUDA included).
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for quantizer, in_features in _calibrating(model):
            if quantizer.enabled:
                quantizer.amax = _draw(rng, (), AMAX_RANGE, quantizer, device)
            if quantizer.track_channels:
                quantizer.reset_channels()  # no mean(|x|) from data: AWQ is not searched
                quantizer.channel_amax = _draw(
                    rng, (in_features,), CHANNEL_AMAX_RANGE, quantizer, device
                )

    return calibrate


def _draw(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    bounds: tuple[float, float],
    like: TensorQuantizer,
    device: torch.device,
) -> torch.Tensor:
    low, high = bounds
    values = np.asarray(low + (high - low) * rng.random(shape), dtype=np.float32)
    return torch.from_numpy(values).to(like.amax.device if like.amax is not None else device)


def _calibrating(model: nn.Module) -> Iterator[tuple[TensorQuantizer, int]]:
    """``(quantizer, input features)`` of every calibrating activation quantizer, in module order."""
    for module in model.modules():
        if not isinstance(module, QuantModule):
            continue
        for attr, quantizer in module.quantizers():
            if quantizer.calibrating:
                yield quantizer, _input_features(module, attr)


def _input_features(module: QuantModule, attr: str) -> int:
    """The width of the tensor the quantizer ``attr`` of ``module`` sees."""
    if isinstance(module, QuantExperts):
        projection = attr.removesuffix("_input_quantizer").removesuffix("_output_quantizer")
        if projection in module.PROJECTIONS:
            return int(module.canonical_weight(projection).shape[-1])
    if isinstance(module, QuantLinear):
        return int(module.out_features if attr == "output_quantizer" else module.in_features)
    weight = getattr(module, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) else 1
