"""Module exporter ``example_marked_linear``.

It claims the quantized linears a user marked with ``module.example_marked = True``
(its predicate) and writes them like the built-in ``quant_linear`` exporter plus a
``<name>.example_marked`` flag. ``prepend = True`` puts it before the built-ins, so
the predicate decides; ``conformance_examples()`` gives the conformance suite
modules it claims, since the toy models carry no mark.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from exportlm.modules import ExportContext, QuantLinearExporter
from exportlm.quant import quantize

__all__ = ["MarkedLinearExporter"]


def _is_marked(module: nn.Module) -> bool:
    return bool(getattr(module, "example_marked", False))


class MarkedLinearExporter(QuantLinearExporter):
    """``QuantLinear`` modules carrying ``example_marked = True``."""

    name = "example_marked_linear"
    keys = ("QuantLinear",)
    predicate = staticmethod(_is_marked)
    prepend = True
    #: {check id, or pattern over item ids: reason}, read by the conformance suite.
    expected_failures: ClassVar[dict[str, str]] = {}

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """The built-in layout, plus a one-element flag tensor under the module's prefix."""
        super().export(name, module, ctx)
        ctx.emit(f"{name}.example_marked", torch.ones(1, dtype=torch.uint8))

    def conformance_examples(self) -> list[nn.Module]:
        """Marked FP8 linears for the conformance checks (the toy models have none)."""
        generator = torch.Generator().manual_seed(0)
        model: Any = quantize(
            nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64)),
            "fp8",
            calibrate=lambda m: m(torch.randn(4, 128, generator=generator)),
        )
        examples = [model[0], model[1]]
        for module in examples:
            module.example_marked = True
        return examples
