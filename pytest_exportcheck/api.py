"""The conformance checks as parameters of a test in your own module.

``pytest --export-targets=...`` runs the suite with no test file. To keep the
checks of your target or module exporter next to your other tests instead
(selectable with ``-k``, ``-m exportcheck``, rerunnable by node id), parametrize
one test with :func:`parametrize_with_checks`::

    from pytest_exportcheck import parametrize_with_checks

    @parametrize_with_checks(targets=["my_target"], models=["decoder"])
    def test_conformance(check, tmp_path):
        check(tmp_path)

Each parameter is an :class:`ExportCheck`; calling it runs one conformance item
and fails the test with the check's own message (:class:`CheckFailedError`, an
``AssertionError``) or skips it with the reason the check or the plan gives.
:func:`run_check` runs one check by id and returns its
:class:`~pytest_exportcheck.checks.CheckResult`.

Importing this module imports neither torch nor exportlm; both are imported when
a decorator is built or a check runs.
"""

from __future__ import annotations

import contextlib
import functools
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_exportcheck._outcome import expected_failure, item_marks, raise_outcome

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckResult, Registries
    from pytest_exportcheck.plan import CaseOptions
    from pytest_exportcheck.plan._items import ItemSpec

__all__ = ["CheckFailedError", "ExportCheck", "parametrize_with_checks", "run_check"]

#: A name selection: ``"all"``, one registry name, or several.
Names = str | Iterable[str]
#: ``expected_failed_checks(target_or_exporter_name) -> {check id or item-id pattern: reason}``.
ExpectedFailures = Callable[[str], Mapping[str, str]]


class CheckFailedError(AssertionError):
    """A conformance check failed; the message is the check's own, with its details.

    ``result`` is the failing :class:`~pytest_exportcheck.checks.CheckResult`. When
    the check failed because the code under test raised, that exception is chained
    as ``__cause__`` (shown in the traceback).
    """

    def __init__(self, name: str, result: CheckResult) -> None:
        lines = [f"{name}: {result.message or 'check failed'}"]
        lines += [f"  {key}: {value}" for key, value in result.details.items()]
        super().__init__("\n".join(lines))
        self.result = result


@dataclass(frozen=True)
class ExportCheck:
    """One conformance item, ready to run: what :func:`parametrize_with_checks` passes.

    Attributes:
        item: the planned item (check id, target or exporter, model, device, and a
            capability-gap ``skip`` reason or a plugin ``failure`` text).
        seed: seed of the toy models.
        models: the selected model families (exporter checks survey these); empty: all.
        goldens_dir: directory of the golden files, or ``None`` (the goldens shipped
            with pytest-exportcheck for the built-in exporters).
        expected_failure: the reason the item is marked as an expected failure, or ``None``.
        registries: the registries its check reads (``case.services.registries``), or
            ``None``: the process's.
    """

    item: ItemSpec
    seed: int = 0
    models: tuple[str, ...] = ()
    goldens_dir: Path | None = None
    expected_failure: str | None = None
    registries: Registries | None = None

    @property
    def id(self) -> str:
        """The parameter id: ``<check>-<target>-<model>-<device>`` (``roundtrip_logits-onnx-decoder-cpu``)."""
        return "-".join((self.item.check, *self.item.params))

    @property
    def name(self) -> str:
        """The id the ``pytest --export-*`` suite gives this item: ``roundtrip_logits[onnx-decoder-cpu]``."""
        return self.item.name

    def __repr__(self) -> str:
        return f"ExportCheck({self.name})"

    @property
    def options(self) -> CaseOptions:
        """The typed options its check sees (``case.options``), as the suite builds them."""
        from pytest_exportcheck.plan import case_options

        return case_options(self.models, self.item.device, expected_failure=self.expected_failure)

    def result(self, workdir: str | Path | None = None) -> CheckResult:
        """Run the check and return its result, without pytest's pass / fail / skip.

        ``workdir``: where the check writes its artifacts. Used as is when it is empty
        (e.g. the test's ``tmp_path``), else a new subdirectory of it. ``None``: a
        temporary directory, removed afterwards.
        """
        from pytest_exportcheck.checks import CheckResult

        if self.item.skip:
            return CheckResult.skipped(self.item.skip)
        with _fresh_workdir(workdir, self.id) as directory:
            return _execute(self, directory)

    def run(self, workdir: str | Path | None = None) -> CheckResult:
        """Run the check as a test: raise :class:`CheckFailedError` on failure, skip on a gap.

        Returns the passing result. ``workdir`` as in :meth:`result`.
        """
        __tracebackhide__ = True
        result = self.result(workdir)
        raise_outcome(result, self.item.check, functools.partial(CheckFailedError, self.name))
        return result

    def __call__(self, workdir: str | Path | None = None) -> CheckResult:
        """Same as :meth:`run`."""
        __tracebackhide__ = True
        return self.run(workdir)


def parametrize_with_checks(
    *,
    targets: Names = (),
    exporters: Names = (),
    models: Names = "all",
    checks: Names | None = None,
    device: str = "cpu",
    seed: int = 0,
    expected_failed_checks: ExpectedFailures | None = None,
    goldens_dir: str | Path | None = None,
    catalogue: int | None = None,
    registries: Registries | None = None,
) -> pytest.MarkDecorator:
    """A ``pytest.mark.parametrize`` over the argument ``check``: one :class:`ExportCheck` per item.

    The items are those ``pytest --export-targets=... --export-exporters=...`` runs
    for the same selection, in the same order, including the ``plugin_loads`` item
    of each target row; a cell the row's declarations exclude (a capability it does not
    declare: docs/checks.md, "Cells that cannot apply") is no parameter, as in the suite.
    Every parameter carries the ``exportcheck`` marker (and the check's own markers,
    e.g. ``hypothesis``); its id is ``<check>-<params>``, so a node id reads
    ``test_mine.py::test_conformance[roundtrip_logits-onnx-decoder-cpu]``.

    Args:
        targets: export targets by registry name, ``"all"``, or none.
        exporters: module exporters by registry name, ``"all"``, or none.
        models: toy model families (``exportlm.models``) of the per-model checks.
        checks: check ids (``docs/checks.md``); ``None``: every check.
        device: ``"cpu"`` or ``"cuda"`` (skipped when CUDA is not available).
        seed: seed of the toy models.
        expected_failed_checks: ``name -> {check id or item-id pattern: reason}``,
            called once per selected target and exporter. Patterns are matched
            against the suite's item id (``roundtrip_logits[onnx-*]``), as in
            ``TargetInfo.expected_failures``; those declared by the targets and
            exporters themselves apply too. Each becomes a strict ``xfail``: an
            item that passes fails the run. An entry that matches no item warns.
        goldens_dir: where the golden files of the ``golden_*`` checks live (e.g.
            ``Path(__file__).parent / "goldens"``); goldens missing there are read
            from those shipped for the built-in exporters. This API compares only:
            create or update goldens with ``pytest --export-update-goldens``.
        catalogue: the catalogue version the plugin conforms to (as the ini key
            ``exportcheck_catalogue``): only the checks and toy families of that
            version or older are parametrized; ``None``: the current version.
        registries: the registries to plan from and check against
            (:class:`~pytest_exportcheck.checks.Registries`), e.g. one whose
            ``targets`` hold only your own; ``None``: the process's
            (``Registries.installed()``). Every check reads only these.

    Each call of a check exports afresh into its own empty directory: unlike the
    ``pytest --export-*`` suite, no artifact is shared between checks or cached
    between runs. An unknown name raises
    :class:`~exportlm.errors.UnknownNameError` listing the available ones, so a
    typo is a collection error of the test module.
    """
    from pytest_exportcheck.checks import CHECKS
    from pytest_exportcheck.plan import discover, plan
    from pytest_exportcheck.plan._api_request import ApiSelection, api_planner, expected_failures

    planner = api_planner(discover(registries), CHECKS, catalogue)
    selection = ApiSelection.resolve(planner, targets, exporters, models, checks, device)
    book = expected_failures(planner, selection, expected_failed_checks)
    params = []
    for item in plan(selection.plan):
        reason = expected_failure(item, book)
        models = () if selection.models.all else selection.plan.models
        check = ExportCheck(item, seed, models, _path(goldens_dir), reason, registries)
        params.append(pytest.param(check, id=check.id, marks=item_marks(item, reason)))
    return pytest.mark.parametrize("check", params)


def run_check(
    check_id: str,
    *,
    target: str | None = None,
    exporter: str | None = None,
    model: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    workdir: str | Path | None = None,
    goldens_dir: str | Path | None = None,
    catalogue: int | None = None,
    registries: Registries | None = None,
) -> CheckResult:
    """Run one check by id against one target or module exporter; return its result.

    ``target`` is a registry name (the target's default options) or
    ``name:variant`` (a declared variant's options). ``model`` is the toy family
    of a per-model check (required for those); for an exporter check it limits
    the families it surveys. A check that cannot apply (a capability the target does
    not declare: the suite plans no item of it) is a ``skip`` result
    ``not applicable: <reason>``; expected failures are not applied. ``workdir`` and ``goldens_dir`` as
    in :meth:`ExportCheck.result` and :func:`parametrize_with_checks`; under a pinned
    ``catalogue``, a check or family added after it raises
    :class:`~exportlm.errors.UnknownNameError` naming the version that added it.
    ``registries`` as in :func:`parametrize_with_checks`.
    """
    from pytest_exportcheck.checks import CHECKS
    from pytest_exportcheck.plan import discover
    from pytest_exportcheck.plan._api_request import api_planner, single_item

    planner = api_planner(discover(registries), CHECKS, catalogue)
    item = single_item(
        planner, check_id, target=target, exporter=exporter, model=model, device=device
    )
    models = (model,) if model else ()
    check = ExportCheck(item, seed, models, _path(goldens_dir), registries=registries)
    return check.result(workdir)


# ----------------------------------------------------------------------------- running


@contextlib.contextmanager
def _fresh_workdir(parent: str | Path | None, label: str) -> Iterator[Path]:
    """An empty directory: ``parent`` if empty, else a new one inside it; or a temporary one."""
    if parent is None:
        with tempfile.TemporaryDirectory(prefix="exportcheck-", ignore_cleanup_errors=True) as tmp:
            yield Path(tmp)
        return
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    if not any(parent.iterdir()):
        yield parent
        return
    slug = re.sub(r"\W", "_", label)[:40]
    yield Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=parent))


def _execute(check: ExportCheck, workdir: Path) -> CheckResult:
    """Run the item through the engine the suite runs it with, exporting afresh into ``workdir``."""
    from pytest_exportcheck.goldens import BUILTIN_GOLDENS, GoldenStore
    from pytest_exportcheck.plan import discover
    from pytest_exportcheck.run import RunServices, run_item

    goldens = GoldenStore(check.goldens_dir or workdir / "goldens", fallbacks=(BUILTIN_GOLDENS,))
    discovery = discover(check.registries)
    services = RunServices(discovery, lambda _name: workdir, goldens, seed=check.seed)
    return run_item(check.item, services, check.options)


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
