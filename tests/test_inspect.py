"""``exportlm.inspection``: our checkpoints pass the loaders' rules; corruptions made on
purpose on real exported checkpoints fail, naming the rule and the tensor."""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.errors import InvalidInputError
from exportlm.inspection import RULES, InspectionReport, Severity, inspect_checkpoint
from exportlm.models import build_model
from exportlm.quant import quantize
from tests._model_dirs import toy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("fp8+fp8_kv", "nvfp4", "int4_awq", "int8_wo")
Q_PROJ = "model.layers.0.self_attn.q_proj"


@functools.cache
def _tokenizer() -> Any:
    return toy_tokenizer()


@functools.cache
def _quantized(family: str, recipe: str) -> Any:
    return quantize(build_model(family, seed=0), recipe)


def export(tmp_path: Path, family: str = "llama", recipe: str = "fp8", **kwargs: Any) -> Path:
    """A fresh export of ``family`` quantized with ``recipe`` (the model is built once),
    with its tokenizer, as a user exports a model they serve."""
    kwargs.setdefault("tokenizer", _tokenizer())
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(family, recipe), tmp_path / f"{family}-{recipe}", **kwargs
    )
    return out


def rewrite(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load the single shard, ``edit`` its tensors in place, save it back."""
    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def errors(report: InspectionReport) -> dict[str, list[str]]:
    """``{rule: [subjects]}`` of the error-level findings."""
    found: dict[str, list[str]] = {}
    for finding in report.errors:
        found.setdefault(finding.rule, []).append(finding.subject)
    return found


def rules_of(report: InspectionReport, severity: Severity) -> set[str]:
    return {f.rule for f in report.by_severity(severity)}


# ----------------------------------------------------------------------------- passing


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral", "gpt_oss"])
def test_our_modelopt_checkpoints_pass(family: str, recipe: str, tmp_path: Path) -> None:
    report = inspect_checkpoint(export(tmp_path, family, recipe))
    assert report.ok, [f.message for f in report.errors]
    # vLLM / SGLang refuse ModelOpt's integer algorithms (see test_inspect_engines.py)
    refused = {"engine-refuses-scheme"} if recipe in ("int4_awq", "int8_wo") else set()
    # transformers reads unpacked codes as weights (test_inspect_loader_verdicts.py)
    misread = set() if recipe in ("int4_awq", "nvfp4") else {"loader-misreads"}
    assert rules_of(report, Severity.WARNING) == refused | misread
    assert report.summary["layout"] == "modelopt"
    assert sum(report.summary["quantized_layers"].values()) > 0
    assert report.summary["kv_cache"] is recipe.endswith("fp8_kv")


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_our_compressed_tensors_checkpoint_passes(family: str, tmp_path: Path) -> None:
    out = export(tmp_path, family, "fp8+fp8_kv", format="compressed-tensors")
    report = inspect_checkpoint(out)
    assert report.ok, [f.message for f in report.errors]
    assert report.summary["layout"] == "compressed-tensors"
    assert report.summary["quantized_layers"] == {"fp8": report.summary["quantized_layers"]["fp8"]}


def test_a_sharded_checkpoint_with_its_index_passes(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "nvfp4", max_shard_size=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    report = inspect_checkpoint(out)
    assert report.ok, [f.message for f in report.errors]
    assert report.summary["shards"] > 1


def test_modelopt_layout_is_reported_unknown_to_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    report = inspect_checkpoint(export(tmp_path))
    (info,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    assert info.severity is Severity.INFO
    assert "transformers" in info.message
    assert "vLLM" in info.details["known"]


# ----------------------------------------------------------------------------- corruptions


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return edit


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = value(tensors[name])

    return edit


def _add(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(name, value)


CORRUPTIONS: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], None], str, str]] = {
    # id: (recipe, edit, rule, subject)
    "missing-input-scale": (
        "fp8",
        _drop(f"{Q_PROJ}.input_scale"),
        "scale-missing",
        f"{Q_PROJ}.input_scale",
    ),
    "missing-weight-scale-2": (
        "nvfp4",
        _drop(f"{Q_PROJ}.weight_scale_2"),
        "scale-missing",
        f"{Q_PROJ}.weight_scale_2",
    ),
    "zero-scale": (
        "fp8",
        _set(f"{Q_PROJ}.weight_scale", torch.zeros_like),
        "scale-nonpositive",
        f"{Q_PROJ}.weight_scale",
    ),
    "nan-input-scale": (
        "fp8",
        _set(f"{Q_PROJ}.input_scale", lambda t: torch.full_like(t, float("nan"))),
        "scale-nonfinite",
        f"{Q_PROJ}.input_scale",
    ),
    "half-scale-dtype": (
        "fp8",
        _set(f"{Q_PROJ}.weight_scale", lambda t: t.half()),
        "scale-dtype",
        f"{Q_PROJ}.weight_scale",
    ),
    "float32-block-scales": (
        "nvfp4",
        _set(f"{Q_PROJ}.weight_scale", lambda t: t.float()),
        "scale-dtype",
        f"{Q_PROJ}.weight_scale",
    ),
    "bf16-weight": (
        "fp8",
        _set(f"{Q_PROJ}.weight", lambda t: t.to(torch.bfloat16)),
        "weight-dtype",
        f"{Q_PROJ}.weight",
    ),
    "half-size-block-scales": (  # ModelOpt 0.46's NVFP4 weight_scale at half size
        "nvfp4",
        _set(f"{Q_PROJ}.weight_scale", lambda t: t[:, : t.shape[1] // 2].contiguous()),
        "block-scale-shape",
        f"{Q_PROJ}.weight_scale",
    ),
    "per-row-input-scale": (
        "fp8",
        _set(f"{Q_PROJ}.input_scale", lambda t: t.reshape(1).repeat(4)),
        "scale-shape",
        f"{Q_PROJ}.input_scale",
    ),
    "lm-head-input-scale": (  # vllm#45102: lm_head is excluded, yet has an input_scale
        "nvfp4",
        _add("lm_head.input_scale", torch.tensor(0.5)),
        "excluded-stray-scale",
        "lm_head.input_scale",
    ),
    "leaked-amax": (
        "fp8",
        _add(f"{Q_PROJ}.weight_quantizer._amax", torch.tensor(1.0)),
        "leaked-buffer",
        f"{Q_PROJ}.weight_quantizer._amax",
    ),
    "missing-k-scale": (
        "fp8+fp8_kv",
        _drop("model.layers.1.self_attn.k_proj.k_scale"),
        "kv-scale-missing",
        "model.layers.1.self_attn.k_proj.k_scale",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupted_checkpoint_fails_naming_the_rule_and_the_tensor(
    case: str, tmp_path: Path
) -> None:
    recipe, edit, rule, subject = CORRUPTIONS[case]
    out = export(tmp_path, "llama", recipe)
    assert inspect_checkpoint(out).ok
    rewrite(out, edit)
    report = inspect_checkpoint(out)
    assert not report.ok
    assert subject in errors(report).get(rule, []), report.to_json()["findings"]
    finding = next(f for f in report.errors if f.rule == rule and f.subject == subject)
    assert RULES[rule].severity is Severity.ERROR
    assert subject.rpartition(".")[0] in finding.message


def test_a_duplicated_tied_weight_fails(tmp_path: Path) -> None:
    out = export(tmp_path, "llama_tied", "fp8")
    assert inspect_checkpoint(out).ok
    rewrite(out, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert errors(inspect_checkpoint(out)) == {"tied-duplicate": ["lm_head.weight"]}


def test_an_index_listing_a_missing_tensor_fails(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "fp8", max_shard_size=20_000)
    index = out / "model.safetensors.index.json"
    shard = sorted(out.glob("*.safetensors"))[0].name
    edit_json(index, lambda d: d["weight_map"].__setitem__("model.layers.9.mlp.weight", shard))
    found = errors(inspect_checkpoint(out))
    assert found == {"index-mismatch": ["model.layers.9.mlp.weight"]}


def test_a_tensor_the_index_does_not_list_fails(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "fp8", max_shard_size=20_000)
    edit_json(
        out / "model.safetensors.index.json",
        lambda d: d["weight_map"].pop(f"{Q_PROJ}.weight_scale"),
    )
    assert errors(inspect_checkpoint(out)) == {"index-mismatch": [f"{Q_PROJ}.weight_scale"]}


def test_a_truncated_shard_fails(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "fp8")
    shard = out / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    found = errors(inspect_checkpoint(out))
    assert found["shard-unreadable"] == ["model.safetensors"]


def test_an_excluded_quantized_module_and_an_unknown_method_fail(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "fp8")
    edit_json(
        out / "hf_quant_config.json",
        lambda d: d["quantization"]["exclude_modules"].extend([Q_PROJ, "model.layers.0.mlp.gate"]),
    )
    edit_json(out / "config.json", lambda d: d["quantization_config"].update(quant_method="fp9"))
    report = inspect_checkpoint(out)
    assert errors(report) == {
        "quant-method-unknown": ["config.json"],
        "excluded-but-quantized": [Q_PROJ],
    }
    assert rules_of(report, Severity.WARNING) == {"excluded-name-unknown"}


def test_unshared_expert_input_scales_and_gate_up_scales_warn(tmp_path: Path) -> None:
    out = export(tmp_path, "mixtral", "nvfp4")
    expert = "model.layers.0.block_sparse_moe.experts.1"
    names = sorted(load_file(out / "model.safetensors"))
    assert f"{expert}.w1.input_scale" in names, names[:20]

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{expert}.w1.input_scale"] = tensors[f"{expert}.w1.input_scale"] * 2
        tensors[f"{expert}.w3.weight_scale_2"] = tensors[f"{expert}.w3.weight_scale_2"] * 2

    rewrite(out, edit)
    report = inspect_checkpoint(out)
    assert report.ok  # loaders cope (with a warning and a loss of accuracy)
    warnings = {f.rule: f.subject for f in report.by_severity(Severity.WARNING)}
    assert warnings == {
        "moe-input-scale-shared": "model.layers.0.block_sparse_moe.experts.*.w1.input_scale",
        "gate-up-scale-consistent": f"{expert}.w1.weight_scale_2",
    }


def test_kv_scales_without_a_declaration_warn(tmp_path: Path) -> None:
    out = export(tmp_path, "llama", "fp8+fp8_kv")
    edit_json(
        out / "hf_quant_config.json", lambda d: d["quantization"].update(kv_cache_quant_algo=None)
    )
    report = inspect_checkpoint(out)
    assert report.ok
    # transformers misreads any ModelOpt FP8 checkpoint (test_inspect_loader_verdicts.py)
    assert rules_of(report, Severity.WARNING) == {"kv-scale-undeclared", "loader-misreads"}


def test_a_checkpoint_without_its_tokenizer_warns(tmp_path: Path) -> None:
    report = inspect_checkpoint(export(tmp_path, "llama", "fp8", tokenizer=None))
    assert report.ok  # the weights load; serving it needs the tokenizer
    (finding,) = [f for f in report.findings if f.rule == "tokenizer-missing"]
    assert finding.severity is Severity.WARNING
    assert "tokenizer.json" in finding.message
    assert "tokenizer=" in finding.message


def test_a_path_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        inspect_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match=r"no \*\.safetensors"):
        inspect_checkpoint(tmp_path / "empty")


# ----------------------------------------------------------------------------- the rules' docs


def _documented_rules() -> list[str]:
    text = (ROOT / "docs" / "checkpoint-rules.md").read_text(encoding="utf-8")
    return re.findall(r"^### `([a-z0-9-]+)`", text, flags=re.MULTILINE)


def test_every_rule_has_a_section_in_the_docs_and_vice_versa() -> None:
    documented = _documented_rules()
    assert documented == list(RULES), "docs/checkpoint-rules.md sections != RULES (same order)"


def test_rules_declare_loaders_and_a_reference() -> None:
    for rule in RULES.values():
        assert rule.reference == f"docs/checkpoint-rules.md#{rule.id}"
        assert rule.summary.endswith(".")
        assert rule.loaders or rule.severity is Severity.INFO


def test_a_clean_copy_of_a_corrupted_checkpoint_passes_again(tmp_path: Path) -> None:
    """The corruption, not the rewrite through safetensors, is what fails."""
    out = export(tmp_path, "llama", "fp8")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    rewrite(copy, lambda t: None)
    assert inspect_checkpoint(copy).ok
