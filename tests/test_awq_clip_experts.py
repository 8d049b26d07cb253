"""AWQ's clip search on stacked experts (transformers-5 fused 3-D parameters): each expert's
INT4 groups searched on the tokens routed to it, as a linear's are on its inputs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.models import tiny_hf_model
from exportlm.quant import QuantExperts
from tests._clip_checks import group_losses, quantized_tiny

#: Two layouts: Qwen3-MoE stores ``[E, out, in]`` (gate rows then up rows), GPT-OSS
#: ``[E, in, out]`` with gate / up columns interleaved.
FAMILIES = ("qwen3_moe", "gpt_oss")


def _experts(model: nn.Module) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def _routed(
    plain: QuantExperts, float_experts: nn.Module, float_model: nn.Module, batches: list[Any]
) -> dict[tuple[str, int], torch.Tensor]:
    """``{(projection, expert): [T, in]}``: the float model's inputs of each expert's
    projections over the calibration batches (what the search's pass sees: every quantizer
    off). ``plain`` (the ``clip=false`` model's experts: under ModelOpt's convention their
    weights are the float model's, the AWQ scale kept beside them) routes and computes."""
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for expert, tokens in plain.routed_tokens(*args, **kwargs):
            seen.setdefault(("gate_up_proj", expert), []).append(tokens)
            hidden = plain.expert_hidden(expert, tokens)
            seen.setdefault(("down_proj", expert), []).append(hidden)

    handle = float_experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                float_model(batch)
    finally:
        handle.remove()
    return {key: torch.cat(parts) for key, parts in seen.items()}


def _effective(module: QuantExperts, projection: str, expert: int) -> torch.Tensor:
    """The ``[out, in]`` weight expert ``expert`` computes with: ``Q(W / p) * p``."""
    with torch.no_grad():
        quantized = module.expert_weights(projection)(expert).detach()
    pqs = module.input_quantizer_of(projection).pre_quant_scale
    if pqs is None:
        return quantized
    row = pqs[expert] if pqs.dim() == 2 else pqs
    return quantized * row.to(quantized.dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_experts_groups_add_no_more_output_error_than_unclipped(family: str) -> None:
    """Per expert, projection, row and group: the squared error the weight adds to that
    expert's output over the tokens routed to it is at most the unclipped one's, and lower
    in total. Before, the clip search left stacked experts at round-to-nearest ranges."""
    clipped, batches = quantized_tiny(family, "int4_awq")
    plain, _ = quantized_tiny(family, "int4_awq:clip=false")
    original = tiny_hf_model(family, seed=0).eval()
    totals = [0.0, 0.0]
    compared = 0
    for name, module in _experts(clipped).items():
        other = plain.get_submodule(name)
        assert isinstance(other, QuantExperts)
        source = original.get_submodule(name)
        inputs = _routed(other, source, original, batches)
        for projection in module.PROJECTIONS:
            stored = source.get_parameter(projection).detach()
            weights = stored.transpose(-1, -2) if module.transposed else stored
            block = int(module.weight_quantizer_of(projection).block_size or 0)
            for expert in range(module.num_experts):
                x = inputs.get((projection, expert))
                if x is None:
                    continue  # no token reached it: left as it is
                weight = weights[expert]
                ours = group_losses(_effective(module, projection, expert) - weight, x, block)
                theirs = group_losses(_effective(other, projection, expert) - weight, x, block)
                assert bool((ours <= theirs * (1 + 1e-6) + 1e-12).all()), (name, projection)
                totals[0] += float(ours.sum())
                totals[1] += float(theirs.sum())
                compared += 1
    assert compared >= 8
    assert totals[0] < 0.9 * totals[1], totals


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_clamped_in_their_layout_and_clip_false_changes_none(family: str) -> None:
    clipped, _ = quantized_tiny(family, "int4_awq")
    plain, _ = quantized_tiny(family, "int4_awq:clip=false")
    original = tiny_hf_model(family, seed=0).eval()
    changed = 0
    for name, module in _experts(clipped).items():
        source = original.get_submodule(name)
        for projection in module.PROJECTIONS:
            before = source.get_parameter(projection)
            assert torch.equal(plain.get_submodule(name).get_parameter(projection), before)
            after = module.get_parameter(projection)
            assert after.shape == before.shape
            assert after.stride() == before.stride()
            moved = after != before
            changed += int(moved.sum())
            assert bool((after.abs() <= before.abs()).all()), (name, projection)
            assert bool((torch.sign(after[moved]) == torch.sign(before[moved])).all())
    assert changed > 0


def test_the_log_counts_every_expert_clipped(caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3-MoE's toy: 2 layers of 7 linears, and each layer's experts (both projections
    of every expert a token reached)."""
    with caplog.at_level(logging.INFO, logger="exportlm.quant._awq_clip"):
        model, _ = quantized_tiny("qwen3_moe", "int4_awq")
    lines = [r.getMessage() for r in caplog.records if r.name == "exportlm.quant._awq_clip"]
    assert len(lines) == 1
    experts = sum(2 * m.num_experts for m in _experts(model).values())
    clipped = int(lines[0].split("AWQ clipping of ")[1].split(" ")[0])
    linears = sum(
        1 for n, m in model.named_modules() if isinstance(m, nn.Linear) and "self_attn" in n
    )
    assert linears < clipped <= linears + experts


def test_the_streams_bound_counts_the_blocks_the_clip_search_holds(monkeypatch: Any) -> None:
    """The stream's memory bound (``clip_bytes``) counts the blocks of ``X^T X`` the clip
    search holds until it runs, per input and per expert: measured on the blocks the search
    of this model held (every layer at once in memory; the stream holds one)."""
    import exportlm.quant._calibration_steps as steps
    from exportlm.export.hf_checkpoint.stream._sizing import calibration_algorithms, clip_bytes
    from exportlm.quant import resolve_algorithm

    held: list[int] = []
    clip_awq = steps.clip_awq

    def measured(model: nn.Module, plan: Any) -> Any:
        searches = [s for _, s in plan.linears] + [s for *_, per in plan.experts for s in per]
        held.append(
            sum(
                s.clip.blocks.nbytes for s in searches if s and s.clip and s.clip.blocks is not None
            )
        )
        return clip_awq(model, plan)

    monkeypatch.setattr(steps, "clip_awq", measured)
    model, _ = quantized_tiny("qwen3_moe", "int4_awq")
    algorithms = calibration_algorithms([resolve_algorithm("int4_awq")])
    per_layer = clip_bytes(tiny_hf_model("qwen3_moe", seed=0), "model.layers.", algorithms)
    layers = int(model.config.num_hidden_layers)
    assert held[0] > 0
    # at most the bound; the bound counts the router's input and experts no token reached
    assert held[0] <= layers * per_layer
    assert held[0] >= 0.5 * layers * per_layer, (held, per_layer)
