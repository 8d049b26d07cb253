"""The machinery every check shares: stopping with a result, failure text, signatures.

Internal to :mod:`pytest_exportcheck.checks` (a documented internal module: the
implementation modules import from here, never each other's private names). It
imports neither torch nor Hypothesis.

A check body is a plain function decorated with :func:`aborts_to_result`; a
helper deep inside it stops the check by raising :class:`CheckAbort` with a
ready :class:`CheckResult`. :func:`attempt` runs a call into the code under test
and turns its exception into such a failure, carrying the exception
(``CheckResult.exception``) so that ``--pdb`` lands in the author's frame.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_exportcheck.checks._api import CheckResult

if TYPE_CHECKING:
    from pytest_exportcheck.goldens import GoldenOutcome

__all__ = [
    "CheckAbort",
    "aborts_to_result",
    "attempt",
    "error_text",
    "golden_result",
    "listed",
]

T = TypeVar("T")
C = TypeVar("C")

_TRACEBACK_LINES = 12
_MAX_LISTED = 8


class CheckAbort(Exception):
    """Raised inside a check to stop it with a ready :class:`CheckResult`."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result


def error_text(err: BaseException) -> str:
    """``Type: message`` plus the last lines of the traceback (the cause chain included)."""
    lines = "".join(traceback.format_exception(err)).rstrip().splitlines()
    tail = "\n".join(lines[-_TRACEBACK_LINES:])
    return f"{type(err).__name__}: {err}\n{tail}"


def attempt(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; an exception fails the check with ``what`` and the error.

    The failure carries the exception (``CheckResult.exception``) and its type
    name (``details["error"]``).
    """
    try:
        return fn(*args, **kwargs)
    except CheckAbort:
        raise
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(
                f"{what} raised {error_text(err)}", exception=err, error=type(err).__name__
            )
        ) from err


def aborts_to_result(fn: Callable[[C], CheckResult]) -> Callable[[C], CheckResult]:
    """Decorate a check body so a :class:`CheckAbort` anywhere in it becomes its result."""

    @functools.wraps(fn)
    def wrapper(case: C) -> CheckResult:
        try:
            return fn(case)
        except CheckAbort as abort:
            return abort.result

    return wrapper


def listed(items: Iterable[str]) -> str:
    """The first few ``items`` joined by ``"; "``, and how many more there are."""
    items = list(items)
    text = "; ".join(items[:_MAX_LISTED])
    return text + (f"; ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def golden_result(outcome: GoldenOutcome) -> CheckResult:
    """The check result of a golden store's outcome: passed when it matched or was written."""
    if outcome.ok:
        return CheckResult.passed(outcome.message, **outcome.details)
    return CheckResult.failed(outcome.message, **outcome.details)
