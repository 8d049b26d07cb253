"""The pytest nodes of the suite: ``exportcheck`` > one collector per check > items.

The suite's root collector is added to the session's own collection (see
:meth:`pytest_exportcheck.session._session.ExportCheckSession.add_to_collection`), so its
items are collected, counted, selected (``-k``, ``-m``, ``--lf``, ``--sw``) and
reported like any test's. Node ids are in :mod:`pytest_exportcheck.plan._nodeids`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_exportcheck.plan._items import ItemSpec
from pytest_exportcheck.plan._nodeids import item_nodeid

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckResult

__all__ = ["CheckCollector", "CheckFailed", "ExportCheckItem", "SuiteCollector"]

#: ``(item) -> None``: runs one item (raises to fail or skip it).
Runner = Callable[["ExportCheckItem"], None]
#: ``(item) -> None``: adds the item's markers (skip, xfail, warning filters...).
Decorator = Callable[["ExportCheckItem"], None]


class CheckFailed(Exception):
    """A check returned a failing :class:`CheckResult`; its text is the item's failure.

    When the check failed because the code under test raised, that exception is
    the ``__cause__`` and this exception carries its traceback, so ``--pdb``
    starts in the frame that raised.
    """

    # Shown as "CheckFailed: <message>" on pytest's FAILED line, the way pytest shows
    # its own pytest.fail() (whose exception class does the same).
    __module__ = "builtins"

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result

    def __str__(self) -> str:
        lines = [self.result.message or "check failed"]
        for key, value in self.result.details.items():
            lines.append(f"  {key}: {value}")
        return "\n".join(lines)


class SuiteCollector(pytest.Collector):
    """The ``exportcheck`` node: one :class:`CheckCollector` per check, in plan order."""

    def __init__(
        self, *, specs: Sequence[ItemSpec], runner: Runner, decorate: Decorator, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.specs = tuple(specs)
        self.runner = runner
        self.decorate = decorate

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        """One collector per check that has items."""
        by_check: dict[str, list[ItemSpec]] = {}
        for spec in self.specs:
            by_check.setdefault(spec.check, []).append(spec)
        return [
            CheckCollector.from_parent(self, name=check, specs=specs)
            for check, specs in by_check.items()
        ]


class CheckCollector(pytest.Collector):
    """``exportcheck::<check>``: the items of one check."""

    def __init__(self, *, specs: Sequence[ItemSpec], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.specs = tuple(specs)

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        """The check's items, with their markers."""
        suite = self.parent
        if not isinstance(suite, SuiteCollector):  # pragma: no cover - built by SuiteCollector
            raise TypeError(f"{self.nodeid} must be a child of the exportcheck collector")
        items: list[pytest.Item | pytest.Collector] = []
        for spec in self.specs:
            # The node id is given as a string: pytest 9 parses it into the same
            # structured id it parses from its cache (--lf, --sw), which it would not
            # derive from a name that holds brackets.
            item = ExportCheckItem.from_parent(
                self,
                name=spec.name,
                nodeid=item_nodeid(spec.check, spec.name),
                spec=spec,
                runner=suite.runner,
            )
            suite.decorate(item)
            items.append(item)
        return items


class ExportCheckItem(pytest.Item):
    """One conformance item; running it hands off to the session's runner."""

    def __init__(self, *, spec: ItemSpec, runner: Runner, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self._runner = runner
        #: The item's JSON-compatible result (status, message, details) once it ran.
        self.result: dict[str, Any] | None = None

    def runtest(self) -> None:
        """Run the check (or report the plugin load failure)."""
        self._runner(self)

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> Any:
        """A check's own message and details, or pytest's traceback for a crash."""
        if isinstance(excinfo.value, CheckFailed):
            # The message only (the check already describes any exception it caught),
            # in pytest's own form, so the FAILED line and xdist carry the message.
            return excinfo.getrepr(style="value", chain=False)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path | str, int | None, str]:
        """Where the check function is defined (shown in failure headers)."""
        where = _check_source(self.spec.check)
        if where is None:
            return self.path, None, self.name
        return Path(where[0]), where[1], self.name


def _check_source(check: str) -> tuple[str, int] | None:
    """``(file, 0-based line)`` of the check's implementation, if it can be found."""
    from pytest_exportcheck.checks import CHECKS

    spec = CHECKS.get(check)
    if spec is None:
        return None
    try:
        fn = spec.fn
        source = inspect.getsourcefile(fn)
        _, line = inspect.getsourcelines(fn)
    except (OSError, TypeError, ImportError, ValueError):
        return None
    return (source, line - 1) if source else None
