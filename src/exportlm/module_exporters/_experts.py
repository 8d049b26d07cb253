"""Exporters of expert layouts that keep their own checkpoint layout: DBRX, gpt-oss.

Llama4's experts are split per expert by the BMM-experts exporter (their wrapper
is a :class:`~exportlm.quant.QuantBMMExperts`); DBRX's are written here in
DBRX's own fused layout, the only one vLLM's DBRX loader reads. In a layout that stores
stacked experts as their own parameters (``native_experts``: gpt-oss-mxfp4) the BMM-experts
exporter writes them with :func:`export_native_experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.module_exporters._base import ModuleExporter
from exportlm.module_exporters._context import ExportContext
from exportlm.quant import QuantExperts, TensorQuantizer
from exportlm.quant._experts import QuantDbrxExperts
from exportlm.quant.formats import CHECKPOINT_LAYOUTS

__all__ = ["DbrxExpertsExporter", "export_native_experts"]

#: DBRX's tensor names per canonical projection (``mlp.w1`` gate, ``mlp.v1`` up, ``mlp.w2`` down).
_DBRX_TENSORS = {"gate_up_proj": ("w1", "v1"), "down_proj": ("w2",)}


class DbrxExpertsExporter(ModuleExporter):
    """``DbrxExperts``: ``{name}.mlp.{w1,v1,w2}`` as DBRX stores them, FP8, one scale per expert.

    Per tensor ``t`` of ``w1`` (gate), ``v1`` (up), ``w2`` (down): ``mlp.t``
    float8_e4m3fn ``[E * I, H]`` in DBRX's layout (``w2`` keeps its per-expert
    ``[in, out]`` rows), ``mlp.t_weight_scale`` float32 ``[E]`` (gate and up of
    one expert share it), ``mlp.t_input_scale`` float32 0-d (shared by every
    expert). These are the names vLLM's DBRX loader maps onto its fused MoE
    weights (``w13_weight_scale[:, 0]`` / ``[:, 1]``, ``w2_weight_scale``).
    The quantization config lists the layer as ``{name}.mlp``.
    """

    name = "dbrx_experts"
    keys = (QuantDbrxExperts,)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write the three fused expert tensors with their scales."""
        if not isinstance(module, QuantDbrxExperts):
            raise TypeError(
                f"{self!r} exports QuantDbrxExperts modules, got {type(module).__name__}"
            )
        if not ctx.layout.stacked_experts:
            able = [n for n, layout in CHECKPOINT_LAYOUTS.items() if layout.stacked_experts]
            raise UnsupportedFormatError(
                f"{name}: DBRX experts are written in DBRX's own layout of stacked experts; "
                f"format={ctx.format!r} has no names for it. Export with "
                f"{' or '.join(f'format={n!r}' for n in able)}, or exclude the experts from "
                "quantization."
            )
        for projection, tensors in _DBRX_TENSORS.items():
            input_q = module.input_quantizer_of(projection)
            for tensor in tensors:
                codes, scales = self._quantize(name, module, projection, tensor, ctx)
                prefix = f"{name}.mlp.{tensor}"
                ctx.emit(prefix, codes)
                del codes  # the writer holds it until its shard is written, no longer
                ctx.emit_scale(f"{prefix}_weight_scale", scales)
                if input_q.enabled:
                    scale = input_q.scale_from(ctx.amax_of(input_q))
                    ctx.emit_scale(f"{prefix}_input_scale", scale)
        if module.quant_algo:
            spec = module.weight_quantizer_of("gate_up_proj").spec
            ctx.quant_config.add_layer(f"{name}.mlp", spec, module.group_size)

    @staticmethod
    def _quantize(
        name: str, module: QuantDbrxExperts, projection: str, tensor: str, ctx: ExportContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes of DBRX's ``[E * I, H]`` tensor ``tensor`` (``w1``, ``v1`` or ``w2``) and
        its ``projection``'s ``[E]`` scales, each expert's codes written in place as it is
        quantized: no stack of the experts' codes beside the tensor.

        One tensor at a time, so that :meth:`export` writes each and lets it go before the
        next is filled: ``w1`` and ``v1`` each quantize their own half of every expert's
        ``[w1; v1]`` rows (:meth:`~QuantDbrxExperts.stored_expert`), on the scale the pair
        shares, which the calibrated amax of the expert gives, not the half's values. (A
        streamed DBRX layer's export peaked on ``w1`` and ``v1`` held while ``w2`` was filled,
        each a sixth of the layer.)
        """
        weight_q: TensorQuantizer = module.weight_quantizer_of(projection)
        amax = ctx.amax_of(weight_q)
        codes: torch.Tensor | None = None
        scales = []
        for expert in range(module.num_experts):  # one expert's AWQ-divided rows alive
            weight = module.stored_expert(tensor, expert)
            q = weight_q.quantize(weight, index=expert, amax=amax)
            if (
                not weight_q.spec.calibrated
                or q.scale.numel() != 1
                or q.scale_2 is not None
                or q.data.shape != weight.shape
            ):
                raise UnsupportedFormatError(
                    f"{name}.{projection}: DBRX experts hold one per-tensor scale per expert, "
                    f"from its calibrated amax, but the {q.format} weights have scales of shape "
                    f"{tuple(q.scale.shape)}; quantize DBRX experts with 'fp8'"
                )
            part = q.data.T if tensor == "w2" else q.data  # down's [H, I] back to DBRX's rows
            rows = part.shape[0]
            if codes is None:
                codes = part.new_empty((module.num_experts * rows, part.shape[1]))
            codes[expert * rows : (expert + 1) * rows] = part
            scales.append(q.scale.reshape(()))
        assert codes is not None  # DBRX has experts
        return codes, torch.stack(scales)


def export_native_experts(name: str, module: QuantExperts, ctx: ExportContext) -> None:
    """Stacked experts as their own parameters, one tensor per stored leaf.

    Per projection ``p``: ``{name}.{p}_{leaf}`` for each leaf the layout stores (gpt-oss:
    ``gate_up_proj_blocks`` ``[E, out, in / 32, 16]``, ``gate_up_proj_scales`` ``[E, out,
    in / 32]``), every expert's leaves stacked in expert order, the rows in the order of the
    model's own parameter (GptOss: gate / up interleaved, as ``gate_up_proj`` stores its
    columns); ``{name}.{p}_bias`` as the model holds it. The layout stores no input scale.
    """
    for projection in module.PROJECTIONS:
        weight_q = module.weight_quantizer_of(projection)
        where = f"{name}.{projection}"
        if not (weight_q.enabled and ctx.layout.holds(weight_q.spec)):
            raise UnsupportedFormatError(
                f"{where}: format={ctx.format!r} stores these experts only quantized in a format "
                f"it holds, but they are {weight_q.format if weight_q.enabled else 'unquantized'}"
            )
        if module.input_quantizer_of(projection).enabled:
            raise UnsupportedFormatError(
                f"{where}: format={ctx.format!r} stores no input scale, but the experts' inputs "
                "are quantized; quantize them weight-only"
            )
        amax = ctx.amax_of(weight_q)
        leaves: dict[str, list[torch.Tensor]] = {}
        for expert in range(module.canonical_weight(projection).shape[0]):
            weight = module.effective_expert(projection, expert)
            q = weight_q.quantize(weight, index=expert, amax=amax)
            for leaf, tensor in ctx.layout.weight_tensors(weight_q.spec, q):
                leaves.setdefault(leaf, []).append(tensor)
        for leaf, parts in leaves.items():
            ctx.emit(f"{where}_{leaf}", torch.stack(parts))
        bias = module.bias_of(projection)
        if bias is not None:
            ctx.emit_plain(f"{where}_bias", bias)
    spec = module.weight_quantizer_of("gate_up_proj").spec
    ctx.quant_config.add_layer(name, spec, module.group_size)
