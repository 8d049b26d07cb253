"""The suite on the user's own model: ``--export-model PATH`` (ini ``export_models_dirs``).

Each directory is a row (a model family) of every per-model check, loaded by the
untrusted-directory rules, with the targets' tolerances scaled to the model. Runs are
in-process; the families they register are removed after each test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import exportlm.export
import exportlm.models
import exportlm.module_exporters
import pytest_exportcheck.checks  # noqa: F401
from exportlm.models import MODEL_REGISTRY, model_names, model_tolerance_scale
from tests._model_dirs import toy_model_dir

NAME = "my_model_v2"  # the family name of a folder named "my-model.v2"
CHECKS = "--export-checks=roundtrip_logits,dynamic_shapes,checkpoint_names"


@pytest.fixture(autouse=True)
def _registry_restored() -> Iterator[None]:
    before = set(model_names())
    yield
    for name in set(model_names()) - before:
        MODEL_REGISTRY.unregister(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model_dir(tmp_path_factory.mktemp("models") / "my-model.v2")


def test_a_model_directory_is_a_row_of_every_per_model_check(
    pytester: pytest.Pytester, model_dir: Path
) -> None:
    result = pytester.runpytest(
        "--export-targets=torch_export,hf_checkpoint",
        f"--export-model={model_dir}",
        f"--export-models={NAME}",
        CHECKS,
        "--export-report=report.json",
        "--export-report-absolute-paths",  # the directory as given, not redacted
        "-v",
    )
    result.assert_outcomes(passed=6)  # + plugin_loads; 2 capability gaps are no items
    result.stdout.fnmatch_lines(
        [
            f"*roundtrip_logits[[]hf_checkpoint-{NAME}-cpu[]] PASSED*",
            f"*checkpoint_names[[]hf_checkpoint-{NAME}-cpu[]] PASSED*",
            f"*roundtrip_logits[[]torch_export-{NAME}-cpu[]] PASSED*",
            f"*dynamic_shapes[[]torch_export-{NAME}-cpu[]] PASSED*",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["options"]["model_dirs"] == [str(model_dir.resolve())]


def test_the_ini_key_lists_model_directories(pytester: pytest.Pytester, model_dir: Path) -> None:
    pytester.makeini(f"[pytest]\nexport_models_dirs =\n    {model_dir}\n")
    result = pytester.runpytest(
        "--export-targets=torch_export",
        f"--export-models={NAME}",
        "--export-checks=roundtrip_logits",
        "-v",
    )
    result.assert_outcomes(passed=2)  # + plugin_loads
    result.stdout.fnmatch_lines([f"*roundtrip_logits[[]torch_export-{NAME}-cpu[]] PASSED*"])


def test_export_quantize_names_the_recipes_of_the_quantized_checks(
    pytester: pytest.Pytester, model_dir: Path
) -> None:
    result = pytester.runpytest(
        "--export-targets=hf_checkpoint",
        f"--export-model={model_dir}",
        f"--export-models={NAME}",
        "--export-checks=loadable",
        "--export-quantize=fp8",
        "--export-report=report.json",
    )
    result.assert_outcomes(passed=2)  # + plugin_loads
    report = json.loads((pytester.path / "report.json").read_text())
    (item,) = [i for i in report["items"] if i["check"] == "loadable"]
    assert set(item["details"]["checked"]) == {"fp8"}, item


def test_an_unknown_recipe_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--export-targets=hf_checkpoint", "--export-quantize=fp9")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-quantize fp9*"])


def test_a_directory_with_code_of_its_own_is_a_usage_error(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    directory = toy_model_dir(tmp_path / "custom")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_evil.py").write_text("raise SystemExit('ran the directory code')\n")
    result = pytester.runpytest("--export-targets=torch_export", f"--export-model={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-model*custom*auto_map*"])
    assert "ran the directory code" not in result.stdout.str() + result.stderr.str()


def test_a_quantized_checkpoint_is_a_usage_error(
    pytester: pytest.Pytester, model_dir: Path, tmp_path: Path
) -> None:
    """Its FP8 codes are no float model whose exports the suite could check (transformers
    read them as weights, without the scales: a row of garbage, before)."""
    quantized = exportlm.export_model("hf_checkpoint", model_dir, tmp_path / "fp8", recipe="fp8")
    result = pytester.runpytest("--export-targets=torch_export", f"--export-model={quantized}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-model*holds a quantized checkpoint*"])


def test_a_config_its_weights_do_not_back_is_a_usage_error(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """10**9 layers over shards that store 2: transformers built layers until the job's
    time ran out (the same checks as `exportlm export --model DIR` now run first)."""
    directory = toy_model_dir(tmp_path / "deep")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    result = pytester.runpytest("--export-targets=torch_export", f"--export-model={directory}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-model*layer(s) 2..999999999 are missing*"])


def test_a_directory_without_config_is_a_usage_error(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    result = pytester.runpytest("--export-targets=torch_export", f"--export-model={tmp_path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-model*no config.json*"])


def test_the_tolerance_grows_with_depth_and_width(tmp_path: Path) -> None:
    from exportlm.models.directory import register_model_directory

    shallow = register_model_directory(toy_model_dir(tmp_path / "shallow"))
    assert model_tolerance_scale(shallow) == 1.0  # the toy llama: what the targets measured on
    deep_dir = tmp_path / "deep"
    toy_model_dir(deep_dir)
    config = json.loads((deep_dir / "config.json").read_text())
    config.update(num_hidden_layers=30, hidden_size=576)  # SmolLM2-135M's shape
    (deep_dir / "config.json").write_text(json.dumps(config))
    # the scale is the config's alone; weights of another shape would be refused
    (deep_dir / "model.safetensors").unlink()
    deep = register_model_directory(deep_dir)
    assert model_tolerance_scale(deep) == pytest.approx(15 * (576 / 128) ** 0.5)


def test_the_family_loads_the_directory_s_weights_in_float32(tmp_path: Path) -> None:
    from exportlm.models import build_model
    from exportlm.models.directory import register_model_directory

    directory = toy_model_dir(tmp_path / "bf16", dtype=torch.bfloat16)
    name = register_model_directory(directory)
    model = build_model(name)
    original = build_model("llama", seed=0)
    assert next(model.parameters()).dtype == torch.float32
    for (key, mine), theirs in zip(model.state_dict().items(), original.state_dict().values()):
        assert torch.equal(mine, theirs.to(torch.bfloat16).to(torch.float32)), key


@pytest.mark.real_model
def test_the_suite_gates_the_real_model(pytester: pytest.Pytester, real_model_dir: Path) -> None:
    from exportlm.models.directory import directory_family_name

    result = pytester.runpytest(
        "--export-targets=hf_checkpoint",
        f"--export-model={real_model_dir}",
        f"--export-models={directory_family_name(real_model_dir)}",
        "--export-checks=roundtrip_logits",
        "--export-report=report.json",
        "-v",
    )
    result.assert_outcomes(passed=2)  # + plugin_loads
    report = json.loads((pytester.path / "report.json").read_text())
    (item,) = [i for i in report["items"] if i["check"] == "roundtrip_logits"]
    assert item["outcome"] == "pass", item
