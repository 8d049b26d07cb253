"""The compressed-tensors layouts of INT4 AWQ, INT8 weight-only and NVFP4 (no optional packages).

What is stored (names, dtypes, shapes, the packing), what the configs declare, that our
loader and ``exportlm inspect`` read it back, and what is refused. Byte equality with
compressed-tensors' own compressor is in ``tests/test_interop_ct.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.errors import UnsupportedFormatError
from exportlm.export.hf_checkpoint import load_hf_checkpoint
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from exportlm.quant.formats._ct_codecs import pack_int32, unpack_int32

#: recipe -> modules left unquantized (INT4 AWQ: the scales that cannot fold into a norm).
EXCLUDE = {"int4_awq": ["*o_proj", "*down_proj"], "int8_wo": None, "nvfp4": None}
Q_PROJ = "model.layers.0.self_attn.q_proj"
#: Logits of our loader against the fake-quantized model (float32 forwards of the same
#: weights; NVFP4's reciprocal global scales may move a scale by one ulp).
ATOL = 1e-5


def _export(recipe: str, out: Path) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    model = tiny_hf_model("llama", seed=0).eval()
    batch = torch.randint(
        0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, recipe, calibrate=lambda m: m(batch), exclude=EXCLUDE[recipe])
    path = exportlm.export_model("hf_checkpoint", model, out, format="compressed-tensors")
    return model, batch, path


def _reference_pack(codes: list[list[int]], bits: int) -> list[list[int]]:
    """compressed-tensors' packing written out: element i of a row at bit i * bits, offset."""
    rows = []
    for row in codes:
        per_word = 32 // bits
        words = []
        for start in range(0, len(row), per_word):
            word = 0
            for k, code in enumerate(row[start : start + per_word]):
                word |= (code + (1 << (bits - 1))) << (k * bits)
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        rows.append(words)
    return rows


@pytest.mark.parametrize(("bits", "cols"), [(4, 16), (4, 13), (8, 8), (8, 6)])
def test_pack_int32_is_compressed_tensors_packing(bits: int, cols: int) -> None:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    gen = torch.Generator().manual_seed(bits * cols)
    codes = torch.randint(low, high + 1, (3, cols), generator=gen, dtype=torch.int8)
    codes[0, 0], codes[1, 0] = low, high  # both ends of the range
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.tolist() == _reference_pack(codes.tolist(), bits)
    assert torch.equal(unpack_int32(packed, bits, cols), codes)


@pytest.mark.parametrize(
    ("recipe", "stored"),
    [
        (
            "int4_awq",
            {
                "weight_packed": (torch.int32, (128, 16)),
                "weight_scale": (torch.float32, (128, 1)),
                "weight_shape": (torch.int64, (2,)),
            },
        ),
        (
            "int8_wo",
            {
                "weight_packed": (torch.int32, (128, 32)),
                "weight_scale": (torch.float32, (128, 1)),
                "weight_shape": (torch.int64, (2,)),
            },
        ),
        (
            "nvfp4",
            {
                "weight_packed": (torch.uint8, (128, 64)),
                "weight_scale": (torch.float8_e4m3fn, (128, 8)),
                "weight_global_scale": (torch.float32, (1,)),
                "input_global_scale": (torch.float32, (1,)),
            },
        ),
    ],
)
def test_each_layout_stores_compressed_tensors_names_and_reads_back(
    recipe: str, stored: dict[str, tuple[torch.dtype, tuple[int, ...]]], tmp_path: Path
) -> None:
    model, batch, out = _export(recipe, tmp_path / "ct")
    tensors = load_file(str(out / "model.safetensors"))
    leaves = {n.rpartition(".")[2]: t for n, t in tensors.items() if n.startswith(f"{Q_PROJ}.")}
    assert {leaf: (t.dtype, tuple(t.shape)) for leaf, t in leaves.items()} == stored
    if "weight_shape" in leaves:
        assert leaves["weight_shape"].tolist() == [128, 128]
    with torch.no_grad():
        want, got = model(batch).logits, exportlm.load_exported("hf_checkpoint", out)(batch)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    report = inspect_checkpoint(out)
    assert report.ok, [f"[{f.rule}] {f.subject}: {f.message}" for f in report.errors]


def test_nvfp4_global_scales_are_the_reciprocals_of_the_modelopt_ones(tmp_path: Path) -> None:
    _, _, ct = _export("nvfp4", tmp_path / "ct")
    model = tiny_hf_model("llama", seed=0).eval()
    batch = torch.randint(
        0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, "nvfp4", calibrate=lambda m: m(batch))
    mo = exportlm.export_model("hf_checkpoint", model, tmp_path / "mo")
    ours, theirs = (
        load_file(str(ct / "model.safetensors")),
        load_file(str(mo / "model.safetensors")),
    )
    # The same E2M1 codes, but -0.0 (code 8, ModelOpt keeps the sign of a value that
    # rounds to zero) packed as +0.0 (code 0), as compressed-tensors packs it.
    modelopt_codes = theirs[f"{Q_PROJ}.weight"]
    nibbles = torch.stack((modelopt_codes & 0x0F, modelopt_codes >> 4))
    assert (nibbles == 8).any()  # the case is exercised
    unsigned = torch.where(nibbles == 8, torch.zeros_like(nibbles), nibbles)
    assert torch.equal(ours[f"{Q_PROJ}.weight_packed"], unsigned[0] | (unsigned[1] << 4))
    for ct_name, mo_name in (
        ("weight_global_scale", "weight_scale_2"),
        ("input_global_scale", "input_scale"),
    ):
        want = 1.0 / theirs[f"{Q_PROJ}.{mo_name}"].reshape(1)
        torch.testing.assert_close(ours[f"{Q_PROJ}.{ct_name}"], want, rtol=1e-7, atol=0)


def test_config_declares_each_scheme_as_compressed_tensors_does(tmp_path: Path) -> None:
    formats = {}
    for recipe in EXCLUDE:
        _, _, out = _export(recipe, tmp_path / recipe)
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        group = config["config_groups"]["group_0"]
        assert config["format"] == group["format"]
        assert group["targets"] == ["Linear"]
        formats[recipe] = (
            group["format"],
            group["weights"]["strategy"],
            group["weights"]["num_bits"],
        )
    assert formats == {
        "int4_awq": ("pack-quantized", "group", 4),
        "int8_wo": ("pack-quantized", "channel", 8),
        "nvfp4": ("nvfp4-pack-quantized", "tensor_group", 4),
    }


def test_an_awq_scale_that_cannot_fold_is_refused_with_the_reason(tmp_path: Path) -> None:
    model = tiny_hf_model("llama", seed=0).eval()
    quantize(model, "int4_awq")  # o_proj / down_proj keep their pre_quant_scale
    with pytest.raises(UnsupportedFormatError, match=r"o_proj.*no pre_quant_scale tensor.*exclude"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()


def test_codes_in_another_dtype_are_refused_and_inspect_reports_them(tmp_path: Path) -> None:
    _, _, out = _export("int4_awq", tmp_path / "ct")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    tensors[f"{Q_PROJ}.weight_packed"] = tensors[f"{Q_PROJ}.weight_packed"].to(torch.int64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = inspect_checkpoint(out)
    assert any(f.rule == "weight-dtype" and f.subject.startswith(Q_PROJ) for f in report.errors)
    with pytest.raises(UnsupportedFormatError, match=r"weight_packed.*int32"):
        load_hf_checkpoint(out)  # the runtime itself: the manifest would refuse the edit first


def test_a_missing_weight_shape_is_reported_by_inspect(tmp_path: Path) -> None:
    _, _, out = _export("int8_wo", tmp_path / "ct")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[f"{Q_PROJ}.weight_shape"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = inspect_checkpoint(out)
    assert [f.subject for f in report.errors if f.rule == "scale-missing"] == [
        f"{Q_PROJ}.weight_shape"
    ]
