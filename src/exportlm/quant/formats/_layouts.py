"""The checkpoint layouts a quantized model is written in, as data.

A :class:`FormatSpec` carries each layout's config fields (``modelopt``,
``compressed_tensors``); a :class:`CheckpointLayout` carries what differs between
the layouts for the tensors themselves: the shape of a per-tensor scale, which
formats the layout can hold, whether it names stacked experts. The module
exporters read these fields (``ExportContext.layout``) and the ``hf_checkpoint``
writer reads the same ones, so neither branches on a layout's name.

Where a layout stores a format's tensors under other names, dtypes or shapes
(compressed-tensors' ``weight_packed`` int32 for INT4), the format's scheme for
that layout carries a :class:`~exportlm.quant.formats.LeafCodec`; the methods
here (:meth:`CheckpointLayout.weight_tensors`, :meth:`CheckpointLayout.from_leaves`,
:meth:`CheckpointLayout.activation_leaf`) apply it both ways, so the writer and
the loader never branch on a format or a layout either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._tensor import QuantizedTensor
from exportlm.quant.formats._parts import LeafCodec, StoredLeaf, StoredScale
from exportlm.quant.formats._spec import FormatSpec

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "MIXED_PRECISION",
    "CheckpointLayout",
    "ExportFormat",
    "checkpoint_layout",
]

#: The half-precision float dtypes a scale may be computed and stored in.
HALF_FLOATS = (torch.bfloat16, torch.float16)

#: ``format=`` values of the export (the layout names).
ExportFormat = Literal["modelopt", "compressed-tensors", "finegrained-fp8", "gpt-oss-mxfp4"]

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
            hold it (``"compressed_tensors"``, ``"finegrained_fp8"``), ``None``: every
            format (ModelOpt's). It also names the layout's config builder
            (``CheckpointQuantization``) and which of the format's schemes a loader matches.
        stacked_experts: the layout has names for experts stored stacked in one
            tensor per projection (DBRX's ``mlp.w1``); ``False``: only per-expert
            linears.
        kv_scales_on_attention: the KV-cache scales sit on the attention module
            (``self_attn.k_scale``), not on ``k_proj`` / ``v_proj``.
        half_scales: a scale computed in bfloat16 / float16 (the ``compressed-tensors``
            scale convention of a half-precision model) is stored in that dtype, as
            compressed-tensors stores a scale in its weight's dtype; ``False``: every
            float scale in float32 (exact: float32 holds every half-float value).
        hf_quant_config: the layout also writes ModelOpt's ``hf_quant_config.json``.
        model_types: the ``config.json`` ``model_type`` values its loaders read the layout
            for (gpt-oss-mxfp4: ``gpt_oss``); empty: any model.
        quantized_modules: fnmatch patterns of the only modules the layout quantizes (gpt-oss:
            its experts, ``*.mlp.experts``; every other module stays in float); empty: any.
            A recipe given for the layout quantizes only these
            (:meth:`~exportlm.quant.QuantRecipe.for_layout`).
        native_experts: stacked experts are stored as their own parameters, one tensor per
            stored leaf, ``<experts>.<param>_<leaf>`` (gpt-oss's ``gate_up_proj_blocks``),
            in the rows' order of the model's parameter; ``False``: split per expert.
    """

    name: str
    scalar_scale_shape: tuple[int, ...] = ()
    scheme: Literal["compressed_tensors", "finegrained_fp8", "gpt_oss_mxfp4"] | None = None
    stacked_experts: bool = True
    kv_scales_on_attention: bool = False
    half_scales: bool = False
    hf_quant_config: bool = False
    model_types: tuple[str, ...] = ()
    quantized_modules: tuple[str, ...] = ()
    native_experts: bool = False

    def holds(self, spec: FormatSpec) -> bool:
        """This layout can store weights in ``spec``'s format."""
        return self.scheme is None or getattr(spec, self.scheme) is not None

    def stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """``scale`` as this layout stores it: a 0-d scale gets :attr:`scalar_scale_shape`.

        The one rule for the shape of per-tensor scales and the dtype of half-float
        ones: a bfloat16 / float16 scale (the ``compressed-tensors`` scale convention of
        a half-precision model) stays so where :attr:`half_scales`, else becomes float32
        (exact); other dtypes (float32, float8 block scales) and a scale with dimensions'
        shape are kept.
        """
        scale = scale.detach()
        if scale.dtype in HALF_FLOATS and not self.half_scales:
            scale = scale.to(torch.float32)
        if scale.dim() == 0 and self.scalar_scale_shape:
            return scale.reshape(self.scalar_scale_shape)
        return scale

    # -- a format's tensors in this layout ---------------------------------
    def codec(self, spec: FormatSpec) -> LeafCodec | None:
        """The :class:`LeafCodec` this layout stores ``spec`` with, ``None``: its own leaves."""
        scheme = getattr(spec, self.scheme) if self.scheme is not None else spec.modelopt
        return getattr(scheme, "codec", None)

    def weight_leaves(self, spec: FormatSpec) -> tuple[StoredLeaf, ...]:
        """The weight leaves this layout stores for ``spec``, in writing order."""
        codec = self.codec(spec)
        if codec is not None:
            return codec.weights
        return tuple(
            StoredLeaf(leaf.name, leaf.dtype, "codes" if leaf.source == "data" else "scale")
            for leaf in spec.weight_leaves
        )

    def weight_tensors(
        self, spec: FormatSpec, q: QuantizedTensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(stored leaf name, tensor)`` of ``q`` as this layout stores it, ready to write.

        Float scales as :meth:`stored_scale` stores them; a second level in the form the
        layout stores it (:meth:`second_level`); a codec re-lays the format's leaves out.
        """
        codec = self.codec(spec)
        native = {
            leaf.name: self._native(spec, leaf.source, t, q) if leaf.is_float32_scale else t
            for leaf, t in spec.weight_tensors(q)
        }
        if codec is None:
            yield from native.items()
            return
        encoded = codec.encode(native)
        for leaf in codec.weights:
            if leaf.name in encoded:
                yield leaf.name, encoded[leaf.name]

    def global_scales(self, spec: FormatSpec) -> bool:
        """This layout stores ``spec``'s second level as compressed-tensors' global scale."""
        codec = self.codec(spec)
        return codec is not None and codec.global_scale

    def second_level(self, spec: FormatSpec, scale: torch.Tensor, divides: bool) -> torch.Tensor:
        """A second-level scale (``divides``: a global scale) in the form this layout stores.

        The same number where the forms agree; else its float32 reciprocal, which for
        some values is one last bit off (``docs/checkpoint-format.md``).
        """
        if divides == self.global_scales(spec):
            return scale
        return 1.0 / scale.to(torch.float32)

    def _native(
        self, spec: FormatSpec, source: str | None, tensor: torch.Tensor, q: QuantizedTensor
    ) -> torch.Tensor:
        if source == "scale_2":
            tensor = self.second_level(spec, tensor, q.scale_2_divides)
        return self.stored_scale(tensor)

    def from_leaves(self, spec: FormatSpec, leaves: Mapping[str, torch.Tensor]) -> QuantizedTensor:
        """The :class:`QuantizedTensor` stored as ``leaves`` (stored names) in this layout."""
        codec = self.codec(spec)
        if codec is not None:
            missing = [leaf.name for leaf in codec.weights if leaf.name not in leaves]
            if missing:
                raise UnsupportedFormatError(
                    f"format {spec.name!r} in the {self.name} layout stores {missing}; got only "
                    f"{sorted(leaves)}"
                )
            codes = leaves[codec.codes.name]
            if codes.dtype != codec.codes.dtype:
                raise UnsupportedFormatError(
                    f"format {spec.name!r} in the {self.name} layout stores {codec.codes.name!r} "
                    f"as {codec.codes.dtype}, got {codes.dtype}; the tensor is not in this format"
                )
            leaves = codec.decode(leaves)
        q = spec.from_leaves(leaves)
        if q.scale_2 is not None and self.global_scales(spec):
            q = dataclasses.replace(q, scale_2_divides=True)
        return q

    def activation_leaf(self, spec: FormatSpec, leaf: str, where: str) -> StoredScale:
        """How this layout stores ``spec``'s activation leaf ``leaf`` (``input_scale``).

        Raises :class:`UnsupportedFormatError` (naming ``where``) when the layout has
        no tensor for it (compressed-tensors and an AWQ ``pre_quant_scale``).
        """
        codec = self.codec(spec)
        if codec is None or leaf not in codec.activations:
            return StoredScale(leaf)
        stored = codec.activations[leaf]
        if stored is None:
            raise UnsupportedFormatError(
                f"{where}: format={self.name!r} cannot store its {spec.name} {leaf!r}: "
                f"{codec.refusal or 'the layout has no tensor for it'}"
            )
        return stored


#: The layouts, by ``format=`` name: ModelOpt's (vLLM, TensorRT-LLM, SGLang),
#: compressed-tensors' (transformers; FP8 ``float-quantized`` of the built-ins), and
#: DeepSeek-V3's / Qwen3-FP8's ``quant_method: "fp8"`` (transformers'
#: ``FineGrainedFP8Config``, vLLM's ``Fp8Config``; ``fp8_block`` only), openai/gpt-oss's
#: ``quant_method: "mxfp4"`` (transformers' ``Mxfp4Config``, vLLM's ``GptOssMxfp4Config``:
#: a GptOss model's experts in ``mxfp4``, nothing else quantized), in the order a
#: recipe's first holding layout is picked (the conformance suite's ``recipe_layout``).
CHECKPOINT_LAYOUTS: Mapping[str, CheckpointLayout] = MappingProxyType(
    {
        "modelopt": CheckpointLayout("modelopt", hf_quant_config=True),
        "compressed-tensors": CheckpointLayout(
            "compressed-tensors",
            scalar_scale_shape=(1,),
            scheme="compressed_tensors",
            stacked_experts=False,
            kv_scales_on_attention=True,
            half_scales=True,
        ),
        "finegrained-fp8": CheckpointLayout(
            "finegrained-fp8",
            scheme="finegrained_fp8",
            stacked_experts=False,
        ),
        "gpt-oss-mxfp4": CheckpointLayout(
            "gpt-oss-mxfp4",
            scheme="gpt_oss_mxfp4",
            stacked_experts=False,
            model_types=("gpt_oss",),
            quantized_modules=("*.mlp.experts",),
            native_experts=True,
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
