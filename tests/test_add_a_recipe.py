"""docs/architecture.md "How to add a recipe", followed as written: INT4 round-to-nearest.

The section's plugin files (the record, the entry point) become an installed
distribution; its two commands run with it on the path; the checkpoint they write
holds INT4 groups of 64 without AWQ's ``pre_quant_scale`` and loads back as the
fake-quantized model.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.errors import RegistryConflictError, UnknownOptionError
from exportlm.export import get_target_info, make_input_ids
from exportlm.models import tiny_hf_model
from exportlm.quant import (
    RECIPE_REGISTRY,
    QuantFormat,
    QuantRecipe,
    Recipe,
    is_quantized_module,
    quantize,
    recipe_names,
    register_recipe,
)
from tests._distinfo import make_distribution
from tests._docblocks import ROOT, Block, parse_blocks

PAGE = ROOT / "docs" / "architecture.md"
HEADING = "## How to add a recipe"


def _section() -> list[Block]:
    """The code blocks between the section's heading and the next heading of its level."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADING) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    return [b for b in parse_blocks(PAGE) if start < b.line <= end]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The section's plugin, installed: its record module and its entry point."""
    blocks = _section()
    record = next(b for b in blocks if b.directives().file)
    toml = next(b for b in blocks if b.language == "toml")
    entry_points = tomllib.loads(toml.source)["project"]["entry-points"]
    root = tmp_path_factory.mktemp("int4-rtn-site")
    filename = record.directives().file
    assert filename is not None
    make_distribution(root, "exportlm-int4-rtn", entry_points, {filename: record.source})
    return root


def _commands() -> list[list[str]]:
    block = next(b for b in _section() if b.language == "bash")
    return [shlex.split(line) for line in block.source.splitlines() if line.strip()]


@pytest.fixture
def int4_rtn() -> Iterator[Recipe]:
    """The documented recipe, registered in this process."""
    record = Recipe("int4_rtn", QuantFormat.INT4, group_sizes=(32, 64, 128))
    register_recipe(record)
    yield record
    RECIPE_REGISTRY.unregister("int4_rtn")


def _run(argv: list[str], site: Path, cwd: Path) -> str:
    assert argv[0] == "exportlm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "exportlm", *argv[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_documented_plugin_recipe_is_listed_and_exported(
    site: Path, tmp_path: Path, int4_rtn: Recipe
) -> None:
    listed, export = _commands()
    recipes = {r["name"]: r for r in json.loads(_run(listed, site, tmp_path))["recipes"]}
    assert recipes["int4_rtn"] == {
        "name": "int4_rtn",
        "format": "int4",
        "kind": "weights",
        "provider": "exportlm-int4-rtn 1.0",
    }
    _run(export, site, tmp_path)

    out = tmp_path / "int4-rtn-cli"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = [group["weights"] for group in config["config_groups"].values()]
    assert [(w["num_bits"], w["group_size"], w["symmetric"]) for w in weights] == [(4, 64, True)]
    # the same recipe in this process, on the CLI's toy model: RTN needs no calibration
    model = tiny_hf_model("llama")  # with the layout's scale convention, as the CLI picks it
    quantize(model, QuantRecipe.parse("int4_rtn:group_size=64").for_layout("compressed-tensors"))
    ids = make_input_ids(model.config.vocab_size, 2, 8, seed=3)
    info = get_target_info("hf_checkpoint")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = exportlm.load_exported("hf_checkpoint", out)(ids)
    torch.testing.assert_close(got, expected, atol=info.atol, rtol=info.rtol)


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_a_recipe_registered_in_code_quantizes_and_round_trips(
    int4_rtn: Recipe, layout: str, tmp_path: Path
) -> None:
    model = tiny_hf_model("llama", seed=0)
    ids = make_input_ids(model.config.vocab_size, 2, 8, seed=3)
    calls: list[int] = []
    quantize(model, "int4_rtn", group_size=64, calibrate=lambda m: calls.append(1))
    assert calls == []  # round-to-nearest needs no calibration forward
    proj = model.model.layers[0].self_attn.o_proj
    assert (proj.quant_algo, proj.group_size, proj.weight_quantizer.block_size) == (
        "W4A16_AWQ",
        64,
        64,
    )
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", format=layout)
    info = get_target_info("hf_checkpoint")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = exportlm.load_exported("hf_checkpoint", out)(ids)
    torch.testing.assert_close(got, expected, atol=info.atol, rtol=info.rtol)


def test_a_recipe_takes_only_its_own_options(int4_rtn: Recipe) -> None:
    assert "int4_rtn" in recipe_names()
    with pytest.raises(UnknownOptionError, match="accepted: group_size"):
        quantize(tiny_hf_model("llama"), "int4_rtn", alpha=0.5)
    with pytest.raises(ValueError, match="group_size=48 is not one it takes"):
        quantize(tiny_hf_model("llama"), "int4_rtn:group_size=48")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (Recipe("int8_rows", QuantFormat.INT8, group_size=64), "group_size is for block formats"),
        (Recipe("int4_in", QuantFormat.INT4, QuantFormat.INT4), "stores activations as None"),
        (Recipe("int8_rows", QuantFormat.INT8, awq=True), "no such leaf"),
        (Recipe("int4 rtn", QuantFormat.INT4), "no spaces"),
        (Recipe("int4_zp", QuantFormat.INT4, symmetric=False), "has a zero point"),
    ],
)
def test_an_unsound_recipe_is_refused_when_registered(record: Recipe, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        register_recipe(record)
    assert record.name not in RECIPE_REGISTRY


def test_a_taken_recipe_name_is_a_conflict() -> None:
    with pytest.raises(RegistryConflictError, match="'int4_awq' is already registered"):
        register_recipe(Recipe("int4_awq", QuantFormat.INT4))


def test_a_recipe_states_the_modules_it_leaves_unquantized(tmp_path: Path) -> None:
    record = Recipe("int8_no_o", QuantFormat.INT8, weight_axis=0, default_exclude=("*o_proj",))
    register_recipe(record)
    try:
        model = tiny_hf_model("llama", seed=0)
        quantize(model, "int8_no_o")
        layer = model.model.layers[0]
        assert not is_quantized_module(layer.self_attn.o_proj)  # the recipe's own exclusion
        assert is_quantized_module(layer.self_attn.q_proj)
        assert is_quantized_module(model.lm_head)  # not in this recipe's default_exclude
        # an override still beats the recipe's exclusions, as it beats the default ones
        again = tiny_hf_model("llama", seed=0)
        quantize(again, {"*": "int8_no_o", "*.o_proj": "int8_wo"})
        assert is_quantized_module(again.model.layers[0].self_attn.o_proj)
    finally:
        RECIPE_REGISTRY.unregister("int8_no_o")


def test_a_broken_recipe_plugin_is_a_failed_line_and_hides_nothing(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_distribution(
        site,
        "exportlm-bad-recipe",
        {"exportlm.recipes": {"int8_g64": "bad_recipe:INT8_G64"}},
        {
            "bad_recipe.py": """
            from exportlm.quant import QuantFormat, Recipe

            INT8_G64 = Recipe("int8_g64", QuantFormat.INT8, group_size=64)
            """
        },
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "exportlm", "list", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    listed = json.loads(done.stdout)
    (failed,) = [f for f in listed["failed_plugins"] if f["registry"] == "quantization recipe"]
    assert (failed["name"], failed["status"]) == ("int8_g64", "failed")
    assert failed["distribution"] == "exportlm-bad-recipe 1.0"
    assert "group_size is for block formats" in failed["error"]
    assert {"fp8", "int4_awq", "w8a8"} <= {r["name"] for r in listed["recipes"]}
