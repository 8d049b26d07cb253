"""The check catalogue: one ordered source of truth, importable without torch or Hypothesis."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_exportcheck.checks import (
    CHECKS,
    CatalogueError,
    CheckResult,
    CheckSpec,
    UnknownCheckError,
    get_check,
)
from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "checks.md"
HYPOTHESIS_CHECKS = {"roundtrip_generated", "quantized_generated"}


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (this process has torch and its checks loaded)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n", 1)[0].split())


# ----------------------------------------------------------------------------- no torch needed


def test_catalogue_and_planner_import_without_torch_or_hypothesis() -> None:
    """``None`` in ``sys.modules`` makes any import of torch / Hypothesis raise ImportError."""
    proc = _run_python(
        """
        import sys
        for name in ("torch", "hypothesis", "numpy", "transformers"):
            sys.modules[name] = None
        import pytest_exportcheck.checks.catalogue
        import pytest_exportcheck.plan._items
        from pytest_exportcheck.checks import CHECKS, CheckResult, get_check
        import pytest_exportcheck.goldens
        spec = get_check("roundtrip_generated")
        print(len(CHECKS), spec.scope, sorted(spec.markers), CheckResult.failed("x").status)
        try:
            spec.fn
        except ImportError:
            print("fn needs torch")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [
        f"{len(BUILTIN_CHECKS)} target ['hypothesis'] fail",
        "fn needs torch",
    ]


# ----------------------------------------------------------------------------- one source of truth


def test_the_catalogue_is_in_the_order_of_the_documentation() -> None:
    rows = re.findall(r"^\| `(\w+)` \|", DOCS.read_text(encoding="utf-8"), flags=re.MULTILINE)
    documented = [row for row in rows if row in CHECKS]
    assert documented == [spec.id for spec in BUILTIN_CHECKS]
    assert list(CHECKS)[: len(BUILTIN_CHECKS)] == documented


@pytest.mark.parametrize("spec", BUILTIN_CHECKS, ids=lambda spec: spec.id)
def test_every_entry_resolves_to_its_decorated_function(spec: CheckSpec) -> None:
    fn = spec.fn
    assert inspect.isfunction(fn)
    assert spec.impl == f"{fn.__module__}:{fn.__qualname__}"
    assert spec.doc, f"{spec.id} has no docstring"
    assert spec.summary == _first_paragraph(spec.doc)
    assert list(inspect.signature(fn).parameters) == ["case"]


def test_only_the_hypothesis_driven_checks_carry_the_hypothesis_marker() -> None:
    marked = {spec.id for spec in CHECKS.values() if "hypothesis" in spec.markers}
    assert marked == HYPOTHESIS_CHECKS
    assert all(spec.markers <= {"hypothesis", "cuda"} for spec in BUILTIN_CHECKS)
    assert {spec.id for spec in BUILTIN_CHECKS if "cuda" in spec.markers} == {"fp8_gemm"}


def test_unknown_check_id_lists_the_known_ones() -> None:
    with pytest.raises(UnknownCheckError, match=r"unknown check 'nope'; known: .*roundtrip_logits"):
        get_check("nope")


def test_invalid_declarations_are_refused() -> None:
    with pytest.raises(CatalogueError, match="scope 'model' is not one of"):
        CheckSpec("x", "model", "a.b:c")  # type: ignore[arg-type]
    with pytest.raises(CatalogueError, match=r"not of the form 'package\.module:function'"):
        CheckSpec("x", "target", "a.b.c")
    with pytest.raises(CatalogueError, match="per_model=True needs scope='target'"):
        CheckSpec("x", "exporter", "a.b:c", per_model=True)
    with pytest.raises(CatalogueError, match="has no function 'nothing_here'"):
        CheckSpec("x", "target", "pytest_exportcheck.checks.catalogue:nothing_here").fn  # noqa: B018


# ----------------------------------------------------------------------------- registering


def test_register_check_appends_and_refuses_a_taken_id() -> None:
    """In a fresh interpreter: registering changes the process-wide mapping."""
    proc = _run_python(
        """
        from pytest_exportcheck.checks import (
            CHECKS, CatalogueError, CheckResult, CheckSpec, check, register_check,
        )

        @check("third_party_probe", scope="target", needs=("kv_cache",))
        def third_party_probe(case):
            '''Probes nothing.

            Details that are not part of the summary.'''
            return CheckResult.passed()

        spec = CHECKS["third_party_probe"]
        assert list(CHECKS)[-1] == "third_party_probe"
        assert spec.fn is third_party_probe and spec.needs == {"kv_cache"}
        assert spec.summary == "Probes nothing."
        assert register_check(spec) is spec  # the same spec again: a no-op
        refused = []
        for attempt in (
            lambda: register_check(CheckSpec("roundtrip_logits", "target", third_party_probe)),
            lambda: check("third_party_probe", scope="target")(lambda case: None),
            lambda: check("new_probe")(third_party_probe),
            lambda: check("roundtrip_logits", scope="target")(third_party_probe),
            lambda: check("roundtrip_logits")(third_party_probe),
        ):
            try:
                attempt()
            except CatalogueError as err:
                refused.append(str(err).split(":")[0])
        print(len(refused))
        print("\\n".join(refused))
        """
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "5", proc.stdout
    assert lines[1:] == [
        "check id 'roundtrip_logits' is already registered (implementation "
        "pytest_exportcheck.checks.targets.roundtrip",
        "check id 'third_party_probe' is already registered (implementation __main__",
        "@check('new_probe') on __main__",
        "@check('roundtrip_logits', ...) on __main__",
        "@check('roundtrip_logits') decorates __main__",
    ]


# ----------------------------------------------------------------------------- results


def test_a_result_exception_is_not_part_of_equality_or_repr() -> None:
    err = RuntimeError("raised by the factory")
    failed = CheckResult.failed("export raised", exception=err, error="RuntimeError")
    assert failed.exception is err
    assert failed == CheckResult.failed("export raised", error="RuntimeError")
    assert "raised by the factory" not in repr(failed)
    assert CheckResult.passed().exception is None
