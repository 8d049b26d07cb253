"""Generated model structures: the spec builder, the CLI, the profiles and the two checks.

The pytester runs install a fake third-party distribution (a real ``*.dist-info``)
with targets that are wrong on purpose only for structures the fixed toy models
never have: ``vocabpad`` corrupts the last logit when the vocabulary is not a
multiple of 64, ``twolayers`` raises on models with more than two layers; and a
module exporter ``dropweight`` that drops the weights of ``o_proj``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.core
import pytest
import torch

from exportlm.cli import main
from exportlm.errors import InvalidConfigError
from exportlm.models import ModelSpec, build_from_spec
from pytest_exportcheck import HYPOTHESIS_PROFILE
from pytest_exportcheck.checks import CHECKS, ExporterCase
from pytest_exportcheck.checks.generated import GENERATED_EXAMPLES, generated_budget
from pytest_exportcheck.run._hypothesis import hypothesis_profile, register_profiles
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed
from tests._services import SERVICES

GEN_PLUGIN = '''
"""Targets and an exporter that are only wrong on structures the toy models lack."""
from pathlib import Path

import torch

from exportlm.export import (
    ExportCacheWrapper, atomic_output, export_target, infer_vocab_size, make_input_ids,
)
from exportlm.module_exporters import QuantLinearExporter

COMMON = dict(atol=1e-5, rtol=1e-5, capabilities={"dynamic_shapes"}, suffix=".pt")


def _save(model, path, example_inputs):
    wrapped = ExportCacheWrapper(model).eval()
    ids = example_inputs
    if ids is None:
        ids = make_input_ids(infer_vocab_size(model), batch=2, seq=8, seed=0)
    with torch.no_grad():
        wrapped(ids)
    torch.save(wrapped, path)


def _export(model, output_path, example_inputs):
    with atomic_output(output_path) as tmp:
        _save(model, tmp, example_inputs)
    return Path(output_path)


def load_plain(artifact, *, device="cpu"):
    module = torch.load(artifact, weights_only=False, map_location=device).eval()

    def run(input_ids):
        with torch.no_grad():
            return module(input_ids.to(device))

    return run


@export_target("plain", runtime="plain", **COMMON)
def export_plain(model, output_path, *, example_inputs=None):
    return _export(model, output_path, example_inputs)


@export_target("vocabpad", runtime="vocabpad", **COMMON)
def export_vocabpad(model, output_path, *, example_inputs=None):
    return _export(model, output_path, example_inputs)


def load_vocabpad(artifact, *, device="cpu"):
    run = load_plain(artifact, device=device)

    def padded(input_ids):
        logits = run(input_ids).clone()
        if logits.shape[-1] % 64:  # FAULT: a padding bug only a vocabulary like 97 shows
            logits[..., -1] += 1.0
        return logits

    return padded


@export_target("twolayers", runtime="plain", **COMMON)
def export_twolayers(model, output_path, *, example_inputs=None):
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
    if layers > 2:  # FAULT: a hard-coded layer count
        raise NotImplementedError(f"twolayers exports at most 2 layers, got {layers}")
    return _export(model, output_path, example_inputs)


class DropWeightExporter(QuantLinearExporter):
    """Writes nothing for o_proj (FAULT: a dropped weight)."""

    name = "dropweight"
    keys = ("QuantLinear",)
    prepend = True

    def export(self, name, module, ctx):
        if name.endswith("o_proj"):
            return
        super().export(name, module, ctx)
'''

ENTRY_POINTS = {
    "exportlm.export_backends": {
        "plain": "genplugin:export_plain",
        "vocabpad": "genplugin:export_vocabpad",
        "twolayers": "genplugin:export_twolayers",
    },
    "exportlm.export_runtimes": {
        "plain": "genplugin:load_plain",
        "vocabpad": "genplugin:load_vocabpad",
    },
    "exportlm.module_exporters": {"dropweight": "genplugin:DropWeightExporter"},
}

CONFTEST = '''
import hypothesis

from pytest_exportcheck.checks._api import CheckResult, check

# Twelve derandomized structures: enough that one has three layers (twolayers' fault).
# Each failing item stops drawing at its first failure and shrinks it, but skips the
# explain phase: every step is a build + export + compare, and explaining the shrunk
# structure (which parts may vary) re-runs it tens of times for a note no test reads.
hypothesis.settings.register_profile(
    "wide",
    max_examples=12,
    derandomize=True,
    database=None,
    report_multiple_bugs=False,
    phases=[phase for phase in hypothesis.Phase if phase is not hypothesis.Phase.explain],
)


@check("profile_probe", scope="target")
def profile_probe(case):
    """Reports the Hypothesis profile and settings exportcheck items run under."""
    current = hypothesis.settings()
    return CheckResult.passed(
        profile=hypothesis.settings.get_current_profile_name(),
        derandomize=current.derandomize,
        database=repr(current.database),
    )
'''


def _items(report: Path) -> dict[str, dict[str, Any]]:
    data = json.loads(report.read_text())
    return {item["id"]: item for item in data["items"]}


@pytest.fixture
def fake_site(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = pytester.path / "site"
    make_distribution(site, "genplugin", ENTRY_POINTS, {"genplugin.py": GEN_PLUGIN})
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest(CONFTEST)
    return site


# ----------------------------------------------------------------------------- the spec


def test_spec_builds_the_structure_it_describes() -> None:
    spec = ModelSpec(
        family="mixtral",
        vocab_size=131,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=16,
        tie_embeddings=True,
        num_experts=3,
        num_experts_per_tok=2,
    )
    assert ModelSpec.from_dict(json.loads(spec.to_json())) == spec
    model = build_from_spec(spec.to_dict(), seed=3)
    config = model.config
    assert (config.vocab_size, config.num_hidden_layers, config.num_key_value_heads) == (131, 3, 1)
    assert config.num_local_experts == 3
    assert config.num_experts_per_tok == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)  # one KV head of 8
    again = build_from_spec(spec, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    logits = model(torch.zeros(1, 2, dtype=torch.long)).logits
    assert logits.shape == (1, 2, 131)


def test_qwen3_moe_spec_uses_its_own_head_dim() -> None:
    spec = ModelSpec(
        family="qwen3_moe",
        vocab_size=99,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
    )
    model = build_from_spec(spec)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (16, 16)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"family": "gpt2"}, "family 'gpt2' is not one of"),
        ({"num_heads": 3}, "num_heads=3 does not divide hidden_size=32"),
        ({"num_kv_heads": 3, "num_heads": 4}, "num_kv_heads=3 does not divide num_heads=4"),
        ({"family": "mixtral"}, "needs num_experts >= 1"),
        ({"num_experts": 2}, "the dense family 'llama' takes num_experts=0"),
        ({"vocab_size": "97"}, "vocab_size must be an integer"),
        ({"layers": 2}, "unknown key(s) ['layers']"),
        ({"format": "v0"}, "format 'v0' is not supported"),
    ],
)
def test_invalid_specs_are_refused_with_the_reason(data: dict[str, Any], message: str) -> None:
    spec = {**ModelSpec().to_dict(), **data}
    with pytest.raises(InvalidConfigError) as err:
        build_from_spec(spec)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- the CLI


def test_cli_exports_a_json_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(ModelSpec(vocab_size=101, num_layers=2).to_json())
    out = tmp_path / "model.pt"
    argv = ["export", "--target", "torch_export", "--model", str(spec_file), "--out", str(out)]
    assert main([*argv, "--verify"]) == 0
    text = capsys.readouterr().out
    assert f"exported {spec_file} with torch_export" in text
    assert text.rstrip().endswith("OK")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the model spec file"),
        ("{not json", "not valid JSON (line 1, column 2"),
        ('{"family": "llama"}', "missing key(s)"),
        ("[1, 2]", "a model spec is a JSON object"),
    ],
)
def test_cli_names_the_file_and_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    spec_file = tmp_path / "bad.json"
    if content is not None:
        spec_file.write_text(content)
    argv = ["export", "--target", "onnx", "--model", str(spec_file), "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--model {spec_file}: " in err
    assert message in err
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- profiles


@pytest.fixture
def default_profile() -> Iterator[None]:
    """Run with Hypothesis' default profile loaded (as under a plain pytest run)."""
    before = hypothesis.settings.get_current_profile_name()
    hypothesis.settings.load_profile("default")
    register_profiles()
    try:
        yield
    finally:
        hypothesis.settings.load_profile(before)


@pytest.mark.usefixtures("default_profile")
@pytest.mark.parametrize(
    ("ci", "seed", "loaded", "expected"),
    [
        (None, None, "default", "dev"),
        ("1", None, "default", "ci"),
        ("true", 7, "default", "dev"),
        ("false", None, "default", "dev"),
        (None, None, "ci", "ci"),  # Hypothesis loads its own "ci" profile on CI runners
    ],
)
def test_profile_follows_ci_unless_a_seed_is_given(
    monkeypatch: pytest.MonkeyPatch, ci: str | None, seed: int | None, loaded: str, expected: str
) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(hypothesis.core, "global_force_seed", seed)
    hypothesis.settings.load_profile(loaded)
    with hypothesis_profile():
        current = hypothesis.settings()
        assert hypothesis.settings.get_current_profile_name() == HYPOTHESIS_PROFILE[expected]
        assert current.derandomize is (expected == "ci")
        assert current.database is None
        assert current.deadline is None
        assert generated_budget() == GENERATED_EXAMPLES
    assert hypothesis.settings.get_current_profile_name() == loaded


@pytest.mark.usefixtures("default_profile")
def test_a_profile_the_user_chose_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    hypothesis.settings.register_profile("user-choice", max_examples=7)
    hypothesis.settings.load_profile("user-choice")
    with hypothesis_profile():
        assert hypothesis.settings.get_current_profile_name() == "user-choice"
        assert generated_budget() == 7
    assert hypothesis.settings.get_current_profile_name() == "user-choice"


# ----------------------------------------------------------------------------- the checks


def test_quantized_generated_passes_on_the_builtin_exporters(tmp_path: Path) -> None:
    from exportlm.module_exporters import (
        EXPORT_MODULE_REGISTRY,
        ensure_module_exporters_registered,
    )

    ensure_module_exporters_registered()
    builtin = [
        e.name for e in EXPORT_MODULE_REGISTRY.entries() if e.provider.startswith("exportlm")
    ]
    assert {"quant_linear", "fused_experts"} <= set(builtin)
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    register_profiles()
    for name in builtin:
        with hypothesis_profile():
            result = CHECKS["quantized_generated"].fn(
                ExporterCase(name, workdir=tmp_path / name, services=SERVICES)
            )
        assert result.status != "fail", result.message
        outcomes[name] = result.status
        messages[name] = result.message
    assert outcomes["quant_linear"] == outcomes["fused_experts"] == "pass"
    # a recipe that refuses a drawn shape (INT4 groups of 128: no drawn hidden size is a
    # multiple of 128, as 576 is not) shows as that refusal, with the quantizer's reason
    assert "int4_awq refused" in messages["quant_linear"], messages["quant_linear"]
    assert "divisible by 128" in messages["quant_linear"], messages["quant_linear"]
    # the recipes leave embeddings unquantized, so quant_embedding's values are checked on
    # its conformance model (conformance_examples) instead of being skipped
    assert outcomes["quant_embedding"] == "pass"


def test_generated_checks_catch_what_the_toy_models_miss(
    pytester: pytest.Pytester, fake_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vocabpad and twolayers pass every toy model but fail roundtrip_generated with the
    smallest structure as JSON; dropweight fails quantized_generated; the JSON rebuilds
    the model through the CLI. No .hypothesis directory appears."""
    result = runpytest_installed(
        pytester,
        fake_site,
        "--export-targets=plain,vocabpad,twolayers",
        "--export-exporters=dropweight",
        "--export-checks=roundtrip_generated,quantized_generated",
        "--hypothesis-profile=wide",
        "--export-report=report.json",
        "--export-report-absolute-paths",  # the spec file is read back below
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    items = _items(pytester.path / "report.json")
    assert items["roundtrip_generated[plain-cpu]"]["outcome"] == "pass"
    vocab = items["roundtrip_generated[vocabpad-cpu]"]
    layers = items["roundtrip_generated[twolayers-cpu]"]
    dropped = items["quantized_generated[dropweight]"]
    for item in (vocab, layers, dropped):
        assert item["outcome"] == "fail"
        assert '"format": "exportlm.model_spec/1"' in item["message"]
        assert "reproduce outside pytest:" in item["message"]
    # shrunk: the smallest vocabulary drawn (97) and the smallest layer count that fails (3)
    assert '"vocab_size": 97' in vocab["message"]
    assert "logits differ from the eager model" in vocab["message"]
    assert "exportlm export --target vocabpad --model " in vocab["message"]
    assert '"num_layers": 3' in layers["message"]
    assert "twolayers exports at most 2 layers, got 3" in layers["message"]
    assert "o_proj.weight was dropped" in dropped["message"]
    assert "--quantize" in dropped["message"]
    assert not (pytester.path / ".hypothesis").exists()

    spec_file = Path(vocab["details"]["spec_file"])
    assert ModelSpec.from_dict(json.loads(spec_file.read_text())).vocab_size == 97
    out = pytester.path / "repro.pt"
    argv = ["export", "--target", "torch_export", "--model", str(spec_file), "--out", str(out)]
    assert main([*argv, "--verify"]) == 0
