"""Module exporter ``example_marked_linear``.

It claims the quantized linears a user marked with ``module.example_marked = True``
(its predicate) and writes them like the built-in ``quant_linear`` exporter plus a
``<name>.example_marked`` flag. ``prepend = True`` puts it before the built-ins, so
the predicate decides; ``conformance_examples()`` gives the conformance suite
modules it claims, since the toy models carry no mark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from exportlm.models import seeded_init_
from exportlm.module_exporters import ExportContext, QuantLinearExporter
from exportlm.quant import quantize, synthetic_calibration

__all__ = ["MarkedLinearExporter"]


def _is_marked(module: nn.Module) -> bool:
    return bool(getattr(module, "example_marked", False))


class MarkedLinearExporter(QuantLinearExporter):
    """``QuantLinear`` modules carrying ``example_marked = True``."""

    name = "example_marked_linear"
    keys = ("QuantLinear",)
    predicate = staticmethod(_is_marked)
    prepend = True
    #: Its value goldens ship inside the package (package data), so the conformance
    #: suite checks them wherever the plugin is installed, also from an empty directory.
    goldens = Path(__file__).parent / "goldens"
    #: {check id, or pattern over item ids: reason}, read by the conformance suite.
    expected_failures: ClassVar[dict[str, str]] = {}

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """The built-in layout, plus a one-element flag tensor under the module's prefix."""
        super().export(name, module, ctx)
        ctx.emit(f"{name}.example_marked", torch.ones(1, dtype=torch.uint8))

    def conformance_examples(self) -> list[nn.Module]:
        """Marked FP8 linears for the conformance checks (the toy models have none).

        Calibrated with ``synthetic_calibration``: the statistics come from the seed,
        not from a forward pass, so the bytes the exporter writes are the same on
        every machine and the golden ``checkpoint/conformance/example_marked_linear``
        compares them exactly.
        """
        linears = seeded_init_(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64)), seed=0)
        model: Any = quantize(
            linears,
            "fp8",
            calibrate=synthetic_calibration(0, run_forward=lambda m: m(torch.zeros(1, 128))),
        )
        examples = [model[0], model[1]]
        for module in examples:
            module.example_marked = True
        return examples
