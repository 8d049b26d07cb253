"""``verify_onnx``: check an ONNX file and compare its onnxruntime logits with the eager model.

Verification returns a report (:class:`OnnxVerification`) and never asserts;
tests and the CLI decide what a failure means. Needs the optional ``onnx`` and
``onnxruntime`` packages (the ``onnx`` extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.export._moe import traceable_model
from exportlm.export._optional import require_modules
from exportlm.export.onnx.export import ONNX_ATOL, ONNX_RTOL
from exportlm.export.onnx.runtime import load_onnx
from exportlm.export.roundtrip import Tolerance, eager_logits, verify_roundtrip
from exportlm.inputs import resolve_example_inputs
from exportlm.inspection import check_onnx_size

__all__ = ["OnnxVerification", "verify_onnx"]

_NAN = float("nan")


@dataclass(frozen=True)
class OnnxVerification:
    """The result of :func:`verify_onnx`: structural check plus onnxruntime roundtrip vs eager.

    ``passed`` is true when the checker accepts the file, onnxruntime ran it, the
    shapes match and every logit satisfies ``|ort - eager| <= atol + rtol * |eager|``.
    ``error`` holds the checker or runtime failure, if any (then the diffs are NaN).
    """

    path: Path
    checker_ok: bool
    max_abs: float
    max_rel: float
    mismatch_fraction: float
    expected_shape: tuple[int, ...]
    actual_shape: tuple[int, ...]
    atol: float
    rtol: float
    passed: bool
    error: str | None = None

    def summary(self) -> str:
        """One line: verdict, max abs / rel diff and mismatch percentage."""
        verdict = "passed" if self.passed else "FAILED"
        text = (
            f"{self.path.name}: {verdict}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
            f"{100 * self.mismatch_fraction:.3g}% beyond atol={self.atol:g} rtol={self.rtol:g}"
        )
        return text + (f" ({self.error})" if self.error else "")


def verify_onnx(
    path: str | os.PathLike[str],
    model: nn.Module,
    example_inputs: Any = None,
    *,
    atol: float = ONNX_ATOL,
    rtol: float = ONNX_RTOL,
    device: str = "cpu",
) -> OnnxVerification:
    """Check an ONNX file and compare its onnxruntime logits with ``model``'s eager logits.

    Returns a report; it never asserts. ``example_inputs`` (``input_ids``) default to
    the deterministic ids export uses; pass other shapes to check dynamic axes. The
    model is run in eval mode and restored.

    A quantized (QDQ) file is compared with the fake-quantized ``model``. With FP8
    activations, an activation within an ulp of an FP8 rounding midpoint can round the
    other way in onnxruntime (one FP8 step); on a rare input set the logits then differ
    by more than ``ONNX_ATOL`` (``docs/onnx-quantized.md`` gives the measured size):
    compare a few input sets, or pass a looser ``atol``.

    Raises:
        MissingDependencyError: ``onnx`` or ``onnxruntime`` is not installed.
    """
    require_modules(
        "onnx", "onnxruntime", extra="onnx", purpose="verifying an ONNX file with verify_onnx"
    )
    import onnx

    file = Path(path)
    ids = resolve_example_inputs(model, example_inputs)[0]
    with traceable_model(model, experts=None):
        expected = eager_logits(model, ids).float().cpu()
    shape = tuple(expected.shape)

    def failed(
        checker_ok: bool, error: str, actual: tuple[int, ...] = (), mismatch: float = _NAN
    ) -> OnnxVerification:
        return OnnxVerification(
            file, checker_ok, _NAN, _NAN, mismatch, shape, actual, atol, rtol, False, error
        )

    try:
        check_onnx_size(file)  # the checker and onnxruntime would read a 16 GiB sparse file whole
    except (ValueError, OSError) as err:  # InputTooLargeError, NotRegularFileError, missing
        return failed(False, f"{type(err).__name__}: {err}")
    try:
        onnx.checker.check_model(str(file), full_check=False)
    except Exception as err:  # the checker raises ValidationError and friends
        return failed(False, f"onnx.checker: {type(err).__name__}: {err}")
    try:
        runtime = load_onnx(file, device=device)
        comparison = verify_roundtrip(model, runtime, ids, Tolerance(atol, rtol), expected=expected)
    except Exception as err:  # MalformedOnnxError (what onnxruntime would refuse), or its own
        return failed(True, f"onnxruntime: {type(err).__name__}: {err}")
    if comparison.shape_mismatch:
        return failed(True, "shape mismatch", comparison.actual_shape, mismatch=1.0)
    return OnnxVerification(
        file,
        True,
        comparison.max_abs,
        comparison.max_rel,
        comparison.mismatch_pct / 100.0,
        shape,
        comparison.actual_shape,
        atol,
        rtol,
        passed=comparison.passed,
    )
