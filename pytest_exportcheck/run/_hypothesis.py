"""The Hypothesis profiles exportcheck items run under (:data:`~pytest_exportcheck.HYPOTHESIS_PROFILE`).

Imported only once the suite is active; it imports Hypothesis.

Shrinking is bounded in time: every shrink step of a generated-structure check
builds, exports and runs a model (seconds each), and Hypothesis' own bound is
five minutes (``MAX_SHRINKING_SECONDS`` of its engine, not a setting); measured
on 2 cores, a ``roundtrip_generated`` failure shrank for 70-133 s. While an item
runs under an exportcheck profile, the bound is :data:`SHRINK_BUDGET_SECONDS`
(``EXPORTCHECK_SHRINK_SECONDS`` overrides it); the steps in flight finish, so the
whole shrink ends about one export later. The failure is reported with the
smallest structure found by then.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_exportcheck._profiles import HYPOTHESIS_PROFILE

__all__ = ["SHRINK_BUDGET_SECONDS", "hypothesis_profile", "in_ci", "register_profiles"]

#: How long Hypothesis may shrink one failing exportcheck item (seconds).
SHRINK_BUDGET_SECONDS = 15.0
_SHRINK_ENV = "EXPORTCHECK_SHRINK_SECONDS"


def register_profiles() -> None:
    """Register ``exportcheck-dev`` and ``exportcheck-ci`` (:data:`HYPOTHESIS_PROFILE`).

    Both: ``deadline=None`` (exports take seconds), a fixed ``max_examples``, the
    ``too_slow`` / ``data_too_large`` health checks off, ``print_blob`` and
    ``database=None``, so a conformance run never writes a ``.hypothesis/``
    directory into the user's repository. The CI profile is also derandomized:
    every CI run draws the same examples.
    """
    from hypothesis import HealthCheck, settings

    common: dict[str, Any] = {
        "deadline": None,
        "max_examples": 10,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
        "print_blob": True,
        "database": None,
    }
    settings.register_profile(HYPOTHESIS_PROFILE["dev"], **common)
    settings.register_profile(HYPOTHESIS_PROFILE["ci"], derandomize=True, **common)


def in_ci() -> bool:
    """Whether the ``CI`` environment variable is set (to anything but ``""``, ``0``, ``false``, ``no``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _load_ours(before: str) -> None:
    """Load the exportcheck profile that fits: CI's unless ``--hypothesis-seed`` was given."""
    import hypothesis.core
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument

    seeded = getattr(hypothesis.core, "global_force_seed", None) is not None
    ci = in_ci() or before == "ci"
    name = HYPOTHESIS_PROFILE["ci" if ci and not seeded else "dev"]
    try:
        settings.get_profile(name)
    except InvalidArgument:  # not registered yet (the session registers them)
        register_profiles()
    settings.load_profile(name)


def shrink_budget() -> float:
    """:data:`SHRINK_BUDGET_SECONDS`, or the positive number ``EXPORTCHECK_SHRINK_SECONDS`` holds."""
    raw = os.environ.get(_SHRINK_ENV, "").strip()
    try:
        value = float(raw) if raw else SHRINK_BUDGET_SECONDS
    except ValueError:
        value = SHRINK_BUDGET_SECONDS
    return value if value > 0 else SHRINK_BUDGET_SECONDS


@contextlib.contextmanager
def _bounded_shrinking(seconds: float) -> Iterator[None]:
    """Hypothesis' engine stops shrinking after ``seconds`` (its module bound, restored after)."""
    from hypothesis.internal.conjecture import engine

    engine_module: Any = engine
    before = getattr(engine_module, "MAX_SHRINKING_SECONDS", None)
    if before is None:  # a Hypothesis without the bound: shrink as it does
        yield
        return
    engine_module.MAX_SHRINKING_SECONDS = min(before, seconds)
    report = getattr(engine_module, "report", None)
    if callable(report):
        engine_module.report = _budget_report(report, seconds)
    try:
        yield
    finally:
        engine_module.MAX_SHRINKING_SECONDS = before
        if callable(report):
            engine_module.report = report


def _budget_report(report: Any, seconds: float) -> Any:
    """``report`` with Hypothesis' "five minutes" warning replaced by the budget that stopped it.

    Hypothesis says it spent "more than five minutes" and that a rerun resumes
    shrinking; under the budget neither is true (exportcheck profiles keep no
    database), so the message says what happened and how to shrink longer.
    """

    def budget_report(text: str) -> None:
        if "five minutes working to shrink" not in str(text):
            report(text)
            return
        report(
            f"exportcheck: shrinking stopped after its budget of {seconds:g} s "
            f"({_SHRINK_ENV}); the failure below is the smallest structure found by then. "
            f"Set {_SHRINK_ENV}=<seconds> to shrink longer."
        )

    return budget_report


@contextlib.contextmanager
def hypothesis_profile() -> Iterator[None]:
    """Run under an exportcheck profile unless the user loaded one (--hypothesis-profile).

    ``exportcheck-ci`` when the ``CI`` environment variable is set (or Hypothesis
    loaded its own ``ci`` profile, which it does on CI), else ``exportcheck-dev``.
    A ``--hypothesis-seed`` wins over CI's derandomization (Hypothesis would
    ignore the seed of a derandomized run), so that seed picks the examples under
    the dev profile. A profile the user chose stays as it is.

    Whenever the active settings have no database, Hypothesis' storage (its
    cache of source constants, written whatever the database) goes to a
    directory under the system's temporary directory instead of ``.hypothesis/``
    in the current directory, unless ``HYPOTHESIS_STORAGE_DIRECTORY`` is set.
    """
    import hypothesis.configuration
    from hypothesis import settings

    before = settings.get_current_profile_name()
    ours = before in ("default", "ci")
    if ours:
        _load_ours(before)
    configuration: Any = hypothesis.configuration
    home_attr = "__hypothesis_home_directory"  # a module global: no name mangling
    home = getattr(configuration, home_attr, None)
    redirect = settings().database is None and not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY")
    if redirect:
        scratch = Path(tempfile.gettempdir()) / "exportcheck-hypothesis"
        configuration.set_hypothesis_home_dir(scratch)
    bounded = _bounded_shrinking(shrink_budget()) if ours else contextlib.nullcontext()
    try:
        with bounded:
            yield
    finally:
        if redirect:
            configuration.set_hypothesis_home_dir(home)
        if ours:
            settings.load_profile(before)
