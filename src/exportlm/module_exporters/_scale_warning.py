"""The warning of an export whose scales' convention is not the layout's (not exact)."""

from __future__ import annotations

import logging

import torch

from exportlm.module_exporters._context import ExportContext
from exportlm.quant import QuantizedTensor, recipe_options, recipes_for_format
from exportlm.quant.formats import HALF_FLOATS, FormatSpec

__all__ = ["warn_scale_convention"]

logger = logging.getLogger(__name__)


def warn_scale_convention(
    ctx: ExportContext, name: str, spec: FormatSpec, q: QuantizedTensor, recipe: str | None
) -> None:
    """Warn once per export when the scales' convention is not the layout's (not exact)."""
    layout = ctx.layout
    if "scale convention" in ctx.warned:
        return
    if q.scale_2 is not None and q.scale_2_divides != layout.global_scales(spec):
        has, stores = ("ModelOpt's", "global") if layout.global_scales(spec) else ("global", "")
        why = (
            f"{name}: its {spec.name} second-level scales are {has} scales, and "
            f"format={ctx.format!r} stores {stores or 'ModelOpt'} scales: through a float32 "
            "reciprocal, one last bit off for some values"
        )
    elif layout.half_scales and q.dtype in HALF_FLOATS and q.scale.dtype == torch.float32:
        why = (
            f"{name}: its {spec.name} scales are float32 and loaders of format={ctx.format!r} "
            f"(transformers) read them in the model's {str(q.dtype).removeprefix('torch.')}"
        )
    elif not layout.half_scales and q.scale.dtype in HALF_FLOATS:
        why = (
            f"{name}: its {spec.name} scales are {str(q.scale.dtype).removeprefix('torch.')}, "
            f"quantizing in that dtype as compressed-tensors does, and format={ctx.format!r} "
            "stores float32 scales its loaders quantize with in float32"
        )
    else:
        return
    ctx.warned.add("scale convention")
    logger.warning(
        "%s, so the checkpoint is not exactly the fake-quantized model; %s "
        "(docs/checkpoint-format.md)",
        why,
        _fix(
            spec, recipe, "scales=compressed-tensors" if layout.half_scales else "scales=modelopt"
        ),
    )


def _fix(spec: FormatSpec, recipe: str | None, option: str) -> str:
    """What makes the checkpoint exact: ``option`` on the recipe used (or on each recipe of
    ``spec``'s format taking it, when the quantizer records none), else why nothing does."""
    names = [recipe] if recipe else recipes_for_format(spec.format)
    takers = [
        n for n in names if "scales" in recipe_options(n) and option not in n.partition(":")[2]
    ]
    if takers:
        examples = " or ".join(repr(_with_option(n, option)) for n in takers)
        return f"quantize with the recipe option '{option}' (e.g. {examples}) to make it exact"
    which = " / ".join(repr(n) for n in names) or f"of format {spec.name!r}"
    return f"recipe {which} has no scale convention ('{option}') that makes it exact"


def _with_option(spelled: str, option: str) -> str:
    """``spelled`` (``"int4_awq:group_size=64"``) with ``option`` (``"scales=..."``) in place
    of its own value of that key."""
    name, _, options = spelled.partition(":")
    key = option.partition("=")[0] + "="
    kept = [o for o in options.split(",") if o and not o.startswith(key)]
    return f"{name}:{','.join([*kept, option])}"
