"""Put a model into a traceable state for one export, and put it back exactly afterwards.

Two things change for the duration of an export and are restored on exit, also
when the export raises:

* **eval mode**: dropout and other train-only behaviour must not enter a graph.
  Every submodule's own ``training`` flag is saved and restored, so a model that
  was partly in train mode comes back partly in train mode.
* **transformers-5 MoE experts**: the default ``grouped_mm`` kernel calls
  ``transformers.grouped_mm_fallback``, which has no ONNX translation and makes a
  ``.pt2`` unloadable in a process that has not imported transformers, and the
  ``eager`` kernel loops over the experts hit by the example batch (a trace is then
  wrong at inputs that hit other experts; ``torch.export`` fails on a
  data-dependent guard). ``batched_mm`` computes every expert densely with plain
  ``bmm`` ops and exports through dynamo, the legacy ONNX exporter,
  ``torch.jit.trace`` and ``torch.export`` alike, at the same logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["TRACEABLE_EXPERTS", "experts_implementations", "traceable_model"]

#: The transformers experts implementation every built-in target exports with.
TRACEABLE_EXPERTS = "batched_mm"


def _switchable_experts(model: nn.Module) -> list[Any]:
    """The outermost transformers models inside ``model`` (``model`` itself, usually).

    Found by the public ``get_experts_implementation`` / ``set_experts_implementation``
    pair: ``set_experts_implementation`` reaches a model's own sub-models, so only the
    outermost ones are returned. A model without switchable experts (Llama, or any
    class transformers does not mark with ``@use_experts_implementation``) accepts
    the call and keeps its implementation, so no private capability probe is needed.
    """
    found: list[Any] = []
    owners: list[str] = []
    for name, module in model.named_modules():
        if any(not owner or name == owner or name.startswith(f"{owner}.") for owner in owners):
            continue  # inside a model already found: reached through it
        if callable(getattr(module, "get_experts_implementation", None)) and callable(
            getattr(module, "set_experts_implementation", None)
        ):
            found.append(module)
            owners.append(name)
    return found


def experts_implementations(model: nn.Module) -> list[dict[str, str | None]]:
    """The experts implementation of every outermost transformers model inside ``model``.

    Empty for models without transformers inside. Two calls returning equal lists
    mean nothing was switched in between.
    """
    return [dict(m.get_experts_implementation()) for m in _switchable_experts(model)]


@contextlib.contextmanager
def traceable_model(
    model: nn.Module, experts: str | None = TRACEABLE_EXPERTS
) -> Iterator[nn.Module]:
    """Yield ``model`` in eval mode with traceable MoE experts; restore both on exit.

    ``experts=None`` leaves the experts implementation alone. The model object is
    yielded itself (not a copy), so no weights are duplicated.
    """
    training = [(module, module.training) for module in model.modules()]
    switched: list[tuple[Any, dict[str, str | None]]] = []
    try:
        model.eval()
        if experts is not None:
            for module in _switchable_experts(model):
                previous = dict(module.get_experts_implementation())
                module.set_experts_implementation(experts)
                switched.append((module, previous))
        yield model
    finally:
        for module, previous in reversed(switched):
            module.set_experts_implementation(previous)
        for module, was_training in training:
            module.training = was_training
