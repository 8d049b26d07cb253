"""Module names in quantization configs are the checkpoint's saved names (issue #7).

A Mixtral checkpoint saves its router as ``model.layers.0.block_sparse_moe.gate``
(transformers' save-time conversion); listing the in-memory name
``model.layers.0.mlp.gate`` in ``exclude_modules`` would make a loader quantize the
router. Checked here through the public API and the files on disk, for every
family and both formats, plus the ``checkpoint_names`` conformance check.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

import exportlm
from exportlm.errors import UnsupportedFormatError
from exportlm.models import HF_FAMILIES, build_model
from exportlm.quant import quantize
from pytest_exportcheck.checks import CHECKS, TargetCase
from pytest_exportcheck.checks.targets.checkpoint import checkpoint_name_problems
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed

TARGET = "hf_checkpoint"
FORMATS = ("modelopt", "compressed-tensors")
MIXTRAL_ROUTER = "model.layers.0.block_sparse_moe.gate"


#: Families whose experts have one checkpoint layout only, their model's own (DBRX's fused
#: ``mlp.w1`` / ``v1`` / ``w2``, one FP8 scale per expert, which vLLM's DBRX loader reads).
#: compressed-tensors quantizes ``Linear`` targets and has no names for them, so a
#: compressed-tensors export refuses these experts quantized.
MODELOPT_ONLY_EXPERTS = {"dbrx"}


@functools.cache
def _fp8(family: str, experts: bool = True) -> Any:
    """The FP8 toy model of ``family`` (quantized once; exports never modify it)."""
    return quantize(build_model(family, seed=0), "fp8", exclude=[] if experts else ["*.experts"])


def _export(
    family: str, directory: Path, format: str = "modelopt", experts: bool = True, **kwargs: Any
) -> Path:
    model = _fp8(family, experts)
    out: Path = exportlm.export_model(TARGET, model, directory, format=format, **kwargs)
    return out


def _tensor_names(directory: Path) -> list[str]:
    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def _quant_config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return dict(config["quantization_config"])


def _excluded(directory: Path) -> list[str]:
    """Every exclude / ignore entry of the checkpoint's configs."""
    entries = list(_quant_config(directory)["ignore"])
    hf_quant = directory / "hf_quant_config.json"
    if hf_quant.is_file():
        entries += json.loads(hf_quant.read_text())["quantization"]["exclude_modules"]
    return entries


def _names_saved_tensor(entry: str, names: list[str]) -> bool:
    return any(name.startswith(entry + ".") for name in names)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_excluded_names_are_saved_names_and_no_quantized_module_is_excluded(
    family: str, format: str, tmp_path: Path
) -> None:
    experts = not (format == "compressed-tensors" and family in MODELOPT_ONLY_EXPERTS)
    if not experts:
        with pytest.raises(UnsupportedFormatError, match="format='modelopt'"):
            _export(family, tmp_path / "refused", format)
        assert not (tmp_path / "refused").exists()
    out = _export(family, tmp_path / "ckpt", format, experts)
    names = _tensor_names(out)
    excluded = _excluded(out)
    assert excluded
    assert all("*" not in e and not e.startswith("re:") for e in excluded)
    # ModelOpt lists a tied lm_head as excluded although only the embedding is saved.
    tied = json.loads((out / "config.json").read_text()).get("tie_word_embeddings", False)
    unsaved = [
        e for e in excluded if not _names_saved_tensor(e, names) and not (tied and e == "lm_head")
    ]
    assert not unsaved, f"exclude entries that name no saved tensor: {unsaved}"
    assert ("lm_head" in excluded) == (tied or _names_saved_tensor("lm_head", names))
    quantized = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
    assert quantized, "the FP8 checkpoint holds no quantized module"
    assert not quantized & set(excluded)
    assert checkpoint_name_problems(out) == []


@pytest.mark.parametrize("format", FORMATS)
def test_mixtral_router_is_excluded_under_its_saved_name(format: str, tmp_path: Path) -> None:
    out = _export("mixtral", tmp_path / "ckpt", format)
    assert f"{MIXTRAL_ROUTER}.weight" in _tensor_names(out)
    ignore = _quant_config(out)["ignore"]
    assert MIXTRAL_ROUTER in ignore
    assert "model.layers.0.mlp.gate" not in ignore
    assert not any(".mlp." in entry for entry in ignore)  # Mixtral saves no `mlp` module
    if format == "modelopt":
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hf_quant["exclude_modules"] == ignore
        assert MIXTRAL_ROUTER in hf_quant["exclude_modules"]


def test_tied_lm_head_is_listed_as_the_saved_embedding(tmp_path: Path) -> None:
    """A tied ``lm_head`` is saved as ``model.embed_tokens``; both are listed, as ModelOpt does.

    ModelOpt 0.47 excludes ``lm_head`` by name although a tied head saves no tensor of
    its own (``tests/test_interop.py`` compares the configs); loaders match the name.
    """
    out = _export("llama_tied", tmp_path / "ckpt")
    assert not any(n.startswith("lm_head.") for n in _tensor_names(out))
    excluded = json.loads((out / "hf_quant_config.json").read_text())["quantization"][
        "exclude_modules"
    ]
    assert sorted(excluded) == ["lm_head", "model.embed_tokens"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_mixed_precision_layers_use_saved_names(family: str, tmp_path: Path) -> None:
    model = quantize(build_model(family, seed=0), {"*": "fp8", "*.experts*": "int8_wo"})
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    names = _tensor_names(out)
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "MIXED_PRECISION"
    layers = hf_quant["quantized_layers"]
    config = _quant_config(out)
    assert config["quantized_layers"] == layers
    targets = [t for g in config["config_groups"].values() for t in g["targets"]]
    assert sorted(targets) == sorted(layers)
    # stacked experts are listed as their experts module (as ModelOpt 0.47 does), whose
    # per-expert projections save the weight scales
    scaled = [n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")]
    assert all(any(s == k or s.startswith(f"{k}.") for s in scaled) for k in layers)
    experts = {"mixtral": "block_sparse_moe.experts"}.get(family, "mlp.experts")
    assert layers[f"model.layers.0.{experts}"] == {"quant_algo": "W8A16"}
    assert checkpoint_name_problems(out) == []


def test_problems_name_the_entry_and_the_nearest_saved_names(tmp_path: Path) -> None:
    out = _export("mixtral", tmp_path / "ckpt")
    path = out / "hf_quant_config.json"
    hf_quant = json.loads(path.read_text())
    quant = hf_quant["quantization"]
    quant["exclude_modules"] += ["model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj"]
    path.write_text(json.dumps(hf_quant))
    problems = checkpoint_name_problems(out)
    assert len(problems) == 2, problems
    stale = next(p for p in problems if "'model.layers.0.mlp.gate'" in p)
    assert "names no saved tensor" in stale
    assert MIXTRAL_ROUTER in stale.split("nearest saved module names:")[1]
    quantized = next(p for p in problems if "q_proj" in p)
    assert "excludes the quantized module 'model.layers.1.self_attn.q_proj'" in quantized


def test_patterns_match_saved_module_paths(tmp_path: Path) -> None:
    out = _export("mixtral", tmp_path / "ckpt", "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    ignore += [r"re:.*block_sparse_moe\.gate$", r"re:.*mlp\.gate$"]
    (out / "config.json").write_text(json.dumps(config))
    problems = checkpoint_name_problems(out)
    assert len(problems) == 1, problems
    assert r"'re:.*mlp\\.gate$'" in problems[0]


@pytest.mark.parametrize("family", [*HF_FAMILIES, "decoder"])
def test_checkpoint_names_check_on_hf_checkpoint(family: str, tmp_path: Path) -> None:
    case = TargetCase(TARGET, None, {}, family, "cpu", workdir=tmp_path)
    result = CHECKS["checkpoint_names"].fn(case)
    if family == "decoder":  # a plain torch model: the target's own reason, a counted skip
        assert result.status == "skip"
        assert "not a transformers PreTrainedModel" in result.message
    else:
        assert result.status == "pass", result.message
        assert sum(result.details["listed"].values()) >= 2


def test_checkpoint_names_skips_file_targets(tmp_path: Path) -> None:
    result = CHECKS["checkpoint_names"].fn(
        TargetCase("onnx", None, {}, "llama", "cpu", workdir=tmp_path)
    )
    assert result.status == "skip"
    assert "writes a single file" in result.message  # onnx declares 'quantized' (QDQ graphs)
    assert CHECKS["checkpoint_names"].needs == frozenset({"quantized"})
    assert CHECKS["checkpoint_names"].per_model


@contextlib.contextmanager
def _stale_target(name: str, edit: Callable[[dict[str, Any]], None]) -> Iterator[str]:
    """A directory target writing hf_checkpoint, then editing config.json's quantization_config."""
    from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered, export_target
    from exportlm.export.hf_checkpoint import export_hf_checkpoint

    def export(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
        out = Path(export_hf_checkpoint(model, output_path))
        config = json.loads((out / "config.json").read_text())
        edit(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
        return out

    ensure_exporters_registered()
    declared = export_target(
        name,
        runtime=TARGET,
        atol=1e-4,
        rtol=1e-3,
        capabilities={"quantized", "multi_file"},
        artifact="directory",
    )(export)
    EXPORT_REGISTRY.register(name, declared)
    try:
        yield name
    finally:
        EXPORT_REGISTRY.unregister(name)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("model.layers.0.mlp.gate", "which names no saved tensor"),
        ("model.layers.1.self_attn.o_proj", "excludes the quantized module"),
    ],
)
def test_wrong_ignore_entries_fail_checkpoint_names(
    entry: str, expected: str, tmp_path: Path
) -> None:
    with _stale_target("stale_ignore", lambda q: q["ignore"].append(entry)) as target:
        case = TargetCase(target, None, {}, "mixtral", "cpu", workdir=tmp_path)
        result = CHECKS["checkpoint_names"].fn(case)
    assert result.status == "fail"
    assert f"config.json: quantization_config.ignore lists {entry!r}" in result.message
    assert expected in result.message
    if "no saved tensor" in expected:
        assert MIXTRAL_ROUTER in result.message.split("nearest saved module names:")[1]


STALE_PLUGIN = '''
"""A directory target that lists the in-memory router name instead of the saved one."""
import json
from pathlib import Path

from exportlm.export import export_target
from exportlm.export.hf_checkpoint import export_hf_checkpoint


@export_target(
    "stale_names", runtime="hf_checkpoint", atol=1e-4, rtol=1e-3,
    capabilities={"quantized", "multi_file"}, artifact="directory",
)
def export_stale(model, output_path, *, example_inputs=None, overwrite=False):
    out = export_hf_checkpoint(model, output_path, overwrite=overwrite)
    path = Path(out) / "hf_quant_config.json"
    if path.is_file():  # FAULT (checkpoint_names): a name the checkpoint does not save
        config = json.loads(path.read_text())
        config["quantization"]["exclude_modules"].append("model.layers.0.mlp.gate")
        path.write_text(json.dumps(config))
    return Path(out)
'''


def test_stale_exclude_name_fails_checkpoint_names(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = pytester.path / "site"
    make_distribution(
        site,
        "stalenames",
        {"exportlm.export_backends": {"stale_names": "stalenames:export_stale"}},
        {"stalenames.py": STALE_PLUGIN},
    )
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=stale_names,hf_checkpoint,onnx",
        "--export-models=mixtral",
        "--export-checks=checkpoint_names",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = json.loads((pytester.path / "report.json").read_text())
    items = {item["id"]: item for item in report["items"]}
    stale = items["checkpoint_names[stale_names-mixtral-cpu]"]
    assert stale["outcome"] == "fail"
    assert "'model.layers.0.mlp.gate'" in stale["message"]
    assert MIXTRAL_ROUTER in stale["message"]
    assert items["checkpoint_names[hf_checkpoint-mixtral-cpu]"]["outcome"] == "pass"
    # onnx writes one file, not a checkpoint directory: the cell cannot apply, no item
    assert "checkpoint_names[onnx-mixtral-cpu]" not in items
    (onnx,) = [c for c in report["not_applicable"] if c["column"] == "onnx"]
    assert onnx["reason"] == (
        "target 'onnx' writes a file artifact; checkpoint_names reads directory artifacts"
    )
