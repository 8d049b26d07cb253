"""The ``hf_checkpoint`` target and runtime, through ``export_model`` / ``load_exported``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import exportlm
from exportlm.errors import (
    InvalidInputError,
    InvalidModelError,
    OutputExistsError,
    UnsupportedFormatError,
)
from exportlm.export import get_target_info
from exportlm.models import HF_FAMILIES, DecoderConfig, DecoderModel, tiny_hf_model

TARGET = "hf_checkpoint"
#: The runtime against the (fake-quantized) model, in one process: measured max |diff| 0
#: for every family and format except AWQ (< 4e-7: the runtime folds pre_quant_scale into
#: the weight, x(W*s)^T where the fake quantizer computes (x*s)W^T). A wrong scale, format
#: or expert layout moves the logits by more than 1e-2.
ATOL, RTOL = 1e-5, 1e-5


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded), by name."""
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118
                tensors[key] = f.get_tensor(key)
    return tensors


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        got = ours[name]
        assert (got.dtype, tuple(got.shape)) == (tensor.dtype, tuple(tensor.shape)), name
        assert torch.equal(
            got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_hf_model("llama", seed=0)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_unquantized_checkpoint_equals_save_pretrained(family: str, tmp_path: Path) -> None:
    model = tiny_hf_model(family, seed=1)
    model.save_pretrained(tmp_path / "ref")
    out = exportlm.export_model(TARGET, model, tmp_path / "ours")

    assert_same_tensors(read_checkpoint(out), read_checkpoint(tmp_path / "ref"))
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads(
            (tmp_path / "ref" / name).read_text()
        )
    assert not (out / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_mixtral_uses_the_original_checkpoint_names(tmp_path: Path) -> None:
    out = exportlm.export_model(TARGET, tiny_hf_model("mixtral", seed=0), tmp_path / "ckpt")
    names = read_checkpoint(out)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n or "gate_up_proj" in n for n in names)


def test_tied_embedding_is_written_once(tmp_path: Path) -> None:
    out = exportlm.export_model(TARGET, tiny_hf_model("llama_tied", seed=0), tmp_path / "ckpt")
    names = read_checkpoint(out)
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names


@pytest.mark.parametrize("max_shard_size", [200_000, "0.2MB"])
def test_shards_fill_in_order_and_index_covers_every_tensor(
    llama: Any, tmp_path: Path, max_shard_size: int | str
) -> None:
    out = exportlm.export_model(TARGET, llama, tmp_path / "ckpt", max_shard_size=max_shard_size)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    count = len(shards)
    assert count > 1
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = read_checkpoint(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]  # noqa: SIM118
        assert len(sizes) == 1 or sum(sizes) <= 200_000
    assert not list(out.glob("*.partial"))


def test_dtype_casts_floating_tensors(llama: Any, tmp_path: Path) -> None:
    out = exportlm.export_model(TARGET, llama, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert {t.dtype for t in read_checkpoint(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_unquantized_roundtrip_logits_match(tmp_path: Path) -> None:
    model = tiny_hf_model("qwen2_moe", seed=2).eval()
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", max_shard_size="100KB")
    run = exportlm.load_exported(TARGET, out, device="cpu")
    ids = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    # same weights, same (eager) attention and experts code
    torch.testing.assert_close(run(ids), expected, atol=ATOL, rtol=RTOL)


def test_existing_directory_is_refused_then_replaced_with_overwrite(
    llama: Any, tmp_path: Path
) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        exportlm.export_model(TARGET, llama, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]

    exportlm.export_model(TARGET, llama, target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left beside it


def test_failure_midway_leaves_no_partial_checkpoint(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import exportlm.module_exporters

    def half_then_fail(model: Any, sink: Any, **kwargs: Any) -> Any:
        for name, tensor in list(model.state_dict().items())[:5]:
            sink.add(name, tensor)
        raise RuntimeError("exporter exploded midway")

    target = tmp_path / "ckpt"
    exportlm.export_model(TARGET, llama, target, max_shard_size=10_000)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    monkeypatch.setattr(exportlm.module_exporters, "export_quantized_state", half_then_fail)
    with pytest.raises(RuntimeError, match="midway"):
        exportlm.export_model(TARGET, llama, target, overwrite=True, max_shard_size=10_000)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_plain_torch_model_is_refused_with_a_reason(tmp_path: Path) -> None:
    model = DecoderModel(DecoderConfig())
    reason = get_target_info(TARGET).accepts(model)  # type: ignore[misc]
    assert reason is not None
    assert "PreTrainedModel" in reason
    with pytest.raises(InvalidModelError, match=r"config\.json"):
        exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "gguf"}, "format must be one of"),
        ({"safe_serialization": False}, "safetensors only"),
        ({"max_shard_size": "lots"}, "is not a size"),
        ({"max_shard_size": 0}, "positive"),
    ],
)
def test_bad_options_are_rejected_before_writing(
    llama: Any, tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        exportlm.export_model(TARGET, llama, tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_target_declares_directory_artifact_and_capabilities() -> None:
    info = get_target_info(TARGET)
    assert info.artifact == "directory"
    assert {"quantized", "multi_file"} <= info.capabilities
    assert info.runtime == TARGET


# --------------------------------------------------------------------------- quantized


#: Families whose experts hold per-tensor FP8 only (DBRX's own fused layout: one scale
#: per expert): ``quantize`` refuses other formats for them, naming ``{"*.experts": "fp8"}``.
FP8_ONLY_EXPERTS = {"dbrx"}


def quantized(family: str, recipe: str, seed: int = 0) -> tuple[Any, torch.Tensor]:
    """A tiny model fake-quantized with ``recipe``, calibrated on one batch; and that batch.

    The experts of :data:`FP8_ONLY_EXPERTS` families take FP8 whatever ``recipe`` is
    (a mixed-precision checkpoint, unless ``recipe`` is FP8 itself).
    """
    from exportlm.quant import quantize

    model = tiny_hf_model(family, seed=seed).eval()
    batch = torch.randint(
        0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed)
    )
    plan: Any = recipe
    if family in FP8_ONLY_EXPERTS and not recipe.startswith("fp8"):
        plan = {"*": recipe, "*.experts": "fp8"}
    with torch.no_grad():
        quantize(model, plan, calibrate=lambda m: m(batch))
    return model, batch


def roundtrip_logits(
    model: Any, batch: torch.Tensor, out: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the runtime's logits, the fake-quantized model's logits) on ``batch``."""
    run = exportlm.load_exported(TARGET, out)
    with torch.no_grad():
        expected = model(batch, use_cache=False).logits
    return run(batch), expected


def test_fp8_checkpoint_layout_and_configs(tmp_path: Path) -> None:
    model, _ = quantized("llama", "fp8+fp8_kv")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    tensors = read_checkpoint(out)
    proj = "model.layers.0.self_attn.k_proj"
    assert tensors[f"{proj}.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{proj}.weight"].shape == model.get_submodule(proj).weight.shape
    for leaf in ("weight_scale", "input_scale", "k_scale"):
        assert (tensors[f"{proj}.{leaf}"].dtype, tensors[f"{proj}.{leaf}"].shape) == (
            torch.float32,
            (),
        )
    assert tensors["lm_head.weight"].dtype == torch.float32
    assert all(
        torch.isfinite(t.float()).all() and (t != 0).all()
        for n, t in tensors.items()
        if n.endswith("_scale")
    )

    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "exportlm"
    assert hf_quant["quantization"]["quant_algo"] == "FP8"
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert "lm_head" in hf_quant["quantization"]["exclude_modules"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt"
    assert config["quant_algo"] == "FP8"
    assert config["ignore"] == hf_quant["quantization"]["exclude_modules"]


RECIPES = ("fp8", "fp8+fp8_kv", "nvfp4", "int4_awq", "int8_wo")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_quantized_roundtrip_reproduces_the_fake_quantized_logits(
    family: str, recipe: str, tmp_path: Path
) -> None:
    if family == "dbrx" and "fp8_kv" in recipe:
        # fused Wqkv: no K / V projection to measure (tests/test_kv_cache.py tests the refusal)
        with pytest.raises(UnsupportedFormatError, match="KV-cache quantization"):
            quantized(family, recipe)
        return
    model, batch = quantized(family, recipe)
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", max_shard_size="200KB")
    got, expected = roundtrip_logits(model, batch, out)
    # weights dequantize bit for bit, activation and expert input scales are re-applied
    # by the fake quantizer's own modules (AWQ: pre_quant_scale folded into the weight)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_mixtral_quantized_experts_use_the_original_names(tmp_path: Path) -> None:
    model, _ = quantized("mixtral", "fp8")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    tensors = read_checkpoint(out)
    w1 = "model.layers.0.block_sparse_moe.experts.2.w1"
    assert tensors[f"{w1}.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(
        tensors[f"{w1}.weight_scale"], tensors[w1.replace("w1", "w3") + ".weight_scale"]
    )
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32


def test_compressed_tensors_layout(tmp_path: Path) -> None:
    model, batch = quantized("llama", "fp8")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
    tensors = read_checkpoint(out)
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape == (1,)
    assert tensors["model.layers.0.mlp.up_proj.input_scale"].shape == (1,)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    group = config["config_groups"]["group_0"]
    assert group["format"] == "float-quantized"
    assert group["weights"] == group["input_activations"]
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "tensor")
    assert "lm_head" in config["ignore"]
    assert not (out / "hf_quant_config.json").exists()
    got, expected = roundtrip_logits(model, batch, out)
    # one process, the same transformers forward on bit-identical (dequantized =
    # fake-quantized) weights and scales
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_compressed_tensors_attention_kv_scales_are_applied(tmp_path: Path) -> None:
    model, batch = quantized("mixtral", "fp8+fp8_kv")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
    tensors = read_checkpoint(out)
    assert tensors["model.layers.0.self_attn.k_scale"].shape == (1,)
    assert not any(name.endswith("k_proj.k_scale") for name in tensors)
    got, expected = roundtrip_logits(model, batch, out)
    # one process, the same transformers forward on bit-identical (dequantized =
    # fake-quantized) weights and scales
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_compressed_tensors_refuses_an_unfolded_awq_scale(tmp_path: Path) -> None:
    from exportlm.errors import UnsupportedFormatError

    model, _ = quantized("llama", "int4_awq")  # o_proj / down_proj keep a pre_quant_scale
    with pytest.raises(UnsupportedFormatError, match=r"compressed-tensors.*pre_quant_scale"):
        exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_checkpoint_directory_gets_the_mode_save_pretrained_gives_and_files_0644(
    llama: Any, tmp_path: Path
) -> None:
    previous = os.umask(0o022)
    try:
        llama.save_pretrained(tmp_path / "ref")
        out = exportlm.export_model(TARGET, llama, tmp_path / "ours")
    finally:
        os.umask(previous)

    def modes(root: Path) -> dict[str, int]:
        return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.iterdir()]}

    ours, ref = modes(out), modes(tmp_path / "ref")
    assert ours.pop("ours") == ref.pop("ref") == 0o755  # not mkdtemp's private 0o700
    assert ours.pop("exportlm-manifest.json") == 0o644  # exportlm's own, beside HF's files
    assert sorted(ours) == sorted(ref)
    # what open() gives under the umask (save_pretrained's own model.safetensors is 0o600)
    assert set(ours.values()) == {0o644}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
def test_compressed_tensors_split_experts_roundtrip(family: str, tmp_path: Path) -> None:
    """Split experts in compressed-tensors' layout: merged by transformers' conversion table
    (Qwen-MoE) or stacked back in the family's own layout (GptOss interleaved, Llama4 not)."""
    model, batch = quantized(family, "fp8")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
    experts = [n for n in read_checkpoint(out) if ".experts.3.down_proj." in n]
    assert {"weight", "weight_scale", "input_scale"} <= {n.rsplit(".", 1)[1] for n in experts}
    got, expected = roundtrip_logits(model, batch, out)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_a_scale_without_its_quantized_weight_is_refused_not_loaded_as_codes(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    from exportlm.errors import UnsupportedFormatError

    model, _ = quantized("llama", "fp8")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]  # the fp8 codes lose their scale
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "exportlm-manifest.json").unlink()  # the loader's own check, not the manifest's
    with pytest.raises(UnsupportedFormatError, match=r"up_proj\.input_scale.*no quantized weight"):
        exportlm.load_exported(TARGET, out)
