"""``config-field-invalid`` for compressed-tensors args its own validation refuses.

vLLM, SGLang and transformers parse each ``config_groups`` entry with compressed-tensors'
``QuantizationArgs``; a ``block`` strategy with a ``block_structure`` of ``[0, 0]`` (or
none, or one number) fails there before a tensor is read, while ``inspect`` said OK
(found 2026-12-06). The rule mirrors the library's validators: the table below is checked
against the library itself where it is installed (the ``interop`` extra), and through
``inspect_checkpoint`` on an exported checkpoint whose config was edited.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.checkpoint import quant_args
from exportlm.inspection import inspect_checkpoint
from exportlm.inspection._ct_args import args_problems
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from tests._malformed import copy_base, edit_json

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
_INT4 = {"num_bits": 4, "type": "int", "symmetric": True}

#: (args, refused by compressed-tensors): what our exports write, and each way to break it.
CASES: list[tuple[dict[str, Any], bool]] = [
    ({**_FP8, "strategy": "block", "block_structure": [128, 128]}, False),
    ({**_FP8, "strategy": "BLOCK", "block_structure": [32, 64]}, False),
    ({**_FP8, "strategy": "block", "block_structure": "128x128"}, False),
    ({**_FP8, "strategy": "block", "block_structure": [0, 0]}, True),
    ({**_FP8, "strategy": "block", "block_structure": [128]}, True),
    ({**_FP8, "strategy": "block", "block_structure": [128, -128]}, True),
    ({**_FP8, "strategy": "block", "block_structure": ["a", "b"]}, True),
    ({**_FP8, "strategy": "block", "block_structure": "128 by 128"}, True),
    ({**_FP8, "strategy": "block"}, True),
    ({**_FP8, "strategy": "channel", "block_structure": [128, 128]}, True),
    ({**_FP8, "strategy": "tensor"}, False),
    ({**_FP8, "strategy": "chanel"}, True),
    ({**_FP8, "strategy": "token", "dynamic": True}, False),
    ({**_FP8, "strategy": "token", "dynamic": False}, True),
    ({**_FP8, "strategy": "group", "group_size": 128, "dynamic": True}, False),
    ({**_FP8, "strategy": "channel", "dynamic": True}, True),
    ({**_FP8, "dynamic": True}, False),
    ({**_INT4, "strategy": "group", "group_size": 128}, False),
    ({**_INT4, "strategy": "group", "group_size": 0}, True),
    ({**_INT4, "strategy": "group"}, True),
    ({**_INT4, "strategy": "tensor_group", "group_size": 16}, False),
    ({**_INT4, "strategy": "channel", "group_size": 128}, True),
    ({**_INT4, "strategy": "channel", "group_size": -1}, False),
    ({**_INT4, "group_size": 64}, False),
    ({**_INT4, "group_size": -1}, False),
    ({**_INT4, "group_size": 0}, True),
    ({**_INT4, "group_size": -2}, True),
]


def _case_id(case: tuple[dict[str, Any], bool]) -> str:
    args, refused = case
    shown = {k: v for k, v in args.items() if k not in ("num_bits", "type", "symmetric")}
    return f"{'refused' if refused else 'taken'}-{json.dumps(shown, sort_keys=True)}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_the_args_the_rule_refuses(case: tuple[dict[str, Any], bool]) -> None:
    args, refused = case
    found = args_problems(quant_args(args), "weights")
    assert bool(found) is refused, found
    assert all(why.startswith("weights") for why in found)


@pytest.mark.interop
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_the_table_is_what_compressed_tensors_validates(case: tuple[dict[str, Any], bool]) -> None:
    """The same table through the library's own ``QuantizationArgs``: refused there
    exactly where the rule refuses."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    args, refused = case
    tile = args.get("block_structure")
    if isinstance(tile, list) and all(isinstance(v, int) for v in tile) and _ct_version() < (0, 19):
        pytest.skip(
            "compressed-tensors before 0.19 takes a tile of any sign (0.17: vLLM 0.32's, which "
            "then fails at load: ZeroDivisionError, measured); the rule refuses it as 0.19 does"
        )
    try:
        ct.QuantizationArgs.model_validate(args)
    except ValueError:  # pydantic's ValidationError is a ValueError
        assert refused, f"compressed-tensors refuses {args}, the rule takes it"
    else:
        assert not refused, f"compressed-tensors takes {args}, the rule refuses it"


def _ct_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("compressed-tensors").split(".")[:2] if p.isdigit())


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_hf_model("llama", seed=0, hidden_size=256, intermediate_size=512, head_dim=64)
    quantize(model, "fp8_block")
    out = tmp_path_factory.mktemp("ct") / "fp8_block"
    return exportlm.export_model("hf_checkpoint", model, out, format="compressed-tensors")


def _edited(source: Path, tmp_path: Path, key: str, value: Any) -> Path:
    """An unsigned copy of ``source`` whose one config group's weights have ``key`` set to
    ``value``."""

    def edit(config: dict[str, Any]) -> None:
        (group,) = config["quantization_config"]["config_groups"].values()
        group["weights"][key] = value

    out = copy_base(source, tmp_path / "edited")
    edit_json(out / "config.json", edit)
    return out


def test_our_fp8_block_checkpoint_has_no_invalid_args(fp8_block: Path) -> None:
    report = inspect_checkpoint(fp8_block)
    assert [f for f in report.findings if f.rule == "config-field-invalid"] == []


@pytest.mark.parametrize("tile", [[0, 0], [128], None], ids=["zeros", "one-number", "none"])
def test_a_block_strategy_without_a_valid_tile_is_an_error(
    fp8_block: Path, tmp_path: Path, tile: Any
) -> None:
    report = inspect_checkpoint(_edited(fp8_block, tmp_path, "block_structure", tile))
    (found,) = [f for f in report.errors if f.rule == "config-field-invalid"]
    assert found.subject == "config.json"
    assert "config_groups['group_0'].weights: strategy 'block' needs block_structure" in (
        found.message
    )
    assert f"got {tile!r}" in found.message
    assert "fail at load" in found.message


def test_the_loader_refuses_the_args_naming_them(fp8_block: Path, tmp_path: Path) -> None:
    """Before the rule, exportlm's loader called ``[0, 0]`` no registered format's scheme
    and asked for a ``FormatSpec`` to be registered (the wrong way to go); now it refuses
    the checkpoint first, naming the field and what it must be."""
    from exportlm.errors import MalformedCheckpointError
    from exportlm.export.guard import UnverifiedArtifactWarning

    edited = _edited(fp8_block, tmp_path, "block_structure", [0, 0])  # unsigned: a third party's
    with pytest.warns(UnverifiedArtifactWarning), pytest.raises(MalformedCheckpointError) as err:
        exportlm.load_exported("hf_checkpoint", edited)
    assert "block_structure [rows, cols] of two positive ints; got [0, 0]" in str(err.value)
