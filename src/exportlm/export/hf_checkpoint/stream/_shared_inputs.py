"""Which linears of each decoder layer read one input tensor, traced on the ``meta`` device.

The calibration matrices a layer holds are one per *input*, not one per linear: AWQ keeps
one Gram matrix per group of linears of one parent that read the same tensor
(:mod:`exportlm.quant._awq_gram`), GPTQ one Hessian per input, shared by its readers
(:mod:`exportlm.quant._gptq_hessian`). Both find those groups by the tensor's identity
while the calibration forwards run; the memory bound is stated before a weight is read,
so :func:`shared_inputs` finds them the same way by one forward of the streamed model's
``meta`` skeleton (no data, no memory: a ``meta`` tensor has no storage), every input
kept alive so that no identity is reused.

Where the forward does not run on ``meta`` (a router that indexes by data, a kernel
without a ``meta`` implementation) or a layer has a linear that reads more than one
tensor in a forward, there is no answer for that layer (``None`` / missing), and the
bound counts it from the weights' shapes alone (:func:`~exportlm.export.hf_checkpoint.
stream._sizing.search_bytes`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["shared_inputs"]

logger = logging.getLogger("exportlm.stream")

#: ``{layer index (text): [[linear names relative to the layer], ...]}``: every linear of a
#: traced layer in exactly one group, the linears of a group reading one tensor.
Groups = dict[str, list[list[str]]]


def shared_inputs(model: nn.Module, inside: str) -> Groups | None:
    """The linears of each decoder layer under ``inside`` (``model.layers.``) grouped by
    the tensor they read, from one forward of ``model`` on ``meta`` tensors; ``None`` when
    that forward cannot run. A layer whose linear read two tensors is left out; a linear
    the forward did not reach is a group of its own."""
    linears = [
        n for n, m in model.named_modules() if n.startswith(inside) and isinstance(m, nn.Linear)
    ]
    read: dict[str, list[torch.Tensor]] = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(_reader(read, n)) for n in linears]
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=ids)
    except Exception as e:  # any failure: no trace, the bound counts by shapes
        logger.debug(
            "no meta forward (%s: %s): calibration matrices counted by shapes", type(e).__name__, e
        )
        return None
    finally:
        for handle in handles:
            handle.remove()
    return _grouped(read, linears, inside)


def _reader(
    read: dict[str, list[torch.Tensor]], name: str
) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            read.setdefault(name, []).append(args[0])  # kept alive: no identity is reused

    return hook


def _grouped(read: dict[str, list[torch.Tensor]], linears: list[str], inside: str) -> Groups:
    layers: dict[str, dict[object, list[str]]] = {}
    mixed: set[str] = set()
    for name in linears:
        layer, _, rest = name[len(inside) :].partition(".")
        tensors = read.get(name, [])
        if len({id(t) for t in tensors}) > 1:
            mixed.add(layer)
        key: object = id(tensors[0]) if tensors else name  # not reached: a group of its own
        layers.setdefault(layer, {}).setdefault(key, []).append(rest)
    return {layer: list(g.values()) for layer, g in layers.items() if layer not in mixed}
