"""Built-in module exporters and their registration."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.module_exporters._context import ExpertSlice, ExportContext
from exportlm.module_exporters._experts import DbrxExpertsExporter, export_native_experts
from exportlm.module_exporters._registry import ExportModuleRegistry, MatchKey, ModuleExporter
from exportlm.module_exporters._scale_warning import warn_scale_convention
from exportlm.quant import (
    QuantBMMExperts,
    QuantEmbedding,
    QuantExperts,
    QuantFusedExperts,
    QuantizedTensor,
    QuantLinear,
    QuantMoELinear,
    TensorQuantizer,
    get_format,
    is_quantized_module,
    unify_expert_input_amax,
)
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, FormatSpec, formats

__all__ = [
    "BMMExpertsExporter",
    "FusedExpertsExporter",
    "IterableCatchAllExporter",
    "IterableExpertsExporter",
    "MoELinearExporter",
    "QuantEmbeddingExporter",
    "QuantLinearExporter",
    "builtin_module_exporters",
    "register_builtin_module_exporters",
]


def _check_format(ctx: ExportContext, name: str, quantizer: TensorQuantizer) -> None:
    layout = ctx.layout
    if not layout.holds(quantizer.spec):
        writable = " / ".join(str(s.format).upper() for s in formats() if layout.holds(s))
        others = [n for n, other in CHECKPOINT_LAYOUTS.items() if other.holds(quantizer.spec)]
        instead = " or ".join(f"format={n!r}" for n in others) or "another format"
        raise UnsupportedFormatError(
            f"{name}: format={ctx.format!r} writes {writable} only, but this module is "
            f"{quantizer.format}; export with {instead}"
        )


def _emit_weight(
    ctx: ExportContext, prefix: str, q: QuantizedTensor, recipe: str | None = None
) -> None:
    """The weight leaves of ``q``'s format as the layout stores them, in its order
    (``recipe``: the one its quantizer records, named by a warning)."""
    spec = get_format(q.format)
    warn_scale_convention(ctx, prefix, spec, q, recipe)
    for leaf, tensor in ctx.layout.weight_tensors(spec, q):
        ctx.emit(f"{prefix}.{leaf}", tensor)


def _kv_cache_format(name: str, quantizer: TensorQuantizer) -> FormatSpec:
    if quantizer.spec.kv_cache is None:
        raise UnsupportedFormatError(
            f"{name}: the KV-cache quantizer is {quantizer.format}, a format without a KV-cache "
            "scheme; quantize the KV cache with a KV-cache recipe (e.g. 'fp8_kv')"
        )
    return quantizer.spec


def _emit_input(
    ctx: ExportContext,
    prefix: str,
    quantizer: TensorQuantizer,
    spec: FormatSpec,
    expert: int | None = None,
) -> None:
    """``input_scale`` and the AWQ ``pre_quant_scale`` (of ``expert`` when kept per expert),
    stored as the layout stores the activation leaves of the weight's format ``spec``.

    A scale folded into the preceding norm (``folded_pre_quant_scale``) is not
    written: the norm's exported weight carries it.
    """
    if quantizer.enabled and quantizer.spec.calibrated:  # dynamic inputs keep no scale
        scale = quantizer.scale_from(ctx.amax_of(quantizer))
        stored = ctx.layout.activation_leaf(spec, "input_scale", prefix)
        if stored.reciprocal != quantizer.divides:  # a global scale stored as a scale or back
            scale = 1.0 / scale.to(torch.float32)  # not exact: docs/checkpoint-format.md
        ctx.emit_scale(f"{prefix}.{stored.name}", scale)
    pqs = quantizer.pre_quant_scale
    if pqs is not None:
        _emit_activation(
            ctx, prefix, spec, "pre_quant_scale", pqs[expert] if pqs.dim() == 2 else pqs
        )


def _emit_activation(
    ctx: ExportContext, prefix: str, spec: FormatSpec, leaf: str, scale: torch.Tensor
) -> None:
    """An activation leaf under the name (and as the reciprocal) the layout stores it with."""
    stored = ctx.layout.activation_leaf(spec, leaf, prefix)
    ctx.emit_scale(f"{prefix}.{stored.name}", 1.0 / scale.float() if stored.reciprocal else scale)


class QuantLinearExporter(ModuleExporter):
    """``QuantLinear``: ``weight`` (+ scales), ``bias``, ``input_scale``, AWQ
    ``pre_quant_scale``, and the KV-cache ``k_scale`` / ``v_scale`` of ``k_proj`` / ``v_proj``."""

    name = "quant_linear"
    keys = ("QuantLinear",)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write one quantized linear under ``name``."""
        if not isinstance(module, QuantLinear):
            raise TypeError(f"{self!r} exports QuantLinear modules, got {type(module).__name__}")
        weight_q = module.weight_quantizer
        if weight_q.enabled and module.quant_algo:
            _check_format(ctx, name, weight_q)
            q = weight_q.quantize(module.effective_weight(), amax=ctx.amax_of(weight_q))
            _emit_weight(ctx, name, q, weight_q.recipe)
            ctx.quant_config.add_layer(name, weight_q.spec, module.group_size)
            _emit_input(ctx, name, module.input_quantizer, weight_q.spec)
        else:
            ctx.emit_plain(f"{name}.weight", module.weight)
            ctx.quant_config.exclude(name)
        if module.bias is not None:
            ctx.emit_plain(f"{name}.bias", module.bias)
        output_q = module.output_quantizer
        if output_q.enabled and output_q.kv_role:
            ctx.emit_scale(
                f"{name}.{output_q.kv_role}_scale", output_q.scale_from(ctx.amax_of(output_q))
            )
            ctx.quant_config.add_kv_cache(name, _kv_cache_format(name, output_q))


class MoELinearExporter(QuantLinearExporter):
    """``QuantMoELinear``: one projection of one expert of an iterable MoE block.

    Same tensors as a linear; its input amax is the block's shared one decided
    by :class:`IterableExpertsExporter` (``ctx.amax_overrides``).
    """

    name = "quant_moe_linear"
    keys = ("QuantMoELinear",)


class QuantEmbeddingExporter(ModuleExporter):
    """``QuantEmbedding``: the quantized table (``weight`` + scales), weight-only."""

    name = "quant_embedding"
    keys = (QuantEmbedding,)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write one quantized embedding under ``name``."""
        if not isinstance(module, QuantEmbedding):
            raise TypeError(f"{self!r} exports QuantEmbedding modules, got {type(module).__name__}")
        quantizer = module.weight_quantizer
        _check_format(ctx, name, quantizer)
        q = quantizer.quantize(module.weight, amax=ctx.amax_of(quantizer))
        _emit_weight(ctx, name, q, quantizer.recipe)
        if module.quant_algo:
            ctx.quant_config.add_layer(name, quantizer.spec, module.group_size)

    def conformance_examples(self) -> list[nn.Module]:
        """Quantized embeddings for the conformance suite.

        The built-in recipes leave embeddings in full precision (as ModelOpt's
        defaults do), so no toy model has one; these are built explicitly, from
        numpy's PCG64 (the same bytes on every torch version and machine: they are
        also the ``conformance_model`` whose golden ``golden_checkpoint`` compares).
        """
        import numpy as np

        from exportlm.quant import quantize

        examples: list[nn.Module] = []
        for seed, recipe in enumerate(("int8_wo", "fp8")):
            draws = np.random.Generator(np.random.PCG64(seed)).standard_normal((256, 128))
            table = torch.from_numpy((draws * 0.02).astype(np.float32))
            holder = nn.ModuleDict(
                {"embed_tokens": nn.Embedding.from_pretrained(table, freeze=False)}
            )
            quantize(holder, {"embed_tokens": recipe}, calibrate=lambda _m: None)
            examples.append(holder["embed_tokens"])
        return examples


class FusedExpertsExporter(ModuleExporter):
    """Stacked experts split per expert into ``{name}.{e}.{gate,up,down}_proj.*``.

    Gate and up of one expert share ``weight_scale`` (one amax per expert of
    ``gate_up_proj``); all experts share each projection's ``input_scale``.
    """

    name = "fused_experts"
    keys: ClassVar[tuple[MatchKey, ...]] = (QuantFusedExperts,)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Write every expert's three linears."""
        if not isinstance(module, QuantExperts):
            raise TypeError(f"{self!r} exports QuantExperts modules, got {type(module).__name__}")
        for projection in module.PROJECTIONS:
            weight_q = module.weight_quantizer_of(projection)
            input_q = module.input_quantizer_of(projection)
            _check_format(ctx, name, weight_q)
            biases = module.bias_of(projection)
            amax = ctx.amax_of(weight_q)
            for expert in range(module.canonical_weight(projection).shape[0]):
                # one expert's AWQ-divided weight alive, not the stack's (docs/streaming.md)
                whole = module.effective_expert(projection, expert)
                for linear, weight, bias in self._split(module, projection, whole, biases, expert):
                    prefix = f"{name}.{expert}.{linear}"
                    q = weight_q.quantize(weight, index=expert, amax=amax)
                    _emit_weight(ctx, prefix, q, weight_q.recipe)
                    if bias is not None:
                        ctx.emit_plain(f"{prefix}.bias", bias)
                    _emit_input(ctx, prefix, input_q, weight_q.spec, expert)
                    if module.quant_algo:
                        ctx.quant_config.add_layer(prefix, weight_q.spec, module.group_size)
                    ctx.quant_config.canonical[prefix] = ExpertSlice(name, expert, linear)

    @staticmethod
    def _split(
        module: QuantExperts,
        projection: str,
        weight: torch.Tensor,
        biases: torch.Tensor | None,
        expert: int,
    ) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        bias = None if biases is None else biases[expert]
        if projection == "down_proj":
            return [("down_proj", weight, bias)]
        gate_w, up_w = module.split_gate_up(weight, dim=-2)
        gate_b, up_b = module.split_gate_up(bias, dim=-1) if bias is not None else (None, None)
        return [("gate_proj", gate_w, gate_b), ("up_proj", up_w, up_b)]


class BMMExpertsExporter(FusedExpertsExporter):
    """GptOss / Llama4-style experts (transposed, GptOss: interleaved gate/up and biases),
    split like :class:`FusedExpertsExporter` into ``[out, in]`` per-expert linears."""

    name = "bmm_experts"
    keys: ClassVar[tuple[MatchKey, ...]] = (QuantBMMExperts,)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Split per expert; in a layout of native experts, as their own parameters."""
        if ctx.layout.native_experts and isinstance(module, QuantExperts):
            export_native_experts(name, module, ctx)
        else:
            super().export(name, module, ctx)


def _is_expert_list(module: nn.Module) -> bool:
    """An unquantized ``nn.ModuleList`` of expert MLPs: an item has a ``QuantMoELinear`` child.

    Only the experts' own list: a decoder's ``layers`` list holds its MoE linears
    deeper down, and is not one.
    """
    return (
        isinstance(module, nn.ModuleList)
        and not is_quantized_module(module)
        and any(isinstance(child, QuantMoELinear) for item in module for child in item.children())
    )


class IterableExpertsExporter(ModuleExporter):
    """An ``nn.ModuleList`` of expert MLPs made of :class:`QuantMoELinear`.

    ``prepare_moe_inputs`` gives each projection one input amax across the
    block's experts, and gate/up of one expert one weight amax (into
    ``ctx.amax_overrides``); the experts' linears are exported by
    :class:`MoELinearExporter` as the walk reaches them.
    """

    name = "iterable_experts"
    keys = (nn.ModuleList,)
    exports_unquantized = True

    @staticmethod
    def predicate(module: nn.Module) -> bool:
        """Only lists of expert MLPs with quantized MoE linears (never a list of layers)."""
        return _is_expert_list(module)

    def prepare_moe_inputs(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Unify the experts' input amax per projection and gate/up weight amax per expert.

        Within this block only: a module that is not an expert list is left alone.
        """
        if not isinstance(module, nn.ModuleList) or not _is_expert_list(module):
            return
        ctx.amax_overrides.update(unify_expert_input_amax(module))
        for expert in module:
            gate, up = getattr(expert, "gate_proj", None), getattr(expert, "up_proj", None)
            if not (isinstance(gate, QuantMoELinear) and isinstance(up, QuantMoELinear)):
                continue
            pair = [gate.weight_quantizer, up.weight_quantizer]
            amaxes = [q.amax for q in pair]
            if all(q.enabled and q.spec.share_expert_gate_up_amax for q in pair) and all(
                a is not None and a.dim() == 0 for a in amaxes
            ):
                shared = max(amaxes, key=lambda a: float(a))  # type: ignore[arg-type]
                for quantizer in pair:
                    ctx.amax_overrides[quantizer] = shared  # type: ignore[assignment]

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Nothing of its own: the experts' linears are exported one by one."""
        return None


class IterableCatchAllExporter(ModuleExporter):
    """Any other container (``ModuleList`` / ``ModuleDict`` / ``Sequential``): no-op export."""

    name = "iterable_catch_all"
    keys = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    exports_unquantized = True

    @staticmethod
    def predicate(module: nn.Module) -> bool:
        """Unquantized containers only: a quantized one must meet an exporter that writes
        its weights, or fail as unclaimed, never vanish into this no-op."""
        return not is_quantized_module(module)

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        """Nothing: containers hold no tensors of their own."""
        return None


def builtin_module_exporters() -> list[ModuleExporter]:
    """Fresh instances of the built-in exporters, in registration order."""
    return [
        MoELinearExporter(),
        QuantLinearExporter(),
        QuantEmbeddingExporter(),
        DbrxExpertsExporter(),
        BMMExpertsExporter(),
        FusedExpertsExporter(),
        IterableExpertsExporter(),
        IterableCatchAllExporter(),
    ]


def register_builtin_module_exporters(registry: ExportModuleRegistry) -> list[ModuleExporter]:
    """Register the built-in exporters into ``registry`` (in order); returns them.

    Order: MoE linear (``"QuantMoELinear"``) before linear (``"QuantLinear"``,
    which a ``QuantMoELinear`` also matches through its MRO), embedding, DBRX
    experts, BMM experts (GptOss, Llama4), fused experts, iterable experts
    (``ModuleList`` + predicate), catch-all containers (unquantized only).
    Each is registered under its name with the keys and predicate its class
    declares, as built in. Idempotent: registering again replaces the entries in place.
    """
    exporters = builtin_module_exporters()
    for exporter in exporters:
        registry.register(exporter, builtin=True)
    return exporters
