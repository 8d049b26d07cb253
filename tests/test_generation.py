"""Generation with a KV cache: ``kv_cache=True`` exports, their runtimes, ``greedy_generate``.

Everything goes through the public API (``export_model``, ``load_exported``,
``greedy_generate``); logits are compared within the target's declared tolerance,
tokens exactly (the prompts' eager top-2 margins are checked to be far above the
tolerance first, so a token flip cannot be a float near-tie).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import exportlm
from exportlm.errors import InvalidInputError, InvalidModelError
from exportlm.export import (
    GenerationResult,
    GenerationRuntime,
    compare_logits,
    get_target_info,
    greedy_generate,
    kv_cache_refusal,
    make_input_ids,
)
from exportlm.models import ModelSpec, build_from_spec, build_model
from tests._exports import shared_export

TARGETS = ("torch_export", "onnx")
SUFFIX = {"torch_export": ".pt2", "onnx": ".onnx"}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Any]:
    """``(target, family) -> (model, runtime)``: one ``kv_cache=True`` export per pair,
    shared with the session's other readers of it (tests/_exports.py)."""
    cache: dict[tuple[str, str], Any] = {}

    def get(target: str, family: str) -> Any:
        if (target, family) not in cache:
            shared = shared_export(tmp_path_factory, target, family, kv_cache=True)
            cache[(target, family)] = (shared.model, shared.load())
        return cache[(target, family)]

    return get


def _prompt(model: nn.Module, seed: int = 1) -> torch.Tensor:
    return make_input_ids(model.config.vocab_size, 2, 5, seed=seed)


def assert_same_generation(got: GenerationResult, eager: GenerationResult, target: str) -> None:
    info = get_target_info(target)
    top = torch.stack([step.topk(2, dim=-1).values for step in eager.step_logits])
    tie_bound = 2 * info.atol + info.rtol * top.abs().sum(dim=-1)
    assert bool((eager.top2_margins() > tie_bound).all()), "the prompt has a near-tie"
    for step, (actual, expected) in enumerate(zip(got.step_logits, eager.step_logits, strict=True)):
        result = compare_logits(actual, expected, info.atol, info.rtol)
        assert result.passed, f"step {step}: {result.summary()}"
    assert got.tokens.tolist() == eager.tokens.tolist()


# ----------------------------------------------------------------------------- parity


# One family per kind of graph: positions from the ids (llama), MoE experts (mixtral), a
# model that places tokens itself (decoder). The tied family and the others are the main
# job's generation_parity items (make conformance), through the same runtimes.
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", ["llama", "mixtral", "decoder"])
def test_greedy_tokens_through_the_artifact_equal_the_eager_model(
    exported: Callable[[str, str], Any], target: str, family: str
) -> None:
    model, runtime = exported(target, family)
    assert isinstance(runtime, GenerationRuntime)
    prompt = _prompt(model)
    got = greedy_generate(runtime, prompt, NEW_TOKENS)
    assert got.tokens.shape == (2, NEW_TOKENS)
    assert_same_generation(got, greedy_generate(model, prompt, NEW_TOKENS), target)


@pytest.mark.parametrize("target", TARGETS)
def test_the_runtime_is_still_input_ids_to_logits(
    exported: Callable[[str, str], Any], target: str
) -> None:
    model, runtime = exported(target, "llama")
    info = get_target_info(target)
    ids = make_input_ids(model.config.vocab_size, 3, 7, seed=4)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    assert compare_logits(runtime(ids), expected, info.atol, info.rtol).passed


@pytest.mark.parametrize("target", TARGETS)
def test_decoding_a_chunk_after_the_past_equals_one_forward(
    exported: Callable[[str, str], Any], target: str
) -> None:
    """prefill(3 tokens) then decode(4 tokens) gives the logits of one 7-token forward."""
    model, runtime = exported(target, "mixtral")
    info = get_target_info(target)
    ids = make_input_ids(model.config.vocab_size, 2, 7, seed=5)
    first, past = runtime.prefill(ids[:, :3])
    second, present = runtime.decode(ids[:, 3:], past)
    assert [tuple(k.shape) for k, _ in present] == [(2, 2, 7, 32)] * 2
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    result = compare_logits(torch.cat([first, second], dim=1), expected, info.atol, info.rtol)
    assert result.passed, result.summary()


GENERATED = [
    ModelSpec("llama", vocab_size=131, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=1),
    ModelSpec(
        "llama",
        vocab_size=211,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        tie_embeddings=True,
    ),
    ModelSpec(
        "qwen3_moe",
        vocab_size=97,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        num_experts=3,
        num_experts_per_tok=2,
    ),
    ModelSpec(
        "mixtral",
        vocab_size=150,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        num_experts=2,
        num_experts_per_tok=1,
    ),
]


@pytest.mark.parametrize(
    ("target", "spec"),
    [("onnx", GENERATED[0]), *(("torch_export", spec) for spec in GENERATED)],
    ids=lambda v: v if isinstance(v, str) else f"{v.family}-{v.num_layers}l-{v.vocab_size}",
)
def test_generated_structures_generate_like_the_eager_model(
    tmp_path: Path, target: str, spec: ModelSpec
) -> None:
    """GQA / MQA, tied, MoE structures from ``build_from_spec`` (the generated-model builder)."""
    model = build_from_spec(spec, seed=0)
    out = exportlm.export_model(target, model, tmp_path / f"m{SUFFIX[target]}", kv_cache=True)
    runtime = exportlm.load_exported(target, out)
    for seed in range(4):  # the first prompt without a near-tie
        prompt = make_input_ids(spec.vocab_size, 2, 5, seed=seed)
        eager = greedy_generate(model, prompt, NEW_TOKENS)
        if float(eager.top2_margins().min()) > 1e-3:
            break
    assert_same_generation(greedy_generate(runtime, prompt, NEW_TOKENS), eager, target)


# ----------------------------------------------------------------------------- refusals


class NoCache(nn.Module):
    """A decoder LM whose forward has no cache interface."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


@pytest.mark.parametrize("target", TARGETS)
def test_kv_cache_for_a_model_without_a_cache_is_refused(tmp_path: Path, target: str) -> None:
    out = tmp_path / f"m{SUFFIX[target]}"
    with pytest.raises(InvalidModelError, match="no use_cache and past_key_values") as err:
        exportlm.export_model(target, NoCache(), out, kv_cache=True)
    assert "Export without kv_cache=True" in str(err.value)
    assert not out.exists()
    assert kv_cache_refusal(NoCache()) == str(err.value)
    assert kv_cache_refusal(build_model("decoder")) is None


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        ("torch_export", {"dynamic": False}, "kv_cache=True needs dynamic=True"),
        ("onnx", {"dynamo": False}, "dynamo=False"),
    ],
)
def test_options_the_past_graph_cannot_honour_are_refused(
    tmp_path: Path, target: str, options: dict[str, Any], message: str
) -> None:
    out = tmp_path / f"m{SUFFIX[target]}"
    with pytest.raises(InvalidInputError, match=message):
        exportlm.export_model(target, build_model("decoder"), out, kv_cache=True, **options)
    assert not out.exists()


@pytest.mark.parametrize("target", TARGETS)
def test_decode_with_a_past_of_the_wrong_layers_or_shape_names_what_was_expected(
    exported: Callable[[str, str], Any], target: str
) -> None:
    model, runtime = exported(target, "llama")
    _, past = runtime.prefill(_prompt(model))
    next_ids = torch.zeros((2, 1), dtype=torch.long)
    with pytest.raises(InvalidInputError, match=r"past has 1 entries; expected a tuple of 2"):
        runtime.decode(next_ids, past[:1])
    wrong_heads = ((past[0][0][:, :1], past[0][1][:, :1]), past[1])
    with pytest.raises(InvalidInputError, match=r"past\[0\] key has shape \[2, 1, 5, 32\]"):
        runtime.decode(next_ids, wrong_heads)
    uneven = (past[0], (past[1][0][:, :, :2], past[1][1][:, :, :2]))
    with pytest.raises(InvalidInputError, match=r"expected \[2, 2, 5, 32\]"):
        runtime.decode(next_ids, uneven)
    with pytest.raises(InvalidInputError, match=r"\[2, 2, 5, 32\]; expected \[1, 2, 5, 32\]"):
        runtime.decode(next_ids[:1], past)  # the ids' batch is not the past's


def test_greedy_generate_refuses_what_cannot_generate(tmp_path: Path) -> None:
    model = build_model("decoder")
    with pytest.raises(InvalidInputError, match="max_new_tokens must be a positive int"):
        greedy_generate(model, _prompt(model), 0)
    plain = exportlm.load_exported(
        "torch_export", exportlm.export_model("torch_export", model, tmp_path / "m.pt2")
    )
    assert not isinstance(plain, GenerationRuntime)
    with pytest.raises(InvalidModelError, match="export with kv_cache=True"):
        greedy_generate(plain, _prompt(model), 2)
    with pytest.raises(InvalidModelError, match="no use_cache"):
        greedy_generate(NoCache(), torch.zeros((1, 2), dtype=torch.long), 2)
