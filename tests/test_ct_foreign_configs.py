"""compressed-tensors checkpoints from another producer load by what their config means.

llm-compressor serializes every ``QuantizationArgs`` field, its defaults included
(``observer``, ``observer_kwargs``, ``actorder``, ``block_structure``, ``scale_dtype``,
``zp_dtype``), leaves a group's ``format`` null and names the format once for the
whole config, and writes ``output_activations: null``. Our loader matched a group by
dict equality with our own serialization, so every llm-compressor checkpoint was
refused (``UnsupportedFormatError: ... is no registered format's compressed-tensors
scheme``) while transformers loaded it. Here our own checkpoints' configs are rewritten
as llm-compressor writes them (the tensors unchanged, the manifest removed as a
foreign producer has none) and must load to the same logits.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.errors import UnsupportedFormatError
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

#: Float32 forwards of the same stored tensors in one process, read through two configs.
ATOL = 1e-6
_PRODUCER_DEFAULTS = {
    "observer_kwargs": {},
    "actorder": None,
    "block_structure": None,
    "scale_dtype": None,
    "zp_dtype": None,
}


def _as_llmcompressor_writes(args: dict[str, Any] | None, observer: str) -> dict | None:
    if args is None:
        return None
    full = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
    return {**full, **args, "observer": observer, **_PRODUCER_DEFAULTS}


def _foreign_copy(ours: Path, out: Path, **weights_extra: Any) -> Path:
    shutil.copytree(ours, out)
    for manifest in out.glob("*manifest*.json"):
        manifest.unlink()
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    formats = {group.get("format") for group in quant["config_groups"].values()}
    assert len(formats) == 1
    quant["format"] = formats.pop()
    for name, group in quant["config_groups"].items():
        quant["config_groups"][name] = {
            "targets": group["targets"],
            "weights": {
                **_as_llmcompressor_writes(group["weights"], "minmax"),  # type: ignore[dict-item]
                **weights_extra,
            },
            "input_activations": _as_llmcompressor_writes(
                group.get("input_activations"), "static_minmax"
            ),
            "output_activations": None,
            "format": None,
        }
    if quant.get("kv_cache_scheme"):
        quant["kv_cache_scheme"] = _as_llmcompressor_writes(
            quant["kv_cache_scheme"], "static_minmax"
        )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a foreign checkpoint has no manifest: unverified
        run = exportlm.load_exported("hf_checkpoint", path)
    return torch.as_tensor(run(ids)).float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for recipe in ("fp8", "fp8+fp8_kv", "w8a8", "nvfp4", "int8_wo"):
        model = tiny_hf_model("llama", seed=0).eval()
        batch = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator())
        quantize(model, recipe, calibrate=lambda m, b=batch: m(b))
        path = tmp_path_factory.mktemp(recipe.replace("+", "-")) / "ours"
        out[recipe] = exportlm.export_model(
            "hf_checkpoint", model, path, format="compressed-tensors"
        )
    return out


@pytest.mark.parametrize("recipe", ["fp8", "fp8+fp8_kv", "w8a8", "nvfp4", "int8_wo"])
def test_a_config_written_as_llmcompressor_writes_it_loads_to_the_same_logits(
    exported: dict[str, Path], recipe: str, tmp_path: Path
) -> None:
    ours = exported[recipe]
    foreign = _foreign_copy(ours, tmp_path / "foreign")
    group = json.loads((foreign / "config.json").read_text())["quantization_config"]
    assert next(iter(group["config_groups"].values()))["weights"]["observer"] == "minmax"
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    torch.testing.assert_close(_logits(foreign, ids), _logits(ours, ids), atol=ATOL, rtol=0)


def test_codes_stored_out_of_order_are_refused_by_name(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    foreign = _foreign_copy(exported["int8_wo"], tmp_path / "foreign", actorder="group")
    with pytest.raises(UnsupportedFormatError, match="actorder='group'"):
        _logits(foreign, torch.tensor([[1, 2]]))


def test_a_meaningful_difference_is_still_refused(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    """Only what does not change the stored tensors' meaning is ignored: 4 bits are not 8."""
    foreign = _foreign_copy(exported["fp8"], tmp_path / "foreign", num_bits=4)
    with pytest.raises(UnsupportedFormatError, match="no registered format"):
        _logits(foreign, torch.tensor([[1, 2]]))
