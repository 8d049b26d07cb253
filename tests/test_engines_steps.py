"""Each decode step compared with eager (exportlm.engines.steps through compare_result).

Hand-made engine answers against a hand-made reference: a decode step whose logprob is
off fails even with equal tokens; a token differs only at an eager near-tie: to a token
eager ranks within twice the tolerance of its own (second best or further down), with
both tokens' logprobs within the tolerance; a KV cache that does not grow by one a
step fails; a malformed ``decode`` object is a protocol problem. No engine, no torch.
"""

from __future__ import annotations

import pytest

from exportlm.engines import (
    DecodeSteps,
    EngineRequest,
    EngineResult,
    Outcome,
    Reference,
    Served,
    Tolerance,
    Verdict,
    compare_result,
)
from exportlm.engines.protocol import parse_result

TOL = Tolerance(1e-4, "a test's")
PROMPTS = [[5, 6, 7], [9, 10]]
TOKENS = [[1, 2], [4, 5]]
#: eager's best (token, logprob) at each step, as a reference with window 2 * TOL.atol
#: keeps them; row 1 step 1 is a near-tie (5 vs 8, and vs 9, third by 1.5e-4)
TOP = [
    [[(1, -0.1), (7, -3.0)], [(2, -0.2), (7, -3.0)]],
    [[(4, -0.3), (7, -3.0)], [(5, -0.69310), (8, -0.69315), (9, -0.69325)]],
]


def _ref() -> Reference:
    margins = [[step[0][1] - step[1][1] for step in row] for row in TOP]
    return Reference(PROMPTS, TOKENS, [[-1.0, -2.0], [-0.5]], margins, TOP)


def _result(
    tokens: list[list[int]],
    logprobs: list[list[float]],
    top: list[list[list[tuple[int, float]]]] | None = None,
    cache: list[list[int]] | None = None,
) -> EngineResult:
    decode = DecodeSteps(logprobs, top, cache)
    return EngineResult("fake", "1.0", tokens, [[-1.0, -2.0], [-0.5]], decode=decode)


def _compare(result: EngineResult) -> Served:
    blank = Served("fake", None, "/a", None, "float32", Outcome.FAILED, Verdict.RUNS, "")
    return compare_result(blank, result, _ref(), TOL)


EAGER_LPS = [[-0.1, -0.2], [-0.3, -0.69310]]


def test_decode_steps_within_tolerance_pass_and_the_gap_is_reported() -> None:
    got = _compare(_result(TOKENS, [[-0.10001, -0.2], [-0.3, -0.69310]]))
    assert got.outcome is Outcome.PASSED, got.message
    assert got.decode_gap == pytest.approx(1e-5, rel=1e-3)
    assert got.decode_gap_at == (0, 0)
    assert "decode steps: max gap" in got.message
    assert got.row()["decode_gap_at"] == [0, 0]


def test_a_decode_step_off_fails_even_with_equal_tokens_and_scores() -> None:
    got = _compare(_result(TOKENS, [[-0.1, -0.2], [-0.3, -0.65]]))
    assert got.outcome is Outcome.FAILED
    assert got.tokens_equal
    assert got.decode_gap_at == (1, 1)
    assert "tokens equal, but" in got.message
    assert "engine -0.65, eager -0.6931" in got.message


def test_a_swap_at_a_near_tie_to_eagers_second_token_is_a_near_tie() -> None:
    top = [
        [[(1, -0.1), (7, -3)], [(2, -0.2), (7, -3)]],
        [[(4, -0.3), (7, -3)], [(8, -0.69312), (5, -0.69313)]],
    ]
    got = _compare(_result([[1, 2], [4, 8]], [[-0.1, -0.2], [-0.3, -0.69312]], top))
    assert got.outcome is Outcome.NEAR_TIE, got.message
    assert got.diverges == (1, 1)


def test_at_a_near_tie_the_engines_logprob_of_eagers_token_is_checked_too() -> None:
    top = [
        [[(1, -0.1), (7, -3)], [(2, -0.2), (7, -3)]],
        [[(4, -0.3), (7, -3)], [(8, -0.69312), (5, -0.9)]],
    ]
    got = _compare(_result([[1, 2], [4, 8]], [[-0.1, -0.2], [-0.3, -0.69312]], top))
    assert got.outcome is Outcome.FAILED
    assert "eager's token 5" in got.message


def test_a_swap_to_eagers_third_token_within_twice_the_tolerance_is_a_near_tie() -> None:
    """The swap's margin is eager's from its token to the engine's (1.5e-4 <= 2e-4), not
    its top-2 margin: bf16 rounding moves every logprob, the third best's too."""
    top = [
        [[(1, -0.1), (7, -3)], [(2, -0.2), (7, -3)]],
        [[(4, -0.3), (7, -3)], [(9, -0.69317), (5, -0.69318)]],
    ]
    got = _compare(_result([[1, 2], [4, 9]], [[-0.1, -0.2], [-0.3, -0.69317]], top))
    assert got.outcome is Outcome.NEAR_TIE, got.message
    assert "eager margin there to the engine's token 0.00015" in got.message
    assert got.decode_gap is not None
    assert got.decode_gap <= TOL.atol


def test_a_swap_further_than_twice_the_tolerance_fails_even_with_close_logprobs() -> None:
    """Eager ranks 9 1.5e-4 below its token 5: with a tolerance of 5e-5 no near-tie
    reaches it, although each logprob the engine gives is within that tolerance."""
    top = [
        [[(1, -0.1), (7, -3)], [(2, -0.2), (7, -3)]],
        [[(4, -0.3), (7, -3)], [(9, -0.69321), (5, -0.69312)]],
    ]
    result = _result([[1, 2], [4, 9]], [[-0.1, -0.2], [-0.3, -0.69321]], top)
    blank = Served("fake", None, "/a", None, "float32", Outcome.FAILED, Verdict.RUNS, "")
    got = compare_result(blank, result, _ref(), Tolerance(5e-5, "a test's"))
    assert got.outcome is Outcome.FAILED, got.message
    assert got.diverges == (1, 1)


def test_a_swap_to_a_token_eager_does_not_rank_near_its_own_is_never_a_near_tie() -> None:
    got = _compare(_result([[1, 2], [4, 11]], [[-0.1, -0.2], [-0.3, -0.69312]]))
    assert got.outcome is Outcome.FAILED
    assert "token 11 not among eager's 3 best [(5, -0.6931), (8, -0.6932), (9, -0.6933)]" in (
        got.message
    )


@pytest.mark.parametrize(
    ("cache", "says"),
    [
        ([[3, 4], [3, 4]], None),  # padded: the batch's width, then one per step
        ([[3, 4], [2, 3]], None),  # unpadded: the row's own prompt
        ([[3, 4], [3, 5]], "expected 4 (one more per step)"),
        ([[3, 4], [1, 2]], "expected the prompt's 2 (or 3 with the batch's padding)"),
    ],
)
def test_the_kv_cache_holds_the_prompt_then_one_more_per_step(
    cache: list[list[int]], says: str | None
) -> None:
    got = _compare(_result(TOKENS, EAGER_LPS, cache=cache))
    if says is None:
        assert got.outcome is Outcome.PASSED, got.message
    else:
        assert got.outcome is Outcome.FAILED
        assert says in got.message


def test_an_engine_without_decode_steps_is_compared_as_before_and_says_so() -> None:
    result = EngineResult("fake", "1.0", TOKENS, [[-1.0, -2.0], [-0.5]])
    got = _compare(result)
    assert got.outcome is Outcome.PASSED
    assert got.decode_gap is None
    assert "decode steps not reported" in got.message


@pytest.mark.parametrize(
    ("decode", "says"),
    [
        ({"logprobs": [[-0.1]]}, "decode logprobs: expected 2 rows"),
        ({"logprobs": [[-0.1, -0.2], [-0.3]]}, "decode logprobs row 1: expected 2 steps"),
        (
            {"logprobs": EAGER_LPS, "top": [[[[1, "x"]]] * 2] * 2},
            "could not convert string to float",
        ),
        ({"logprobs": EAGER_LPS, "cache_lengths": "3"}, "decode cache_lengths: expected 2 rows"),
        ("not an object", "decode must be an object"),
    ],
)
def test_a_malformed_decode_object_is_named(decode: object, says: str) -> None:
    request = EngineRequest.left_padded(PROMPTS, max_new_tokens=2)
    response = {"tokens": TOKENS, "logprobs": [[-1.0, -2.0], [-0.5]], "decode": decode}
    got = parse_result("fake", response, request)
    assert isinstance(got, str)
    assert says in got


def test_a_decode_object_parses_into_its_steps() -> None:
    request = EngineRequest.left_padded(PROMPTS, max_new_tokens=2)
    decode = {
        "logprobs": EAGER_LPS,
        "top": [[[[1, -0.1], [7, -3.0]]] * 2] * 2,
        "cache_lengths": [[3, 4], [3, 4]],
    }
    got = parse_result(
        "fake", {"tokens": TOKENS, "logprobs": [[-1.0, -2.0], [-0.5]], "decode": decode}, request
    )
    assert isinstance(got, EngineResult)
    assert got.decode == DecodeSteps(
        EAGER_LPS, [[[(1, -0.1), (7, -3.0)]] * 2] * 2, [[3, 4], [3, 4]]
    )
