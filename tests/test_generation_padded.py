"""Padded batches through ``kv_cache=True`` ONNX graphs, and the files serving runtimes load.

The graph takes ``attention_mask`` and ``position_ids`` (Optimum's names), so a batch
of left-padded prompts of different lengths generates, row by row, what each prompt
generates alone in the eager model. The engine tests run Optimum's
``ORTModelForCausalLM`` and onnxruntime-genai out of process through
``exportlm.engines.run_engine``, in the interpreter that
``EXPORTLM_ENGINE_OPTIMUM_ONNXRUNTIME`` / ``EXPORTLM_ENGINE_ONNXRUNTIME_GENAI`` name
(each skips with the reason when no interpreter has the engine).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.engines import EngineRequest, EngineResult, run_engine
from exportlm.errors import EngineUnavailableError, InvalidInputError, InvalidModelError
from exportlm.export import get_target_info, greedy_generate, make_input_ids
from exportlm.models import build_model
from tests._exports import shared_export

NEW_TOKENS = 8
LENGTHS = (3, 5, 7)  # three prompts of different lengths, left-padded to 7
#: Teacher-forced logprobs of an engine against the eager model (float32 both sides;
#: onnxruntime reorders reductions: measured <= 2e-6 here, 50x margin).
LOGPROB_ATOL = 1e-4


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that avoid ids 0-2 (bos / eos / the pad ids the engines use)."""
    return [(make_input_ids(vocab - 3, 1, n, seed=n)[0] + 3).tolist() for n in LENGTHS]


def _left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """``(family, **options) -> (model, folder)``: one Optimum + genai export per case and
    session (``tests/test_engines_artifact.py`` reads the llama one too), read-only."""

    def get(family: str, **options: Any) -> Any:
        shared = shared_export(
            tmp_path_factory,
            "onnx",
            family,
            filename="model.onnx",
            kv_cache=True,
            layout="optimum",
            genai_config=True,
            **options,
        )
        return shared.model, shared.path.parent

    return get


def _eager_alone(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [
        greedy_generate(model, torch.tensor([p]), NEW_TOKENS).tokens[0].tolist() for p in prompts
    ]


# ----------------------------------------------------------------------------- our runtime


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(
    served: Callable[..., Any], family: str
) -> None:
    model, folder = served(family)
    runtime = exportlm.load_exported("onnx", folder / "model.onnx")
    prompts = _prompts(model.config.vocab_size)
    ids, mask = _left_padded(prompts)
    got = greedy_generate(runtime, ids, NEW_TOKENS, attention_mask=mask)
    eager = greedy_generate(model, ids, NEW_TOKENS, attention_mask=mask)
    assert got.tokens.tolist() == _eager_alone(model, prompts)
    assert eager.tokens.tolist() == got.tokens.tolist()
    info = get_target_info("onnx")
    for step, (actual, expected) in enumerate(zip(got.step_logits, eager.step_logits, strict=True)):
        assert torch.allclose(actual, expected, atol=info.atol, rtol=info.rtol), step


def test_without_the_mask_input_a_padded_batch_is_refused_not_misread(
    served: Callable[..., Any],
) -> None:
    model, folder = served("llama", attention_mask=False)
    runtime = exportlm.load_exported("onnx", folder / "model.onnx")
    ids, mask = _left_padded(_prompts(model.config.vocab_size))
    with pytest.raises(InvalidInputError, match="no attention_mask input"):
        greedy_generate(runtime, ids, 2, attention_mask=mask)
    ones = torch.ones_like(ids)  # an unpadded batch still runs
    assert greedy_generate(runtime, ids, 2, attention_mask=ones).tokens.shape == (3, 2)


def test_a_torch_export_program_refuses_a_padded_mask(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The .pt2 program has no mask input: a padded batch is refused, never misread."""
    shared = shared_export(tmp_path_factory, "torch_export", "llama", kv_cache=True)
    model, runtime = shared.model, shared.load()
    ids, mask = _left_padded(_prompts(model.config.vocab_size))
    with pytest.raises(InvalidInputError, match="no attention_mask input"):
        greedy_generate(runtime, ids, 2, attention_mask=mask)


def test_a_model_without_position_ids_gets_a_mask_input_and_its_own_positions(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """DecoderModel places tokens itself (padding included): the graph equals it padded."""
    shared = shared_export(tmp_path_factory, "onnx", "decoder", kv_cache=True)
    model, runtime = shared.model, shared.load()
    ids, mask = _left_padded(_prompts(model.config.vocab_size))
    got = greedy_generate(runtime, ids, NEW_TOKENS, attention_mask=mask)
    eager = greedy_generate(model, ids, NEW_TOKENS, attention_mask=mask)
    assert got.tokens.tolist() == eager.tokens.tolist()
    assert runtime.takes_mask
    assert not runtime.takes_positions


def test_a_mask_of_the_wrong_shape_names_what_was_expected(served: Callable[..., Any]) -> None:
    model, folder = served("llama")
    runtime = exportlm.load_exported("onnx", folder / "model.onnx")
    ids, mask = _left_padded(_prompts(model.config.vocab_size))
    with pytest.raises(InvalidInputError, match=r"\[batch, past \+ seq\] = \[3, 7\]"):
        runtime.prefill(ids, attention_mask=mask[:, 1:])
    _, past = runtime.prefill(ids, attention_mask=mask)
    with pytest.raises(InvalidInputError, match=r"= \[3, 8\]"):
        runtime.decode(ids[:, :1], past, attention_mask=mask)  # the mask must cover the past


# ----------------------------------------------------------------------------- serving files


def test_the_folder_holds_what_optimum_and_genai_read(served: Callable[..., Any]) -> None:
    model, folder = served("llama")
    names = {p.name for p in folder.iterdir()}
    assert {"model.onnx", "config.json", "generation_config.json", "genai_config.json"} <= names
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    decoder = genai["decoder"]
    assert decoder["filename"] == "model.onnx"
    runtime = exportlm.load_exported("onnx", folder / "model.onnx")
    graph_inputs = [i.name for i in runtime.session.get_inputs()]
    named = [decoder["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")]
    assert graph_inputs[:3] == named
    layers = model.config.num_hidden_layers
    assert graph_inputs[3:] == [
        decoder["inputs"][f"past_{kind}_names"] % i
        for i in range(layers)
        for kind in ("key", "value")
    ]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"]) == (layers, 2)
    assert genai["pad_token_id"] == model.config.eos_token_id  # the config has no pad id


@pytest.mark.parametrize(
    ("family", "options", "error", "message"),
    [
        ("llama", {"layout": "optimum"}, InvalidInputError, "need kv_cache=True"),
        ("llama", {"layout": "tree", "kv_cache": True}, InvalidInputError, "layout must be one of"),
        (
            "decoder",
            {"genai_config": True, "kv_cache": True},
            InvalidModelError,
            "not a transformers",
        ),
    ],
)
def test_serving_options_that_cannot_be_honoured_are_refused_before_writing(
    tmp_path: Path, family: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(error, match=message):
        exportlm.export_model("onnx", build_model(family), out, **options)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- real engines


def _serve(engine: str, folder: Path, prompts: list[list[int]]) -> EngineResult:
    request = EngineRequest.left_padded(prompts, max_new_tokens=NEW_TOKENS)
    try:
        return run_engine(engine, folder / "model.onnx", request)
    except EngineUnavailableError as err:
        pytest.skip(str(err))


def _eager_logprobs(model: Any, rows: list[list[int]]) -> list[torch.Tensor]:
    """log p(row[i + 1] | row[:i + 1]) of each prompt alone, in the eager model."""
    picked = []
    for row in rows:
        ids = torch.tensor([row])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.double(), dim=-1)[0]
        picked.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0])
    return picked


def _check_engine(model: Any, prompts: list[list[int]], result: EngineResult) -> None:
    where = f"{result.engine} {result.engine_version}"
    assert result.tokens == _eager_alone(model, prompts), where
    for r, (got, expected) in enumerate(
        zip(result.logprobs, _eager_logprobs(model, prompts), strict=True)
    ):
        diff = float((torch.tensor(got, dtype=torch.float64) - expected).abs().max())
        assert diff <= LOGPROB_ATOL, f"{where} row {r}: logprobs {diff:.2e} off"


# Optimum on the llama and qwen3_moe kv_cache folders, and onnxruntime-genai on them,
# are the plugin's `served` items (served[onnx-optimum-onnxruntime-llama-cpu], ...);
# Optimum on a graph without the mask is tests/test_served_broken.py's nomask_onnx.
# Here: genai on mixtral, a family `served` does not run (Optimum cannot: optimum-onnx
# 0.1.0 sizes the empty past with num_attention_heads for model types outside its GQA
# list, so a GQA mixtral fails in onnxruntime there).
@pytest.mark.engines
@pytest.mark.parametrize("family", ["mixtral"])
def test_onnxruntime_genai_generates_the_eager_tokens_on_a_padded_batch(
    served: Callable[..., Any], family: str
) -> None:
    model, folder = served(family)
    prompts = _prompts(model.config.vocab_size)
    result = _serve("onnxruntime-genai", folder, prompts)
    assert any("right-padded" in note for note in result.notes)  # genai's own convention
    _check_engine(model, prompts, result)
