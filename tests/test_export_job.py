"""The export job does its once-per-export work once, and carries the target as registered.

``accepts``, the weight check (``check_real_weights``) and the vocabulary
(``infer_vocab_size``) run once per export, whether a built-in target is reached
through ``export_model`` or called directly; the manifest names the target as it
was called.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ExportCacheWrapper,
    TargetInfo,
    ensure_exporters_registered,
    export_model,
    export_target,
    export_to_onnx,
    load_exported,
)
from exportlm.export.guard import check_real_weights
from exportlm.export.job import ExportRequest, export_job, job_target
from exportlm.export.manifest import read_manifest
from exportlm.export.torchscript import export_torchscript, load_torchscript
from exportlm.inputs import infer_vocab_size
from exportlm.models import build_model

pytest.importorskip("onnxscript")


class Counter:
    """Calls of one function, wherever exportlm imported it from."""

    def __init__(self) -> None:
        self.calls = 0


def _spy(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any]) -> Counter:
    counter = Counter()

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        return fn(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("exportlm"):
            continue
        for attr, value in list(vars(module).items()):
            if value is fn:
                monkeypatch.setattr(module, attr, counted)
    return counter


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter]:
    ensure_exporters_registered()
    return {
        "check_real_weights": _spy(monkeypatch, check_real_weights),
        "infer_vocab_size": _spy(monkeypatch, infer_vocab_size),
    }


def _decoder() -> nn.Module:
    return build_model("decoder", seed=0, num_layers=1)


def _quiet(fn: Callable[[], Path]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


EXPORTS: dict[str, Callable[[Path], Path]] = {
    "export_model(onnx)": lambda out: export_model("onnx", _decoder(), out / "m.onnx"),
    "export_to_onnx": lambda out: export_to_onnx(_decoder(), out / "m.onnx"),
    "export_model(torchscript)": lambda out: export_model("torchscript", _decoder(), out / "m.pt"),
    "export_torchscript": lambda out: export_torchscript(_decoder(), out / "m.pt"),
    "export_model(hf_checkpoint)": lambda out: export_model(
        "hf_checkpoint", build_model("llama", seed=0), out / "ckpt"
    ),
}


@pytest.mark.parametrize("how", sorted(EXPORTS))
def test_weights_and_vocabulary_are_read_once_per_export(
    how: str, tmp_path: Path, spies: dict[str, Counter]
) -> None:
    artifact = _quiet(lambda: EXPORTS[how](tmp_path))
    assert read_manifest(artifact) is not None
    assert {name: c.calls for name, c in spies.items()} == {
        "check_real_weights": 1,
        "infer_vocab_size": 1,
    }


@pytest.fixture
def counted_target() -> Iterator[tuple[str, Counter]]:
    """A traced target on the shared job whose ``accepts`` counts its calls."""
    calls = Counter()

    def accepts(model: Any) -> str | None:
        calls.calls += 1
        return None

    @job_target(TargetInfo("counted_job", runtime="torchscript", accepts=accepts))
    def export_counted(request: ExportRequest, *, example_inputs: Any = None) -> Path:
        with export_job(request, example_inputs, options={}) as job:
            traced = torch.jit.trace(ExportCacheWrapper(job.model).eval(), job.inputs[:1])
            torch.jit.save(traced, str(job.staged))
        return request.output_path

    ensure_exporters_registered()
    EXPORT_REGISTRY.register("counted_job", export_counted)
    try:
        yield "counted_job", calls
    finally:
        EXPORT_REGISTRY.unregister("counted_job")


def test_accepts_runs_once_through_export_model_and_once_called_directly(
    tmp_path: Path, counted_target: tuple[str, Counter], spies: dict[str, Counter]
) -> None:
    name, calls = counted_target
    _quiet(lambda: export_model(name, _decoder(), tmp_path / "a.pt"))
    assert (calls.calls, spies["check_real_weights"].calls) == (1, 1)
    _quiet(lambda: EXPORT_REGISTRY.get(name)(_decoder(), tmp_path / "b.pt"))
    assert (calls.calls, spies["check_real_weights"].calls) == (2, 2)


def test_accepts_and_weights_run_once_around_a_third_party_factory(
    tmp_path: Path, spies: dict[str, Counter]
) -> None:
    calls = Counter()

    def accepts(model: Any) -> str | None:
        calls.calls += 1
        return None

    @export_target("counted_plain", accepts=accepts)
    def plain(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
        Path(output_path).write_bytes(b"weights")
        return Path(output_path)

    ensure_exporters_registered()
    EXPORT_REGISTRY.register("counted_plain", plain)
    try:
        artifact = export_model("counted_plain", _decoder(), tmp_path / "m.bin")
    finally:
        EXPORT_REGISTRY.unregister("counted_plain")
    assert (calls.calls, spies["check_real_weights"].calls, spies["infer_vocab_size"].calls) == (
        1,
        1,
        1,
    )
    manifest = read_manifest(artifact)
    assert manifest is not None
    assert manifest.target == "counted_plain"


def test_a_built_in_registered_under_another_name_writes_that_name(tmp_path: Path) -> None:
    ensure_exporters_registered()
    EXPORT_REGISTRY.register("ts_alias", export_torchscript)
    RUNTIME_REGISTRY.register("ts_alias", load_torchscript)
    try:
        artifact = _quiet(lambda: export_model("ts_alias", _decoder(), tmp_path / "m.pt"))
        manifest = read_manifest(artifact)
        assert manifest is not None
        assert manifest.target == "ts_alias"
        assert load_exported("ts_alias", artifact) is not None  # signed for it: no trust needed
    finally:
        EXPORT_REGISTRY.unregister("ts_alias")
        RUNTIME_REGISTRY.unregister("ts_alias")


def test_a_factory_wrapping_a_built_in_gets_the_manifest_of_what_the_built_in_published(
    tmp_path: Path,
) -> None:
    @export_target("wraps_torchscript", runtime="torchscript", executes_code=True)
    def wrapper(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
        out = export_torchscript(model, output_path)
        out.with_name("late.txt").write_text("written after the artifact was published")
        return out

    ensure_exporters_registered()
    EXPORT_REGISTRY.register("wraps_torchscript", wrapper)
    try:
        model = _decoder()
        artifact = _quiet(lambda: export_model("wraps_torchscript", model, tmp_path / "m.pt"))
        manifest = read_manifest(artifact)
        assert manifest is not None
        assert manifest.target == "wraps_torchscript"  # re-signed for the target called
        assert sorted(manifest.files) == ["m.pt"]
        ids = torch.zeros(1, 4, dtype=torch.long)
        runtime = load_exported("wraps_torchscript", artifact)  # vouched for: no trust=True
        torch.testing.assert_close(
            runtime(ids), ExportCacheWrapper(model).eval()(ids), atol=1e-5, rtol=1e-5
        )
    finally:
        EXPORT_REGISTRY.unregister("wraps_torchscript")
