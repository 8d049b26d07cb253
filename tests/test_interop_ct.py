"""compressed-tensors layouts of INT4 AWQ, INT8 weight-only and NVFP4 against compressed-tensors itself.

(a) bytes: every tensor we write for a quantized linear equals what compressed-tensors'
    own compressor (``pack-quantized`` / ``nvfp4-pack-quantized``) writes for the same
    quantized weight and scales; the ``config_groups`` group equals the one
    compressed-tensors serializes for the same scheme.
(b) transformers (this venv) loads each checkpoint with logits within 1e-4 of the
    fake-quantized model; so does the engines' transformers 5.19 + compressed-tensors
    0.17 (``EXPORTLM_ENGINE_TRANSFORMERS``, ``make engines``).
(c) vLLM's CPU build serves the INT4 AWQ checkpoint (``EXPORTLM_ENGINE_VLLM``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantRecipe, dequantize, quantize
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, get_format
from tests.test_interop import _calibration_batch as _batch
from tests.test_interop import _tensors

pytestmark = pytest.mark.interop

#: recipe -> (the format, the modules left unquantized). INT4 AWQ quantizes every linear:
#: under the compressed-tensors convention (``QuantRecipe.for_layout``, as the CLI applies
#: it) down_proj's scale folds into up_proj, and o_proj (grouped-query attention: no
#: linear before it takes a scale) is round-to-nearest.
RECIPES: dict[str, tuple[str, list[str] | None]] = {
    "int4_awq": ("int4", None),
    "int8_wo": ("int8", None),
    "nvfp4": ("nvfp4", None),
}
LAYOUT = CHECKPOINT_LAYOUTS["compressed-tensors"]
LOGITS_ATOL = 1e-4


def _export(recipe: str, out: Path) -> tuple[torch.nn.Module, Path]:
    model = tiny_hf_model("llama", seed=0).eval()
    batch = _batch(model.config.vocab_size)
    converted = QuantRecipe.parse(recipe).for_layout("compressed-tensors")
    quantize(model, converted, calibrate=lambda m: m(batch), exclude=RECIPES[recipe][1])
    path: Path = exportlm.export_model("hf_checkpoint", model, out, format="compressed-tensors")
    return model, path


def _modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{module: {leaf: tensor}}`` of the quantized modules (those with ``weight_packed``)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, {})[leaf] = tensor
    return {m: leaves for m, leaves in modules.items() if "weight_packed" in leaves}


def _ct_scheme(group: dict[str, Any]) -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})


def _theirs(fmt: str, group: dict[str, Any], ours: dict[str, torch.Tensor]) -> Any:
    """compressed-tensors' compressor output for our quantized weight and scales."""
    from compressed_tensors.compressors import BaseCompressor

    spec = get_format(fmt)
    weight = dequantize(LAYOUT.from_leaves(spec, ours), torch.float32)
    state = {"weight": weight, "weight_scale": ours["weight_scale"].float()}
    if "weight_global_scale" in ours:  # NVFP4: the float8 block scales, as floats
        state["weight_global_scale"] = ours["weight_global_scale"]
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.compress(state, _ct_scheme(group))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tensors_equal_compressed_tensors_compressor_bytes(recipe: str, tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    _, out = _export(recipe, tmp_path / "ct")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"
    ]
    modules = _modules(_tensors(out))
    assert modules, "no quantized module was written"
    for module, ours in modules.items():
        theirs = _theirs(RECIPES[recipe][0], group, ours)
        assert set(ours) - set(theirs) <= {"input_global_scale"}, module  # calibrated, ours
        for leaf in sorted(set(ours) & set(theirs)):
            mine, ref = ours[leaf], theirs[leaf].contiguous()
            assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape), f"{module}.{leaf}"
            assert torch.equal(_raw(mine), _raw(ref)), f"{module}.{leaf}: bytes differ"


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(
    ("recipe", "preset"),
    [("int4_awq", "W4A16"), ("nvfp4", "NVFP4")],
)
def test_config_group_equals_compressed_tensors_serialization(
    recipe: str, preset: str, tmp_path: Path
) -> None:
    """The group equals compressed-tensors' preset as it serializes it (``model_dump``)."""
    qs = pytest.importorskip("compressed_tensors.quantization")
    _, out = _export(recipe, tmp_path / "ct")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = qs.preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    theirs["format"] = config["format"]
    dropped = {k: v for k, v in theirs.items() if v is not None}
    assert config["config_groups"]["group_0"] == dropped


def test_int8_channel_group_equals_compressed_tensors_serialization(tmp_path: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    _, out = _export("int8_wo", tmp_path / "ct")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    args = qs.QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    theirs = qs.QuantizationScheme(targets=["Linear"], weights=args).model_dump(mode="json")
    assert config["config_groups"]["group_0"] == {
        **{k: v for k, v in theirs.items() if v is not None},
        "format": "pack-quantized",
    }
    assert config["format"] == "pack-quantized"


#: NVFP4 on CPU: compressed-tensors 0.20.1 decompresses ``weight_packed`` to bfloat16 whatever
#: the model dtype, so a float32 model fails in F.linear (measured: "expected m1 and m2 to
#: have the same dtype, but got: float != c10::BFloat16"). Strict: a fix shows up here.
_NVFP4_CPU = pytest.mark.xfail(
    raises=RuntimeError, strict=True, reason="compressed-tensors decompresses NVFP4 to bf16"
)


@pytest.mark.parametrize("recipe", ["int4_awq", "int8_wo", pytest.param("nvfp4", marks=_NVFP4_CPU)])
def test_transformers_loads_each_layout_with_the_fake_quant_logits(
    recipe: str, tmp_path: Path
) -> None:
    pytest.importorskip("compressed_tensors")
    import transformers

    model, out = _export(recipe, tmp_path / "ct")
    batch = _batch(model.config.vocab_size)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want = model(batch).logits
        theirs = loaded(batch, use_cache=False).logits
        mine = ours(batch)
    worst = float((theirs - want).abs().max())
    print(f"transformers {transformers.__version__} {recipe}: max |logit diff| {worst:.3g}")
    torch.testing.assert_close(theirs, want, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(mine, want, atol=LOGITS_ATOL, rtol=0)


def test_our_loader_reads_nvfp4_back_with_the_fake_quant_logits(tmp_path: Path) -> None:
    """NVFP4's global scales are stored as reciprocals: a last-bit difference at most."""
    model, out = _export("nvfp4", tmp_path / "ct")
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        want, got = model(batch).logits, exportlm.load_exported("hf_checkpoint", out)(batch)
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)


# ----------------------------------------------------------------------------- the engines


def _engine_python(name: str) -> None:
    from exportlm.engines import find_interpreter

    if find_interpreter(name).path is None:
        pytest.skip(f"no {name} interpreter: run `make engines` (EXPORTLM_ENGINE_{name.upper()})")


def _served_reference(recipe: str, dtype: str, out: Path) -> tuple[Any, Any, list[list[int]]]:
    """The checkpoint of the toy Llama the engines' tests use, its fake-quant model, prompts.

    The reference for a float16 checkpoint is the checkpoint itself read by our loader in
    float32 (its float16-rounded norms), and the fake-quant model beside it.
    """
    from exportlm.engines.reference import choose_prompts, eager_reference
    from tests.test_engines_served import _model

    model = _model()
    quantize(model, recipe, exclude=RECIPES[recipe][1])
    path = exportlm.export_model(
        "hf_checkpoint", model, out, format="compressed-tensors", dtype=dtype
    )
    loaded = exportlm.load_exported("hf_checkpoint", path)

    class _Logits(torch.nn.Module):
        def forward(self, ids: torch.Tensor) -> Any:
            return type("Out", (), {"logits": loaded(ids)})()

    prompts = choose_prompts(_Logits())
    return eager_reference(_Logits(), prompts), eager_reference(model, prompts), prompts


# vLLM on the CT W4A16 (int4_awq) checkpoint and transformers on it are the plugin's
# served items (served[hf_checkpoint-vllm-llama-cpu], ...-transformers-...); here only
# transformers on CT W8A16 (int8_wo), which `served` does not send.
@pytest.mark.engines
@pytest.mark.parametrize("recipe", ["int8_wo"])
def test_engines_transformers_serves_each_integer_layout(recipe: str, tmp_path: Path) -> None:
    """transformers 5.19 + compressed-tensors 0.17 (vLLM's pins), float32, left-padded batch."""
    from exportlm.engines import EngineRequest, run_engine
    from exportlm.engines.reference import NEW_TOKENS

    _engine_python("transformers")
    eager, _, prompts = _served_reference(recipe, "float32", tmp_path / "ct")
    request = EngineRequest.left_padded(prompts, max_new_tokens=NEW_TOKENS, dtype="float32")
    result = run_engine("transformers", tmp_path / "ct", request)
    assert result.tokens == eager.tokens
    worst = max(abs(g - w) for r, e in zip(result.logprobs, eager.logprobs) for g, w in zip(r, e))
    print(f"transformers {result.engine_version} CT {recipe}: max |logprob diff| {worst:.3g}")
    assert worst <= 1e-4
