"""FP8 and INT8 weight-only QDQ ONNX: quantized initializers, exact bytes, roundtrip, refusals.

Every export here goes through the public API (``export_model("onnx", ...)``,
``export_to_onnx``) and is read back with ``get_onnx_info`` / ``onnx`` /
onnxruntime. Logits are compared within a tolerance (see the roundtrip tests);
bytes of quantized initializers, a pure function of the weights and the scale,
are compared exactly.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx
from safetensors import safe_open

from exportlm.errors import (
    InvalidInputError,
    InvalidModelError,
    QuantizationError,
    UnsupportedFormatError,
)
from exportlm.export import (
    ExportCacheWrapper,
    compare_logits,
    export_model,
    export_to_onnx,
    get_onnx_info,
    get_target_info,
    infer_vocab_size,
    load_exported,
    make_input_ids,
    verify_onnx,
)
from exportlm.export.onnx import ONNX_ATOL, ONNX_RTOL
from exportlm.models import build_model
from exportlm.quant import QuantLinear, is_quantized_module, quantize
from pytest_exportcheck.checks import CHECKS, TargetCase
from pytest_exportcheck.checks._recipes import conformance_recipes
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.checks.targets.quantized import FLIP_ATOL, FLIP_RTOL
from tests._exports import shared_export
from tests._faulty_target import faulty_checkpoint_target

ONNX_DTYPES = {"fp8": "float8e4m3fn", "int8_wo": "int8"}
#: ExportCacheWrapper holds the model as ``model``: graph names are ``model.<module path>``.
WRAPPER_PREFIX = "model."


#: A Llama whose linears hold 93% of the parameters (the default toy: 82%), so that the
#: file-size ratio measures the weights rather than the graph's own bytes.
OVERRIDES = {"llama": {"hidden_size": 256, "intermediate_size": 1024}}


def _build(family: str) -> nn.Module:
    return build_model(family, seed=0, **OVERRIDES.get(family, {})).eval()


def _quantized(family: str, recipe: str) -> nn.Module:
    return quantize(_build(family), recipe)


#: llama with both recipes: weights and activations (fp8), weights only (int8_wo). The
#: MoE experts with fp8, which quantizes both: their weight-only path is llama's.
EXPORTED = [("llama", "fp8"), ("llama", "int8_wo"), ("iterable_moe", "fp8")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """ONNX files of (family, recipe), exported once for the module's tests."""
    root = tmp_path_factory.mktemp("qdq")
    files: dict[tuple[str, str], Path] = {}
    for family, recipe in EXPORTED:
        model = _quantized(family, recipe)
        files[family, recipe] = export_model("onnx", model, root / f"{family}-{recipe}.onnx")
    return files


def _quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and is_quantized_module(module)
    }


# ----------------------------------------------------------------------------- roundtrip


@pytest.mark.parametrize(("family", "recipe"), EXPORTED, ids=[f"{r}-{f}" for f, r in EXPORTED])
def test_roundtrip_matches_the_fake_quantized_model(
    exported: dict[tuple[str, str], Path], family: str, recipe: str
) -> None:
    """Weight-only: every input set within the onnx tolerance. FP8 activations: a rare
    input set may see one activation round the other way at an FP8 midpoint (an ulp of
    float difference upstream), so each set is held to the flip bound and the median
    to the onnx tolerance (see pytest_exportcheck.checks.targets.quantized)."""
    model = _quantized(family, recipe)
    runtime = load_exported("onnx", exported[family, recipe])
    flips = recipe == "fp8"
    atol, rtol = (FLIP_ATOL, FLIP_RTOL) if flips else (ONNX_ATOL, ONNX_RTOL)
    worst: list[float] = []
    for seed in range(1, 6):
        ids = make_input_ids(infer_vocab_size(model), 2, 8, seed=seed)
        with torch.no_grad():
            expected = ExportCacheWrapper(model)(ids)
        result = compare_logits(runtime(ids), expected, atol, rtol)
        assert result.passed, f"seed {seed}: {result.summary()}"
        worst.append(result.max_abs)
    assert statistics.median(worst) <= ONNX_ATOL


def test_the_roundtrip_is_not_the_float_model(exported: dict[tuple[str, str], Path]) -> None:
    """The bound above is tighter than what quantization changes: the float model fails it."""
    float_model = _build("llama")
    ids = make_input_ids(infer_vocab_size(float_model), 2, 8, seed=1)
    with torch.no_grad():
        expected = ExportCacheWrapper(float_model)(ids)
    actual = load_exported("onnx", exported["llama", "fp8"])(ids)
    assert not compare_logits(actual, expected, FLIP_ATOL, FLIP_RTOL).passed


def test_verify_onnx_runs_on_a_quantized_file(exported: dict[tuple[str, str], Path]) -> None:
    model = _quantized("llama", "int8_wo")
    report = verify_onnx(exported["llama", "int8_wo"], model)
    assert report.checker_ok
    assert report.passed, report.summary()


# ----------------------------------------------------------------------------- initializers


@pytest.mark.parametrize("recipe", ["fp8", "int8_wo"])
def test_info_lists_one_quantized_initializer_per_quantized_linear(
    exported: dict[tuple[str, str], Path], recipe: str
) -> None:
    model = _quantized("llama", recipe)
    info = get_onnx_info(exported["llama", recipe])
    linears = _quantized_linears(model)
    by_name = {q.name: q for q in info.quantized_initializers}
    assert set(by_name) == {f"{WRAPPER_PREFIX}{name}.weight" for name in linears}
    for name, module in linears.items():
        entry = by_name[f"{WRAPPER_PREFIX}{name}.weight"]
        assert entry.dtype == ONNX_DTYPES[recipe]
        assert entry.dims == tuple(module.weight.shape)
        assert entry.bytes == module.weight.numel()  # one byte per code
        assert entry.scale == f"{WRAPPER_PREFIX}{name}.weight_scale"
    assert info.quantized_bytes == sum(q.bytes for q in info.quantized_initializers)
    assert info.quantized_bytes < info.initializer_bytes
    # no float copy of a quantized weight is left: what is not quantized is about the
    # float parameters outside the quantized linears (plus scales and small constants)
    quantized_params = {id(m.weight) for m in linears.values()}
    float_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized_params
    )
    scale_bytes = sum(4 * m.out_features for m in linears.values())  # at most one per row
    assert info.initializer_bytes - info.quantized_bytes < float_bytes + scale_bytes + 16 * 1024


def test_info_of_a_float_graph_lists_no_quantized_initializer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    info = get_onnx_info(shared_export(tmp_path_factory, "onnx", "decoder").path)
    assert info.quantized_initializers == ()
    assert info.quantized_bytes == 0


def _raw(path: Path) -> dict[str, bytes]:
    return {t.name: t.raw_data for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("recipe", ["fp8", "int8_wo"])
def test_quantized_bytes_equal_the_hf_checkpoint_tensors(
    exported: dict[tuple[str, str], Path], tmp_path: Path, recipe: str
) -> None:
    model = _quantized("llama", recipe)
    checkpoint = export_model("hf_checkpoint", model, tmp_path / "ckpt")
    leaves = (
        ("weight", "weight_scale", "input_scale") if recipe == "fp8" else ("weight", "weight_scale")
    )
    wanted = {f"{name}.{leaf}" for name in _quantized_linears(model) for leaf in leaves}
    saved: dict[str, bytes] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in wanted.intersection(f.keys()):
                tensor = f.get_tensor(key).contiguous().reshape(-1)
                saved[key] = tensor.view(torch.uint8).numpy().tobytes()
    assert set(saved) == wanted
    raw = _raw(exported["llama", recipe])
    # The exporter's optimizer keeps one copy of equal initializers (q/k/v share their
    # scales), so a scale is read where its DequantizeLinear reads it.
    scale_of = {
        q.name: q.scale for q in get_onnx_info(exported["llama", recipe]).quantized_initializers
    }
    input_scales = 0
    for key, expected in saved.items():
        module, leaf = key.rsplit(".", 1)
        weight = f"{WRAPPER_PREFIX}{module}.weight"
        if leaf == "weight":
            assert raw[weight] == expected, key
        elif leaf == "weight_scale":
            assert raw[scale_of[weight]] == expected, key
        elif WRAPPER_PREFIX + key in raw:
            assert raw[WRAPPER_PREFIX + key] == expected, key
            input_scales += 1
    assert input_scales > 0 or recipe != "fp8"


def test_fp8_file_is_well_under_half_the_float_file(
    exported: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    """The linears hold 93% of the parameters; the FP8 file stores them in a byte each."""
    float_file = export_to_onnx(_build("llama"), tmp_path / "float.onnx")
    ratio = exported["llama", "fp8"].stat().st_size / float_file.stat().st_size
    assert ratio < 0.5


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("family", "recipe", "named"),
    [
        ("llama", "nvfp4", "'nvfp4'"),
        ("llama", "int4_awq", "'int4_awq'"),
        ("llama", "fp8+fp8_kv", "fp8_kv"),
        ("mixtral", "fp8", "stacked MoE experts"),
    ],
)
def test_inexpressible_quantization_is_refused_before_writing(
    tmp_path: Path, family: str, recipe: str, named: str
) -> None:
    model = _quantized(family, recipe)
    reason = get_target_info("onnx").accepts(model)  # type: ignore[misc]
    assert reason is not None
    assert named in reason
    if recipe in ("nvfp4", "int4_awq"):
        assert "supported: fp8 (fp8), int8_gptq / int8_wo (int8)" in reason
    with pytest.raises(InvalidModelError, match="cannot export this model"):
        export_model("onnx", model, tmp_path / "a.onnx")
    with pytest.raises(UnsupportedFormatError, match=named.strip("'")):
        export_to_onnx(model, tmp_path / "b.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("recipe", "named"),
    [
        ("int4_gptq", "recipe 'int4_gptq' (int4)"),
        ("int4_gptq:group_size=64", "recipe 'int4_gptq:group_size=64' (int4)"),
        ("int4_awq", "recipe 'int4_awq' (int4)"),
    ],
)
def test_the_refusal_names_the_recipe_the_model_was_quantized_with(
    tmp_path: Path, recipe: str, named: str
) -> None:
    """int4_awq and int4_gptq write one format: the refusal names the one that was used."""
    model = _build("llama")
    ids = make_input_ids(infer_vocab_size(model), 2, 8, seed=0)
    quantize(model, recipe, calibrate=lambda m: m(ids))
    with pytest.raises(InvalidModelError) as refused:
        export_model("onnx", model, tmp_path / "a.onnx")
    assert named in str(refused.value)
    assert "int4_awq" not in str(refused.value) or recipe.startswith("int4_awq")
    with pytest.raises(UnsupportedFormatError, match=re.escape(named)):
        export_to_onnx(model, tmp_path / "b.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_quantizer_without_a_recorded_recipe_names_every_recipe_of_its_format() -> None:
    model = _quantized("llama", "int4_awq")
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.weight_quantizer.recipe = None  # as built from a checkpoint
    reason = get_target_info("onnx").accepts(model)  # type: ignore[misc]
    assert reason is not None
    assert "format int4 (recipe 'int4_awq' or 'int4_gptq')" in reason


def test_fp8_below_opset_19_names_the_opset(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="opset >= 19"):
        export_to_onnx(_quantized("llama", "fp8"), tmp_path / "m.onnx", opset=18)
    assert list(tmp_path.iterdir()) == []


def test_the_legacy_exporter_is_refused_for_quantized_models(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="dynamo=True"):
        export_to_onnx(_quantized("llama", "int8_wo"), tmp_path / "m.onnx", dynamo=False)


def test_an_uncalibrated_quantizer_asks_to_calibrate_first(tmp_path: Path) -> None:
    model = _quantized("llama", "fp8")
    linear = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(linear, QuantLinear)
    linear.input_quantizer.reset_amax()
    with pytest.raises(QuantizationError, match="Calibrate first") as err:
        export_to_onnx(model, tmp_path / "m.onnx")
    assert "model.layers.0.mlp.down_proj.input_quantizer" in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the model is untouched


def test_export_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = _quantized("llama", "fp8")
    before = [(n, id(p)) for n, p in model.named_parameters()]
    keys = list(model.state_dict())
    ids = make_input_ids(infer_vocab_size(model), 1, 4, seed=3)
    with torch.no_grad():
        logits = ExportCacheWrapper(model)(ids)
    export_to_onnx(model, tmp_path / "m.onnx")
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert list(model.state_dict()) == keys
    assert all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(ExportCacheWrapper(model)(ids), logits)  # same code, same inputs


# ----------------------------------------------------------------------------- the check


@pytest.mark.parametrize("target", ["onnx", "hf_checkpoint"])
def test_roundtrip_quantized_check_passes_for_the_quantized_targets(
    tmp_path: Path, target: str
) -> None:
    result = CHECKS["roundtrip_quantized"].fn(TargetCase(target, None, {}, None, "cpu", tmp_path))
    assert result.status == "pass", result.message
    # every registered recipe; ONNX's QDQ form holds FP8 and INT8 weight-only only, whichever
    # algorithm chose the codes (int8_gptq: GPTQ's INT8 rows); int8_sq's pre_quant_scale,
    # w8a8's per-token inputs, INT4, MX, NVFP4, the KV cache: skipped
    registered = set(conformance_recipes(Registries.installed()))
    expected = registered if target == "hf_checkpoint" else {"fp8", "int8_wo", "int8_gptq"}
    assert set(result.details["recipes"]) == expected
    assert set(result.details["skipped"]) == registered - expected


def test_roundtrip_quantized_is_a_capability_gap_for_other_targets(tmp_path: Path) -> None:
    result = CHECKS["roundtrip_quantized"].fn(
        TargetCase("torch_export", None, {}, None, "cpu", tmp_path)
    )
    assert result.status == "skip"
    assert "capability gap" in result.message
    assert CHECKS["roundtrip_quantized"].needs == frozenset({"quantized"})


def _double_weight_scales(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    for shard in directory.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name] = tensors[name] * 2  # FAULT (roundtrip_quantized): wrong scales
        save_file(tensors, shard, metadata={"format": "pt"})


def test_a_target_writing_wrong_weight_scales_fails_roundtrip_quantized(tmp_path: Path) -> None:
    with faulty_checkpoint_target("doubled_scales", _double_weight_scales) as target:
        result = CHECKS["roundtrip_quantized"].fn(
            TargetCase(target, None, {}, "llama", "cpu", tmp_path)
        )
    assert result.status == "fail", result.message
    assert "fp8" in result.message
