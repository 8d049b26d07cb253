"""W4AFP8 (recipe ``w4afp8``): INT4 AWQ group weights, FP8 inputs per token at run time.

compressed-tensors' / llm-compressor's ``W4AFP8`` preset through the public API: the
config group equals the preset and validates with compressed-tensors' own classes, the
weight bytes equal its ``pack-quantized`` compressor on our codes (and ``int4_awq``'s under
the same calibration), the checkpoint loads back through our runtime and through
transformers + compressed-tensors with the fake-quantized logits, the inputs really are
quantized, the ModelOpt layout is refused before any work, the group sizes, streaming,
``inspect`` and the engine tables; the real model from its directory. Stacked MoE experts:
``tests/test_awq_ct_experts.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import exportlm
from exportlm.cli import main
from exportlm.errors import UnsupportedFormatError
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantLinear, QuantRecipe, check_layout, quantize
from exportlm.quant.formats import CHECKPOINT_LAYOUTS
from exportlm.stream import export_streaming
from tests._fake_quant import assert_pack_quantized_as_compressed_tensors
from tests._fake_quant import checkpoint_tensors as _tensors
from tests._fake_quant import ct_group as _group
from tests._stream_models import assert_same_checkpoint, in_memory_export, llama_directory

CT = "compressed-tensors"
LAYOUT = CHECKPOINT_LAYOUTS[CT]
#: Our runtime dequantizes the very codes and runs the same per-token FP8 kernel: the two
#: forwards differ by float noise only (measured: 0.0 on the toy llama).
RUNTIME_ATOL = 1e-5
#: transformers + compressed-tensors decompress the codes and quantize each token with
#: their own FP8 code (measured: 3.0e-7 with transformers 5.25.0 + compressed-tensors 0.20.1).
TRANSFORMERS_ATOL = 1e-4
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _quantized(recipe: str = "w4afp8", family: str = "llama") -> tuple[Any, torch.Tensor]:
    model = tiny_hf_model(family, seed=0).eval()
    batch = _batch(model.config.vocab_size)
    quantize(model, QuantRecipe.parse(recipe).for_layout(CT), calibrate=lambda m: m(batch))
    return model, batch


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, torch.Tensor, Path]:
    model, batch = _quantized()
    out = tmp_path_factory.mktemp("w4afp8") / "ckpt"
    return model, batch, Path(exportlm.export_model("hf_checkpoint", model, out, format=CT))


def _no_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nones(v) for k, v in value.items() if v is not None}
    return value


def test_the_group_is_llm_compressors_w4afp8_preset(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    _, _, out = exported
    group = _group(out)
    assert group["format"] == "pack-quantized"
    scheme = qs.QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    preset = qs.preset_name_to_scheme("W4AFP8", ["Linear"])
    assert scheme == preset
    assert _no_nones(preset.model_dump(mode="json")) == {
        k: v for k, v in group.items() if k != "format"
    }


def test_every_linear_is_quantized_with_no_stored_input_scale(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    """The AWQ scales of o_proj / down_proj fold into v_proj / up_proj, as int4_awq's in
    compressed-tensors: no linear stays in full precision, none keeps a scale of its own."""
    _, _, out = exported
    tensors = _tensors(out)
    packed = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    layers = {n.split(".")[2] for n in packed}
    assert packed == {
        f"model.layers.{i}.{'self_attn' if p.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{p}"
        for i in layers
        for p in _PROJECTIONS
    }
    assert len(packed) == 14
    assert not [n for n in tensors if n.endswith(("pre_quant_scale", "input_scale"))]
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32


def test_weight_bytes_equal_compressed_tensors_pack_quantized_compressor(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    pytest.importorskip("compressed_tensors.quantization")

    _, _, out = exported
    tensors = _tensors(out)
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    assert_pack_quantized_as_compressed_tensors(tensors, modules, out, "w4afp8")


def test_the_codes_are_int4_awqs_under_the_same_calibration(
    exported: tuple[Any, torch.Tensor, Path], tmp_path: Path
) -> None:
    """The same AWQ search, folds and INT4 kernels: every tensor is int4_awq's byte for byte
    (W4A16 and W4AFP8 differ in the config's input_activations only)."""
    _, _, out = exported
    int4, _ = _quantized("int4_awq")
    theirs = _tensors(
        Path(exportlm.export_model("hf_checkpoint", int4, tmp_path / "w4a16", format=CT))
    )
    ours = _tensors(out)
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []
    assert "input_activations" not in _group(tmp_path / "w4a16")


def test_it_loads_back_with_the_fake_quant_logits_and_its_inputs_quantized(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    model, batch, out = exported
    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want = model(batch).logits
        got = torch.as_tensor(runtime(batch))
        torch.testing.assert_close(got, want, atol=RUNTIME_ATOL, rtol=0)
        # the inputs are quantized, in both: without them the logits move far beyond that
        quantizers = [m.input_quantizer for m in model.modules() if isinstance(m, QuantLinear)]
        for quantizer in quantizers:
            quantizer.enabled = False
        try:
            weights_only = model(batch).logits
        finally:
            for quantizer in quantizers:
                quantizer.enabled = True
    assert float((weights_only - want).abs().max()) > 100 * RUNTIME_ATOL


def test_transformers_and_compressed_tensors_load_it_on_cpu(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    pytest.importorskip("compressed_tensors")
    import transformers

    model, batch, out = exported
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want = model(batch).logits
        theirs = loaded(batch, use_cache=False).logits
    torch.testing.assert_close(theirs, want, atol=TRANSFORMERS_ATOL, rtol=0)


def test_the_modelopt_layout_refuses_it_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Named: the compressed-tensors layout, and w4a8_awq (ModelOpt's static-input W4A8)."""
    pattern = r"compressed-tensors.*'w4a8_awq'"
    with pytest.raises(UnsupportedFormatError, match=pattern):
        check_layout(QuantRecipe.parse("w4afp8"), "modelopt")
    model, _ = _quantized()
    with pytest.raises(UnsupportedFormatError, match=pattern):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "mo")
    assert not (tmp_path / "mo").exists()
    # the CLI refuses before it loads the model: a model directory that does not exist
    argv = ["export", "--target", "hf_checkpoint", "--model", str(tmp_path / "no-such-model")]
    assert main([*argv, "--out", str(tmp_path / "cli"), "--quantize", "w4afp8"]) != 0
    err = capsys.readouterr().err
    assert "w4a8_awq" in err, err
    assert "format=compressed-tensors" in err, err
    assert not (tmp_path / "cli").exists()


def test_the_streamed_export_refuses_the_modelopt_layout_before_it_reads_a_layer(
    tmp_path: Path,
) -> None:
    """Before: the stream calibrated, then the writer refused, leaving its work directory."""
    src = llama_directory(tmp_path, tied=False)
    with pytest.raises(UnsupportedFormatError, match=r"compressed-tensors.*'w4a8_awq'"):
        export_streaming(src, tmp_path / "out", recipe="w4afp8", calibration_inputs="float")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no work dir


def test_a_group_size_that_does_not_divide_is_refused_naming_those_that_do() -> None:
    model = nn.Sequential(nn.Linear(576, 200))
    with pytest.raises(UnsupportedFormatError, match=r"group_size=64 or group_size=32 divides 576"):
        quantize(model, "w4afp8")
    assert not isinstance(model[0], QuantLinear)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    quantize(model, "w4afp8:group_size=64", calibrate=lambda m: m(x))
    assert isinstance(model[0], QuantLinear)
    assert model[0].weight_quantizer.block_size == 64


def test_group_size_64_is_written_and_inspect_warns_that_vllm_takes_128(tmp_path: Path) -> None:
    model, batch = _quantized("w4afp8:group_size=64")
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "g64", format=CT))
    assert _group(out)["weights"]["group_size"] == 64
    assert _tensors(out)["model.layers.0.self_attn.o_proj.weight_scale"].shape == (128, 2)
    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.as_tensor(runtime(batch)), model(batch).logits, atol=RUNTIME_ATOL, rtol=0
        )
    report = inspect_checkpoint(out)
    assert report.errors == []
    found = [f for f in report.findings if f.rule == "w4afp8-group-size"]
    assert [(f.subject, f.details["group_size"], f.details["layers"]) for f in found] == [
        ("config.json", 64, 14)
    ]
    (line,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    assert "vLLM" not in line.details["known"]  # the warning's verdict (before: listed)
    assert line.details["fails"] == ["vLLM"]
    assert "fails in vLLM on W4AFP8 groups of 64, which it does not read" in line.message


def test_inspect_recognises_it(exported: tuple[Any, torch.Tensor, Path]) -> None:
    _, _, out = exported
    report = inspect_checkpoint(out)
    assert dict(report.summary["quantized_layers"]) == {"w4afp8": 14}
    assert report.errors == []
    assert not [f for f in report.findings if f.rule == "w4afp8-group-size"]
    (line,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    assert (line.details["fails"], "vLLM" in line.details["known"]) == ([], True)
    assert main(["inspect", str(out)]) == 0


def test_the_engine_tables_name_it_w4afp8(exported: tuple[Any, torch.Tensor, Path]) -> None:
    """vLLM: Hopper only (a GPU row, its limit on a CPU); transformers runs it in float32."""
    from exportlm.engines import Verdict, artifact_kind, get_engine

    _, _, out = exported
    kind = artifact_kind(out)
    assert (kind.layout, kind.scheme) == (CT, "W4AFP8")
    vllm = get_engine("vllm")
    cpu = vllm.support(kind.target, kind.layout, kind.scheme, dtype="bfloat16")
    assert cpu.verdict is Verdict.ENGINE_LIMIT
    assert "compute capability 9.0" in cpu.reason
    assert "groups of 128" in cpu.reason
    cuda = vllm.support(kind.target, kind.layout, kind.scheme, dtype="bfloat16", device="cuda")
    assert cuda.verdict is Verdict.RUNS
    transformers = get_engine("transformers").support(kind.target, kind.layout, kind.scheme)
    assert transformers.verdict is Verdict.RUNS


def test_the_streamed_export_is_the_in_memory_one_byte_for_byte(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    recipe = QuantRecipe.parse("w4afp8").for_layout(CT)
    expected = in_memory_export(src, tmp_path / "memory", recipe, shard="100KB", format=CT)
    streamed = export_streaming(
        src,
        tmp_path / "streamed",
        recipe="w4afp8",
        format=CT,
        max_shard_size="100KB",
        calibration_inputs="float",
    )
    assert_same_checkpoint(expected, streamed)


@pytest.mark.real_model
def test_the_real_model_exports_from_its_directory(real_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2-135M: 576 / 1536 input features, so groups of 64."""
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"The calibration sentence number {i} is short." for i in range(8)))
    out = tmp_path / "real"
    argv = [
        "export",
        "--target",
        "hf_checkpoint",
        "--model",
        str(real_model_dir),
        "--out",
        str(out),
    ]
    argv += ["--quantize", "w4afp8:group_size=64", "-o", f"format={CT}"]
    argv += ["--calib-data", str(data), "--calib-samples", "4", "--calib-seq-len", "32"]
    assert main(argv) == 0
    group = _group(out)
    assert (group["weights"]["group_size"], group["input_activations"]["strategy"]) == (64, "token")
    report = inspect_checkpoint(out)
    assert report.errors == [], [f.message for f in report.errors]
    assert report.summary["quantized_layers"] == {"w4afp8": 30 * 7}
    runtime = exportlm.load_exported("hf_checkpoint", out)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30]])
    logits = torch.as_tensor(runtime(ids))
    assert logits.shape[-1] == 49152
    assert torch.isfinite(logits).all()
