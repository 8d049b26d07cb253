"""Fixtures for the tests of an exportlm plugin: toy models, work directories, single checks.

Registered with the ``exportcheck`` pytest plugin, so they exist wherever
exportlm is installed (``pytest --fixtures`` lists them). Importing this module
imports neither torch nor exportlm: a fixture imports what it needs when a test
uses it, so a project that never uses them pays nothing.

Example::

    def test_my_target_roundtrips(exportcheck_run):
        result = exportcheck_run("roundtrip_logits", target="my_target", model="decoder")
        assert result.status == "pass", result.message
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from torch import nn

    from pytest_exportcheck.checks import CheckResult

__all__ = [
    "CheckRunner",
    "ToyModelFactory",
    "exportcheck_run",
    "exportcheck_toy_model",
    "exportcheck_workdir",
]


class ToyModelFactory(Protocol):
    """What :func:`exportcheck_toy_model` returns."""

    def __call__(self, family: str = "decoder", seed: int = 0, **overrides: Any) -> nn.Module:
        """A toy model of ``family`` (an ``exportlm.models`` name) with seeded weights."""
        ...


class CheckRunner(Protocol):
    """What :func:`exportcheck_run` returns."""

    def __call__(
        self,
        check_id: str,
        *,
        target: str | None = None,
        exporter: str | None = None,
        model: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        goldens_dir: str | Path | None = None,
    ) -> CheckResult:
        """Run ``check_id`` on a target (``name`` or ``name:variant``) or module exporter."""
        ...


@pytest.fixture
def exportcheck_toy_model() -> ToyModelFactory:
    """Build toy models: ``exportcheck_toy_model(family="decoder", seed=0, **overrides)`` -> nn.Module.

    ``family`` is a name of the ``exportlm.models`` registry (built-in or from an
    ``exportlm.models`` entry point); the weights depend only on ``seed``; config
    ``overrides`` the family does not have raise ``UnknownOptionError``. The model
    is in eval mode, on the CPU.
    """

    def build(family: str = "decoder", seed: int = 0, **overrides: Any) -> nn.Module:
        from exportlm.models import build_model

        model: nn.Module = build_model(family, seed=seed, **overrides)
        return model

    return build


@pytest.fixture
def exportcheck_workdir(tmp_path: Path) -> Path:
    """An empty directory for export artifacts, kept with the test's ``tmp_path``."""
    workdir = tmp_path / "exportcheck"
    workdir.mkdir()
    return workdir


@pytest.fixture
def exportcheck_run(tmp_path: Path) -> CheckRunner:
    """Run one check by id, return its CheckResult: ``exportcheck_run("roundtrip_logits", target="onnx", model="decoder")``.

    Takes the arguments of :func:`pytest_exportcheck.api.run_check` and returns
    the check's result (``status`` ``"pass"``, ``"fail"`` or ``"skip"``, ``message``,
    ``details``) without failing or skipping the test. Each call exports into a new
    empty directory under the test's ``tmp_path`` (kept for inspection); nothing
    is cached between calls.
    """
    counter = itertools.count(1)

    def run(
        check_id: str,
        *,
        target: str | None = None,
        exporter: str | None = None,
        model: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        goldens_dir: str | Path | None = None,
    ) -> CheckResult:
        from pytest_exportcheck.api import run_check

        workdir = tmp_path / f"exportcheck-run-{next(counter)}-{check_id}"
        return run_check(
            check_id,
            target=target,
            exporter=exporter,
            model=model,
            device=device,
            seed=seed,
            workdir=workdir,
            goldens_dir=goldens_dir,
        )

    return run
