"""``FormatSpec``: one quantization format as data.

A spec holds everything the rest of exportlm needs about a format: the numeric
kernels (quantize / dequantize), the stored layout and how it packs, the rule
that refuses a module of the wrong shape, the checkpoint leaves it writes and
the config fields of each checkpoint layout (ModelOpt ``hf_quant_config.json`` /
``config.json``, compressed-tensors ``config_groups``). Generic code reads the
spec instead of branching on the format.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._tensor import FormatId, QuantizedTensor, format_name
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    FineGrainedFP8Scheme,
    GptOssMxfp4Scheme,
    KVCacheScheme,
    Leaf,
    LeafRole,
    ModelOptScheme,
    WeightRecipe,
    is_token,
)

__all__ = ["DequantizeFn", "FormatSpec", "Granularity", "QuantizeFn"]

#: How many scales a weight has: one (``tensor``), one per row, one per block of the last
#: dim, one per ``block x block`` tile of the last two (``tile``: FP8 block-wise).
Granularity = Literal["tensor", "row", "block", "tile"]


class QuantizeFn(Protocol):
    """A format's kernel: the real quantization of ``x`` (last dimension = input features).

    ``scale`` is the per-tensor scale of a calibrated format (``amax / amax_divisor``,
    0-d or broadcastable, e.g. ``[E, 1, 1]`` for stacked experts), ``None`` for a
    format that derives its scales from ``x``; ``block_size`` is given exactly when
    the format is block-granular; ``where`` names the tensor in error messages.
    """

    def __call__(
        self, x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
    ) -> QuantizedTensor: ...


class DequantizeFn(Protocol):
    """A format's inverse kernel: the float32 tensor a :class:`QuantizedTensor` stands for."""

    def __call__(self, q: QuantizedTensor) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)  # identity: hashable, and two specs are never "equal"
class FormatSpec:
    """Everything exportlm knows about one quantization format.

    Attributes:
        format: the format's identity: a :class:`~exportlm.quant.QuantFormat` member
            for the built-ins, the name (a plain string) for a registered one.
        quantize: the kernel (:class:`QuantizeFn`).
        dequantize: the inverse kernel (:class:`DequantizeFn`), float32 out.
        maxbound: the largest representable magnitude the scale maps amax to.
        amax_divisor: ``scale = amax / amax_divisor`` of the quantizer's per-tensor
            (or per-axis) scale: ``maxbound``, or NVFP4's ``6 * 448`` (two levels).
        granularity: ``"tensor"``, ``"row"``, ``"block"`` (of the last dimension) or
            ``"tile"`` (square ``block_size`` tiles of the last two).
        leaves: every checkpoint leaf the format writes, weight leaves first, in
            the order they are written.
        calibrated: the per-tensor scale comes from a calibrated amax (so the
            format can quantize activations and load a static scale); ``False``:
            every scale is derived from the tensor itself (weight-only).
        packing: codes per stored element (2 for 4-bit formats), along ``packed_dim``.
        packed_dim: ``-1`` (pairs of columns, NVFP4) or ``-2`` (pairs of rows, INT4).
        block_size: the block / group size of a block format's scales when a
            checkpoint declares none (NVFP4: 16, INT4: 128); ``None`` for other formats.
            A recipe may pick another of its group sizes (``int4_awq:group_size=64``).
        activations: the format a layer of this weight format quantizes its inputs to
            in its checkpoint layouts (the format itself for FP8 / NVFP4, ``int8_tensor``
            for ``int8_sq``), ``None`` for a weight-only format. A layout fact the
            writer and the loader read; whether a model's inputs are quantized is the
            recipe's choice (:class:`exportlm.quant.Recipe`).
        recipe: deprecated (a recipe is a record of its own,
            :func:`exportlm.quant.register_recipe`): a weight recipe the format still
            declares itself; :func:`register_format` registers it as a
            :class:`~exportlm.quant.Recipe`, and it fills ``block_size`` and
            ``activations`` when they are not given.
        modelopt: the ModelOpt config fields.
        compressed_tensors: the compressed-tensors fields, ``None`` if that layout
            cannot hold the format.
        kv_cache: the KV-cache recipe of the format, or ``None``.
        share_fused_weight_amax: linears fused into one GEMM (``q/k/v``, ``gate/up``)
            share one per-tensor weight amax after calibration (NVFP4: one
            ``weight_scale_2`` per fused GEMM).
        share_expert_gate_up_amax: gate and up of one iterable expert share one
            weight amax at export (FP8: one ``weight_scale``).
        global_scale: the per-tensor scale is a second level that compressed-tensors
            stores as a *global scale* (``amax_divisor / amax``, divided by): the kernels
            take ``divides=True`` for it (NVFP4), so a recipe's ``scales=compressed-tensors``
            quantizes with the stored number itself.
        search_format: the format the AWQ search scores a candidate scale with, when not
            this one: W4A8's first stage, ``int4`` (ModelOpt's ``awq_lite`` runs inside
            ``SequentialQuantizer.convert_to_single_quantizer``: INT4 only, no FP8 step).
        finegrained_fp8: the fields of DeepSeek-V3's / Qwen3-FP8's layout (``quant_method:
            "fp8"`` with ``weight_block_size``), ``None`` if that layout cannot hold the format.
        gpt_oss_mxfp4: the fields of gpt-oss's layout (``quant_method: "mxfp4"``, experts'
            ``<p>_blocks`` / ``<p>_scales``), ``None`` if that layout cannot hold the format.
        modelopt_instead: for a format without a ModelOpt scheme, what to quantize with
            for that layout instead (a sentence the refusal ends with), ``""``: nothing.
    """

    format: FormatId
    quantize: QuantizeFn
    dequantize: DequantizeFn
    maxbound: float
    amax_divisor: float
    granularity: Granularity
    leaves: tuple[Leaf, ...]
    calibrated: bool = False
    packing: int = 1
    packed_dim: int = -1
    block_size: int | None = None
    activations: FormatId | None = None
    recipe: WeightRecipe | None = None
    modelopt: ModelOptScheme | None = None
    compressed_tensors: CompressedTensorsScheme | None = None
    kv_cache: KVCacheScheme | None = None
    share_fused_weight_amax: bool = False
    share_expert_gate_up_amax: bool = False
    global_scale: bool = False
    search_format: FormatId | None = None
    finegrained_fp8: FineGrainedFP8Scheme | None = None
    gpt_oss_mxfp4: GptOssMxfp4Scheme | None = None
    modelopt_instead: str = ""

    def __post_init__(self) -> None:
        legacy = self.recipe
        if legacy is not None and self.block_size is None:
            object.__setattr__(self, "block_size", legacy.block_size)
        if legacy is not None and legacy.quantize_inputs and self.activations is None:
            object.__setattr__(self, "activations", legacy.input_format or self.format)
        problems = list(self._problems())
        if problems:
            raise ValueError(f"invalid FormatSpec {self.name!r}: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if not is_token(self.name):
            yield f"the name must be a non-empty string without spaces, got {self.name!r}"
        if self.granularity not in ("tensor", "row", "block", "tile"):
            yield f"granularity must be 'tensor', 'row', 'block' or 'tile', got {self.granularity!r}"
        if not (self.maxbound > 0 and self.amax_divisor > 0):
            yield "maxbound and amax_divisor must be positive"
        if self.packing < 1 or self.packed_dim not in (-1, -2):
            yield "packing must be >= 1 along packed_dim -1 or -2"
        sources = [leaf.source for leaf in self.weight_leaves]
        if sources.count("data") != 1 or sources.count("scale") != 1:
            yield "exactly one weight leaf has source 'data' and exactly one 'scale'"
        if self.needs_block != bool(self.block_size):
            yield "block_size is required by block formats and only by them"
        own_inputs = self.activations is not None and format_name(self.activations) == self.name
        if own_inputs and self.calibrated and "input_scale" not in self._names("activation"):
            yield "a format that quantizes its own inputs writes the activation leaf 'input_scale'"
        if self.recipe is not None:
            yield from self._recipe_problems(self.recipe)
        if (self.share_fused_weight_amax or self.share_expert_gate_up_amax) and not self.calibrated:
            yield "only a calibrated format has a per-tensor weight amax to share"
        if self.global_scale and not (self.calibrated and "scale_2" in sources):
            yield "a global scale is the per-tensor second level (a 'scale_2' leaf) of a calibrated format"
        if self.kv_cache is not None and not (self.calibrated and self.granularity == "tensor"):
            yield "a KV-cache recipe needs a calibrated per-tensor format"
        if self.kv_cache is not None and {"k_scale", "v_scale"} - self._names("kv_cache"):
            yield "a KV-cache recipe writes the kv_cache leaves 'k_scale' and 'v_scale'"

    def _recipe_problems(self, recipe: WeightRecipe) -> Iterator[str]:
        """The deprecated ``recipe`` field's rules (a :class:`~exportlm.quant.Recipe` checks its own)."""
        if not is_token(recipe.name) or "+" in recipe.name:
            yield f"recipe names have no spaces and no '+' (it combines recipes), got {recipe.name!r}"
        if self.modelopt is None and self.compressed_tensors is None:
            yield "a format with a recipe declares a checkpoint scheme (ModelOpt or compressed-tensors)"
        if self.block_size != recipe.block_size:
            yield "recipe.block_size is the format's block_size"
        if recipe.group_sizes and recipe.block_size not in recipe.group_sizes:
            yield "recipe.group_sizes (the group_size option's values) include its block_size"
        own_inputs = recipe.quantize_inputs and recipe.input_format is None
        if own_inputs and not self.calibrated:
            yield "only a calibrated format can quantize activations"
        if own_inputs and "input_scale" not in self._names("activation"):
            yield "a recipe that quantizes inputs writes the activation leaf 'input_scale'"
        if recipe.input_format is not None and not recipe.quantize_inputs:
            yield "recipe.input_format names the activations' format of a recipe that quantizes them"
        alpha = recipe.smoothquant_alpha
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            yield f"recipe.smoothquant_alpha must be in [0, 1], got {alpha!r}"
        if alpha is not None and "pre_quant_scale" not in self._names("activation"):
            yield "a SmoothQuant recipe writes the activation leaf 'pre_quant_scale'"
        if recipe.awq and "pre_quant_scale" not in self._names("activation"):
            yield "an AWQ recipe writes the activation leaf 'pre_quant_scale'"

    def _names(self, role: LeafRole) -> set[str]:
        return {leaf.name for leaf in self.leaves if leaf.role == role}

    # -- identity and layout -----------------------------------------------
    @property
    def name(self) -> str:
        """The registry name (``"fp8"``)."""
        return format_name(self.format)

    @property
    def needs_block(self) -> bool:
        """Block- or tile-granular: quantizing needs a ``block_size``."""
        return self.granularity in ("block", "tile")

    @property
    def weight_leaves(self) -> tuple[Leaf, ...]:
        """The leaves written from the quantized weight, in the order they are written."""
        return tuple(leaf for leaf in self.leaves if leaf.role == "weight")

    @property
    def data_leaf(self) -> Leaf:
        """The leaf holding the codes (``weight``)."""
        return next(leaf for leaf in self.leaves if leaf.source == "data")

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the stored codes."""
        return self.data_leaf.dtype

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of a tensor of logical ``shape``."""
        dims = list(shape)
        dims[self.packed_dim] //= self.packing
        return tuple(dims)

    def logical_shape(self, packed: tuple[int, ...]) -> tuple[int, ...]:
        """The logical shape of stored codes of shape ``packed`` (inverse of :meth:`packed_shape`)."""
        dims = list(packed)
        dims[self.packed_dim] *= self.packing
        return tuple(dims)

    def shape_problem(self, rows: int, cols: int, block_size: int | None) -> str | None:
        """What a ``[rows, cols]`` weight lacks to take this format, or ``None`` when it fits.

        The text completes "needs ...", e.g. ``"input features divisible by 128 and an
        even number of output features"`` (INT4 AWQ).
        """
        needs: list[str] = []
        bad = False
        if self.needs_block and block_size:
            needs.append(f"input features divisible by {block_size}")
            bad = cols % block_size != 0
        if self.packing > 1:
            packed = rows if self.packed_dim == -2 else cols
            bad = bad or packed % self.packing != 0
            # packing along the input features is implied by a block that is a multiple of it
            implied = (
                self.packed_dim == -1
                and self.needs_block
                and block_size is not None
                and block_size % self.packing == 0
            )
            if not implied:
                what = "output" if self.packed_dim == -2 else "input"
                needs.append(
                    f"an even number of {what} features"
                    if self.packing == 2
                    else f"{what} features divisible by {self.packing}"
                )
        return " and ".join(needs) if bad else None

    # -- checkpoint leaves -------------------------------------------------
    def weight_tensors(self, q: QuantizedTensor) -> Iterator[tuple[Leaf, torch.Tensor]]:
        """``(leaf, tensor)`` of each weight leaf of ``q`` in writing order (absent ones skipped).

        Raises :class:`UnsupportedFormatError` when the kernel produced a dtype the
        spec does not declare (float32 scales are cast when written).
        """
        for leaf in self.weight_leaves:
            tensor: torch.Tensor | None = getattr(q, leaf.source or "data")
            if tensor is None:
                continue
            if not leaf.is_float32_scale and tensor.dtype != leaf.dtype:
                raise UnsupportedFormatError(
                    f"format {self.name!r}: leaf {leaf.name!r} is declared {leaf.dtype} but the "
                    f"kernel produced {tensor.dtype}; fix the FormatSpec or its quantize kernel"
                )
            yield leaf, tensor

    def from_leaves(
        self, leaves: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32
    ) -> QuantizedTensor:
        """The :class:`QuantizedTensor` stored as ``leaves`` (``{leaf name: tensor}``).

        The inverse of writing :meth:`weight_tensors`: the logical shape comes from
        the packed codes, the block size from the scale's shape, per-tensor scales
        of shape ``[1]`` (compressed-tensors) become 0-d. ``dtype`` is the dtype
        :func:`~exportlm.quant.dequantize` returns by default.

        Raises :class:`UnsupportedFormatError` for missing leaves or stored dtypes
        that are not this format's.
        """
        by_source: dict[str, torch.Tensor] = {}
        for leaf in self.weight_leaves:
            tensor = leaves.get(leaf.name)
            if tensor is None:
                if leaf.source == "scale_2":
                    continue
                raise UnsupportedFormatError(
                    f"format {self.name!r} stores leaf {leaf.name!r}; got only {sorted(leaves)}"
                )
            if leaf.source == "data" and tensor.dtype != leaf.dtype:
                raise UnsupportedFormatError(
                    f"format {self.name!r} stores {leaf.name!r} as {leaf.dtype}, got "
                    f"{tensor.dtype}; the tensor is not in this format"
                )
            by_source[leaf.source or "data"] = tensor.float() if leaf.is_float32_scale else tensor
        data, scale = by_source["data"], by_source["scale"]
        shape = self.logical_shape(tuple(data.shape))
        block: int | None = None
        if self.granularity == "tensor":
            scale = scale.reshape(())
        elif self.granularity == "row":
            scale = scale.reshape(shape[:-1])
        else:  # a block of the last dim, or a square tile (its edge, from the same dim)
            block = shape[-1] // scale.shape[-1]
        return QuantizedTensor(
            self.format, data, scale, by_source.get("scale_2"), block, shape, dtype
        )

    # -- checkpoint configs ------------------------------------------------
    def modelopt_layer_config(self, group_size: int | None) -> dict[str, Any]:
        """A layer's ``hf_quant_config.json`` entry: ``quant_algo`` (+ ``group_size``, extras)."""
        scheme = self._require_modelopt(group_size)
        config: dict[str, Any] = {"quant_algo": scheme.quant_algo}
        if group_size and scheme.group_size_field:
            config["group_size"] = group_size
        config.update(copy.deepcopy(dict(scheme.layer_fields)))
        return config

    def modelopt_group(self, group_size: int | None) -> dict[str, Any]:
        """A ``config.json`` ``config_groups`` group (without ``targets``), as ModelOpt writes it.

        Block formats give each entry ``group_size`` (``group_size`` or the recipe's).
        """
        scheme = self._require_modelopt(group_size)
        if scheme.named_group:
            return {"quant_algo": scheme.quant_algo}
        block = group_size or self.block_size
        group: dict[str, Any] = {}
        for key, args in (
            ("input_activations", scheme.input_activations),
            ("weights", scheme.weights),
        ):
            if args is None:
                continue
            entry = copy.deepcopy(dict(args))
            if self.needs_block and block:
                entry["group_size"] = block
            group[key] = entry
        return group

    def modelopt_block_problem(self, group_size: int | None) -> str | None:
        """Why the ModelOpt layout cannot hold this format in blocks of ``group_size``, or ``None``."""
        if self.modelopt is None:
            return None
        held = (
            ("compressed-tensors", self.compressed_tensors),
            ("finegrained-fp8", self.finegrained_fp8),
        )
        others = [name for name, scheme in held if scheme is not None]
        return self.modelopt.block_problem(group_size or self.block_size, self.name, others)

    def _require_modelopt(self, group_size: int | None = None) -> ModelOptScheme:
        problem = self.modelopt_block_problem(group_size)
        if problem is not None:
            raise UnsupportedFormatError(problem)
        if self.modelopt is None:
            instead = (
                "export with format='compressed-tensors', which holds it"
                if self.compressed_tensors is not None
                else "give its FormatSpec a ModelOptScheme"
            )
            if self.modelopt_instead:
                instead += f"; {self.modelopt_instead}"
            raise UnsupportedFormatError(
                f"format {self.name!r} declares no ModelOpt scheme, so it cannot be written "
                f"in the ModelOpt checkpoint layout; {instead}"
            )
        return self.modelopt
