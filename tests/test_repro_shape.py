"""A shrunk ``roundtrip_generated`` failure prints a command that reproduces it.

The item compares at the traced shape ``[2, 8]`` and then at a drawn input shape; a
runtime wrong only on one-token sequences fails at the drawn shape alone. The printed
``exportlm export ... --verify`` must compare at that shape too (``--verify-shape``),
with the ids the check drew, or it reports "OK" for a failure (the command without
``--verify-shape`` does: the control below).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.cli import main
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ExportCacheWrapper,
    atomic_output,
    ensure_exporters_registered,
    export_target,
)
from pytest_exportcheck.checks import CHECKS, TargetCase
from pytest_exportcheck.run._hypothesis import hypothesis_profile, register_profiles
from tests._services import SERVICES

TARGET = "shortseq_fault"


@export_target(
    TARGET, runtime=TARGET, atol=1e-5, rtol=1e-5, capabilities={"dynamic_shapes"}, suffix=".pt"
)
def _export(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
    with atomic_output(output_path) as tmp:
        torch.save(ExportCacheWrapper(model).eval(), tmp)
    return Path(output_path)


def _load(artifact: Path, *, device: str = "cpu") -> Any:
    module = torch.load(artifact, weights_only=False, map_location=device).eval()

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = module(input_ids).clone()
        if input_ids.shape[-1] == 1:  # FAULT: only a one-token sequence shows it
            logits[..., 0] += 1.0
        return logits

    return run


@pytest.fixture
def shortseq() -> Iterator[str]:
    ensure_exporters_registered()
    EXPORT_REGISTRY.register(TARGET, _export)
    RUNTIME_REGISTRY.register(TARGET, _load)
    try:
        yield TARGET
    finally:
        EXPORT_REGISTRY.unregister(TARGET)
        RUNTIME_REGISTRY.unregister(TARGET)


def test_the_printed_command_of_a_shrunk_failure_fails_as_the_item_did(
    shortseq: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTCHECK_SHRINK_SECONDS", "2")
    register_profiles()
    case = TargetCase(shortseq, None, {}, None, "cpu", tmp_path / "work", services=SERVICES)
    with hypothesis_profile():
        result = CHECKS["roundtrip_generated"].fn(case)
    assert result.status == "fail", result.message
    assert result.details["shape"][1] == 1
    command = str(result.details["repro"])
    argv = shlex.split(command)
    assert argv[:2] == ["exportlm", "export"]
    batch = result.details["shape"][0]
    assert argv[-4:] == ["--verify-shape", "2x8", "--verify-shape", f"{batch}x1"]
    assert command in result.message  # the message prints the same command

    assert main(argv[1:]) == 1  # MISMATCH, as the item found

    # The control: without the drawn shape the command verifies [2, 8] only, and passes.
    assert main([*argv[1:-4], "--out", str(tmp_path / "control.pt")]) == 0


@pytest.mark.parametrize("text", ["2x0", "x8", "2x", "2*8", "-1x3", "axb"])
def test_verify_shape_refuses_what_is_not_a_shape(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "--target", "onnx", "--model", "decoder", "--out", str(tmp_path / "m")]
    assert main([*argv, "--verify", f"--verify-shape={text}"]) == 2
    err = capsys.readouterr().err
    assert f"expected BATCHxSEQUENCE with both at least 1 (such as 2x8), got {text!r}" in err
    assert not (tmp_path / "m").exists()
