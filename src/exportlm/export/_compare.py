"""One logits comparison for the whole project: max abs, max rel, mismatch %; NaN/inf fail.

Used by :func:`exportlm.export.onnx.verify_onnx`, ``exportlm export --verify`` and
every conformance check, so a number means the same thing wherever it is printed.

The comparison is ``|actual - expected| <= atol + rtol * |expected|`` elementwise
(the convention of :class:`exportlm.export.TargetInfo` and ``torch.isclose``),
computed in float64 on the host so the numbers in a message do not depend on the
device or dtype of the logits. A failure's message names both sides' dtype and shape
when they differ (a runtime that returns float16 logits says so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["LogitsComparison", "compare_logits", "dtype_name", "to_numpy"]


@dataclass(frozen=True)
class LogitsComparison:
    """The numbers of one comparison.

    Attributes:
        max_abs: largest ``|actual - expected|`` (``inf`` where a value is NaN/inf).
        max_rel: largest ``|actual - expected| / |expected|`` (``0/0`` counts as 0).
        mismatch_pct: percentage of elements beyond ``atol + rtol * |expected|``
            (non-finite elements always count).
        passed: no element beyond the tolerance, shapes equal, everything finite.
        atol, rtol: the tolerance used.
        numel: number of compared elements.
        nonfinite: number of positions where either side is NaN or inf.
        actual_shape, expected_shape: the shapes compared.
        actual_dtype, expected_dtype: the dtypes as given (``"float16"``,
            ``"bfloat16"``), before the float64 copy the numbers are computed on.
    """

    max_abs: float
    max_rel: float
    mismatch_pct: float
    passed: bool
    atol: float
    rtol: float
    numel: int
    nonfinite: int
    actual_shape: tuple[int, ...]
    expected_shape: tuple[int, ...]
    actual_dtype: str = "float64"
    expected_dtype: str = "float64"

    @property
    def shape_mismatch(self) -> bool:
        """True when the two sides do not have the same shape (nothing else was compared)."""
        return self.actual_shape != self.expected_shape

    @property
    def dtype_mismatch(self) -> bool:
        """True when the two sides came with different dtypes (compared in float64 anyway)."""
        return self.actual_dtype != self.expected_dtype

    def summary(self) -> str:
        """One line for a failure message: the numbers and the tolerance.

        When dtypes or shapes differ, it ends with both sides' dtype and shape.
        """
        sides = (
            f"; got {self.actual_dtype} {list(self.actual_shape)}, expected "
            f"{self.expected_dtype} {list(self.expected_shape)}"
            if self.dtype_mismatch
            else ""
        )
        if self.shape_mismatch:
            return (
                f"shape {list(self.actual_shape)} does not match the expected "
                f"{list(self.expected_shape)}"
            ) + sides
        text = (
            f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
            f"{self.mismatch_pct:.3g}% of {self.numel} elements beyond "
            f"atol={self.atol:g} + rtol={self.rtol:g}*|expected|"
        )
        if self.nonfinite:
            text += f"; {self.nonfinite} NaN/inf value(s)"
        return text + sides

    def details(self) -> dict[str, Any]:
        """A JSON-friendly dict for ``CheckResult.details`` and the report."""
        data = asdict(self)
        data["actual_shape"] = list(self.actual_shape)
        data["expected_shape"] = list(self.expected_shape)
        return data


def dtype_name(value: Any) -> str:
    """``"float16"`` for a torch tensor or numpy array of that dtype (numpy's name otherwise)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return str(np.asarray(value).dtype)
    return str(dtype).removeprefix("torch.")


def to_numpy(value: Any) -> np.ndarray:
    """A float64 host copy of a torch tensor, numpy array or nested sequence.

    Torch tensors are detached and moved to the CPU first; low-precision floats
    (bf16, fp8) are widened through float32, which numpy cannot skip.
    """
    if hasattr(value, "detach") and hasattr(
        value, "cpu"
    ):  # a torch tensor, without importing torch
        tensor = value.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()
        value = tensor.numpy()
    return np.asarray(value, dtype=np.float64)


def compare_logits(actual: Any, expected: Any, atol: float, rtol: float) -> LogitsComparison:
    """Compare ``actual`` logits with ``expected`` (the eager model's) within ``atol``/``rtol``.

    Either side may be a torch tensor or a numpy array. NaN or inf on either side
    is a mismatch at that element (never "equal because both are NaN"). A shape
    mismatch fails with every number set to ``inf``.
    """
    dtypes = {"actual_dtype": dtype_name(actual), "expected_dtype": dtype_name(expected)}
    a = to_numpy(actual)
    e = to_numpy(expected)
    if a.shape != e.shape:
        inf = float("inf")
        return LogitsComparison(
            inf, inf, 100.0, False, atol, rtol, 0, 0, a.shape, e.shape, **dtypes
        )
    numel = int(e.size)
    if numel == 0:
        return LogitsComparison(0.0, 0.0, 0.0, True, atol, rtol, 0, 0, a.shape, e.shape, **dtypes)
    finite = np.isfinite(a) & np.isfinite(e)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        diff = np.where(finite, np.abs(a - e), np.inf)
        magnitude = np.abs(e)
        rel = np.where(diff == 0.0, 0.0, diff / magnitude)
        mismatched = ~finite | (diff > atol + rtol * magnitude)
    count = int(mismatched.sum())
    return LogitsComparison(
        max_abs=float(diff.max()),
        max_rel=float(np.nan_to_num(rel, nan=np.inf).max()),
        mismatch_pct=100.0 * count / numel,
        passed=count == 0,
        atol=float(atol),
        rtol=float(rtol),
        numel=numel,
        nonfinite=int((~finite).sum()),
        actual_shape=tuple(a.shape),
        expected_shape=tuple(e.shape),
        **dtypes,
    )
