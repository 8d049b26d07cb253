"""Recipes a model directory cannot take are refused from its ``config.json`` alone, before a
weight file is opened (the CLI, ``export_model("hf_checkpoint", DIR, recipe=...)`` in memory
and streamed), and the way out the refusal names works in one step.

Each refusal is asked of a copy of the directory whose weights file is garbage: reading it
would raise safetensors' own error, so the refusal's message coming out shows no weight was
read. The in-quantize refusal stays for a model in memory (``tests/test_awq_ct_experts.py``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import exportlm
from exportlm.cli import main
from exportlm.errors import InvalidConfigError, MalformedCheckpointError, UnsupportedFormatError
from exportlm.models import tiny_hf_model

CT = "compressed-tensors"

#: (family, recipe, -o options, what the refusal says was wrong)
CASES = {
    "w4a8_awq on stacked experts": (
        "mixtral",
        "w4a8_awq",
        [],
        "quantizes the inputs after a per-expert AWQ scale",
    ),
    "DBRX experts under INT4 in compressed-tensors": (
        "dbrx",
        "int4_awq",
        ["-o", f"format={CT}"],
        "DBRX experts are exported in DBRX's own fused layout",
    ),
    "int4_gptq on stacked experts": (
        "qwen3_moe",
        "int4_gptq",
        [],
        "runs GPTQ, which quantizes linear layers from their inputs' Hessian",
    ),
    "int8_gptq on stacked experts": (
        "mixtral",
        "int8_gptq",
        [],
        "runs GPTQ, which quantizes linear layers from their inputs' Hessian",
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny model saved with seeded weights."""
    root = tmp_path_factory.mktemp("models")
    families = {family for family, *_ in CASES.values()}
    for family in sorted(families):
        tiny_hf_model(family, seed=0).save_pretrained(root / family)
    small = root / "hidden-192"  # input features 192: no block of 128 divides them
    tiny_hf_model("llama", seed=0, hidden_size=192, intermediate_size=384).save_pretrained(small)
    # three layers; q / k / v, gate / up take 192 inputs, down 160 (64 does not divide it), o 128
    uneven = root / "uneven"
    tiny_hf_model(
        "llama", seed=0, hidden_size=192, intermediate_size=160, num_hidden_layers=3
    ).save_pretrained(uneven)
    return {**{f: root / f for f in families}, "hidden-192": small, "uneven": uneven}


def _garbage_weights(model_dir: Path, where: Path) -> Path:
    """``model_dir``'s config with a weights file no reader can open."""
    where.mkdir()
    shutil.copy(model_dir / "config.json", where / "config.json")
    (where / "model.safetensors").write_bytes(b"\xff" * 64)
    return where


def _export(model: Path, out: Path, recipe: str, *extra: str) -> list[str]:
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model), "--out", str(out)]
    return [*argv, "--quantize", recipe, *extra]


@pytest.mark.parametrize("case", list(CASES))
def test_the_cli_refuses_before_a_weight_is_read_and_the_named_exclusion_exports(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    family, recipe, options, wrong = CASES[case]
    garbage = _garbage_weights(saved[family], tmp_path / "garbage")
    assert main(_export(garbage, tmp_path / "refused", recipe, *options)) == 2  # a usage error
    err = capsys.readouterr().err
    assert wrong in err
    assert "SafetensorError" not in err
    assert not (tmp_path / "refused").exists()
    # the way out, as the message spells it for the command line, on the real directory
    found = re.search(r"--exclude '([^']+)'", err)
    assert found is not None, err
    out = tmp_path / "out"
    assert main(_export(saved[family], out, recipe, *options, "--exclude", found[1])) == 0
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_export_model_from_a_directory_refuses_before_a_weight_is_read(
    saved: dict[str, Path], tmp_path: Path, case: str, stream: bool
) -> None:
    """Before: the in-memory source loaded the model and quantize refused it; the stream
    read the shards' headers first. Both raised safetensors' own error on this directory."""
    family, recipe, options, wrong = CASES[case]
    garbage = _garbage_weights(saved[family], tmp_path / "garbage")
    format = options[1].removeprefix("format=") if options else "modelopt"
    out = tmp_path / "out"
    with pytest.raises(UnsupportedFormatError, match=re.escape(wrong)):
        exportlm.export_model(
            "hf_checkpoint", garbage, out, recipe=recipe, stream=stream, format=format
        )
    assert not out.exists()


def test_gptq_on_experts_names_a_pattern_for_every_layer_and_a_recipe_that_takes_them(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Before: ``exclude=['model.layers.0.mlp.experts']``, layer 0's only, so following it
    was refused again at layer 1."""
    out = tmp_path / "out"
    with pytest.raises(UnsupportedFormatError) as refused:
        exportlm.export_model("hf_checkpoint", saved["qwen3_moe"], out, recipe="int4_gptq")
    message = str(refused.value)
    assert "exclude=['*.mlp.experts'], --exclude '*.mlp.experts'" in message
    assert "{'*.mlp.experts': 'int4_awq'}" in message
    recipe = {"*": "int4_gptq", "*.mlp.experts": "int4_awq"}
    exportlm.export_model("hf_checkpoint", saved["qwen3_moe"], out, recipe=recipe)
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["quant_algo"] == "W4A16_AWQ"


def test_fp8_block_refusal_names_options_that_export_in_one_step(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """192 input features in the default (ModelOpt) layout, which holds blocks of 128 only.
    Before: the refusal named ``--quantize fp8_block:group_size=64`` alone, which the layout
    check then refused ("blocks of 128 only")."""
    garbage = _garbage_weights(saved["hidden-192"], tmp_path / "garbage")
    assert main(_export(garbage, tmp_path / "refused", "fp8_block")) == 2
    err = capsys.readouterr().err
    assert "needs input features divisible by 128" in err
    assert "SafetensorError" not in err
    suggested = re.search(r"--quantize (\S+) -o format=(\S+) or -o format=(\S+?),", err)
    assert suggested is not None, err
    recipe, *layouts = suggested.groups()
    assert (recipe, layouts) == ("fp8_block:group_size=64", [CT, "finegrained-fp8"])
    for layout in layouts:
        out = tmp_path / layout
        assert main(_export(saved["hidden-192"], out, recipe, "-o", f"format={layout}")) == 0
        assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("recipe", ["int4_awq", "fp8_block"])
def test_a_shape_refusal_names_every_module_refused_alike_and_its_exclusion_exports(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str
) -> None:
    """Before: ``--exclude 'model.layers.0.self_attn.q_proj'``, one module of the 18 the group
    size does not fit, so following it was refused again at the next (k_proj, layer 1...)."""
    garbage = _garbage_weights(saved["uneven"], tmp_path / "garbage")
    assert main(_export(garbage, tmp_path / "refused", recipe)) == 2
    err = capsys.readouterr().err
    assert "(17 more module(s) are refused alike)" in err  # 6 per layer
    excludes = re.findall(r"--exclude '([^']+)'", err)
    # o_proj (128 inputs) fits: not excluded; every MLP projection is refused: one pattern
    assert excludes == ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.mlp.*"]
    out = tmp_path / "out"
    extra = [arg for pattern in excludes for arg in ("--exclude", pattern)]
    assert main(_export(saved["uneven"], out, recipe, *extra)) == 0
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.2.self_attn.o_proj" not in declared["exclude_modules"]  # still quantized


def test_a_shape_refusals_group_size_fits_every_module_and_exports(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``int4_awq:group_size=64``, which divides the first refused module's 192 inputs
    but not down_proj's 160: refused again. Now the sizes named divide every weight's inputs."""
    garbage = _garbage_weights(saved["uneven"], tmp_path / "garbage")
    assert main(_export(garbage, tmp_path / "refused", "int4_awq")) == 2
    err = capsys.readouterr().err
    assert "group_size=32 divides 160 and 192" in err
    suggested = re.search(r"--quantize ([\w:=]+)", err)
    assert suggested is not None, err
    assert suggested[1] == "int4_awq:group_size=32"
    assert main(_export(saved["uneven"], tmp_path / "out", suggested[1])) == 0


@pytest.mark.real_model
def test_the_real_models_fp8_block_refusal_names_the_options_that_export_it(
    real_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2-135M (hidden 576): refused from its config.json, naming the options
    ``tests/test_fp8_block.py::test_the_real_model_exports_from_its_directory`` exports with."""
    assert main(_export(real_model_dir, tmp_path / "out", "fp8_block")) == 2
    err = capsys.readouterr().err
    assert "group_size=64 or group_size=32 divides 576" in err
    assert f"--quantize fp8_block:group_size=64 -o format={CT}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_garbage_weights_file_a_recipe_passes_is_named_not_safetensors_own_error(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], stream: bool
) -> None:
    """Past the recipe's checks the weights are read: a file that is no safetensors is named
    (before: ``SafetensorError: Error while deserializing header``, safetensors' own)."""
    garbage = _garbage_weights(saved["hidden-192"], tmp_path / "garbage")
    out = tmp_path / "out"
    error = MalformedCheckpointError if stream else InvalidConfigError
    with pytest.raises(error, match="garbage") as raised:
        exportlm.export_model("hf_checkpoint", garbage, out, recipe="int8_wo", stream=stream)
    assert "SafetensorError" not in type(raised.value).__name__
    assert not out.exists()
    if not stream:
        assert main(_export(garbage, out, "int8_wo")) == 2
        assert "transformers cannot load a causal LM from this directory" in capsys.readouterr().err
