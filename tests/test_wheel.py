"""``.ci/wheel_contents.py``, the gate of ``make test-wheel``, refuses what is not a wheel's.

``make test-wheel`` runs it in ``.venv-wheel`` against the installed wheel. Here it
runs against this checkout (an editable install or ``PYTHONPATH``), which it must
refuse: that is exactly the copy a wheel test must not pick up. The goldens it is
given on stdin are compared with the ones the package carries, by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "wheel_contents.py"


def _checkout_goldens() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "goldens").rglob("*.json"))


def _run(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def test_the_checkout_is_not_taken_for_the_wheel() -> None:
    done = _run("\n".join(_checkout_goldens()) + "\n")
    assert done.returncode == 1
    assert f"wheel: exportlm {ROOT / 'src' / 'exportlm' / '__init__.py'}" in done.stdout
    assert "wheel: exportlm is imported from" in done.stderr
    assert "missing from the wheel" not in done.stderr  # the package's goldens are the repo's


def test_a_golden_the_package_lacks_is_named() -> None:
    listed = [*_checkout_goldens(), "goldens/checkpoint/new_case/quant_linear.json"]
    done = _run("\n".join(listed) + "\n")
    assert done.returncode == 1
    assert "missing from the wheel: goldens/checkpoint/new_case/quant_linear.json" in done.stderr
    assert f"{len(listed) - 1} golden JSON file(s) shipped, {len(listed)} in the checkout" in (
        done.stdout
    )
