"""Streaming export (exportlm.stream): the same checkpoint as the in-memory export, layer by layer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.errors import InvalidInputError, LayerTooLargeError, StreamingUnsupportedError
from exportlm.stream import export_streaming, parse_memory, should_stream
from tests._stream_models import (
    MANIFEST,
    assert_same_checkpoint,
    different_files,
    family_directory,
    in_memory_export,
    llama_directory,
)

SHARD = "100KB"  # several shards per model: the shard boundaries are compared too


def streams_as_in_memory(
    src: Path, tmp_path: Path, recipe: Any, inputs: str, *, format: str = "modelopt"
) -> Path:
    """Stream ``src`` with ``recipe``; assert it is the in-memory export byte for byte."""
    expected = in_memory_export(src, tmp_path / "memory", recipe, shard=SHARD, format=format)
    streamed = export_streaming(
        src,
        tmp_path / "streamed",
        recipe=recipe,
        max_shard_size=SHARD,
        calibration_inputs=inputs,  # type: ignore[arg-type]
        format=format,  # type: ignore[arg-type]
    )
    assert_same_checkpoint(expected, streamed)
    return streamed


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    ("recipe", "inputs"),
    [
        ("fp8", "float"),
        ("int8_wo", "quantized"),
        ("int4_awq", "float"),
        ("nvfp4", "float"),
        ("fp8+fp8_kv", "float"),
        ({"*": "fp8", "*.mlp.*": "int8_wo", "*.layers.1.self_attn.o_proj": None}, "float"),
        ({"*": "int4_awq+fp8_kv", "*.self_attn.*": "nvfp4"}, "float"),
        (None, "quantized"),
    ],
    ids=["fp8", "int8_wo", "int4_awq", "nvfp4", "fp8_kv", "mixed", "mixed_awq_kv", "unquantized"],
)
def test_streamed_checkpoint_is_the_in_memory_one_byte_for_byte(
    tmp_path: Path, recipe: Any, inputs: str, tied: bool
) -> None:
    # int8_wo is weight-only: its bytes do not depend on the calibration inputs at all;
    # fp8 / int4_awq calibrate activations: "float" inputs are what whole-model calibration sees.
    streamed = streams_as_in_memory(llama_directory(tmp_path, tied=tied), tmp_path, recipe, inputs)
    assert len(list(streamed.glob("*.safetensors"))) > 2
    names = set(json.loads((streamed / "model.safetensors.index.json").read_text())["weight_map"])
    assert any(n.endswith("weight_scale") for n in names) == (recipe is not None)
    assert any(n.endswith("k_scale") for n in names) == ("fp8_kv" in str(recipe))
    if isinstance(recipe, dict) and "*.layers.1.self_attn.o_proj" in recipe:  # left unquantized
        assert "model.layers.0.self_attn.o_proj.weight_scale" in names
        assert "model.layers.1.self_attn.o_proj.weight_scale" not in names
    assert not list(tmp_path.glob(".streamed.stream*"))  # the work area is gone once published


@pytest.mark.parametrize(
    ("recipe", "format"), [("int8_sq", "modelopt"), ("w8a8", "compressed-tensors")]
)
def test_smoothquant_streams_byte_for_byte(tmp_path: Path, recipe: str, format: str) -> None:
    # SmoothQuant's smoothing folds into the norms of the layer it smooths: it stays inside
    src = llama_directory(tmp_path, tied=False)
    streamed = streams_as_in_memory(src, tmp_path, recipe, "float", format=format)
    names = set(json.loads((streamed / "model.safetensors.index.json").read_text())["weight_map"])
    assert any(n.endswith("weight_scale") for n in names)


def test_a_directory_without_a_generation_config_streams_the_in_memory_configs(
    tmp_path: Path,
) -> None:
    # from_pretrained makes the generation config from config.json then; from_config keeps
    # defaults (bos / eos ids, use_cache) that it does not write
    src = llama_directory(tmp_path, tied=False, layers=1)
    (src / "generation_config.json").unlink()
    streamed = streams_as_in_memory(src, tmp_path, "int8_wo", "quantized")
    assert (streamed / "generation_config.json").is_file()


def test_sequential_calibration_changes_activation_scales_within_a_bound(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = llama_directory(tmp_path, tied=False)
    whole = export_streaming(src, tmp_path / "float", recipe="fp8", calibration_inputs="float")
    sequential = export_streaming(src, tmp_path / "seq", recipe="fp8")
    a, b = load_file(whole / "model.safetensors"), load_file(sequential / "model.safetensors")
    assert a.keys() == b.keys()
    weights = [k for k in a if not k.endswith("input_scale")]
    assert all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in weights
        if a[k].dtype == torch.float8_e4m3fn
    )
    scales = [k for k in a if k.endswith("input_scale")]
    # layer 0 sees the same (unquantized) embedding output either way
    first = [k for k in scales if ".layers.0." in k]
    assert all(torch.equal(a[k], b[k]) for k in first)
    ratios = torch.stack([(b[k] / a[k]).float() for k in scales])
    assert float((ratios - 1).abs().max()) < 0.5  # a quantized input moves an amax, not its scale


@pytest.mark.parametrize(
    ("recipe", "inputs"),
    [("int6g_wo", "quantized"), ({"*": "fp8", "*.mlp.*": "int6g_wo"}, "float")],
    ids=["int6g_wo", "fp8_with_int6g_mlp"],
)
def test_a_plugins_format_streams_byte_for_byte(tmp_path: Path, recipe: Any, inputs: str) -> None:
    # a third-party FormatSpec supplies per-tensor functions; the calibration is exportlm's
    # own, inside one layer, so the plugin's checkpoint streams like a built-in one
    from exportlm.quant import QUANT_FORMATS, register_format
    from tests.test_export_toy_format import INT6G, QUANT_ALGO

    src = llama_directory(tmp_path, tied=True)
    register_format(INT6G)
    try:
        streamed = streams_as_in_memory(src, tmp_path, recipe, inputs)
    finally:
        QUANT_FORMATS.unregister("int6g")
    quantization = json.loads((streamed / "hf_quant_config.json").read_text())["quantization"]
    algos = {quantization["quant_algo"]}
    algos |= {layer["quant_algo"] for layer in quantization.get("quantized_layers", {}).values()}
    assert QUANT_ALGO in algos  # the plugin's own layout, not a built-in fallback


def test_unsupported_families_and_recipes_are_refused_by_name(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    # the stream writes the modules around the layers as they are: a recipe naming one is refused
    with pytest.raises(StreamingUnsupportedError, match=r"quantizes lm_head, outside"):
        export_streaming(src, tmp_path / "head", recipe={"*": "fp8", "lm_head": "fp8"})
    with pytest.raises(StreamingUnsupportedError, match=r"quantizes model.embed_tokens, outside"):
        export_streaming(src, tmp_path / "head", recipe={"*": "fp8", "*embed_tokens": "int8_wo"})
    assert not (tmp_path / "head").exists()
    assert not list(tmp_path.glob(".head.stream*"))


@pytest.mark.parametrize(
    ("family", "recipe"),
    [
        ("gpt_oss", "nvfp4"),
        ("gpt_oss", "fp8+fp8_kv"),
        ("gpt_oss", "int4_awq"),
        ("gpt_oss", "int8_sq"),
        ("llama4", "int4_awq"),
        ("llama4", "int8_wo"),
        ("llama4", "int8_sq"),
        ("dbrx", "fp8"),
    ],
)
def test_moe_families_saved_under_their_module_names_stream_byte_for_byte(
    tmp_path: Path, family: str, recipe: str
) -> None:
    # GPT-OSS, Llama 4 and DBRX store their experts as the fused tensors the model holds.
    # GPT-OSS with int4_awq / int8_sq: in memory, layer 1 calibrates on the outputs of layer
    # 0's quantized experts wrapper (every quantizer transparent), the stream on
    # transformers' own; equal only because the wrapper adds the biases as transformers
    # does (``x @ W + b``, not addmm's fused bias, one bf16 rounding fewer)
    streamed = streams_as_in_memory(family_directory(tmp_path, family), tmp_path, recipe, "float")
    index = streamed / "model.safetensors.index.json"
    names = set(json.loads(index.read_text())["weight_map"]) if index.exists() else set()
    assert any("experts" in n and "scale" in n for n in names), sorted(names)[:20]


def test_a_layer_larger_than_the_budget_is_a_clear_error(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    with pytest.raises(
        LayerTooLargeError,
        match=r"streaming needs about .* beyond the process itself \(decoder layer 0 .* "
        r"Raise --max-memory",
    ):
        export_streaming(src, tmp_path / "out", recipe="fp8", max_memory="100KB")
    assert not (tmp_path / "out").exists()
    # a budget of a few bytes is said as such: it read "the 0.00 MB budget"
    with pytest.raises(LayerTooLargeError, match=r"more than the budget of 1000 bytes; expected"):
        export_streaming(src, tmp_path / "out", recipe="fp8", max_memory="1KB")


def test_the_budget_bounds_what_the_stream_holds_beyond_the_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the toy's layer (0.29 MB), one output shard (100 KB) and one linear in float32
    # (0.13 MB) fit 1 MB; the interpreter and torch are not counted (the logged bound is)
    src = llama_directory(tmp_path, tied=False, layers=1)
    with caplog.at_level("INFO", logger="exportlm.stream"):
        export_streaming(src, tmp_path / "ok", recipe="fp8", max_memory="1MB", max_shard_size=SHARD)
    assert re.search(r"memory bound of \d+ MB = baseline \d+ MB", caplog.text)


def test_under_a_budget_the_stream_picks_a_shard_size_that_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the default shard (the whole 0.46 MB model in one file) does not fit 0.8 MB beside a
    # layer (0.29 MB) and one linear in float32 (0.13 MB): it used to refuse ("lower
    # max_shard_size"); now it writes smaller shards, says so, and they are the bytes the
    # in-memory export writes with that shard size
    src = llama_directory(tmp_path, tied=False, layers=1)
    with caplog.at_level("INFO", logger="exportlm.stream"):
        streamed = export_streaming(src, tmp_path / "small", recipe="fp8", max_memory="0.8MB")
    chosen = json.loads((streamed / MANIFEST).read_text())["options"]["max_shard_size"]
    assert 0 < chosen < 460_000
    assert chosen & (chosen - 1) == 0, chosen  # a power of two
    assert f"shards of at most {chosen / 1e6:.1f} MB instead" in caplog.text
    assert len(list(streamed.glob("*.safetensors"))) > 1
    expected = in_memory_export(src, tmp_path / "memory", "fp8", shard=str(chosen))
    assert different_files(expected, streamed, skip=(MANIFEST,)) == []


def test_the_budget_decides_whether_to_stream(tmp_path: Path) -> None:
    src = llama_directory(tmp_path, tied=False)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert should_stream(src, max_memory=size)  # the in-memory export needs about twice
    assert not should_stream(src, max_memory=10 * size)
    assert parse_memory("8GB") == 8 * 10**9
    assert parse_memory("1GiB") == 2**30
    for unreadable in ("lots", "nan", "inf", "1e400"):  # inf and 1e400: OverflowError, raw
        with pytest.raises(InvalidInputError, match="expected a number and a unit"):
            parse_memory(unreadable)


def test_activations_past_the_budget_are_read_back_from_disk_with_the_same_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from exportlm.inputs import make_input_ids

    src = llama_directory(tmp_path, tied=False, layers=2)
    # 16 batches of 4 x 32 tokens: 0.52 MB of bf16 activations per layer boundary. The
    # budget's 1.5 MB less what the stream holds otherwise (a layer 0.29 MB, the one output
    # shard 0.72 MB, quantizing one linear 0.13 MB) leaves 0.35 MB: they live on disk.
    # Sequences stay under 64 tokens: torch 2.13's bf16 attention on a CPU with AMX, run
    # with ATEN_CPU_CAPABILITY=default, fails from 64 tokens on ("pack_vnni2 is only
    # supported when avx512 is supported"); the spill is what is tested here.
    batches = [make_input_ids(256, batch=4, seq=32, seed=s) for s in range(16)]
    with caplog.at_level("DEBUG", logger="exportlm.stream"):
        on_disk = export_streaming(
            src, tmp_path / "disk", recipe="fp8", calibration=batches, max_memory="1.5MB"
        )
    assert "entering layer 1 are read from disk" in caplog.text
    in_memory = export_streaming(
        src, tmp_path / "held", recipe="fp8", calibration=batches, max_memory="1GB"
    )
    assert different_files(on_disk, in_memory, skip=(MANIFEST,)) == []
