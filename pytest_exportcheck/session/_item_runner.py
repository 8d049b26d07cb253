"""The suite's side of running an item: :func:`~pytest_exportcheck.run.run_item` as a pytest outcome.

:class:`SuiteRunner` is what every :class:`~pytest_exportcheck.session.nodes._nodes.ExportCheckItem`
hands off to. It builds the process's :class:`~pytest_exportcheck.run.RunServices`
(cached exports, the run's golden store, pytest's temporary directories), gives
each item its typed :class:`~pytest_exportcheck.plan.CaseOptions`, records the
item's result and time profile, and turns the result into pytest's outcome: a
skip, or :class:`~pytest_exportcheck.session.nodes._nodes.CheckFailed` raised with the
traceback of the exception the code under test raised (when the check caught
one), so ``--pdb`` starts in the frame that raised.
"""

from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck._outcome import raise_outcome
from pytest_exportcheck.checks import CheckResult
from pytest_exportcheck.plan import CaseOptions, Discovery, case_options
from pytest_exportcheck.run import SEED, CachedExports, RunServices, check_services, run_item
from pytest_exportcheck.session.environment._golden_setup import golden_store
from pytest_exportcheck.session.environment._scratch import Scratch
from pytest_exportcheck.session.nodes._nodes import CheckFailed, ExportCheckItem
from pytest_exportcheck.session.options._options import Options
from pytest_exportcheck.session.reporting._report import jsonable

__all__ = ["SuiteRunner"]


class SuiteRunner:
    """Runs the suite's items of one pytest process through the one engine."""

    def __init__(
        self,
        config: pytest.Config,
        options: Options,
        discovery: Discovery,
        *,
        cross_run: bool = True,
    ) -> None:
        self.config = config
        #: False: no cross-run artifact cache or failure memo (the run signs with its own key).
        self.cross_run = cross_run
        self.options = options
        self.discovery = discovery
        self.scratch = Scratch(config)
        #: node id -> the time profile of the item that ran (``ItemProfile.as_json``).
        self.profiles: dict[str, dict[str, Any]] = {}

    @cached_property
    def services(self) -> RunServices:
        """The process's services (built on first use: pytest's temp dirs exist by then)."""
        checks = check_services(self.discovery)  # the registries discovery read, once
        exports = CachedExports(
            self.discovery,
            checks,
            lambda: self.scratch.mktemp("exportcheck-artifacts"),
            self._cache_root,
            seed=SEED,
        )
        return RunServices(
            self.discovery, self.scratch.mktemp, self.goldens, checks, exports=exports
        )

    @cached_property
    def goldens(self) -> Any:
        """The golden store handed to every case."""
        return golden_store(self.config, self.options, self.discovery.golden_dirs)

    def _cache_root(self) -> Path | None:
        """``<pytest cache>/exportcheck``; ``None`` under --export-no-cache or no cacheprovider."""
        cache = getattr(self.config, "cache", None)  # absent under -p no:cacheprovider
        if cache is None or self.options.no_cache or not self.cross_run:
            return None
        return Path(cache.mkdir("exportcheck"))

    def case_options(self, item: pytest.Item) -> CaseOptions:
        """The typed options the item's check sees."""
        spec = getattr(item, "spec", None)
        return case_options(
            str(self.options.models),
            None if spec is None else spec.device,
            require_device=self.options.require_device,
            expected_failure=_xfail_reason(item),
            engines=self.options.engines,
            require_engines=self.options.require_engines,
            quantize=self.options.quantize,
        )

    def __call__(self, item: ExportCheckItem) -> None:
        """Run ``item`` and record its time profile (also when it skips or fails)."""
        services = self.services
        profile = services.checks.begin_item()
        start = time.perf_counter()
        try:
            result = run_item(item.spec, services, self.case_options(item))
        finally:
            self.profiles[item.nodeid] = profile.as_json(time.perf_counter() - start)
        _outcome(item, result)

    def close(self) -> None:
        """Remove what this run created outside pytest's temporary directory, if anything."""
        self.scratch.close()


def _outcome(item: ExportCheckItem, result: CheckResult) -> None:
    """Record ``result`` on the item; skip or fail the item as it says (as the API does)."""
    item.result = {
        "status": result.status,
        "message": result.message,
        "details": jsonable(dict(result.details)),
    }
    raise_outcome(result, item.spec.check, CheckFailed)


def _xfail_reason(item: pytest.Item) -> str | None:
    """The reason of the item's expected-failure mark, if it has one."""
    marker = item.get_closest_marker("xfail")
    return None if marker is None else str(marker.kwargs.get("reason", "expected failure"))
