"""``export --quantize RECIPE[:options] [--exclude PATTERN]``: options, refusals before any work,
weight-only recipes without calibration, and the seconds of each step reported apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
import exportlm.cli._calib  # imported before any spy replaces what it imports
from exportlm.cli import main
from exportlm.models import tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory whose input features (192) no group of 128 divides."""
    directory = tmp_path_factory.mktemp("hidden-192")
    tiny_hf_model("llama", seed=0, hidden_size=192, intermediate_size=384).save_pretrained(
        directory
    )
    return directory


@pytest.fixture
def calib_data(tmp_path: Path) -> Path:
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"sample text number {i}" for i in range(16)))
    return data


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Spies: loading the weights, reading the calibration data, running a forward."""
    calls: list[str] = []
    import transformers

    def spy(what: str) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            calls.append(what)
            raise AssertionError(f"{what} ran before the refusal")

        return called

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", spy("loading the model")
    )
    monkeypatch.setattr(
        exportlm.cli._calib, "load_calibration_texts", spy("reading the calibration data")
    )
    return calls


def _export(model: Path | str, out: Path, *extra: str) -> list[str]:
    return ["export", "--target", "hf_checkpoint", "--model", str(model), "--out", str(out), *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--quantize", "int4_awq"],
            "group_size=64 or group_size=32 divides 192: quantize with int4_awq:group_size=64",
        ),
        (["--quantize", "w8a8"], "-o format=compressed-tensors"),
        (
            ["--quantize", "int8_sq", "-o", "format=compressed-tensors"],
            "cannot be written in the compressed-tensors checkpoint layout",
        ),
        (["--quantize", "int4_awq:group_sze=64"], "'group_sze'; accepted: clip, group_size"),
        (["--quantize", "int4_awq:group_size=48"], "group_size=48 is not one it takes"),
        (["--quantize", "int4_awq:group_size"], "options are KEY=VALUE"),
        # which one won was the parser's to choose, silently (the last)
        (["--quantize", "int4_awq:group_size=64,group_size=128"], "'group_size' is given twice"),
    ],
)
def test_refusals_come_before_loading_or_reading_the_calibration_data(
    model_dir: Path,
    calib_data: Path,
    tmp_path: Path,
    no_work: list[str],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    argv = _export(model_dir, tmp_path / "out", *extra, "--calib-data", str(calib_data))
    assert main(argv) != 0
    assert message in capsys.readouterr().err
    assert no_work == []
    assert not (tmp_path / "out").exists()


def test_exclude_needs_quantize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_export("llama", tmp_path / "out", "--exclude", "*o_proj")) == 2
    assert "--exclude: only used with --quantize" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["family", "directory"])
def test_an_exclude_pattern_that_matches_nothing_is_said_once(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    """A typo in ``--exclude`` left the modules it meant to keep quantized, silently."""
    model = "llama" if source == "family" else str(model_dir)
    typo, good = ["--exclude", "*down_porj"], ["--exclude", "*o_proj"]
    assert main([*_export(model, tmp_path / "out", "--quantize", "fp8"), *typo, *good]) == 0
    err = capsys.readouterr().err
    assert err.count("--exclude '*down_porj' matches no module of LlamaForCausalLM") == 1
    assert "--exclude '*o_proj'" not in err
    config = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert "model.layers.0.self_attn.o_proj" in config["quantization"]["exclude_modules"]


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_group_size_option_and_exclude_reach_the_checkpoint(
    model_dir: Path,
    calib_data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    layout: str,
) -> None:
    out = tmp_path / layout
    argv = _export(model_dir, out, "--quantize", "int4_awq:group_size=64", "-o", f"format={layout}")
    # compressed-tensors has no pre_quant_scale: the scales that cannot fold stay out
    excluded = ["--exclude", "*o_proj", "--exclude", "*down_proj"]
    calib = ["--calib-data", str(calib_data), "--calib-samples", "2", "--calib-seq-len", "8"]
    assert main([*argv, *excluded, *calib, "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["passed"]
    assert report["quantize_seconds"] > 0
    assert report["export_seconds"] > 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert declared["group_size"] == 64
        excluded_names = declared["exclude_modules"]
    else:
        assert config["config_groups"]["group_0"]["weights"]["group_size"] == 64
        excluded_names = config["ignore"]
    assert "model.layers.0.self_attn.o_proj" in excluded_names
    assert "model.layers.1.mlp.down_proj" in excluded_names
    runtime = exportlm.load_exported("hf_checkpoint", out)
    assert torch.isfinite(torch.as_tensor(runtime(torch.tensor([[1, 2, 3]])))).all()


def test_a_weight_only_recipe_runs_no_calibration(
    model_dir: Path,
    calib_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    forwards: list[str] = []
    monkeypatch.setattr(
        exportlm.cli._calib, "load_calibration_texts", lambda *a, **k: forwards.append("read")
    )
    monkeypatch.setattr(
        exportlm.cli._calib, "calibrate_with", lambda *a, **k: forwards.append("calibrate")
    )
    argv = _export(model_dir, tmp_path / "out", "--quantize", "int8_wo", "--verify")
    assert main([*argv, "--calib-data", str(calib_data)]) == 0
    captured = capsys.readouterr()
    assert forwards == []
    assert "is not read: recipe int8_wo is weight-only" in captured.err
    assert "synthetic" not in captured.err
    assert "quantization (calibration)" in captured.out
    assert "export " in captured.out


_REFUSE_IN_CHILD = """
import json, sys
from exportlm.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "modules": sorted(m for m in sys.modules if m.startswith(("transformers", "safetensors")))}))
"""


def test_a_shape_refusal_reads_no_weight_and_builds_no_modeling_code(
    model_dir: Path, tmp_path: Path
) -> None:
    """The int4 shape refusal of a dense Llama-style directory comes from ``config.json``
    alone: the weights file (garbage here) is never read, and neither transformers nor
    safetensors is imported (the meta skeleton's modeling code cost 2.5 s of the refusal)."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    argv = _export(directory, tmp_path / "out", "--quantize", "int4_awq")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _REFUSE_IN_CHILD, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] != 0
    assert "module 'model.layers.0.self_attn.q_proj' (Linear)" in done.stderr
    assert "group_size=64 or group_size=32 divides 192" in done.stderr
    assert result["modules"] == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_config_skeleton_has_the_modules_transformers_builds(model_type: str) -> None:
    """Same names, types, shapes and order of every embedding and linear as the meta model
    transformers builds from the same config (head_dim given or derived, GQA ratio 3)."""
    import transformers

    from exportlm.cli._config_skeleton import config_skeleton

    sizes = {"hidden_size": 192, "intermediate_size": 320, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 96}
    extra = {"head_dim": 48} if model_type == "qwen3" else {}
    config = transformers.AutoConfig.for_model(model_type, **sizes, **heads, **extra)

    def modules(model: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
        return [
            (name, type(m).__name__, tuple(m.weight.shape))
            for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
        ]

    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    skeleton = config_skeleton(config.to_dict())
    assert skeleton is not None
    assert modules(skeleton) == modules(reference)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
