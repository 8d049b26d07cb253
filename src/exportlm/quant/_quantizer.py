"""``TensorQuantizer``: one tensor's format, calibrated amax and fake quantization."""

from __future__ import annotations

import torch
from torch import nn

from exportlm.errors import QuantizationError
from exportlm.quant import _tensor
from exportlm.quant._channel_stats import ChannelStatistics
from exportlm.quant._formats import (
    convention_scale,
    dequantize,
    quantize_tensor,
    row_chunks,
    static_scale_value,
)
from exportlm.quant._tensor import FormatId, QuantizedTensor, safe_scale
from exportlm.quant.formats import FormatSpec, get_format

__all__ = ["TensorQuantizer", "row_chunks"]


class TensorQuantizer(ChannelStatistics, nn.Module):
    """Quantizes one tensor (a weight, an activation or a KV-cache output).

    Args:
        fmt: the numeric format: a :class:`~exportlm.quant.QuantFormat` member or
            the name of a registered format (:mod:`exportlm.quant.formats`).
        axis: ``None`` keeps one amax for the whole tensor; an int keeps one amax
            per index along that axis (``0`` = per expert for stacked experts
            ``[E, out, in]``, per row for a 2-D weight).
        block_size: NVFP4 block (16) / INT4 group (128) along the last dimension.
        enabled: a disabled quantizer passes its input through unchanged.
        label: the quantizer's module path, used in error messages.
        min_scale: a lower bound of the per-tensor scale (``None``: none). KV-cache
            scales are ``amax / 448`` unclamped, as ModelOpt exports them, unless a
            recipe asks for a floor (:attr:`QuantRecipe.kv_cache_min_scale
            <exportlm.quant.QuantRecipe.kv_cache_min_scale>`).

    Raises :class:`~exportlm.errors.UnknownNameError` for an unregistered format.

    Modes: while :attr:`calibrating` is true ``forward`` records ``amax`` (max
    calibration: the running max of ``|x|``, reduced over every dimension but
    ``axis``) and returns ``x`` unchanged; otherwise ``forward`` is
    :meth:`fake_quant`. A ``pre_quant_scale`` buffer (AWQ) multiplies the input
    first, whether or not the quantizer is enabled.
    """

    amax: torch.Tensor | None
    pre_quant_scale: torch.Tensor | None
    folded_pre_quant_scale: torch.Tensor | None
    static_scale: torch.Tensor | None
    #: The recipe the model was quantized with, as spelled (set by ``quantize``; ``None``
    #: for a quantizer built otherwise, e.g. from a checkpoint): what messages name.
    recipe: str | None = None

    def __init__(
        self,
        fmt: FormatId,
        *,
        axis: int | None = None,
        block_size: int | None = None,
        enabled: bool = True,
        label: str = "",
        min_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.format: FormatId = get_format(fmt).format
        self.axis = axis
        self.block_size = block_size
        self.enabled = enabled
        self.label = label
        self.min_scale = min_scale
        self.calibrating = False
        #: How the per-tensor scale is computed and stored (the recipe's ``scales`` option):
        #: ``"compressed-tensors"`` gives a format with a global scale (NVFP4) that scale,
        #: divided by, and rounds the others to :attr:`scale_dtype`.
        self.scales: _tensor.ScaleConvention = "modelopt"
        #: The dtype per-tensor scales are rounded to and stored in (the module weight's
        #: bfloat16 / float16 under the ``compressed-tensors`` convention); ``None``: float32.
        self.scale_dtype: torch.dtype | None = None
        #: ``"k"`` / ``"v"`` for the KV-cache output quantizers of ``k_proj`` / ``v_proj``.
        self.kv_role: str | None = None
        #: Where a KV-cache quantizer runs: ``"projection"`` (the ``k_proj`` / ``v_proj``
        #: output) or ``"attention"`` (inside the attention function, on the cached K / V;
        #: see :func:`~exportlm.quant.route_kv_cache_to_attention`).
        self.kv_site = "projection"
        #: Also record per-input-channel statistics while calibrating (AWQ smoothing):
        #: :attr:`channel_amax` and the running sum of per-forward ``mean(|x|)``
        #: (:attr:`channel_mean`, ModelOpt's AWQ activation statistic).
        self.track_channels = False
        self.channel_amax: torch.Tensor | None = None
        #: Sum over calibration forwards of the per-channel ``mean(|x|)`` (``[in]``, or
        #: ``[E, in]`` for per-expert statistics) and the number of forwards (``[]`` /
        #: ``[E]``). Stacked experts fill them per expert, from their routed tokens.
        self.channel_sum: torch.Tensor | None = None
        self.channel_steps: torch.Tensor | None = None
        #: The number of experts whose statistics are kept per expert (stacked experts
        #: under AWQ), else ``None``; :meth:`collect` leaves the channel sums to them.
        self.channel_experts: int | None = None
        #: The smallest relative margin of the AWQ search decisions that chose this
        #: quantizer's ``pre_quant_scale`` (:func:`~exportlm.quant.awq_margin`); ``None``
        #: when no search set it.
        self.awq_margin: float | None = None
        #: The linear's weight already holds the division by :attr:`pre_quant_scale`
        #: (SmoothQuant stores the smoothed weight, as ModelOpt does), so the weight
        #: quantizer sees the weight as it is.
        self.weight_smoothed = False
        #: Search this (INT4 weight) quantizer's group ranges after AWQ's smoothing
        #: (:mod:`exportlm.quant._awq_clip`; the AWQ recipes' ``clip`` option).
        self.awq_clip = False
        self.register_buffer("amax", None)
        self.register_buffer("pre_quant_scale", None)
        #: An AWQ ``pre_quant_scale`` the preceding norm applies (folded into its
        #: weight): the weight is divided by it, the input is not multiplied again.
        self.register_buffer("folded_pre_quant_scale", None)
        #: A per-tensor scale used as is instead of one derived from ``amax``
        #: (set by :meth:`load_scale` from a checkpoint).
        self.register_buffer("static_scale", None)

    @property
    def spec(self) -> FormatSpec:
        """The :class:`~exportlm.quant.formats.FormatSpec` of :attr:`format`."""
        return get_format(self.format)

    # -- calibration -------------------------------------------------------
    def collect(self, x: torch.Tensor) -> None:
        """Update ``amax`` with the max of ``|x|`` (max calibration)."""
        # The max in x's own dtype, then float32: the same value as the max of the float32
        # copy (widening is exact and keeps the order; narrowing a float64 is monotonic),
        # without that copy, which for a weight is twice its size in bf16.
        x = x.detach()
        new = _tensor.abs_max(x, self.axis)
        self.amax = new if self.amax is None else torch.maximum(self.amax, new)
        if self.track_channels:
            x = x.abs().to(torch.float32)
            channels = x.reshape(-1, x.shape[-1]).amax(dim=0)
            self.channel_amax = (
                channels
                if self.channel_amax is None
                else torch.maximum(self.channel_amax, channels)
            )
            if self.channel_experts is None:
                self.add_channel_mean(x.reshape(-1, x.shape[-1]).mean(dim=0))

    def reset_amax(self) -> None:
        """Forget the calibrated amax (and a loaded :attr:`static_scale`)."""
        self.amax = None
        self.reset_channels()
        self.static_scale = None

    # -- quantization ------------------------------------------------------
    def _amax_for(
        self, x: torch.Tensor, index: int | None, amax: torch.Tensor | None
    ) -> torch.Tensor | None:
        spec = self.spec
        if not spec.calibrated:
            return None  # e.g. INT4 / INT8: scales come from the tensor itself (per group / row)
        amax = self.amax if amax is None else amax
        if amax is None:
            raise QuantizationError(
                f"{self.label or 'quantizer'}: {self.format} quantizer has no amax; it was "
                "never calibrated. Run a calibration forward that reaches this module "
                "(quantize(model, recipe, calibrate=...)) or exclude the module."
            )
        if index is not None and amax.dim():
            amax = amax[index]
        elif self.axis is not None and amax.dim():
            shape = [1] * x.dim()
            shape[self.axis % x.dim()] = amax.numel()
            amax = amax.reshape(shape)
        if self.min_scale is not None:
            amax = torch.clamp(amax, min=self.min_scale * spec.amax_divisor)
        return amax

    def quantize(
        self, x: torch.Tensor, *, index: int | None = None, amax: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """The real quantization of ``x`` (what exporters write).

        ``index`` picks one entry of a per-axis amax (e.g. one expert's slice of
        stacked expert weights); ``amax`` replaces the calibrated amax (an
        exporter's unified value) without modifying the quantizer. A loaded
        :attr:`static_scale` is used as it is unless ``amax`` is given.
        """
        where, block = self.label or "quantizer", self.block_size
        scale: torch.Tensor | None = None
        if amax is None and self.static_scale is not None:
            scale = self.static_scale
        elif self.scales != "modelopt" and self.spec.calibrated:  # the convention's own scale
            scale = self.scale_from(self._amax_for(x, index, amax))
        elif self.scales != "modelopt":  # a row / group format's, where its scheme has one
            scale = convention_scale(x, self.spec, block, self.scale_dtype, where)
        if scale is None:
            amax = self._amax_for(x, index, amax)
            return quantize_tensor(x, self.format, amax=amax, block_size=block, where=where)
        return quantize_tensor(
            x, self.format, scale=scale, block_size=block, where=where, divides=self.divides
        )

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x))`` in ``x``'s dtype.

        Exactly the tensor a loader gets by dequantizing the exported form (no
        gradient flows: this is post-training quantization, not QAT). Laid out like
        ``x`` (a transposed view stays transposed), so a matmul with it runs the
        same kernel as with a loader's dequantized weight stored in ``x``'s layout.

        A weight is fake-quantized a slice of rows at a time (:func:`row_chunks`) when
        its scale allows it, straight into the result: the same values, without the
        weight-sized float32 copies (codes, dequantized values) of the whole at once.
        """
        # stacked experts [E, out, in]: one expert at a time (its amax picked by index)
        parts: list[tuple[int | slice, int | None]] = (
            [(e, e) for e in range(x.shape[0])]
            if self._per_expert(x)
            else [(rows, None) for rows in self._row_chunks(x)]
        )
        if len(parts) > 1:
            out = torch.empty_like(x)
            for part, index in parts:
                out[part] = dequantize(self.quantize(x[part], index=index), x.dtype)
            return out
        out = dequantize(self.quantize(x), x.dtype)
        if out.stride() != x.stride():  # packed formats unpack into a contiguous tensor
            out = torch.empty_like(x).copy_(out)
        return out

    def quantizes_experts_alone(self, x: torch.Tensor) -> bool:
        """Whether :meth:`fake_quant_expert` gives each expert of the stacked weight ``x``
        what ``self(x)[expert]`` is: enabled, not calibrating, no pre-quantization scale of
        its own, and each expert quantizing alone to the values of the whole."""
        return (
            self.enabled
            and not self.calibrating
            and self.pre_quant_scale is None
            and self._per_expert(x)
        )

    def fake_quant_expert(
        self, x: torch.Tensor, expert: int, part: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Expert ``expert`` of the stacked ``[E, out, in]`` weight ``x`` fake-quantized alone:
        the values and the layout of ``fake_quant(x)[expert]`` (where
        :meth:`quantizes_experts_alone`), without the whole stack's copy. ``part``: that
        expert's weight when it is not ``x[expert]`` (divided by an AWQ scale)."""
        part = x[expert] if part is None else part
        out = torch.empty_like(x[:1])[0]  # laid out as the whole stack's result is, sliced
        return out.copy_(dequantize(self.quantize(part, index=expert), x.dtype))

    def _per_expert(self, x: torch.Tensor) -> bool:
        """Whether each expert of a stacked ``[E, out, in]`` weight quantizes alone to the
        values of the whole: scales per row / block from the data, or a calibrated amax
        that is one value or one per expert (``axis=0``). A loaded static scale, or a
        per-tensor scale taken from the data, needs the whole tensor."""
        if x.dim() != 3 or x.shape[0] < 2 or self.static_scale is not None:
            return False
        if not self.spec.calibrated:
            return self.spec.granularity in ("row", "block")
        if self.amax is None:
            return False
        if self.amax.dim() == 0:
            return True
        return self.axis is not None and self.axis % 3 == 0 and self.amax.numel() == x.shape[0]

    def _row_chunks(self, x: torch.Tensor) -> list[slice]:
        """:func:`row_chunks` of ``x`` when its amax is one value for the whole tensor."""
        dense = x.dim() == 2 and (x.is_contiguous() or x.t().is_contiguous())
        whole = self.static_scale is not None or self.amax is None or self.amax.dim() == 0
        if not (dense and whole):
            return [slice(None)]
        return row_chunks(x.shape, self.spec)

    @property
    def scale(self) -> torch.Tensor:
        """The per-tensor (or per-axis) scale from ``amax``, float32.

        ``amax / spec.amax_divisor``: FP8 / INT ``amax / maxbound``; NVFP4 ``amax / (6 * 448)``
        (its second-level scale, exported as ``weight_scale_2`` / ``input_scale``). Safe: a zero amax
        gives 1.0 and a NaN/inf amax raises :class:`QuantizationError`. A loaded
        :attr:`static_scale` is returned as it is.
        """
        if self.static_scale is not None:
            return self.static_scale
        return self.scale_from(self.amax)

    def scale_from(self, amax: torch.Tensor | None) -> torch.Tensor:
        """:attr:`scale` computed from ``amax`` instead of the calibrated value."""
        if amax is None:
            raise QuantizationError(
                f"{self.label or 'quantizer'}: no amax; calibrate the model before exporting"
            )
        divisor = self.spec.amax_divisor
        if self.min_scale is not None:
            amax = torch.clamp(amax, min=self.min_scale * divisor)
        where = self.label or "quantizer"
        if self.divides:
            return _tensor.global_scale(amax, divisor, where=where)
        scale = safe_scale(amax, divisor, where=where)
        if self.scales != "modelopt" and self.scale_dtype is not None:
            # rounded as llm-compressor's observer computes it in the weight's dtype
            # (torch divides half floats in float32 and rounds once), and stored so
            return scale.to(self.scale_dtype)
        return scale

    @property
    def divides(self) -> bool:
        """The per-tensor scale is compressed-tensors' global scale (NVFP4 under the
        ``compressed-tensors`` convention): quantization divides by it."""
        return self.scales == "compressed-tensors" and self.spec.global_scale

    def load_scale(
        self,
        scale: torch.Tensor,
        fmt: FormatId,
        *,
        block_size: int | None = None,
        divides: bool = False,
    ) -> None:
        """Enable this quantizer as a static one whose :attr:`scale` is an exported ``scale``.

        ``scale`` becomes :attr:`static_scale` and is used as it is (FP8: the
        ``input_scale`` / ``k_scale``; NVFP4 activations: the per-tensor second-level
        scale), so a checkpoint's activation scale quantizes exactly as the quantizer
        that exported it: deriving it back from ``amax = scale * maxbound`` would not
        (``fl(fl(s * 448) / 448) != s`` for some float32 ``s``). ``amax`` is set to
        ``scale * maxbound`` for information; ``min_scale`` is dropped. ``divides``:
        ``scale`` is compressed-tensors' global scale (NVFP4's ``input_global_scale``), used
        as it is under the ``compressed-tensors`` convention.

        Raises :class:`QuantizationError` for a scale that is not a single finite,
        positive number, or a weight-only format (one whose spec is not ``calibrated``,
        e.g. INT4 / INT8: activations are FP8 or NVFP4).
        """
        spec = get_format(fmt)
        value = static_scale_value(scale, spec, self.label or "quantizer")
        self.format = spec.format
        self.block_size = block_size
        self.min_scale = None
        self.static_scale = value
        self.scales = "compressed-tensors" if divides and spec.global_scale else "modelopt"
        self.scale_dtype = None
        self.amax = (
            spec.amax_divisor / self.static_scale
            if self.divides
            else self.static_scale * spec.amax_divisor
        )
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Calibrate or fake-quantize ``x`` (identity when disabled).

        A per-expert ``pre_quant_scale`` (``[E, in]``) is applied by the experts
        wrapper to each expert's routed tokens, not here.
        """
        if self.pre_quant_scale is not None and self.pre_quant_scale.dim() == 1:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.calibrating:
            self.collect(x)
            return x
        if not self.enabled:
            return x
        return self.fake_quant(x)

    def extra_repr(self) -> str:
        parts = [str(self.format), f"axis={self.axis}"]
        if self.block_size:
            parts.append(f"block_size={self.block_size}")
        if not self.enabled:
            parts.append("disabled")
        if self.calibrating:
            parts.append("calibrating")
        return ", ".join(parts)
