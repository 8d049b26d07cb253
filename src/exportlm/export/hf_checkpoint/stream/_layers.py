"""One decoder layer at a time: the inputs of the first layer, and calibrating a layer on its inputs.

The calibration batch runs through the modules before the layers (the embedding and the
rotary table) once: a hook on layer 0 records what the model hands it (the hidden states
and the keyword arguments: position embeddings, mask, positions) and stops the forward.
Each layer is then quantized with :func:`exportlm.quant.quantize` on a calibrate function
that runs that layer alone on those inputs, and its outputs become the next layer's inputs:

* ``"quantized"`` (default, llm-compressor's sequential pipeline): the outputs of the
  layer *after* it was fake-quantized, so each layer is calibrated on what the quantized
  model feeds it;
* ``"float"``: the outputs of the unquantized layer, which is what whole-model
  calibration sees (every quantizer is transparent while the model calibrates), so the
  checkpoint is the in-memory export's, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "CalibrationInputs",
    "LayerInputs",
    "capture_layer_inputs",
    "quantize_layer",
    "run_layer",
]

CalibrationInputs = Literal["quantized", "float"]


@dataclass
class LayerInputs:
    """What the model hands its decoder layers, per calibration batch.

    ``hidden``: layer 0's hidden states. ``kwargs[i]``: the keyword arguments of layer
    ``i`` (position embeddings, mask, positions). They are computed before the layers
    run and do not depend on the hidden states, but they differ between layers where
    the attention does (GPT-OSS alternates sliding-window and full attention, and the
    model passes each layer the mask of its own kind).
    """

    hidden: list[torch.Tensor]
    kwargs: list[list[dict[str, Any]]]


class _Reached(Exception):
    """Raised by the hook on the last layer once every layer's inputs are recorded."""


def capture_layer_inputs(
    model: nn.Module, layers: Sequence[nn.Module], batches: Sequence[torch.Tensor]
) -> LayerInputs:
    """Run ``batches`` through ``model`` to its last layer, recording what each layer is given.

    The layers do not run (their weights are not loaded): each one hands its input
    hidden states on unchanged, so only the modules before the layers need real weights.
    """
    found = LayerInputs([], [[] for _ in layers])
    last = len(layers) - 1

    def recorder(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            rest = {k: _without_cache(v) for k, v in kwargs.items() if k != "hidden_states"}
            if index == 0:
                hidden = args[0] if args else kwargs["hidden_states"]
                found.hidden.append(hidden.detach())
            found.kwargs[index].append(rest)
            if index == last:
                raise _Reached

        return hook

    def pass_through(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]

    handles = [
        layer.register_forward_pre_hook(recorder(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    for layer in layers[:-1]:
        layer.forward = pass_through  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(batch)
                except _Reached:
                    continue
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers[:-1]:
            del layer.forward
    return found


def _without_cache(value: Any) -> Any:
    """``None`` for a KV cache object: layers run alone, with nothing cached."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return value
    return None if isinstance(value, Cache) else value


def run_layer(
    layer: nn.Module, hidden: Sequence[torch.Tensor], kwargs: Sequence[dict[str, Any]]
) -> list[torch.Tensor]:
    """``layer``'s output hidden states for every batch (no gradients), its half-precision
    matmuls as :func:`~exportlm.quant.quantize`'s calibration runs them (float32 on a CPU
    without a half-precision GEMM): in memory the next layer's calibration inputs come
    from that calibration's forward."""
    from exportlm.quant._gemm import float32_matmuls

    outputs = []
    with torch.no_grad(), float32_matmuls(layer):
        for h, kw in zip(hidden, kwargs, strict=True):
            out = layer(h, **kw)
            outputs.append((out[0] if isinstance(out, tuple) else out).detach())
    return outputs


def _calibrate_on(
    layer: nn.Module, hidden: Sequence[torch.Tensor], kwargs: Sequence[dict[str, Any]]
) -> Callable[[nn.Module], None]:
    def calibrate(_root: nn.Module) -> None:
        # the outputs are dropped batch by batch: calibration reads the layer's inputs only
        with torch.no_grad():
            for h, kw in zip(hidden, kwargs, strict=True):
                layer(h, **kw)

    return calibrate


def _nested(layer: nn.Module, prefix: str) -> nn.Module:
    """An empty root module holding ``layer`` at ``prefix`` (``model.layers.3``).

    ``quantize`` then sees the module names the whole model has
    (``model.layers.3.mlp.gate_proj``), so a recipe's patterns (mixed precision,
    exclusions, the default exclusions) pick the modules they pick in memory.
    """
    root = parent = nn.Module()
    *path, last = prefix.split(".")
    for part in path:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(last, layer)
    return root


def quantize_layer(
    layer: nn.Module,
    recipe: Any,
    hidden: Sequence[torch.Tensor],
    kwargs: Sequence[dict[str, Any]],
    mode: CalibrationInputs,
    prefix: str,
) -> tuple[nn.Module, list[torch.Tensor]]:
    """Quantize ``layer`` (the model's module ``prefix``) in place, calibrated on ``hidden``.

    Returns the quantized layer and the next layer's inputs.
    """
    from exportlm.quant import quantize

    if recipe is None:
        return layer, run_layer(layer, hidden, kwargs)
    float_outputs = run_layer(layer, hidden, kwargs) if mode == "float" else None
    root = quantize(_nested(layer, prefix), recipe, calibrate=_calibrate_on(layer, hidden, kwargs))
    layer = root.get_submodule(prefix)
    if float_outputs is not None:
        return layer, float_outputs
    return layer, run_layer(layer, hidden, kwargs)
