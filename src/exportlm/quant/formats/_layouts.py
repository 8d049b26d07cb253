"""The checkpoint layouts a quantized model is written in, as data.

A :class:`FormatSpec` carries each layout's config fields (``modelopt``,
``compressed_tensors``); a :class:`CheckpointLayout` carries what differs between
the layouts for the tensors themselves: the shape of a per-tensor scale, which
formats the layout can hold, whether it names stacked experts. The module
exporters read these fields (``ExportContext.layout``) and the ``hf_checkpoint``
writer reads the same ones, so neither branches on a layout's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

from exportlm.quant.formats._spec import FormatSpec

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "MIXED_PRECISION",
    "CheckpointLayout",
    "ExportFormat",
    "checkpoint_layout",
]

#: ``format=`` values of the export (the layout names).
ExportFormat = Literal["modelopt", "compressed-tensors"]

#: ModelOpt's ``quant_algo`` of a checkpoint whose layers use more than one format
#: (the layers are then listed in ``quantized_layers``). The one definition.
MIXED_PRECISION = "MIXED_PRECISION"


@dataclass(frozen=True)
class CheckpointLayout:
    """What one checkpoint layout does with the tensors a format writes.

    Attributes:
        name: the ``format=`` value (``"modelopt"``).
        scalar_scale_shape: the shape a per-tensor (0-d) float32 scale is stored
            with: ``()`` (ModelOpt) or ``(1,)`` (compressed-tensors).
        scheme: the :class:`FormatSpec` attribute a format needs for this layout to
            hold it (``"compressed_tensors"``), ``None``: every format.
        stacked_experts: the layout has names for experts stored stacked in one
            tensor per projection (DBRX's ``mlp.w1``); ``False``: only per-expert
            linears.
        kv_scales_on_attention: the KV-cache scales sit on the attention module
            (``self_attn.k_scale``), not on ``k_proj`` / ``v_proj``.
    """

    name: str
    scalar_scale_shape: tuple[int, ...] = ()
    scheme: Literal["compressed_tensors"] | None = None
    stacked_experts: bool = True
    kv_scales_on_attention: bool = False

    def holds(self, spec: FormatSpec) -> bool:
        """This layout can store weights in ``spec``'s format."""
        return self.scheme is None or getattr(spec, self.scheme) is not None

    def stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """``scale`` as this layout stores it: a 0-d scale gets :attr:`scalar_scale_shape`.

        The one rule for the shape of per-tensor scales; a scale with dimensions is
        returned as is.
        """
        if scale.dim() == 0 and self.scalar_scale_shape:
            return scale.reshape(self.scalar_scale_shape)
        return scale


#: The layouts, by ``format=`` name: ModelOpt's (vLLM, TensorRT-LLM, SGLang) and
#: compressed-tensors' (transformers; FP8 ``float-quantized`` of the built-ins).
CHECKPOINT_LAYOUTS: Mapping[str, CheckpointLayout] = MappingProxyType(
    {
        "modelopt": CheckpointLayout("modelopt"),
        "compressed-tensors": CheckpointLayout(
            "compressed-tensors",
            scalar_scale_shape=(1,),
            scheme="compressed_tensors",
            stacked_experts=False,
            kv_scales_on_attention=True,
        ),
    }
)

#: The layout an export uses when none is named.
DEFAULT_LAYOUT: ExportFormat = "modelopt"


def checkpoint_layout(name: str) -> CheckpointLayout:
    """The layout called ``name``; :class:`ValueError` naming the known ones otherwise."""
    try:
        return CHECKPOINT_LAYOUTS[name]
    except KeyError:
        raise ValueError(
            f"format must be one of {tuple(CHECKPOINT_LAYOUTS)}, got {name!r}"
        ) from None
