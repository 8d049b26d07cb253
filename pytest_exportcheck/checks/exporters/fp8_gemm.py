"""``fp8_gemm`` (scope ``"exporter"``): the exported FP8 linears, run as a serving engine runs them.

A serving engine does not dequantize an FP8 checkpoint: it quantizes the
activations with the stored ``input_scale`` and multiplies the float8 codes on
the tensor cores, scaling the float32 accumulator by ``input_scale *
weight_scale`` (vLLM's ``Fp8LinearMethod``, TensorRT-LLM's FP8 GEMM). This check
does exactly that with ``torch._scaled_mm`` and compares the result with the
fake-quant module's forward.

The GEMM is pluggable: :func:`compare_fp8_linear` takes any :data:`GemmFn`.
:func:`scaled_mm_gemm` is the one the check uses (CUDA, compute capability 8.9
or newer: Ada, Hopper, Blackwell); :func:`reference_gemm` (dequantize, then a
float32 matmul) computes the same product anywhere, so the comparison itself is
tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from exportlm.quant import quantize_tensor
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import CheckAbort, aborts_to_result, attempt
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks._support import require_cuda_capability
from pytest_exportcheck.checks._survey import exporter_entry, selected_models, survey_of

__all__ = [
    "FP8_GEMM_CAPABILITY",
    "GEMM_ATOL",
    "GEMM_ALIGNMENT",
    "GEMM_RTOL",
    "GEMM_TOKENS",
    "Fp8GemmComparison",
    "GemmFn",
    "compare_fp8_linear",
    "fp8_gemm",
    "fp8_linear_prefixes",
    "reference_gemm",
    "scaled_mm_gemm",
]

#: ``(a, b, scale_a, scale_b) -> (a * scale_a) @ (b * scale_b).T`` in float32, where ``a``
#: ``[M, K]`` and ``b`` ``[N, K]`` (a linear's weight, row-major) are float8_e4m3fn and
#: the scales float32 0-d tensors.
GemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: The first compute capability with FP8 tensor cores (Ada; Hopper is 9.0).
FP8_GEMM_CAPABILITY = (8, 9)
#: ``torch._scaled_mm`` needs ``K`` and ``N`` divisible by 16; ``M`` is too, to be safe.
GEMM_ALIGNMENT = 16
#: Rows (tokens) of the activations every linear is run on.
GEMM_TOKENS = 32
#: Tolerance of the comparison, elementwise:
#: ``|gemm - fake_quant| <= GEMM_RTOL * (|x_q| @ |w_q|.T) + GEMM_ATOL``.
#: Both sides sum the same products of float8 values times their scales; they
#: differ only in rounding: the fake-quant forward rounds each scaled element to
#: float32 and accumulates in float32 in its kernel's order, the FP8 GEMM
#: multiplies the codes exactly, accumulates in the tensor cores' order (on
#: Hopper with partial sums narrower than float32, about 14 bits, promoted to
#: float32 periodically) and scales once at the end. Such errors are bounded by
#: a small multiple of the accumulator's unit roundoff (2**-14 = 6e-5 at worst)
#: times the sum of the absolute products, ``|x_q| @ |w_q|.T``; 1e-3 leaves more
#: than an order of magnitude of margin. A wrong scale is off by ``delta * |y|``,
#: which for any real error (a scale off by a few percent, a transposed or
#: mis-split weight) exceeds the bound on most elements.
GEMM_RTOL = 1e-3
GEMM_ATOL = 1e-6

_FP8 = torch.float8_e4m3fn


def reference_gemm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """The :data:`GemmFn` of a loader that dequantizes: ``(a * scale_a) @ (b * scale_b).T``."""
    return (a.to(torch.float32) * scale_a) @ (b.to(torch.float32) * scale_b).t()


def scaled_mm_gemm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """The :data:`GemmFn` of a serving engine: ``torch._scaled_mm`` on the float8 codes.

    ``torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=...)`` (private in
    torch; no public FP8 GEMM exists) wants ``mat1`` row-major and ``mat2``
    column-major: the weight ``[N, K]`` row-major, transposed, is exactly that, as
    in vLLM. Per-tensor scales are float32 with one element; the output is
    float32 (no bias: ``_scaled_mm`` refuses a bias with a float32 output, so the
    caller adds it).
    """
    scale_a = scale_a.to(device=a.device, dtype=torch.float32).reshape(())
    scale_b = scale_b.to(device=a.device, dtype=torch.float32).reshape(())
    return torch._scaled_mm(
        a.contiguous(), b.contiguous().t(), scale_a, scale_b, out_dtype=torch.float32
    )


@dataclass(frozen=True)
class Fp8GemmComparison:
    """How far the FP8 GEMM of one exported linear is from its fake-quant forward.

    Attributes:
        name: the linear's module name.
        shape: ``(M, K, N)`` of the GEMM.
        max_abs: the largest ``|gemm - fake_quant|``.
        max_ratio: the largest ``|gemm - fake_quant| / bound`` (passes when <= 1).
        mismatched: elements beyond the bound (NaN / inf count as mismatched).
    """

    name: str
    shape: tuple[int, int, int]
    max_abs: float
    max_ratio: float
    mismatched: int

    @property
    def passed(self) -> bool:
        """Every element within :data:`GEMM_RTOL` / :data:`GEMM_ATOL`."""
        return self.mismatched == 0

    def summary(self) -> str:
        """One line: the linear, the shape and the numbers."""
        m, k, n = self.shape
        return (
            f"{self.name} [M={m}, K={k}, N={n}]: max abs {self.max_abs:.3g}, "
            f"{self.max_ratio:.3g} of the bound, {self.mismatched} of {m * n} beyond "
            f"{GEMM_RTOL:g} * (|x_q| @ |w_q|^T) + {GEMM_ATOL:g}"
        )


def fp8_linear_prefixes(names: Mapping[str, torch.Tensor] | list[str]) -> list[str]:
    """Module names with a float8 ``weight``, a ``weight_scale`` and an ``input_scale``."""
    present = set(names)
    return sorted(
        name.removesuffix(".weight")
        for name in present
        if name.endswith(".weight")
        and {f"{name.removesuffix('.weight')}.{leaf}" for leaf in ("weight_scale", "input_scale")}
        <= present
    )


def _activations(k: int, amax: float, device: torch.device, seed: int) -> torch.Tensor:
    """Deterministic ``[GEMM_TOKENS, k]`` activations (numpy PCG64) with ``max |x| = 0.9 amax``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    x = rng.standard_normal((GEMM_TOKENS, k)).astype(np.float32)
    x *= np.float32(0.9 * amax) / np.abs(x).max()
    return torch.from_numpy(x).to(device)


def compare_fp8_linear(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    gemm: GemmFn = reference_gemm,
    *,
    seed: int = 0,
) -> Fp8GemmComparison:
    """Run the exported FP8 linear ``prefix`` through ``gemm`` and compare with ``module``.

    ``tensors`` holds what the exporter wrote: ``{prefix}.weight`` (float8_e4m3fn
    ``[N, K]``), ``{prefix}.weight_scale`` and ``{prefix}.input_scale`` (float32,
    one element). Activations ``[GEMM_TOKENS, K]`` are drawn from numpy's PCG64
    (``seed``) within the calibrated range, quantized with the exported
    ``input_scale`` (:func:`exportlm.quant.quantize_tensor`), multiplied by
    ``gemm``; the module's bias is added in float32. The reference is the
    fake-quant ``module``'s own forward on the same activations.

    Raises:
        ValueError: a tensor is missing or of the wrong dtype / shape.
    """
    weight, weight_scale, input_scale = (
        tensors[f"{prefix}.{leaf}"] for leaf in ("weight", "weight_scale", "input_scale")
    )
    if weight.dtype != _FP8 or weight.dim() != 2:
        raise ValueError(
            f"{prefix}.weight is {weight.dtype} {tuple(weight.shape)}; an FP8 linear's weight "
            "is float8_e4m3fn [out_features, in_features]"
        )
    for leaf, scale in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(
                f"{prefix}.{leaf} is {scale.dtype} {tuple(scale.shape)}; per-tensor FP8 "
                "scales are float32 with one element"
            )
    param = next(module.parameters())
    device = param.device
    weight, weight_scale, input_scale = (
        t.to(device) for t in (weight, weight_scale, input_scale.reshape(()))
    )
    x = _activations(weight.shape[1], float(input_scale) * 448.0, device, seed).to(param.dtype)
    x_q = quantize_tensor(x, "fp8", scale=input_scale, where=f"{prefix} input").data
    with torch.no_grad():
        got = gemm(x_q, weight, input_scale, weight_scale).to(torch.float32)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            got = got + bias.to(torch.float32)
        expected = module(x).to(torch.float32)
        magnitude = (x_q.to(torch.float32).abs() * input_scale) @ (
            weight.to(torch.float32).abs() * weight_scale
        ).t()
    return _compare(prefix, got, expected, GEMM_RTOL * magnitude + GEMM_ATOL, weight.shape)


def _compare(
    name: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    bound: torch.Tensor,
    weight_shape: torch.Size,
) -> Fp8GemmComparison:
    shape = (GEMM_TOKENS, int(weight_shape[1]), int(weight_shape[0]))
    if got.shape != expected.shape:
        raise ValueError(
            f"{name}: the GEMM returned shape {tuple(got.shape)}, the module "
            f"{tuple(expected.shape)}; expected [{shape[0]}, {shape[2]}]"
        )
    diff = (got - expected).abs()
    finite = torch.isfinite(got) & torch.isfinite(expected)
    within = finite & (diff <= bound)
    ratio = torch.where(finite, diff / bound, torch.full_like(diff, float("inf")))
    return Fp8GemmComparison(
        name=name,
        shape=shape,
        max_abs=float(diff[finite].max()) if bool(finite.any()) else float("inf"),
        max_ratio=float(ratio.max()),
        mismatched=int((~within).sum()),
    )


def _gemm_ready(module: nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str) -> str | None:
    """Why ``prefix`` cannot go through ``_scaled_mm``, or ``None``."""
    weight = tensors[f"{prefix}.weight"]
    if weight.dtype != _FP8 or weight.dim() != 2 or not isinstance(module, nn.Module):
        return f"{prefix}: not a 2-D float8 weight"
    if any(d % GEMM_ALIGNMENT for d in weight.shape):
        return f"{prefix}: shape {tuple(weight.shape)} not divisible by {GEMM_ALIGNMENT}"
    if not callable(getattr(module, "forward", None)) or next(module.parameters(), None) is None:
        return f"{prefix}: the module has no parameters to run"
    return None


@check("fp8_gemm")
@aborts_to_result
def fp8_gemm(case: ExporterCase) -> CheckResult:
    """On a CUDA device of compute capability 8.9 or newer, the exported FP8 linears run
    through ``torch._scaled_mm`` match the fake-quant forward within
    ``|gemm - fake_quant| <= 1e-3 * (|x_q| @ |w_q|^T) + 1e-6``.

    The toy models of ``--export-models`` are quantized with ``fp8`` on the
    case's device and exported; every module the exporter wrote a float8
    ``weight``, ``weight_scale`` and ``input_scale`` for (dimensions divisible by
    16) is run as a serving engine runs it: activations quantized with the stored
    ``input_scale``, ``torch._scaled_mm`` on the codes with both scales, bias
    added in float32. See :data:`GEMM_RTOL` for why the tolerance holds. Skips on
    the CPU, on an older GPU (a failure there under ``--export-require-device``)
    and for an exporter that writes no such linear.
    """
    exporter_entry(case)
    require_cuda_capability(
        case.device,
        FP8_GEMM_CAPABILITY,
        what="fp8_gemm (torch._scaled_mm)",
        require=bool(case.options.get("require_device")),
    )
    fresh = CheckServices(registries=case.services.registries)  # nothing shared, as before
    survey = survey_of(
        selected_models(case), case.seed, ("fp8",), device=case.device, services=fresh
    )
    results: list[Fp8GemmComparison] = []
    skipped: list[str] = []
    for q in survey.quantized:
        modules = dict(q.model.named_modules())
        for call in (c for c in q.calls if c.exporter == case.name):
            for prefix in fp8_linear_prefixes(list(call.names)):
                module = modules.get(prefix)
                reason = (
                    "no such module" if module is None else _gemm_ready(module, q.tensors, prefix)
                )
                if module is None or reason:
                    skipped.append(f"{q.model_name}: {reason}")
                    continue
                what = f"{q.model_name}: running {prefix} through torch._scaled_mm"
                compared = attempt(
                    what,
                    compare_fp8_linear,
                    module,
                    q.tensors,
                    prefix,
                    scaled_mm_gemm,
                    seed=case.seed + len(results),
                )
                results.append(_labelled(compared, q.model_name))
    return _verdict(case.name, results, skipped)


def _labelled(result: Fp8GemmComparison, model: str) -> Fp8GemmComparison:
    return Fp8GemmComparison(
        f"{model}: {result.name}", result.shape, result.max_abs, result.max_ratio, result.mismatched
    )


def _verdict(exporter: str, results: list[Fp8GemmComparison], skipped: list[str]) -> CheckResult:
    details: dict[str, Any] = {
        "linears": len(results),
        "not_gemm_ready": len(skipped),
        "max_ratio": max((r.max_ratio for r in results), default=0.0),
        "max_abs": max((r.max_abs for r in results), default=0.0),
    }
    if not results:
        why = f" ({len(skipped)} not GEMM-ready: {'; '.join(skipped[:3])})" if skipped else ""
        raise CheckAbort(
            CheckResult.skipped(
                f"module exporter {exporter!r} writes no FP8 linear (float8 weight, weight_scale, "
                f"input_scale) in the toy models quantized with fp8{why}",
                **details,
            )
        )
    failed = [r for r in results if not r.passed]
    if failed:
        lines = "\n".join(r.summary() for r in failed[:8])
        return CheckResult.failed(
            f"{len(failed)} of {len(results)} FP8 linear(s) written by {exporter!r} give another "
            f"result through torch._scaled_mm than the fake-quant forward (wrong scale, layout "
            f"or codes?):\n{lines}",
            **details,
        )
    worst = max(results, key=lambda r: r.max_ratio)
    return CheckResult.passed(
        f"{len(results)} FP8 linear(s) through torch._scaled_mm; worst: {worst.summary()}",
        **details,
    )
