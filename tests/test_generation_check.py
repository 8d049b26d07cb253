"""The ``generation_parity`` check: called directly, and through the plugin with ``pytester``.

A correct ``kv_cache`` target passes; a target whose decode step ignores the past
fails; a target without prefill / decode steps fails; capability gaps are
counted skips with their reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ensure_exporters_registered,
    export_target,
)
from exportlm.export.torch_export import export_torch_export, load_torch_export
from exportlm.models import MODEL_REGISTRY, ensure_models_registered
from pytest_exportcheck.checks import CHECKS, CheckResult, TargetCase

FAKE = "generation_fake"
NO_CACHE_FAMILY = "generation_no_cache"


def run(case: TargetCase) -> CheckResult:
    return CHECKS["generation_parity"].fn(case)


def make_case(tmp_path: Path, target: str, model: str = "decoder") -> TargetCase:
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    return TargetCase(target, None, {}, model, "cpu", workdir)


class IgnoresPast:
    """A generation runtime whose decode step runs the new tokens alone (the past is dropped)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, input_ids: Any) -> Any:
        return self.inner(input_ids)

    def prefill(self, input_ids: Any) -> Any:
        return self.inner.prefill(input_ids)

    def decode(self, next_ids: Any, past: Any) -> Any:
        return self.inner.prefill(next_ids)


def load_ignoring_past(artifact: Path, *, device: str = "cpu") -> IgnoresPast:
    return IgnoresPast(load_torch_export(artifact, device=device))


def load_logits_only(artifact: Path, *, device: str = "cpu") -> Callable[[Any], Any]:
    runtime = load_torch_export(artifact, device=device)
    return lambda ids: runtime(ids)


@pytest.fixture
def fake_target() -> Iterator[Callable[..., str]]:
    """Register ``torch_export``'s factory under another name with a given runtime, for one test."""
    ensure_exporters_registered()
    registered: list[str] = []

    def register(loader: Callable[..., Any], capabilities: set[str]) -> str:
        def factory(model: nn.Module, output_path: Path, **kwargs: Any) -> Path:
            return export_torch_export(model, output_path, **kwargs)

        declared = export_target(
            FAKE,
            capabilities=capabilities,
            suffix=".pt2",
            executes_code=True,
            atol=1e-5,
            rtol=1e-5,
        )(factory)
        EXPORT_REGISTRY.register(FAKE, declared)
        RUNTIME_REGISTRY.register(FAKE, loader)
        registered.append(FAKE)
        return FAKE

    yield register
    if registered:
        EXPORT_REGISTRY.unregister(FAKE)
        RUNTIME_REGISTRY.unregister(FAKE)


@pytest.mark.parametrize(("target", "family"), [("torch_export", "llama"), ("onnx", "decoder")])
def test_builtin_kv_cache_targets_pass(tmp_path: Path, target: str, family: str) -> None:
    result = run(make_case(tmp_path, target, family))
    assert result.status == "pass", result.message
    assert "8 greedy tokens x 2 prompts equal to the eager model's" in result.message
    assert len(result.details["tokens"]) == 2


def test_a_decode_that_ignores_the_past_fails(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(load_ignoring_past, {"kv_cache", "dynamic_shapes"})
    result = run(make_case(tmp_path, target))
    assert result.status == "fail"
    assert "generation logits differ from the eager model at step 1 (decode)" in result.message
    assert result.details["step"] == 1


def test_a_kv_cache_target_without_decode_steps_fails(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(load_logits_only, {"kv_cache"})
    result = run(make_case(tmp_path, target))
    assert result.status == "fail"
    assert "declares 'kv_cache'" in result.message
    assert "without prefill / decode steps" in result.message


def test_a_target_without_kv_cache_is_a_counted_skip(
    tmp_path: Path, fake_target: Callable[..., str]
) -> None:
    target = fake_target(load_torch_export, {"dynamic_shapes"})
    result = run(make_case(tmp_path, target))
    assert result.status == "skip"
    assert "does not declare 'kv_cache'" in result.message


class _NoCacheLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 64})()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def _no_cache_family(seed: int = 0, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    return _NoCacheLM().eval()


def test_a_model_without_a_cache_is_a_counted_skip_with_the_reason(tmp_path: Path) -> None:
    ensure_models_registered()
    MODEL_REGISTRY.register(NO_CACHE_FAMILY, _no_cache_family)
    try:
        result = run(make_case(tmp_path, "torch_export", NO_CACHE_FAMILY))
    finally:
        MODEL_REGISTRY.unregister(NO_CACHE_FAMILY)
    assert result.status == "skip"
    assert "cannot be exported with kv_cache" in result.message
    assert "no use_cache and past_key_values" in result.message


CONFTEST = """
from pathlib import Path

from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered
from exportlm.export import export_target
from exportlm.export.torch_export import export_torch_export, load_torch_export


class IgnoresPast:
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, input_ids):
        return self.inner(input_ids)

    def prefill(self, input_ids):
        return self.inner.prefill(input_ids)

    def decode(self, next_ids, past):
        return self.inner.prefill(next_ids)


@export_target("ignores_past", capabilities={"kv_cache", "dynamic_shapes"}, suffix=".pt2",
               executes_code=True, atol=1e-5, rtol=1e-5)
def ignores_past(model, output_path, **kwargs):
    return export_torch_export(model, output_path, **kwargs)


def load(artifact, *, device="cpu"):
    return IgnoresPast(load_torch_export(artifact, device=device))


ensure_exporters_registered()
EXPORT_REGISTRY.register("ignores_past", ignores_past)
RUNTIME_REGISTRY.register("ignores_past", load)


def pytest_unconfigure(config):
    EXPORT_REGISTRY.unregister("ignores_past")
    RUNTIME_REGISTRY.unregister("ignores_past")
"""


def test_through_the_plugin_the_past_ignoring_target_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest(
        "--export-targets=torch_export,ignores_past",
        "--export-checks=generation_parity",
        "--export-models=decoder",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=3, failed=1)  # plugin_loads of both targets, torch_export
    result.stdout.fnmatch_lines(
        [
            "*generation_parity[[]ignores_past-decoder-cpu[]]*",
            "ignores_past: generation logits differ from the eager model at step 1 (decode)*",
            "*check * target*ignores_past*torch_export*",
            "generation_parity * 0/1 F1 * 1/1",
        ]
    )
