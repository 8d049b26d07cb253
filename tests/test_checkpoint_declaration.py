"""The checkpoint room: one reader of a checkpoint's quantization configs (issue 40).

``exportlm.checkpoint.read_declaration`` reads ``config.json``'s ``quantization_config``
and ``hf_quant_config.json`` as untrusted input into one declaration model; the
``hf_checkpoint`` loader, ``exportlm inspect`` and the engines read through it, so a
malformed config is a named error or a finding in each of them, never a raw exception.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.checkpoint import MIXED_PRECISION, QuantArgs, read_declaration
from exportlm.engines import artifact_kind
from exportlm.errors import MalformedCheckpointError, NotRegularFileError, UnsupportedFormatError
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


def _write(directory: Path, config: dict[str, Any], hf_quant: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return directory


def test_a_modelopt_checkpoint_reads_from_hf_quant_config_first(tmp_path: Path) -> None:
    hf_quant = {
        "producer": {"name": "modelopt", "version": "0.29"},
        "quantization": {
            "quant_algo": MIXED_PRECISION,
            "kv_cache_quant_algo": "FP8",
            "quantized_layers": {
                "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
                "model.layers.0.self_attn.q_proj": {"quant_algo": "W4A16_AWQ", "group_size": 128},
            },
            "exclude_modules": ["lm_head"],
        },
    }
    config = {"model_type": "llama", "quantization_config": {"quant_method": "modelopt"}}
    declared = read_declaration(_write(tmp_path, config, hf_quant))
    section = declared.primary
    assert section is declared.hf_quant
    assert section is not None
    assert (section.layout, section.source, section.mixed) == (
        "modelopt",
        "hf_quant_config.json",
        True,
    )
    assert [
        (layer.name, layer.quant_algo, layer.group_size) for layer in section.quantized_layers
    ] == [
        ("model.layers.0.mlp.down_proj", "FP8", None),
        ("model.layers.0.self_attn.q_proj", "W4A16_AWQ", 128),
    ]
    assert section.kv_cache_quant_algo == "FP8"
    assert declared.quant_method == "modelopt"
    assert declared.producer == "modelopt"
    excluded = [(i.entry, i.where) for i in declared.listed if i.excluded]
    assert excluded == [("lm_head", "hf_quant_config.json: quantization.exclude_modules")]


def test_compressed_tensors_groups_read_by_meaning_and_preset(tmp_path: Path) -> None:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "format": None},
                "group_1": {
                    "targets": ["model.layers.0.mlp.down_proj"],
                    "weights": {"num_bits": 8, "type": "float", "observer": "minmax"},
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                    "format": "float-quantized",
                },
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "observer": "minmax"},
        }
    }
    section = read_declaration(_write(tmp_path, config)).primary
    assert section is not None
    assert section.layout == "compressed-tensors"
    groups = section.config_groups or ()
    assert [g.format for g in groups] == ["pack-quantized", "float-quantized"]  # the config's
    assert [g.preset for g in groups] == ["W4A16", "FP8"]
    assert section.scheme == MIXED_PRECISION
    # a producer's extra keys (observer) do not change what the args mean
    assert section.kv_cache_scheme is not None
    assert section.kv_cache_scheme.meaning() == QuantArgs(num_bits=8, type="float").meaning()
    assert groups[0].weights is not None
    assert groups[0].weights.group_size == 64
    listed = [(i.entry, i.excluded, i.target) for i in section.listed]
    assert listed == [
        ("lm_head", True, False),
        ("Linear", False, True),
        ("model.layers.0.mlp.down_proj", False, True),
    ]


def test_values_of_the_wrong_kind_are_kept_for_the_rules_not_raised(tmp_path: Path) -> None:
    config = {"quantization_config": {"quant_method": "modelopt", "quantized_layers": ["a"]}}
    section = read_declaration(_write(tmp_path / "a", config)).config
    assert section is not None
    assert section.quantized_layers == ()
    assert section.quantized_layers_invalid == ["a"]
    declared = read_declaration(_write(tmp_path / "b", {"quantization_config": ["modelopt"]}))
    assert declared.config is None
    assert declared.config_invalid == ["modelopt"]
    assert declared.primary is None
    assert declared.quant_method is None


def test_the_configs_are_read_as_untrusted_files(tmp_path: Path) -> None:
    directory = _write(tmp_path / "garbage", {"model_type": "llama"})
    (directory / "hf_quant_config.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(MalformedCheckpointError, match=r"hf_quant_config\.json") as info:
        read_declaration(directory)
    assert info.value.path == directory / "hf_quant_config.json"
    with pytest.raises(MalformedCheckpointError, match=r"has no config\.json"):
        read_declaration(tmp_path / "garbage" / "missing")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_for_hf_quant_config_is_refused_without_blocking(tmp_path: Path) -> None:
    directory = _write(tmp_path, {"model_type": "llama"})
    os.mkfifo(directory / "hf_quant_config.json")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            read_declaration(directory)
        except BaseException as err:
            errors.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "reading a FIFO hf_quant_config.json blocked"
    assert len(errors) == 1
    assert isinstance(errors[0], NotRegularFileError)


@pytest.mark.parametrize(
    ("quantization_config", "layout", "scheme"),
    [
        (["modelopt"], None, None),  # not an object: no declaration (was AttributeError)
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "float"},
                        "input_activations": {"num_bits": None, "type": "float"},
                    }
                },
            },
            "compressed-tensors",
            "unknown ('float', 8, ('float', 0))",  # num_bits null (was TypeError)
        ),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt", "NVFP4"),
    ],
)
def test_engines_read_a_checkpoint_s_layout_and_scheme_through_the_reader(
    tmp_path: Path, quantization_config: Any, layout: str | None, scheme: str | None
) -> None:
    config = {
        "model_type": "llama",
        "dtype": "bfloat16",
        "quantization_config": quantization_config,
    }
    kind = artifact_kind(_write(tmp_path, config))
    assert (kind.target, kind.layout, kind.scheme, kind.dtype) == (
        "hf_checkpoint",
        layout,
        scheme,
        "bfloat16",
    )


def test_the_loader_refuses_a_kv_cache_scheme_that_is_not_args_by_name(tmp_path: Path) -> None:
    """A ``kv_cache_scheme`` string is refused naming the field and what to do (it was a
    ``MalformedCheckpointError`` wrapping the parser's ``AttributeError``)."""
    model = tiny_hf_model("llama", seed=0).eval()
    batch = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator())
    quantize(model, "fp8+fp8_kv", calibrate=lambda m: m(batch))
    out = exportlm.export_model(
        "hf_checkpoint", model, tmp_path / "ours", format="compressed-tensors"
    )
    for manifest in out.glob("*manifest*.json"):
        manifest.unlink()  # a foreign checkpoint: its configs are not ours
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = "fp8"
    (out / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: loaded unverified
        with pytest.raises(UnsupportedFormatError, match="kv_cache_scheme 'fp8'"):
            exportlm.load_exported("hf_checkpoint", out)


@pytest.mark.parametrize(
    ("fmt", "layout", "source"),
    [
        ("modelopt", "modelopt", "hf_quant_config.json"),
        ("compressed-tensors", "compressed-tensors", "config.json quantization_config"),
    ],
)
def test_what_the_writer_writes_reads_back_as_its_scheme(
    tmp_path: Path, fmt: str, layout: str, source: str
) -> None:
    model = tiny_hf_model("llama", seed=0).eval()
    batch = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator())
    quantize(model, "fp8+fp8_kv", calibrate=lambda m: m(batch), exclude=["lm_head"])
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "out", format=fmt)
    declared = read_declaration(out)
    section = declared.primary
    assert section is not None
    assert (section.layout, section.source, section.scheme) == (layout, source, "FP8")
    assert declared.quant_method == fmt
    assert [i.entry for i in declared.listed if i.excluded][:1] == ["lm_head"]
    kv = section.kv_cache_quant_algo if fmt == "modelopt" else section.kv_cache_scheme
    assert kv
