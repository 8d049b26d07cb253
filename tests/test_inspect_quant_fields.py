"""Quantization fields the loaders require in one form (``inspection/_quant_fields.py``).

Each of these passed ``inspect`` as OK and most loaded in exportlm (found 2026-12-06): a
ModelOpt ``group_size`` of 0, -1, ``"128"`` or ``true`` (vLLM's NVFP4 divides the input
features by it); a ``kv_cache_quant_algo`` of ``"FP9"``; ``exclude_modules`` / ``ignore``
/ a compressed-tensors group's ``targets`` that are not lists of strings (vLLM's ModelOpt
config raises "exclude_modules must be a list"; compressed-tensors takes ``list[str]``).
Each is now an error of ``inspect`` and a refusal of the loader, naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.errors import ExportLMError
from exportlm.export.guard import UnverifiedArtifactWarning
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from tests._malformed import copy_base, edit_json


def _export(root: Path, recipe: str, layout: str) -> Path:
    model = tiny_hf_model("llama", seed=0, hidden_size=256, intermediate_size=512)
    quantize(model, recipe)
    out = root / f"{recipe.replace('+', '_')}-{layout}"
    return exportlm.export_model("hf_checkpoint", model, out, format=layout)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fields")
    return {
        "int4_awq": _export(root, "int4_awq", "modelopt"),
        "fp8_kv": _export(root, "fp8+fp8_kv", "modelopt"),
        "fp8_kv_ct": _export(root, "fp8+fp8_kv", "compressed-tensors"),
    }


Edit = Callable[[dict[str, Any]], None]


def _edited(source: Path, tmp_path: Path, file: str, edit: Edit) -> Path:
    """An unsigned copy of ``source`` (a third party's checkpoint) with ``file`` edited."""
    out = copy_base(source, tmp_path / "edited")
    edit_json(out / file, edit)
    return out


def _quantization(key: str, value: Any) -> Edit:
    return lambda c: c["quantization"].__setitem__(key, value)


def _ct(key: str, value: Any) -> Edit:
    return lambda c: c["quantization_config"].__setitem__(key, value)


def _targets(value: Any) -> Edit:
    return lambda c: c["quantization_config"]["config_groups"]["group_0"].__setitem__(
        "targets", value
    )


def _findings(directory: Path, rule: str) -> list[Any]:
    return [f for f in inspect_checkpoint(directory).errors if f.rule == rule]


TAKEN = [
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", 128), "group-128"),
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", None), "group-null"),
    ("fp8_kv", "hf_quant_config.json", _quantization("kv_cache_quant_algo", "FP8"), "kv-fp8"),
    ("fp8_kv", "hf_quant_config.json", _quantization("exclude_modules", []), "exclude-empty"),
    ("fp8_kv_ct", "config.json", _ct("ignore", ["lm_head"]), "ignore-list"),
]

REFUSED = [
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", 0), "config-field-invalid", "group_size is 0"),
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", -1), "config-field-invalid", "group_size is -1"),
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", "128"), "config-field-invalid", "group_size is '128'"),
    ("int4_awq", "hf_quant_config.json", _quantization("group_size", True), "config-field-invalid", "group_size is True"),
    ("fp8_kv", "hf_quant_config.json", _quantization("kv_cache_quant_algo", "FP9"), "quant-algo-unknown", "kv_cache_quant_algo is 'FP9'"),
    ("fp8_kv", "hf_quant_config.json", _quantization("exclude_modules", "lm_head"), "config-field-invalid", "quantization.exclude_modules is 'lm_head'"),
    ("fp8_kv", "hf_quant_config.json", _quantization("exclude_modules", [5]), "config-field-invalid", "quantization.exclude_modules is [5]"),
    ("fp8_kv_ct", "config.json", _ct("ignore", "lm_head"), "config-field-invalid", "quantization_config.ignore is 'lm_head'"),
    ("int4_awq", "config.json", _ct("ignore", "lm_head"), "config-field-invalid", "ignore is 'lm_head', expected a JSON list of module-name strings: vLLM's ModelOpt config"),
    ("fp8_kv_ct", "config.json", _targets("Linear"), "config-field-invalid", "group_0.targets is 'Linear'"),
    ("fp8_kv_ct", "config.json", _targets(None), "config-field-invalid", "group_0.targets is None"),
]  # fmt: skip


@pytest.mark.parametrize(("base", "file", "edit", "name"), TAKEN, ids=[t[-1] for t in TAKEN])
def test_what_the_loaders_take_is_no_finding_and_loads(
    exported: dict[str, Path], tmp_path: Path, base: str, file: str, edit: Edit, name: str
) -> None:
    edited = _edited(exported[base], tmp_path, file, edit)
    report = inspect_checkpoint(edited)
    assert [
        f for f in report.errors if f.rule in ("config-field-invalid", "quant-algo-unknown")
    ] == []
    with pytest.warns(UnverifiedArtifactWarning):
        exportlm.load_exported("hf_checkpoint", edited)


@pytest.mark.parametrize(
    ("base", "file", "edit", "rule", "says"), REFUSED, ids=[r[-1] for r in REFUSED]
)
def test_another_value_is_an_error_and_the_loader_refuses_it(
    exported: dict[str, Path],
    tmp_path: Path,
    base: str,
    file: str,
    edit: Edit,
    rule: str,
    says: str,
) -> None:
    edited = _edited(exported[base], tmp_path, file, edit)
    (found,) = _findings(edited, rule)
    assert found.subject == file
    assert says in found.message
    with pytest.warns(UnverifiedArtifactWarning), pytest.raises(ExportLMError) as err:
        exportlm.load_exported("hf_checkpoint", edited)
    assert says in str(err.value)


@pytest.mark.parametrize("size", [128, 0], ids=["positive", "zero"])
def test_each_mixed_precision_layer_has_its_group_size_checked(tmp_path: Path, size: int) -> None:
    """``MIXED_PRECISION``'s ``quantized_layers`` entries carry their own ``group_size``."""
    from exportlm.checkpoint import MIXED_PRECISION, read_declaration
    from exportlm.inspection._config import quant_config_problems

    layer = "model.layers.0.self_attn.q_proj"
    hf_quant = {
        "quantization": {
            "quant_algo": MIXED_PRECISION,
            "quantized_layers": {
                "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
                layer: {"quant_algo": "W4A16_AWQ", "group_size": size},
            },
            "exclude_modules": ["lm_head"],
        }
    }
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "modelopt"}})
    )
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    messages = [m for _, _, m in quant_config_problems(read_declaration(tmp_path))]
    if size > 0:
        assert messages == []
    else:
        (only,) = messages
        assert f"quantized_layers[{layer!r}] group_size is 0, expected a positive int" in only
