"""``served`` covers the compressed-tensors integer recipes vLLM's CPU build runs.

Nothing here starts an engine (the items themselves run in ``make test-engines``): the
served artifacts, the dtype each engine is asked for (its support-table row's), and a
stated tolerance for every (engine, scheme, dtype) the check can serve on a CPU, and
prompts chosen as cheaply as the wide W8A8 margin allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.engines import (
    Verdict,
    artifact_kind,
    choose_prompts,
    eager_reference,
    get_engine,
)
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from pytest_exportcheck.checks.targets.served import (
    CUDA_DTYPE,
    QUANTIZED,
    QUANTIZED_CUDA,
    SERVED_FAMILIES,
    Quantized,
    served_dtype,
)

_HF = "hf_checkpoint"


def test_served_checkpoints_include_the_ct_integer_layouts() -> None:
    served = {(q.layout, q.recipe, q.scheme) for q in QUANTIZED}
    assert ("compressed-tensors", "w8a8", "W8A8") in served
    assert ("compressed-tensors", "int4_awq:scales=compressed-tensors", "W4A16") in served
    awq = next(q for q in QUANTIZED if q.recipe.startswith("int4_awq"))
    assert not awq.exclude  # every linear: the scales no norm takes fold into the op before


def test_each_engine_is_asked_for_its_rows_dtype() -> None:
    vllm, transformers = get_engine("vllm"), get_engine("transformers")
    ct = "compressed-tensors"
    assert served_dtype(vllm, _HF, ct, "W8A8", "llama") == "bfloat16"
    assert served_dtype(vllm, _HF, ct, "W4A16", "llama") == "float16"  # bf16 swapped tokens
    assert served_dtype(vllm, _HF, None, None, "llama") is None  # the checkpoint's own
    # a row limited to a model type decides for that model type (float32 misread row)
    assert served_dtype(transformers, _HF, ct, "FP8", "qwen3_moe") is None
    assert served_dtype(transformers, _HF, ct, "FP8", "llama") is None


def test_a_scheme_tolerance_takes_precedence_over_the_dtype_one() -> None:
    vllm = get_engine("vllm")
    w8a8 = vllm.tolerance("bfloat16", "W8A8")
    bf16 = vllm.tolerance("bfloat16")
    assert w8a8 is not None
    assert bf16 is not None
    assert (w8a8.dtype, w8a8.scheme) == ("bfloat16", "W8A8")
    assert w8a8.atol > bf16.atol
    assert "0.305" in w8a8.evidence
    # a scheme without a row of its own: the engine's dtype tolerance
    assert vllm.tolerance("bfloat16", "FP8") is bf16
    assert vllm.tolerance("float16") is None  # plain float16: nothing stated


def test_every_quantized_item_vllm_or_transformers_runs_on_cpu_has_a_tolerance() -> None:
    """Else the served item fails with 'no tolerance stated' instead of comparing."""
    missing = []
    for name in ("vllm", "transformers"):
        engine = get_engine(name)
        for q in QUANTIZED:
            for family in SERVED_FAMILIES:
                dtype = served_dtype(engine, _HF, q.layout, q.scheme, family) or "float32"
                match = engine.support(_HF, q.layout, q.scheme, dtype=dtype, model_type=family)
                if match.verdict is Verdict.RUNS and engine.tolerance(dtype, q.scheme) is None:
                    missing.append((name, q.scheme, dtype, family))
    assert not missing


def _chosen_from_full_references(model: object, min_margin: float, tries: int) -> list[list[int]]:
    """choose_prompts' rule, spelled out with whole eager references for every draw."""
    import numpy as np

    from exportlm.engines.reference import FIRST_ID, PROMPT_LENGTHS, PROMPT_SEED

    rng = np.random.default_rng(PROMPT_SEED)
    chosen = []
    for length in PROMPT_LENGTHS:
        best: tuple[float, list[int]] | None = None
        for _ in range(tries):
            prompt = [int(t) for t in rng.integers(FIRST_ID, 256, size=length)]
            margin = eager_reference(model, [prompt]).min_margin
            if best is None or margin > best[0]:
                best = (margin, prompt)
            if margin > min_margin:
                break
        assert best is not None
        chosen.append(best[1])
    return chosen


@pytest.mark.parametrize("min_margin", [2.0, 50.0])  # 50: no draw clears it, the best is taken
def test_prompts_stopped_early_are_the_prompts_full_references_choose(min_margin: float) -> None:
    model = tiny_hf_model("llama", seed=0, initializer_range=0.3, num_hidden_layers=1)
    assert model.config.vocab_size == 256
    got = choose_prompts(model, min_margin=min_margin, tries=3)
    assert got == _chosen_from_full_references(model, min_margin, tries=3)


@pytest.mark.parametrize("family", sorted(SERVED_FAMILIES))
@pytest.mark.parametrize("item", QUANTIZED_CUDA, ids=lambda q: f"{q.layout}-{q.recipe}")
def test_every_gpu_served_checkpoint_exports_and_its_row_runs_on_cuda_only(
    item: Quantized, family: str, tmp_path: Path
) -> None:
    """What the GPU runner's served item will ask vLLM for, checked without a GPU: the toy
    exports in the layout, the file reads back as the row's scheme, the row runs on CUDA
    in bfloat16 with a stated tolerance, and on a CPU it is an engine limit with a reason."""
    model = tiny_hf_model(family)
    batch = torch.randint(
        0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, item.recipe, exclude=list(item.exclude) or None, calibrate=lambda m: m(batch))
    path = Path(exportlm.export_model(_HF, model, tmp_path / "ckpt", format=item.layout))
    read = artifact_kind(path)
    assert (read.layout, read.scheme) == (item.layout, item.scheme)
    vllm = get_engine("vllm")
    cuda = vllm.support(
        _HF, item.layout, item.scheme, dtype=CUDA_DTYPE, device="cuda", model_type=family
    )
    assert cuda.verdict is Verdict.RUNS, cuda
    assert vllm.tolerance(CUDA_DTYPE, item.scheme) is not None
    cpu = vllm.support(
        _HF, item.layout, item.scheme, dtype=CUDA_DTYPE, device="cpu", model_type=family
    )
    assert cpu.verdict is Verdict.ENGINE_LIMIT
    assert cpu.row is not None
    assert cpu.row.limit


def test_a_scheme_the_engine_runs_on_one_gpu_generation_is_skipped_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W4AFP8: vLLM's CUTLASS W4A8 on compute capability 9.0 only; elsewhere a skip naming
    both, never a failure the GPU cannot help (and nothing asked of CUDA on the CPU)."""
    from pytest_exportcheck.checks._common import CheckAbort
    from pytest_exportcheck.checks.targets._served_artifacts import require_capability

    w4afp8 = next(q for q in QUANTIZED_CUDA if q.scheme == "W4AFP8")
    assert w4afp8.capability == (9, 0)
    require_capability("cpu", w4afp8)  # the CPU items never serve it: no CUDA call
    found = {"cap": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device: found["cap"])
    with pytest.raises(CheckAbort) as skipped:
        require_capability("cuda:0", w4afp8)
    assert skipped.value.result.status == "skip"
    assert "capability 9.0 only; this GPU is 8.0" in str(skipped.value.result.message)
    found["cap"] = (9, 0)
    require_capability("cuda:0", w4afp8)  # Hopper: served
    plain = next(q for q in QUANTIZED_CUDA if q.scheme == "FP8")
    require_capability("cuda:0", plain)  # no capability stated: any GPU
