"""Value checks of an exporter no toy model exercises: its conformance model, through pytest.

A third-party style plugin (a ``conftest.py`` of the pytester project) defines
``QuantScaledLinear`` (an FP8 linear times a per-channel scale) and its exporter
``scaled_linear``. Written correctly, with its golden, its value checks pass
(not skip); writing ``weight_scale`` twice fails, naming the check and the tensor;
without a conformance model its value checks fail and say how to add one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from exportlm.errors import DuplicateTensorError
from exportlm.export.hf_checkpoint.sink import ShardedSafetensorsWriter
from exportlm.module_exporters import (
    DictSink,
    ExportContext,
    ExportModuleRegistry,
    ModuleExporter,
    QuantLinearExporter,
    export_quantized_state,
)
from exportlm.quant import quantize, synthetic_calibration

PLUGIN = """
import torch
import torch.nn.functional as F
from torch import nn

from exportlm.module_exporters import EXPORT_MODULE_REGISTRY, ModuleExporter, library_dequantized_module
from exportlm.quant import QuantModule, TensorQuantizer

DOUBLED = {doubled}
WITH_MODEL = {with_model}
SCALE_FACTOR = {scale_factor}


class QuantScaledLinear(QuantModule, nn.Linear):
    quant_algo = "FP8"

    def __init__(self, in_features, out_features, generator):
        nn.Linear.__init__(self, in_features, out_features, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.randn(out_features, in_features, generator=generator))
        self.register_buffer("channel_scale", torch.rand(out_features, generator=generator) + 0.5)
        self.weight_quantizer = TensorQuantizer("fp8")
        self.weight_quantizer.amax = self.weight.detach().abs().amax()

    def forward(self, x):
        return F.linear(x, self.weight_quantizer(self.weight)) * self.channel_scale


class Rescaled(nn.Module):
    def __init__(self, linear, scale):
        super().__init__()
        self.linear, self.scale = linear, scale

    def forward(self, x):
        return self.linear(x) * self.scale


class ScaledLinearExporter(ModuleExporter):
    name = "scaled_linear"
    keys = ("QuantScaledLinear",)

    def export(self, name, module, ctx):
        q = module.weight_quantizer.quantize(module.weight, amax=ctx.amax_of(module.weight_quantizer))
        ctx.emit(f"{{name}}.weight", q.data)
        ctx.emit_scale(f"{{name}}.weight_scale", q.scale)
        if DOUBLED:
            ctx.emit_scale(f"{{name}}.weight_scale", q.scale)
        ctx.emit_scale(f"{{name}}.channel_scale", module.channel_scale * SCALE_FACTOR)
        ctx.quant_config.add_layer(name, module.quant_algo)

    def dequantized_module(self, module, tensors):
        return Rescaled(library_dequantized_module(module, tensors), tensors["channel_scale"])

    if WITH_MODEL:
        def conformance_model(self, seed):
            generator = torch.Generator().manual_seed(seed)
            layer = QuantScaledLinear(32, 32, generator)
            return nn.Sequential(layer, layer)  # one layer under two names: a tie


EXPORTER = ScaledLinearExporter()
EXPORT_MODULE_REGISTRY.register(EXPORTER, name="scaled_linear")


def pytest_unconfigure(config):  # the run may be in-process: leave the registry as it was
    EXPORT_MODULE_REGISTRY.unregister(EXPORTER)
"""

ARGS = (
    "--export-exporters=scaled_linear",
    "--export-models=decoder",
    "--export-checks=quantized_generated,golden_checkpoint,export_contract,tied_weights",
    "--export-report=report.json",
    "-p",
    "xdist",
    "-n",
    "0",
)


def _project(
    pytester: pytest.Pytester,
    *,
    doubled: bool = False,
    with_model: bool = True,
    scale_factor: float = 1.0,
) -> None:
    plugin = PLUGIN.format(doubled=doubled, with_model=with_model, scale_factor=scale_factor)
    pytester.makeconftest(plugin)
    pytester.makefile(".toml", pyproject='[project]\nname = "acme-scaled"\nversion = "1"\n')


def _items(pytester: pytest.Pytester) -> dict[str, dict[str, str]]:
    report = json.loads((pytester.path / "report.json").read_text())
    return {item["check"]: item for item in report["items"]}


def test_a_missing_golden_fails_and_with_its_golden_a_correct_exporter_passes_its_value_checks(
    pytester: pytest.Pytester,
) -> None:
    """One project, three in-process runs (the conftest takes its exporter out of the
    registry when each run ends): without a golden, golden_checkpoint fails saying it is
    missing; --export-update-goldens writes it; against it every value check passes.
    The first two runs select golden_checkpoint alone: the other checks do not read the
    golden (the generated structures of quantized_generated cost each run ~1.3 s more)."""
    _project(pytester)
    golden_only = (*ARGS[:2], "--export-checks=golden_checkpoint", *ARGS[3:])
    missing = pytester.runpytest(*golden_only)
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*golden_checkpoint*scaled_linear*", "*is missing*"])
    pytester.runpytest(*golden_only, "--export-update-goldens").assert_outcomes(passed=1)
    golden = pytester.path / "goldens" / "checkpoint" / "conformance" / "scaled_linear.json"
    written = json.loads(golden.read_text())
    assert sorted(written["tensors"]) == ["0.channel_scale", "0.weight", "0.weight_scale"]
    assert written["quantization"]["quant_algo"] == "FP8"
    assert written["ties"] == {"0.weight=1.weight": ["0.weight"]}
    pytester.runpytest(*ARGS).assert_outcomes(passed=4)  # against the golden: no skip
    items = _items(pytester)
    assert items["quantized_generated"]["outcome"] == "pass"
    assert items["golden_checkpoint"]["outcome"] == "pass"
    assert items["tied_weights"]["outcome"] == "pass"
    assert "conformance" in items["golden_checkpoint"]["message"]


def test_writing_weight_scale_twice_fails_naming_the_check_and_the_tensor(
    pytester: pytest.Pytester,
) -> None:
    _project(pytester, doubled=True)
    result = pytester.runpytest(*ARGS, "--export-update-goldens")
    result.assert_outcomes(failed=4)
    items = _items(pytester)
    for check_id in ("quantized_generated", "golden_checkpoint", "export_contract", "tied_weights"):
        message = items[check_id]["message"]
        assert "tensor '0.weight_scale' was written twice" in message, (check_id, message)
    assert (
        "module exporter 'scaled_linear' on '0' (QuantScaledLinear)"
        in items["quantized_generated"]["message"]
    )
    for check_id in ("export_contract", "quantized_generated", "golden_checkpoint"):
        result.stdout.fnmatch_lines([f"FAILED *{check_id}[[]scaled_linear[]]*"])


def test_a_scale_two_percent_off_fails_the_dequantized_forward(pytester: pytest.Pytester) -> None:
    _project(pytester, scale_factor=1.02)
    result = pytester.runpytest(*ARGS[:2], "--export-checks=quantized_generated", *ARGS[3:])
    result.assert_outcomes(failed=1)
    message = _items(pytester)["quantized_generated"]["message"]
    assert "0 (QuantScaledLinear): the written tensors ['channel_scale', 'weight', " in message
    assert "off the fake-quant forward, beyond 1e-06 + 0.0001 * max|fake_quant|" in message


def test_an_exporter_without_a_conformance_model_fails_value_coverage(
    pytester: pytest.Pytester,
) -> None:
    _project(pytester, with_model=False)
    result = pytester.runpytest(*ARGS)
    items = _items(pytester)
    for check_id in ("quantized_generated", "golden_checkpoint"):
        assert items[check_id]["outcome"] == "fail", items[check_id]
        message = items[check_id]["message"]
        assert "value_coverage[scaled_linear]" in message
        assert "conformance_model(self, seed: int) -> nn.Module" in message
    assert items["export_contract"]["outcome"] == "skip"
    result.assert_outcomes(failed=2, skipped=2)


# ----------------------------------------------------------------------------- duplicates


class TwiceExporter(QuantLinearExporter):
    name = "twice"

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        super().export(name, module, ctx)
        ctx.emit_scale(f"{name}.weight_scale", torch.ones(()))


def _fp8_linear() -> nn.Module:
    return quantize(
        nn.Sequential(nn.Linear(32, 16)),
        "fp8",
        synthetic_calibration(0, run_forward=lambda m: m(torch.zeros(1, 32))),
    )


def test_a_duplicate_write_names_the_tensor_and_the_exporter_that_wrote_it_again() -> None:
    registry = ExportModuleRegistry()
    registry.register(TwiceExporter(), "QuantLinear")
    with pytest.raises(DuplicateTensorError) as raised:
        export_quantized_state(_fp8_linear(), DictSink(), registry=registry)
    message = str(raised.value)
    assert "tensor '0.weight_scale' was written twice" in message
    assert "by module exporter 'twice' on '0' (QuantLinear), which emits it twice" in message


def test_the_checkpoint_writer_refuses_a_second_tensor_of_one_name(tmp_path: Path) -> None:
    writer = ShardedSafetensorsWriter(tmp_path)
    writer.add("a.weight_scale", torch.ones(()))
    with pytest.raises(DuplicateTensorError, match=r"'a\.weight_scale' was written twice"):
        writer.add("a.weight_scale", torch.ones(()))


def test_conformance_model_defaults_to_the_conformance_examples() -> None:
    class WithExamples(ModuleExporter):
        def conformance_examples(self) -> list[nn.Module]:
            return [_fp8_linear()[0]]

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            return None

    model = WithExamples().conformance_model(0)
    assert model is not None
    assert [n for n, _ in model.named_children()] == ["examples"]
    assert QuantLinearExporter().conformance_model(0) is None
