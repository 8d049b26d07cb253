"""What both fronts do with pytest: an item's marks and a result as a pytest outcome.

The suite (``pytest --export-*``, :mod:`pytest_exportcheck.session`) and
:func:`~pytest_exportcheck.parametrize_with_checks` plan the same items and run them
through the same :func:`~pytest_exportcheck.run.run_item`; this module is the one
place where such an item gets its pytest marks (``exportcheck``, its check's markers,
a collection-time skip, a strict ``xfail`` naming each expected-failure rule) and
where a :class:`~pytest_exportcheck.checks.CheckResult` becomes a pass, a skip or a
failure. Imports pytest only (no torch, no exportlm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckResult
    from pytest_exportcheck.plan import ItemSpec, XfailBook

__all__ = ["expected_failure", "item_marks", "raise_outcome"]


def expected_failure(item: ItemSpec, book: XfailBook) -> str | None:
    """The reason ``item`` is expected to fail (every rule of ``book`` covering it, each
    with its source), or ``None``."""
    rules = book.match(item.name, item.check, item.column)
    return "; ".join(f"{rule.reason} [{rule.source}]" for rule in rules) or None


def item_marks(item: ItemSpec, expected: str | None) -> list[pytest.MarkDecorator]:
    """``exportcheck``, the check's own markers, the plan's skip, and a strict ``xfail``."""
    marks = [pytest.mark.exportcheck, *(getattr(pytest.mark, m) for m in sorted(item.markers))]
    if item.skip:
        marks.append(pytest.mark.skip(reason=item.skip))
    if expected is not None:
        marks.append(pytest.mark.xfail(reason=expected, strict=True))
    return marks


def raise_outcome(
    result: CheckResult, check: str, failure: Callable[[CheckResult], Exception]
) -> None:
    """Return on a pass; skip with the check's reason; raise ``failure(result)`` on a failure.

    A failure the code under test caused (``result.exception``) is chained to it and
    carries its traceback, so a post-mortem debugger (``--pdb``) starts in the frame
    that raised, not in the plugin's.
    """
    __tracebackhide__ = True
    if result.status == "skip":
        pytest.skip(result.message or f"check {check!r} skipped without a reason")
    if result.status == "fail":
        error = failure(result)
        cause = result.exception
        if cause is None:
            raise error
        raise error.with_traceback(cause.__traceback__) from cause
