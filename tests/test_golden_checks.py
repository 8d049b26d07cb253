"""The golden checks: shipped goldens match, one ULP fails readably, verdicts hold on any machine.

``golden_checkpoint`` compares bytes that are a pure function of fixed inputs
(toy weights from PCG64, quantizer statistics from ``synthetic_calibration``),
so it is exact; ``golden_calibration`` compares scales from a forward pass
within its stated tolerance. The portability test reruns them in fresh
processes with the generic CPU kernels on one thread and with this machine's
best kernels under xdist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.module_exporters import (
    EXPORT_MODULE_REGISTRY,
    ExportContext,
    QuantLinearExporter,
)
from pytest_exportcheck.checks import CHECKS, CheckResult, ExporterCase
from pytest_exportcheck.checks.exporters.golden import GOLDEN_CASES, golden_case
from pytest_exportcheck.goldens import GoldenStore
from tests._services import SERVICES

ROOT = Path(__file__).resolve().parents[1]
REPO_GOLDENS = ROOT / "goldens"
BUILTIN_EXPORTERS = (
    "quant_moe_linear",
    "quant_linear",
    "quant_embedding",
    "bmm_experts",
    "fused_experts",
    "iterable_experts",
    "iterable_catch_all",
)
GOLDEN_CHECKS = ("golden_checkpoint", "golden_calibration")


def run(check_id: str, exporter: str, tmp_path: Path, store: GoldenStore) -> CheckResult:
    return CHECKS[check_id].fn(ExporterCase(exporter, tmp_path, goldens=store, services=SERVICES))


@pytest.mark.parametrize("exporter", BUILTIN_EXPORTERS)
def test_shipped_goldens_match(tmp_path: Path, exporter: str) -> None:
    store = GoldenStore(REPO_GOLDENS)
    for check_id in GOLDEN_CHECKS:
        result = run(check_id, exporter, tmp_path, store)
        assert result.status in ("pass", "skip"), result.message
        assert not list(REPO_GOLDENS.rglob("*.obtained"))


def test_every_golden_case_has_a_shipped_golden() -> None:
    for case in GOLDEN_CASES:
        assert list((REPO_GOLDENS / "checkpoint" / case.id).glob("*.json")), case.id
    assert golden_case("nvfp4").recipe == "nvfp4"
    with pytest.raises(KeyError, match="unknown golden case 'nope'; known: tied_decoder"):
        golden_case("nope")


def test_a_golden_check_runs_on_its_own_in_a_fresh_process(tmp_path: Path) -> None:
    # Nothing registered beforehand: the check registers the models and exporters it needs.
    code = (
        "from pathlib import Path\n"
        "from pytest_exportcheck.checks import CHECKS, ExporterCase\n"
        "from pytest_exportcheck.goldens import GoldenStore\n"
        f"case = ExporterCase('quant_embedding', Path({str(tmp_path)!r}), "
        f"goldens=GoldenStore(Path({str(REPO_GOLDENS)!r})))\n"
        "r = CHECKS['golden_checkpoint'].fn(case)\n"
        "print(r.status, r.message)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.startswith("pass "), out.stdout + out.stderr


class OneUlpOff(QuantLinearExporter):
    """The built-in linear exporter, optionally writing ``down_proj``'s weight_scale one ULP up."""

    def __init__(self, nudge: bool = False) -> None:
        self.nudge = nudge

    def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
        if not (self.nudge and name.endswith("down_proj")):
            super().export(name, module, ctx)
            return
        sink = ctx.sink

        class Nudged:
            def add(self, tensor_name: str, tensor: torch.Tensor) -> None:
                if tensor_name.endswith(".weight_scale") and tensor.dtype == torch.float32:
                    tensor = torch.nextafter(tensor, torch.tensor(1.0, dtype=tensor.dtype))
                sink.add(tensor_name, tensor)

        ctx.sink = Nudged()
        try:
            super().export(name, module, ctx)
        finally:
            ctx.sink = sink


def test_a_scale_one_ulp_off_fails_its_golden_naming_the_tensor_and_both_values(
    tmp_path: Path, register_exporter: Callable[..., str]
) -> None:
    honest = OneUlpOff()
    name = register_exporter(honest, "QuantLinear", prepend=True)
    goldens = tmp_path / "goldens"
    written = run("golden_checkpoint", name, tmp_path, GoldenStore(goldens, update=True))
    assert written.status == "pass", written.message
    EXPORT_MODULE_REGISTRY.unregister(honest)  # one registry: its name goes with it
    assert register_exporter(OneUlpOff(nudge=True), "QuantLinear", prepend=True) == name
    result = run("golden_checkpoint", name, tmp_path, GoldenStore(goldens))
    assert result.status == "fail"
    golden = json.loads((goldens / "checkpoint" / "untied_llama" / f"{name}.json").read_text())
    tensor = "model.layers.0.mlp.down_proj.weight_scale"
    before = golden["tensors"][tensor]["values"][0]
    obtained = json.loads(
        (goldens / "checkpoint" / "untied_llama" / f"{name}.obtained").read_text()
    )
    after = obtained["tensors"][tensor]["values"][0]
    assert after != before
    assert f"{tensor}: {before} -> {after} (rel " in result.message
    assert "untied_llama" in result.message
    assert "--export-update-goldens" in result.message


def test_real_calibration_changes_no_checkpoint_golden_but_shows_in_the_calibration_one(
    tmp_path: Path,
) -> None:
    calibration = json.loads((REPO_GOLDENS / "calibration" / "quant_linear.json").read_text())
    assert calibration["tolerance"] == {"rtol": 1e-4, "atol": 1e-12}
    scales = calibration["cases"]["untied_llama"]["approx"]
    key = "model.layers.0.self_attn.q_proj.input_scale"
    checkpoint = json.loads(
        (REPO_GOLDENS / "checkpoint" / "untied_llama" / "quant_linear.json").read_text()
    )
    # The checkpoint golden holds the synthetic statistics, not the calibrated ones.
    assert checkpoint["calibration"] == "synthetic_calibration(seed=0)"
    assert checkpoint["tensors"][key]["values"] != scales[key]
    # A calibrated scale moved by 1e-3 (relative) is beyond the stated tolerance.
    moved: dict[str, Any] = json.loads(json.dumps(calibration))
    moved["cases"]["untied_llama"]["approx"][key] = [scales[key][0] * (1 + 1e-3)]
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "quant_linear.json").write_text(json.dumps(moved))
    result = run("golden_calibration", "quant_linear", tmp_path, GoldenStore(tmp_path))
    assert result.status == "fail"
    assert f"approx {key}:" in result.message
    assert "beyond atol=1e-12 + rtol=0.0001*|golden|" in result.message


def _run_golden_items(basetemp: Path, kernels: dict[str, str | None], *args: str) -> str:
    """Run every golden item in a fresh pytest process; ``None`` in ``kernels`` unsets a variable."""
    env = dict(os.environ)
    for key, value in kernels.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--export-exporters=all",
        f"--export-checks={','.join(GOLDEN_CHECKS)}",
        "--export-only",
        # only the golden checks run, so rows they do not reach are unchecked: not the point
        "--export-strict=off",
        f"--basetemp={basetemp}",
        *args,
    ]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_golden_verdicts_are_the_same_on_generic_and_best_kernels_serial_and_xdist(
    tmp_path: Path,
) -> None:
    # Generic kernels, one thread, no xdist: every golden rewritten into a scratch directory
    # holds exactly the bytes of the shipped one (written on this machine's best kernels).
    rewritten = tmp_path / "rewritten"
    _run_golden_items(
        tmp_path / "generic",
        {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
        "-n",
        "0",
        "--export-update-goldens=all",
        f"--export-goldens-dir={rewritten}",
    )
    shipped = sorted(
        p.relative_to(REPO_GOLDENS) for p in (REPO_GOLDENS / "checkpoint").rglob("*.json")
    )
    again = sorted(p.relative_to(rewritten) for p in (rewritten / "checkpoint").rglob("*.json"))
    assert again == shipped
    for relative in shipped:
        assert (rewritten / relative).read_bytes() == (REPO_GOLDENS / relative).read_bytes()
    # The machine's best kernels, every thread, under xdist: the shipped goldens pass. One
    # worker: the plugin hands every exporter item to one worker, so a second one only
    # imported torch and collected the suite.
    summary = _run_golden_items(
        tmp_path / "best",
        {"ATEN_CPU_CAPABILITY": None, "OMP_NUM_THREADS": None},
        "-n",
        "1",
    )
    assert " passed" in summary.splitlines()[-1]
    assert "failed" not in summary.splitlines()[-1]


# ----------------------------------------------------------------------------- the workflow

WORKFLOW = (
    "--export-exporters=quant_embedding",
    "--export-checks=golden_checkpoint",
    "-p",
    "xdist",
)


def test_workflow_missing_update_unused_and_no_silent_shadowing(pytester: pytest.Pytester) -> None:
    golden = pytester.path / "goldens" / "checkpoint" / "mixed_precision" / "quant_embedding.json"
    # A third-party project: the built-in exporter's golden comes from the package.
    pytester.makefile(".toml", pyproject='[project]\nname = "acme-plugin"\nversion = "1"\n')
    first = pytester.runpytest(*WORKFLOW, "-n", "0")
    first.assert_outcomes(passed=1)
    # Updating does not write a local copy of a golden exportlm ships...
    kept = pytester.runpytest(
        *WORKFLOW, "-n", "0", "--export-update-goldens", "--export-report=r.json"
    )
    kept.assert_outcomes(passed=1)
    assert not golden.exists()
    (item,) = json.loads((pytester.path / "r.json").read_text())["items"]
    assert "not updated: it describes an exporter that exportlm provides" in item["message"]
    assert "acme-plugin" in item["message"]
    # ...unless asked to, with =all.
    forced = pytester.runpytest(*WORKFLOW, "-n", "0", "--export-update-goldens=all")
    forced.assert_outcomes(passed=1)
    assert json.loads(golden.read_text())["exporter"] == "quant_embedding"
    # A golden that exists nowhere fails and says how to create it.
    empty = pytester.path / "empty"
    missing = pytester.runpytest(
        "--export-exporters=quant_linear",
        "--export-checks=golden_calibration",
        f"--export-goldens-dir={empty}",
        "-p",
        "xdist",
        "-n",
        "0",
    )
    missing.assert_outcomes(passed=1)  # the shipped golden backs up an empty local directory
    mangled = pytester.path / "goldens" / "calibration" / "quant_linear.json"
    mangled.parent.mkdir(parents=True)
    mangled.write_text(json.dumps({"exporter": "quant_linear", "cases": {}}))
    differs = pytester.runpytest(
        "--export-exporters=quant_linear", "--export-checks=golden_calibration", "-p", "xdist"
    )
    differs.assert_outcomes(failed=1)
    differs.stdout.fnmatch_lines(["*cases.untied_llama: obtained, not in the golden*"])
    assert (mangled.parent / "quant_linear.obtained").exists()


def test_a_missing_golden_fails_and_says_how_to_create_it(tmp_path: Path) -> None:
    result = run("golden_checkpoint", "quant_embedding", tmp_path, GoldenStore(tmp_path / "none"))
    assert result.status == "fail"
    assert "is missing" in result.message
    assert "--export-update-goldens" in result.message


def test_a_full_run_reports_goldens_no_item_used(pytester: pytest.Pytester) -> None:
    stale = pytester.path / "goldens" / "checkpoint" / "gone_case" / "quant_linear.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    result = pytester.runpytest(
        "--export-exporters=all",
        "--export-checks=golden_checkpoint,golden_calibration",
        "--export-update-goldens=all",
        "-p",
        "xdist",
        "-n",
        "0",
    )
    # dbrx_experts writes only in its own case (fp8_dbrx_experts): its checkpoint item
    # passes, its calibration item skips like those of the exporters no case reaches
    result.assert_outcomes(passed=10, skipped=6)
    result.stdout.fnmatch_lines(
        ["*1 golden file(s) under * were used by no item of this full run*", f"*{stale}"]
    )
