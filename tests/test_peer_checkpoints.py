"""llm-compressor's own checkpoints of the real model: our loader and ``inspect`` read them.

llm-compressor 0.14 (``make engines``; ``tests/_peers.py``) quantizes the bf16 SmolLM2-135M
with its presets FP8, FP8 + FP8 KV cache, W8A8 after SmoothQuant, NVFP4 and FP8_DYNAMIC
over 16 x 256 tokens of English text, and saves them compressed (built once per machine).
Each one:

* loads with ``exportlm.load_exported("hf_checkpoint", dir)`` as written (bf16);
* computes transformers' logits on it (this venv: transformers + compressed-tensors 0.20),
  both run in float32 (``config.json``'s ``dtype`` set to ``float32`` in a copy: the stored
  tensors unchanged) with eager attention, so that neither side's bf16 rounding order
  counts: the tolerance :data:`LOGITS_ATOL` is float32 accumulation order only. Where
  transformers computes something else by design, its reference is adjusted, each named:
  - W8A8's dynamic int8 per-token activation scale: compressed-tensors' fake quantizer
    divides the row max by 127.5 (``calculate_qparams``: the int8 range 255 / 2), vLLM's
    ``scaled_int8_quant`` (and our loader, as the engine runs it) by 127; the reference
    uses 127;
  - NVFP4: compressed-tensors' decompressor dequantizes to bf16 (``unpack_fp4_from_uint8``'s
    default dtype) whatever the model's dtype; the reference dequantizes in float32. Its
    dynamic FP4 activations are discontinuous in their input: a one-ULP float32 difference
    (the order of ``code * block_scale / global_scale``) flips an FP4 code, and 30 layers
    amplify the flips (measured: 4.8 max on the logits, both sides reading the same
    values). So NVFP4 is compared linear by linear instead: each of ours, fed the input
    transformers' module received, gives its output within :data:`LINEAR_RTOL`;
  - the FP8 KV cache: transformers drops ``k_scale`` / ``v_scale`` as unexpected keys (it
    has no KV-cache quantization); the reference applies them as vLLM does,
    ``fp8(K / k_scale) * k_scale`` on the post-RoPE keys and the values, in an attention
    function registered with transformers;
* ``exportlm inspect DIR`` exits 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.cli import main
from tests._peers import LLMC_RECIPES, llmcompressor_checkpoint, llmcompressor_missing_reason

pytestmark = [pytest.mark.engines, pytest.mark.real_model, pytest.mark.interop]

#: Float32 forwards of the same stored values, eager attention on both sides (measured: 0.0
#: for FP8; the bound leaves room for a different summation order in a later torch).
LOGITS_ATOL = 1e-3
#: NVFP4, per linear: relative to the output's largest magnitude (float32 rounding of the
#: weight's dequantization order and of the block scales; measured: about 1e-7).
LINEAR_RTOL = 1e-5
#: A sentence the calibration text does not hold.
PROMPT = "The lighthouse keeper wrote in his log that the storm had passed before dawn."


@pytest.fixture(scope="module")
def llmc(real_model_dir: Path) -> Callable[[str], Path]:
    reason = llmcompressor_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return functools.cache(lambda recipe: llmcompressor_checkpoint(recipe, real_model_dir))


def _float32_copy(source: Path, out: Path) -> Path:
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _ids(directory: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return torch.tensor([AutoTokenizer.from_pretrained(directory)(PROMPT)["input_ids"]])


def _ours(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a foreign checkpoint has no manifest: unverified
        run = exportlm.load_exported("hf_checkpoint", directory)
    return torch.as_tensor(run(ids)).float()


@pytest.mark.parametrize("recipe", LLMC_RECIPES)
def test_llmcompressor_checkpoint_loads_and_matches_transformers(
    llmc: Callable[[str], Path], recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = llmc(recipe)
    ids = _ids(checkpoint)
    assert torch.isfinite(_ours(checkpoint, ids)).all()  # as written: bf16
    wide = _float32_copy(checkpoint, tmp_path / "float32")
    with _as_vllm_computes(monkeypatch, wide) as attention:
        reference = _transformers_model(wide, attention)
    if recipe == "nvfp4":
        assert _worst_linear(_our_model(wide), reference, ids) <= LINEAR_RTOL
        return
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits.float()
    got = _ours(wide, ids)
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("recipe", LLMC_RECIPES)
def test_inspect_passes_llmcompressor_checkpoint(
    llmc: Callable[[str], Path], recipe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(llmc(recipe))]) == 0, capsys.readouterr().out


def _transformers_model(directory: Path, attention: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attention).eval()


def _our_model(directory: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = exportlm.load_exported("hf_checkpoint", directory)
    return run.module.func  # type: ignore[attr-defined]  # partial(model, use_cache=False)


def _worst_linear(ours: Any, reference: Any, ids: torch.Tensor) -> float:
    """The largest relative output difference of a quantized linear fed the reference's input."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            seen.setdefault(name, (args[0], out))

        return hook

    hooks = [
        module.register_forward_hook(keep(name))
        for name, module in reference.named_modules()
        if getattr(module, "quantization_scheme", None) is not None
    ]
    with torch.no_grad():
        reference(ids, use_cache=False)
        for hook in hooks:
            hook.remove()
        modules = dict(ours.named_modules())
        worst = 0.0
        for name, (given, expected) in seen.items():
            got = modules[name](given)
            scale = float(expected.abs().max()) or 1.0
            worst = max(worst, float((got - expected).abs().max()) / scale)
    assert len(seen) == 210, sorted(seen)[:3]  # every linear but lm_head
    return worst


@contextlib.contextmanager
def _as_vllm_computes(monkeypatch: pytest.MonkeyPatch, directory: Path) -> Iterator[str]:
    """transformers' compressed-tensors path, adjusted where it differs by design (docstring)."""
    pytest.importorskip("compressed_tensors", reason="the interop extra (make test installs it)")
    from compressed_tensors.compressors.nvfp4 import base as nvfp4
    from compressed_tensors.quantization.lifecycle import forward

    monkeypatch.setattr(
        nvfp4,
        "unpack_fp4_from_uint8",
        functools.partial(nvfp4.unpack_fp4_from_uint8, dtype=torch.float32),
    )
    monkeypatch.setattr(
        forward,
        "compute_dynamic_scales_and_zp",
        _int8_per_token_over_127(forward.compute_dynamic_scales_and_zp),
    )
    yield _register_fp8_kv_attention(directory)


def _int8_per_token_over_127(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute(value: torch.Tensor, args: Any, module: Any, global_scale: Any = None) -> Any:
        scale, zero_point = original(value, args, module, global_scale=global_scale)
        if args.type == "int" and args.strategy == "token":
            amax = value.abs().amax(dim=-1, keepdim=True).float()
            scale = (amax / 127.0).to(scale.dtype).reshape(scale.shape)
        return scale, zero_point

    return compute


def _register_fp8_kv_attention(directory: Path) -> str:
    """``eager`` attention with K and V through FP8 at the stored scales (when it has them)."""
    from safetensors import safe_open
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    scales: dict[tuple[int, str], torch.Tensor] = {}
    for shard in directory.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    layer = int(name.split(".")[2])
                    scales[layer, name[-7]] = handle.get_tensor(name).float()
    if not scales:
        return "eager"

    def fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        codes = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (codes.float() * scale).to(x.dtype)

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        layer = module.layer_idx
        key, value = fp8(key, scales[layer, "k"]), fp8(value, scales[layer, "v"])
        return eager_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("exportlm_fp8_kv", attention)
    # eager's causal mask: a function without one would get sdpa's, which may be None
    ALL_MASK_ATTENTION_FUNCTIONS.register("exportlm_fp8_kv", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return "exportlm_fp8_kv"
