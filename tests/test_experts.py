"""Expert layouts: Llama4 and DBRX quantized and exported, unknown layouts refused, and
the iterable-experts exporter confined to expert lists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exportlm.errors import UnclaimedModuleError, UnsupportedFormatError
from exportlm.export.hf_checkpoint.configs import CheckpointQuantization
from exportlm.models import IterableMoEModel, tiny_hf_model
from exportlm.module_exporters import (
    DictSink,
    ExportContext,
    ExportModuleRegistry,
    IterableExpertsExporter,
    QuantExportSummary,
    export_quantized_state,
    register_builtin_module_exporters,
)
from exportlm.quant import (
    QuantBMMExperts,
    QuantExperts,
    QuantModule,
    QuantMoELinear,
    TensorQuantizer,
    is_fused_experts,
    quantize,
    wrap_module,
)

#: Same process, same kernels, same operations in the same order: the wrapper's
#: output may differ from the original's only by float rounding, if at all.
ATOL, RTOL = 1e-6, 1e-5


def _export(
    model: nn.Module, **kwargs: object
) -> tuple[dict[str, torch.Tensor], QuantExportSummary]:
    sink = DictSink()
    summary = export_quantized_state(model, sink, **kwargs)  # type: ignore[arg-type]
    return sink.tensors, summary


def _experts(model: nn.Module) -> tuple[str, nn.Module]:
    return next((n, m) for n, m in model.named_modules() if n.endswith(".experts"))


def _ids(seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(3))


# -- stacked experts (Mixtral, Qwen-MoE, GPT-OSS) ---------------------------------------


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_experts_wrapped_with_quantizers_off_are_transformers_experts_bit_for_bit(
    family: str, implementation: str
) -> None:
    # bfloat16, where every rounding shows. Both sides run in this process on the same
    # kernels, so equal operations give equal bits: whole-model calibration (the wrapper,
    # quantizers transparent) then sees the float model's activations exactly, which the
    # streamed checkpoints' byte identity rests on (tests/test_stream*.py). Mixtral's router
    # returns float32 weights: its grouped kernel sums each token's shares in float32 and
    # rounds once, its eager loop adds each share into bfloat16.
    model = tiny_hf_model(family, seed=0).to(torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default here
    model.config._experts_implementation = implementation
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        for name, experts in [(n, m) for n, m in model.named_modules() if n.endswith(".experts")]:
            wrap_module(experts, name)
        assert any(isinstance(m, QuantExperts) for m in model.modules())
        assert torch.equal(model(ids).logits, expected)


# -- Llama4 ----------------------------------------------------------------------------


def test_llama4_experts_wrapped_with_quantizers_off_compute_the_original_forward() -> None:
    model = tiny_hf_model("llama4", num_hidden_layers=1)
    _, experts = _experts(model)
    assert is_fused_experts(experts)
    routed = torch.randn(4 * 6, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = experts(routed)
        wrapper = wrap_module(experts, "experts")
        torch.testing.assert_close(wrapper(routed), expected, atol=ATOL, rtol=RTOL)
    assert isinstance(wrapper, QuantBMMExperts)


def test_llama4_fp8_fake_quant_weights_equal_the_dequantized_per_expert_export() -> None:
    model = quantize(tiny_hf_model("llama4", num_hidden_layers=1), "fp8")
    name, experts = _experts(model)
    assert isinstance(experts, QuantExperts)
    tensors, summary = _export(model)
    quantizer = experts.gate_up_proj_weight_quantizer
    gate_up = quantizer(experts.canonical_weight("gate_up_proj"))
    down = experts.down_proj_weight_quantizer(experts.canonical_weight("down_proj"))
    # Llama4's own [E, H, 2I] layout, fake-quantized elementwise with the same per-expert
    # scales: gate is the first half of the columns, up the second (not interleaved).
    stored_layout = quantizer(experts.get_parameter("gate_up_proj"))
    inner = stored_layout.shape[-1] // 2
    for e in range(experts.num_experts):
        for proj, fake, columns in (
            ("gate_proj", gate_up[e, :inner], stored_layout[e, :, :inner].T),
            ("up_proj", gate_up[e, inner:], stored_layout[e, :, inner:].T),
            ("down_proj", down[e], down[e]),
        ):
            prefix = f"{name}.{e}.{proj}"
            stored = (
                tensors[f"{prefix}.weight"].to(torch.float32) * tensors[f"{prefix}.weight_scale"]
            )
            assert torch.equal(stored, fake), prefix  # elementwise arithmetic: exact
            assert torch.equal(stored, columns), prefix
            assert f"{prefix}.input_scale" in tensors
        assert torch.equal(
            tensors[f"{name}.{e}.gate_proj.weight_scale"],
            tensors[f"{name}.{e}.up_proj.weight_scale"],
        )
    assert f"{name}.gate_up_proj" not in tensors
    assert CheckpointQuantization.of(summary).quant_algo == "FP8"
    assert "model.layers.0.feed_forward.router" in summary.exclude_modules


@pytest.mark.parametrize("recipe", ["nvfp4", "int4_awq", "int8_wo", "fp8+fp8_kv"])
def test_llama4_quantizes_and_exports_with_every_recipe(recipe: str) -> None:
    model = quantize(tiny_hf_model("llama4", num_hidden_layers=1), recipe)
    name, _ = _experts(model)
    tensors, summary = _export(model)
    assert tensors[f"{name}.3.down_proj.weight"].dtype != torch.float32
    assert summary.quantized_layers
    with torch.no_grad():
        assert torch.isfinite(model(_ids()).logits).all()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "llama4"])
def test_int4_awq_calibrates_bfloat16_fused_experts(family: str) -> None:
    # The expert statistics are kept in float32 while the experts compute in their own
    # dtype: a bf16 model (as checkpoints are stored) once failed with a dtype mismatch.
    model = tiny_hf_model(family, num_hidden_layers=1).to(torch.bfloat16)
    quantize(model, "int4_awq")
    name, experts = _experts(model)
    scales = [b for n, b in experts.named_buffers() if n.endswith("pre_quant_scale") and b.numel()]
    assert scales, f"{name}: no AWQ pre_quant_scale on the experts"
    assert all(torch.isfinite(s).all() and (s > 0).all() for s in scales)
    with torch.no_grad():
        assert torch.isfinite(model(_ids()).logits.float()).all()


# -- DBRX ------------------------------------------------------------------------------


def test_dbrx_experts_wrapped_with_quantizers_off_compute_the_original_forward() -> None:
    model = tiny_hf_model("dbrx", num_hidden_layers=1)
    with torch.no_grad():
        expected = model(_ids()).logits
        _, experts = _experts(model)
        wrap_module(experts, "experts")
        torch.testing.assert_close(model(_ids()).logits, expected, atol=ATOL, rtol=RTOL)
    assert not is_fused_experts(experts)


def test_dbrx_fp8_exports_its_own_fused_layout_with_one_scale_per_expert() -> None:
    model = quantize(tiny_hf_model("dbrx", num_hidden_layers=1), "fp8")
    name, experts = _experts(model)
    assert isinstance(experts, QuantExperts)
    tensors, summary = _export(model)
    count, inner, hidden = 4, 128, 128
    fake = {
        proj: quantizer(experts.canonical_weight(proj))
        for proj, quantizer in (
            ("gate_up_proj", experts.gate_up_proj_weight_quantizer),
            ("down_proj", experts.down_proj_weight_quantizer),
        )
    }
    expected = {
        "w1": fake["gate_up_proj"][:, :inner],
        "v1": fake["gate_up_proj"][:, inner:],
        "w2": fake["down_proj"].transpose(1, 2),  # DBRX keeps [in, out] rows for w2
    }
    for tensor, want in expected.items():
        prefix = f"{name}.mlp.{tensor}"
        codes, scales = tensors[prefix], tensors[f"{prefix}_weight_scale"]
        assert codes.dtype == torch.float8_e4m3fn
        assert codes.shape == (count * inner, hidden)
        assert scales.dtype == torch.float32
        assert scales.shape == (count,)
        stored = codes.to(torch.float32).view(count, inner, hidden) * scales.view(count, 1, 1)
        assert torch.equal(stored, want), tensor  # elementwise arithmetic: exact
        assert tensors[f"{prefix}_input_scale"].shape == ()
    assert torch.equal(
        tensors[f"{name}.mlp.w1_weight_scale"], tensors[f"{name}.mlp.v1_weight_scale"]
    )
    assert torch.equal(tensors[f"{name}.mlp.w1_input_scale"], tensors[f"{name}.mlp.v1_input_scale"])
    assert f"{name}.mlp" in summary.quantized_layers
    assert "transformer.blocks.0.ffn.router.layer" in summary.exclude_modules


@pytest.mark.parametrize("recipe", ["nvfp4", "int4_awq", "int8_wo"])
def test_dbrx_refuses_formats_its_layout_cannot_hold_and_converts_nothing(recipe: str) -> None:
    model = tiny_hf_model("dbrx", num_hidden_layers=1)
    with pytest.raises(
        UnsupportedFormatError, match=r"'transformer\.blocks\.0\.ffn\.experts'.*fp8"
    ):
        quantize(model, recipe)
    assert not any(isinstance(m, QuantModule) for m in model.modules())
    quantize(model, {"*": recipe, "*.experts": "fp8"})  # the way out the message names


def test_dbrx_experts_refuse_the_compressed_tensors_layout() -> None:
    model = quantize(tiny_hf_model("dbrx", num_hidden_layers=1), "fp8")
    with pytest.raises(UnsupportedFormatError, match="format='modelopt'"):
        _export(model, format="compressed-tensors")


# -- layouts nobody handles ------------------------------------------------------------


class StackedExperts(nn.Module):
    """Experts in a layout no wrapper knows: one 3-D weight, its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("th,eoh->to", x, self.weight)


class WithStackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.experts = StackedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(self.proj(x))
        return out


def test_stacked_experts_without_a_wrapper_are_refused_never_left_unquantized() -> None:
    model = WithStackedExperts()
    with pytest.raises(UnsupportedFormatError) as info:
        quantize(model, "fp8", calibrate=lambda m: m(torch.randn(2, 32)))
    message = str(info.value)
    assert "'experts'" in message
    assert "StackedExperts" in message
    assert "exclude" in message
    quantize(model, "fp8", calibrate=lambda m: m(torch.randn(2, 32)), exclude=["experts"])


class QuantExpertList(QuantModule, nn.ModuleList):
    """A quantized container (an expert list with its own quantizer) that no exporter knows."""


def test_a_quantized_container_is_unclaimed_not_swallowed_by_the_catch_all() -> None:
    model = nn.Module()
    experts = QuantExpertList([nn.Linear(4, 4) for _ in range(2)])
    experts.weight_quantizer = TensorQuantizer("fp8")
    model.experts = experts
    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    assert registry.match(experts) is None
    with pytest.raises(UnclaimedModuleError) as info:
        export_quantized_state(model, DictSink(), registry=registry)
    message = str(info.value)
    assert "'experts'" in message
    assert "QuantExpertList" in message
    assert "iterable_catch_all" in message
    assert "bmm_experts" in message


# -- iterable experts: expert lists only -----------------------------------------------


class Spy(IterableExpertsExporter):
    """The built-in iterable-experts exporter, recording what it prepares."""

    def __init__(self) -> None:
        self.prepared: list[str] = []

    def prepare_moe_inputs(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        self.prepared.append(name)
        before = dict(ctx.amax_overrides)
        super().prepare_moe_inputs(name, module, ctx)
        block = {
            id(q) for m in module.modules() for q in m.children() if isinstance(q, TensorQuantizer)
        }
        changed = [q for q in ctx.amax_overrides if before.get(q) is not ctx.amax_overrides[q]]
        assert all(id(q) in block for q in changed), f"{name} set amax outside its block"


def test_iterable_experts_claim_expert_lists_only_and_never_merge_layers() -> None:
    model = quantize(IterableMoEModel(num_layers=2), "fp8")
    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    assert registry.match(model.layers).display_name == "iterable_catch_all"  # type: ignore[union-attr]
    assert registry.match(model.layers[0].mlp.experts).display_name == "iterable_experts"  # type: ignore[union-attr]
    # layer 1's experts read activations ten times larger: a merge would leak into layer 0
    for expert in model.layers[1].mlp.experts:
        for linear in expert.children():
            assert isinstance(linear, QuantMoELinear)
            linear.input_quantizer.amax = linear.input_quantizer.amax * 10
    spy, catch_all = Spy(), registry.get("iterable_catch_all")
    registry.unregister("iterable_experts")
    registry.unregister(catch_all)
    registry.register(spy)  # the keys and predicate IterableExpertsExporter declares
    registry.register(catch_all, builtin=True)
    tensors, _ = _export(model, registry=registry)
    assert spy.prepared == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for layer in (0, 1):
            own = max(
                float(getattr(e, proj).input_quantizer.amax)
                for e in model.layers[layer].mlp.experts
            )
            written = float(tensors[f"layers.{layer}.mlp.experts.0.{proj}.input_scale"])
            assert written == pytest.approx(own / 448, rel=1e-6), (layer, proj)
    ctx = ExportContext(model, DictSink())
    IterableExpertsExporter().prepare_moe_inputs("layers", model.layers, ctx)
    assert ctx.amax_overrides == {}  # asked about the layers directly, it still merges nothing


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4", "dbrx"])
def test_stored_weights_put_canonical_weights_back_in_the_families_own_layout(
    family: str,
) -> None:
    model = tiny_hf_model(family, num_hidden_layers=1)
    _, experts = _experts(model)
    stored = {n: p.detach().clone() for n, p in experts.named_parameters()}
    wrapper = wrap_module(experts, "experts")
    assert isinstance(wrapper, QuantExperts)
    for projection in wrapper.PROJECTIONS:
        canonical = wrapper.canonical_weight(projection).detach()
        if projection == "gate_up_proj":  # as the exporters split them: gate rows, up rows
            canonical = torch.cat(wrapper.split_gate_up(canonical, dim=-2), dim=1)
        for path, tensor in type(wrapper).stored_weights(wrapper, projection, canonical).items():
            assert torch.equal(tensor, stored[path]), (family, path)  # layout moves only


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_awq_experts_are_fake_quantized_one_expert_at_a_time_in_any_layout(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPT-OSS stores its experts transposed: its forward once divided the whole stack by
    # the AWQ scales and fake-quantized it (two stack-sized copies beside a streamed layer)
    # because the quotient's layout was not checked. (Llama4's and DBRX's own forwards:
    # tests/test_stacked_expert_forms_memory.py.)
    model = quantize(tiny_hf_model(family, num_hidden_layers=1).to(torch.bfloat16), "int4_awq")
    _, experts = _experts(model)
    assert isinstance(experts, QuantExperts)
    with torch.no_grad():
        for projection in experts.PROJECTIONS:
            whole = experts.weight_quantizer_of(projection)(experts.effective_weight(projection))
            alone = experts.expert_weights(projection)
            divided = experts.effective_weight(projection)
            for expert in range(experts.num_experts):  # elementwise: the same bytes, same layout
                own = experts.effective_expert(projection, expert)  # what the exporters quantize
                assert torch.equal(own, divided[expert]), (family, projection, expert)
                assert own.stride() == divided[expert].stride(), (family, projection, expert)
                one = alone(expert)
                assert torch.equal(one, whole[expert]), (family, projection, expert)
                assert one.stride() == whole[expert].stride(), (family, projection, expert)

        def whole_stack(projection: str) -> torch.Tensor:
            raise AssertionError(f"{projection}: the whole stack divided at once")

        monkeypatch.setattr(experts, "effective_weight", whole_stack)
        assert torch.isfinite(model(_ids()).logits.float()).all()
