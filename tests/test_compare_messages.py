"""A logits mismatch message names both sides' dtype and shape when they differ."""

from __future__ import annotations

import numpy as np
import torch

from exportlm.export import compare_logits

EXPECTED = torch.linspace(-3.0, 3.0, 2 * 8 * 16).reshape(2, 8, 16)


def test_float16_logits_that_miss_the_tolerance_name_the_dtype() -> None:
    result = compare_logits(EXPECTED.half(), EXPECTED, atol=1e-5, rtol=1e-5)
    assert not result.passed
    assert result.dtype_mismatch
    summary = result.summary()
    assert summary.startswith("max abs ")
    assert summary.endswith("; got float16 [2, 8, 16], expected float32 [2, 8, 16]")


def test_a_shape_mismatch_with_another_dtype_names_both() -> None:
    result = compare_logits(EXPECTED[:1].bfloat16(), EXPECTED, atol=1e-4, rtol=1e-4)
    assert result.summary() == (
        "shape [1, 8, 16] does not match the expected [2, 8, 16]; "
        "got bfloat16 [1, 8, 16], expected float32 [2, 8, 16]"
    )


def test_numpy_dtypes_are_named_the_same_way() -> None:
    result = compare_logits(EXPECTED.numpy().astype(np.float16), EXPECTED, atol=0.0, rtol=0.0)
    assert "got float16 [2, 8, 16], expected float32 [2, 8, 16]" in result.summary()
    assert result.details()["actual_dtype"] == "float16"


def test_same_dtype_messages_are_unchanged() -> None:
    result = compare_logits(EXPECTED + 1e-2, EXPECTED, atol=1e-4, rtol=1e-4)
    assert not result.passed
    assert "got " not in result.summary()
    assert result.details()["expected_dtype"] == result.details()["actual_dtype"] == "float32"
