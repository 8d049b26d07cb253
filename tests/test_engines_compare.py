"""The served comparison (exportlm.engines.compare) without any real engine.

compare_result on hand-made answers (tokens, gaps, near-ties), and serve_and_compare
against fake workers whose support-table rows declare runs / refused / engine-limit /
misreads: every outcome is named, and a declared limit is never a pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exportlm.engines import (
    NEW_TOKENS,
    Engine,
    EngineResult,
    Outcome,
    Reference,
    Served,
    Support,
    Tolerance,
    Verdict,
    builtin_engines,
    choose_prompts,
    compare_result,
    eager_reference,
    get_engine,
    serve_and_compare,
)
from exportlm.models import tiny_hf_model
from tests.test_engines import FAKE_WORKER, PYTEST_VERSION

TOL = Tolerance(1e-4, "a test's")
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]


def _ref() -> Reference:
    return Reference(
        prompts=[[5, 6, 7], [9, 10]],
        tokens=[[1, 2, 3], [4, 5, 6]],
        logprobs=[[-1.0, -2.0], [-0.5]],
        margins=[[3.0, 3.0, 3.0], [3.0, 1e-5, 3.0]],
    )


def _answer(tokens: list[list[int]], logprobs: list[list[float]]) -> EngineResult:
    return EngineResult("fake", "1.2.3", tokens, logprobs)


def _blank() -> Served:
    return Served("fake", None, "/a", None, "float32", Outcome.FAILED, Verdict.RUNS, "")


def test_equal_tokens_within_tolerance_pass_and_say_the_numbers() -> None:
    got = compare_result(
        _blank(), _answer([[1, 2, 3], [4, 5, 6]], [[-1.00002, -2.0], [-0.5]]), _ref(), TOL
    )
    assert got.outcome is Outcome.PASSED
    assert got.ok
    assert not got.declared
    assert got.tokens_equal
    assert got.diverges is None
    assert got.max_gap == pytest.approx(2e-5, rel=1e-3)
    assert got.gap_at == (0, 0)
    assert got.engine_version == "1.2.3"
    assert "fake 1.2.3" in got.message
    assert "tolerance 0.0001" in got.message


def test_a_token_difference_names_the_first_diverging_row_and_position() -> None:
    got = compare_result(
        _blank(), _answer([[1, 2, 3], [4, 5, 9]], [[-1.0, -2.0], [-0.5]]), _ref(), TOL
    )
    assert got.outcome is Outcome.FAILED
    assert not got.ok
    assert got.diverges == (1, 2)
    assert "row 1 diverges at new token 2" in got.message


def test_a_difference_at_an_eager_near_tie_is_a_near_tie_not_a_failure() -> None:
    got = compare_result(
        _blank(), _answer([[1, 2, 3], [4, 7, 6]], [[-1.0, -2.0], [-0.5]]), _ref(), TOL
    )
    assert got.outcome is Outcome.NEAR_TIE
    assert got.message.startswith("near-tie")


def test_logprobs_beyond_the_tolerance_fail_with_equal_tokens() -> None:
    got = compare_result(
        _blank(), _answer([[1, 2, 3], [4, 5, 6]], [[-1.0, -2.0], [-0.7]]), _ref(), TOL
    )
    assert got.outcome is Outcome.FAILED
    assert got.gap_at == (1, 0)
    assert "tokens equal, but" in got.message


def test_a_nan_logprob_is_as_far_off_as_it_gets() -> None:
    got = compare_result(
        _blank(), _answer([[1, 2, 3], [4, 5, 6]], [[float("nan"), -2.0], [-0.5]]), _ref(), TOL
    )
    assert got.outcome is Outcome.FAILED
    assert got.max_gap == float("inf")


def test_every_stated_tolerance_names_its_evidence() -> None:
    stated = [t for e in builtin_engines() for t in e.tolerances]
    assert len(stated) >= 9
    assert all(t.atol > 0 and t.evidence for t in stated)
    vllm = get_engine("vllm")
    assert vllm.tolerance("float32") == next(t for t in vllm.tolerances if t.dtype == "float32")
    assert vllm.tolerance("int3") is None
    with pytest.raises(ValueError, match="measurement"):
        Tolerance(1e-4, "")  # a tolerance without its evidence is refused
    with pytest.raises(ValueError, match="two tolerances"):
        Engine("x", "json", (), "w.py", tolerances=(Tolerance(1, "m"), Tolerance(2, "m")))


def test_the_reference_and_the_prompts_come_from_the_eager_model_alone() -> None:
    model = tiny_hf_model("llama", seed=0, initializer_range=0.3).eval()
    prompts = choose_prompts(model, lengths=(3, 5), tries=20, new_tokens=4)
    assert [len(p) for p in prompts] == [3, 5]
    assert all(3 <= t < model.config.vocab_size for p in prompts for t in p)
    assert prompts == choose_prompts(model, lengths=(3, 5), tries=20, new_tokens=4)
    ref = eager_reference(model, prompts, 4)
    assert [len(t) for t in ref.tokens] == [4, 4]
    assert [len(lp) for lp in ref.logprobs] == [2, 4]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0].double()
    expected = float(torch.log_softmax(logits, -1)[0, prompts[0][1]])
    assert ref.logprobs[0][0] == pytest.approx(expected, abs=1e-9)
    assert ref.min_margin > 0


# -- serve_and_compare on fake workers ----------------------------------------------


def _engine(tmp_path: Path, *rows: Support, tolerances: tuple[Tolerance, ...] = ()) -> Engine:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.format(module="json"))
    return Engine(
        "fake",
        "json",
        ("pytest",),
        str(worker),
        table_version=PYTEST_VERSION,
        table=rows,
        tolerances=tolerances,
    )


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0).eval()


@pytest.fixture
def graph(tmp_path: Path) -> Path:
    (tmp_path / "artifact").mkdir()  # a folder of its own: no worker .py beside it
    path = tmp_path / "artifact" / "model.onnx"
    path.write_bytes(b"not read by the fake engine")
    return path


def _serve(
    engine: Engine,
    graph: Path,
    model: torch.nn.Module,
    mode: str,
    tolerance: Tolerance = TOL,
    **options: str,
) -> Served:
    return serve_and_compare(
        engine,
        graph,
        model,
        prompts=PROMPTS,
        tolerance=tolerance,
        options={"mode": mode, **options},
    )


def test_an_engine_that_answers_wrongly_fails_naming_engine_version_and_row(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    got = _serve(_engine(tmp_path, Support("onnx", "plain")), graph, model, "ok")
    assert got.outcome is Outcome.FAILED
    assert (got.engine, got.engine_version) == ("fake", PYTEST_VERSION)
    assert got.kind is not None
    assert (got.kind.target, got.kind.layout) == ("onnx", "plain")
    assert got.diverges is not None
    assert f"row {got.diverges[0]} diverges" in got.message
    assert got.row()["outcome"] == "failed"


def test_an_undeclared_refusal_fails_with_the_engines_own_message(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    got = _serve(_engine(tmp_path, Support("onnx", "plain")), graph, model, "refuse")
    assert got.outcome is Outcome.FAILED
    assert "scheme 'W8A16' has no kernel here" in got.engine_error
    assert "EngineRefusedError" in got.message
    assert str(graph) in got.message


@pytest.mark.parametrize(
    ("verdict", "outcome"),
    [(Verdict.REFUSED, Outcome.REFUSED), (Verdict.ENGINE_LIMIT, Outcome.ENGINE_LIMIT)],
)
def test_a_declared_refusal_or_limit_is_reported_as_such_never_as_a_pass(
    tmp_path: Path, graph: Path, model: torch.nn.Module, verdict: Verdict, outcome: Outcome
) -> None:
    row = Support(
        "onnx", "plain", verdict=verdict, devices=(), message="has no kernel", evidence="e"
    )
    got = _serve(_engine(tmp_path, row), graph, model, "refuse")
    assert got.outcome is outcome
    assert got.declared
    assert got.ok
    assert got.outcome is not Outcome.PASSED
    assert "has no kernel here" in got.message
    assert got.engine_version == PYTEST_VERSION


def test_a_declared_refusal_the_engine_words_otherwise_fails_the_table(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    row = Support("onnx", "plain", verdict=Verdict.REFUSED, message="config validation")
    got = _serve(_engine(tmp_path, row), graph, model, "refuse")
    assert got.outcome is Outcome.FAILED
    assert "config validation" in got.message
    assert "has no kernel here" in got.message


def test_a_declared_refusal_the_engine_serves_now_fails_the_table(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    row = Support("onnx", "plain", verdict=Verdict.REFUSED, message="no")
    got = _serve(_engine(tmp_path, row), graph, model, "ok")
    assert got.outcome is Outcome.FAILED
    assert "update the table" in got.message


def test_a_declared_misread_that_computes_something_else_is_reported_as_misreads(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    row = Support("onnx", "plain", verdict=Verdict.MISREADS, evidence="reads codes as weights")
    got = _serve(_engine(tmp_path, row), graph, model, "ok")
    assert got.outcome is Outcome.MISREADS
    assert got.declared
    assert "reads codes as weights" in got.message


def test_a_declared_misread_served_within_tolerance_but_for_a_near_tie_stays_a_near_tie(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    # a misread that shows on some prompts may not on these: tokens that part only where
    # the tolerance could swap them neither confirm the row nor prove the engine right
    row = Support("onnx", "plain", verdict=Verdict.MISREADS, evidence="off by up to 1.4")
    wide = Tolerance(100.0, "wide enough that every divergence is a near-tie")
    got = _serve(_engine(tmp_path, row), graph, model, "ok", tolerance=wide)
    assert got.outcome is Outcome.NEAR_TIE
    assert not got.declared
    assert "neither confirm nor refute" in got.message
    assert "misreads" in got.message
    assert "near-tie" in got.message


def test_a_declared_misread_the_engine_computes_right_fails_the_table(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    row = Support("onnx", "plain", verdict=Verdict.MISREADS, evidence="off by up to 1.4")
    ref = eager_reference(model, PROMPTS, NEW_TOKENS)
    answer = json.dumps([ref.tokens, ref.logprobs])  # the eager model's own, exactly
    got = _serve(_engine(tmp_path, row), graph, model, "answer", answer=answer)
    assert got.outcome is Outcome.FAILED
    assert "the table says" in got.message
    assert "update the table" in got.message


def test_an_engine_nobody_can_run_is_unavailable(graph: Path, model: torch.nn.Module) -> None:
    engine = Engine("nowhere", "no_such_module_here", (), "/bin/true")
    got = serve_and_compare(engine, graph, model, prompts=PROMPTS, tolerance=TOL)
    assert got.outcome is Outcome.UNAVAILABLE
    assert got.ok
    assert "no_such_module_here" in got.message


def test_no_stated_tolerance_is_said_not_guessed(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    got = serve_and_compare(_engine(tmp_path, Support("onnx", "plain")), graph, model)
    assert got.outcome is Outcome.FAILED
    assert "no tolerance stated" in got.message


def test_a_row_that_computes_another_scheme_is_held_to_that_schemes_tolerance(
    tmp_path: Path, graph: Path, model: torch.nn.Module
) -> None:
    """vLLM CPU computes a W4A16 MoE as W4A8 (``Support.computes``): the comparison takes
    the stated tolerance of what the engine computes, not of the artifact's own scheme."""
    own = Tolerance(1e-4, "the artifact's dtype", "float32")
    kernel = Tolerance(100.0, "what the kernel computes", "float32", "W4A8")
    plain_row = Support("onnx", "plain")
    plain = serve_and_compare(
        _engine(tmp_path, plain_row, tolerances=(own, kernel)), graph, model, prompts=PROMPTS
    )
    assert plain.atol == own.atol
    assert plain.tolerance_evidence == own.evidence
    row = Support("onnx", "plain", computes="W4A8")
    got = serve_and_compare(
        _engine(tmp_path, row, tolerances=(own, kernel)), graph, model, prompts=PROMPTS
    )
    assert got.atol == kernel.atol
    assert got.tolerance_evidence == kernel.evidence
    assert (
        get_engine("vllm")
        .support(
            "hf_checkpoint",
            "compressed-tensors",
            "W4A16",
            dtype="float16",
            model_type="qwen3_moe",
            cpu_features=frozenset({"amx_tile"}),
        )
        .row.computes
        == "W4A8"
    )
