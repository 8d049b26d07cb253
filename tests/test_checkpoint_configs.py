"""The checkpoint's quantization configs: one builder from the exporters' layer facts.

The module exporters record facts (``LayerFacts``: spec, group size); the
``hf_checkpoint`` builder (``CheckpointQuantization``) writes both layouts' configs
from them and the specs' fields; the layouts' tensor rules are data
(``CheckpointLayout``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from exportlm.errors import UnsupportedFormatError
from exportlm.export.hf_checkpoint.configs import CheckpointQuantization
from exportlm.models import DecoderModel
from exportlm.module_exporters import (
    DictSink,
    LayerFacts,
    QuantConfigCollector,
    export_quantized_state,
)
from exportlm.quant import get_format, quantize
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, MIXED_PRECISION, checkpoint_layout

ROOT = Path(__file__).resolve().parents[1]


def _quantization(recipe: object) -> CheckpointQuantization:
    model = quantize(DecoderModel(num_layers=1), recipe)  # type: ignore[arg-type]
    return CheckpointQuantization.of(export_quantized_state(model, DictSink()))


def test_one_format_writes_its_spec_fields_and_the_excluded_modules() -> None:
    quant = _quantization("int4_awq")
    section = quant.hf_quant_config()
    assert section == {
        "quant_algo": "W4A16_AWQ",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["embed_tokens", "lm_head"],
        **get_format("int4").modelopt_layer_config(128),
    }
    config = quant.modelopt_config()
    assert config["ignore"] == ["embed_tokens", "lm_head"]
    assert "config_groups" not in config  # ModelOpt 0.47 writes none for W4A16_AWQ


def test_mixed_precision_lists_layers_and_no_exclude_modules() -> None:
    """As ModelOpt 0.47's process_layer_quant_config: exclude_modules only for one format."""
    quant = _quantization({"*": "fp8", "*.mlp.*": "nvfp4"})
    assert quant.mixed
    assert quant.quant_algo == MIXED_PRECISION
    section = quant.hf_quant_config()
    assert "exclude_modules" not in section
    assert section["quantized_layers"]["layers.0.mlp.up_proj"] == {
        "quant_algo": "NVFP4",
        "group_size": 16,
    }
    config = quant.modelopt_config()
    assert config["ignore"] == []
    targets = [group["targets"] for group in config["config_groups"].values()]
    assert [t[0] for t in targets] == ["layers.0.self_attn.k_proj", "layers.0.mlp.down_proj"]
    with pytest.raises(UnsupportedFormatError, match="MIXED_PRECISION"):
        quant.compressed_tensors_config()


def test_compressed_tensors_config_comes_from_the_spec() -> None:
    quant = _quantization("fp8+fp8_kv")
    config = quant.compressed_tensors_config()
    fp8 = get_format("fp8")
    assert fp8.compressed_tensors is not None
    assert fp8.kv_cache is not None
    assert config["config_groups"] == {"group_0": fp8.compressed_tensors.group(["Linear"])}
    assert config["kv_cache_scheme"] == dict(fp8.kv_cache.compressed_tensors or {})
    assert config["ignore"] == ["embed_tokens", "lm_head"]


#: (layout, what it says it holds, the layouts named instead) of the one-format layouts.
_ONE_FORMAT = [
    (
        "finegrained-fp8",
        "(quant_method 'fp8' with weight_block_size) holds one block-wise format for every "
        "quantized layer (fp8_block)",
        "format='compressed-tensors' or format='modelopt'",
    ),
    (
        "gpt-oss-mxfp4",
        "(quant_method 'mxfp4') holds the experts in mxfp4",
        "format='modelopt'",
    ),
]


@pytest.mark.parametrize(("layout", "holds", "instead"), _ONE_FORMAT)
@pytest.mark.parametrize(
    ("recipe", "what"),
    [
        ({"*": "fp8", "*.mlp.*": "nvfp4"}, "'MIXED_PRECISION'"),
        ("fp8", "'FP8'"),
        ("fp8_block+fp8_kv", "the KV cache as 'fp8'"),
    ],
)
def test_a_one_format_layout_refuses_what_it_cannot_hold_naming_what_it_holds(
    layout: str, holds: str, instead: str, recipe: object, what: str
) -> None:
    """finegrained-fp8 and gpt-oss-mxfp4 hold one format with their scheme and no KV cache."""
    quant = _quantization(recipe)
    message = (
        f"format={layout!r} {holds} and no KV-cache scales, but the model quantizes {what}; "
        f"use {instead}"
    )
    with pytest.raises(UnsupportedFormatError) as info:
        quant.quantization_config(checkpoint_layout(layout))
    assert str(info.value) == message


def test_a_layer_recorded_with_the_old_quant_algo_string_is_the_same_fact() -> None:
    collector = QuantConfigCollector()
    collector.add_layer("a", "W4A16_AWQ", 128)
    collector.add_layer("b", get_format("int4"), 128)
    assert collector.layers["a"] == collector.layers["b"] == LayerFacts(get_format("int4"), 128)


def test_one_scale_rule_per_layout() -> None:
    scale = torch.tensor(0.5)
    assert checkpoint_layout("modelopt").stored_scale(scale).shape == ()
    assert checkpoint_layout("compressed-tensors").stored_scale(scale).shape == (1,)
    block = torch.ones(4, 2)
    stored = checkpoint_layout("compressed-tensors").stored_scale(block)
    assert (stored.shape, stored.dtype) == (block.shape, block.dtype)  # kept as it is
    assert stored.data_ptr() == block.data_ptr()
    with pytest.raises(ValueError, match="format must be one of"):
        checkpoint_layout("gguf")


def _string_constants(room: Path) -> set[str]:
    found: set[str] = set()
    for path in room.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_the_module_exporters_name_no_layout_and_no_config_field() -> None:
    """Layouts, quant_algo names and config fields live in quant.formats / hf_checkpoint."""
    room = ROOT / "src" / "exportlm" / "module_exporters"
    names = set(CHECKPOINT_LAYOUTS) | {MIXED_PRECISION}
    for spec in (get_format(n) for n in ("fp8", "nvfp4", "int4", "int8")):
        assert spec.modelopt is not None
        names.add(spec.modelopt.quant_algo)
    # config keys (``pre_quant_scale`` is also a tensor leaf's name, which exporters write)
    names |= {"exclude_modules", "quantized_layers", "has_zero_point", "kv_cache_quant_algo"}
    assert not names & _string_constants(room)
