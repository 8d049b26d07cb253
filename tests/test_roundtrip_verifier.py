"""One verifier of logits roundtrips: ``exportlm export --verify`` and the checks compare the
same way (``exportlm.export.roundtrip``): the same ids, tolerance and message for a runtime
that returns something other than one logits tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.cli import main
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ensure_exporters_registered,
    export_target,
)
from pytest_exportcheck.api import run_check

#: What the verifier says of a runtime returning ``(logits, cache)``.
TUPLE = (
    "the runtime returned a tuple of 2 items; expected one logits tensor [batch, seq, vocab] "
    "(did the export trace the model without ExportCacheWrapper?)"
)


@export_target("verifier_tuple", runtime="verifier_tuple", suffix=".bin")
def _export_anything(model: Any, output_path: Path) -> Path:
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text("not a model")
    return output_path


def _load_tuple(artifact: Path) -> Any:
    """A runtime that forgot the logits-only wrapper: ``(logits, cache)``."""
    return lambda ids: (torch.zeros(*ids.shape, 7), torch.zeros(1))


@pytest.fixture
def tuple_target() -> Iterator[None]:
    ensure_exporters_registered()
    EXPORT_REGISTRY.register("verifier_tuple", _export_anything)
    RUNTIME_REGISTRY.register("verifier_tuple", _load_tuple)
    yield
    EXPORT_REGISTRY.unregister("verifier_tuple")
    RUNTIME_REGISTRY.unregister("verifier_tuple")


@pytest.mark.usefixtures("tuple_target")
def test_a_runtime_returning_a_tuple_is_named_alike_by_the_cli_and_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "--target", "verifier_tuple", "--model", "decoder"]
    assert main([*argv, "--out", str(tmp_path / "m.bin"), "--verify"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"exportlm: error: {TUPLE}"
    result = run_check("roundtrip_logits", target="verifier_tuple", model="decoder")
    assert result.status == "fail"
    assert result.message == TUPLE


def test_the_cli_verifies_with_the_checks_ids_and_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "--target", "torchscript", "--model", "decoder", "--json", "--verify"]
    assert main([*argv, "--out", str(tmp_path / "decoder.pt")]) == 0
    cli = json.loads(capsys.readouterr().out)["verify"]
    check = run_check("roundtrip_logits", target="torchscript", model="decoder").details
    same = ("atol", "rtol", "numel", "expected_shape", "passed")
    assert {k: cli[k] for k in same} == {k: check[k] for k in same}
    assert cli["expected_shape"] == [2, 8, check["expected_shape"][-1]]  # the traced shape
    assert cli["max_abs"] <= cli["atol"]
    assert check["max_abs"] <= check["atol"]
