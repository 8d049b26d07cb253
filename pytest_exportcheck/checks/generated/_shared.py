"""What the generated-structure checks share: the failure, the tally, the budget, the repro.

Internal to :mod:`pytest_exportcheck.checks.generated`.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.core
from hypothesis import seed, settings

from exportlm.models import ModelSpec
from pytest_exportcheck._profiles import HYPOTHESIS_PROFILE
from pytest_exportcheck.checks._api import CheckResult

__all__ = [
    "GENERATED_EXAMPLES",
    "GeneratedFailure",
    "Tally",
    "failure_result",
    "generated_budget",
    "repro_command",
    "run",
    "shared_seed",
    "write_spec",
]

#: Structures drawn per check run (the profile decides whether they are derandomized).
GENERATED_EXAMPLES = 3


class GeneratedFailure(AssertionError):
    """A property failed on one drawn structure; carries the structure for the report.

    ``exception`` is the exception of the code under test behind the failure
    (an export, a runtime, a module exporter), if one was raised.
    """

    def __init__(
        self,
        spec: ModelSpec,
        message: str,
        shape: tuple[int, int] | None = None,
        *,
        exception: BaseException | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.spec = spec
        self.message = message
        self.shape = shape
        self.exception = exception
        self.details = details

    def again(self) -> GeneratedFailure:
        """A fresh exception with the same content (a memoized outcome raised once more)."""
        return GeneratedFailure(
            self.spec, self.message, self.shape, exception=self.exception, **self.details
        )


@dataclass
class Tally:
    """What the drawn examples did (for the result message and the report)."""

    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    shapes: list[list[int]] = field(default_factory=list)
    families: Counter[str] = field(default_factory=Counter)
    vocab_sizes: list[int] = field(default_factory=list)
    claimed: int = 0
    fp8_weights: int = 0
    quantized_models: int = 0
    not_fitting: Counter[str] = field(default_factory=Counter)
    #: recipe -> why it refused the first structure it did not fit (the refusal, as is).
    refusals: dict[str, str] = field(default_factory=dict)


def generated_budget() -> int:
    """Structures a check draws: :data:`GENERATED_EXAMPLES` under exportcheck's own (or
    Hypothesis' ``default`` / ``ci``) profile; under a profile the user chose
    (``--hypothesis-profile``), that profile's ``max_examples``."""
    name = settings.get_current_profile_name()
    if name in ("default", "ci") or name in HYPOTHESIS_PROFILE.values():
        return GENERATED_EXAMPLES
    return int(settings().max_examples)


#: Seed of ``quantized_generated`` in a randomized run: one per process, so every
#: exporter row draws the same structures and shares their (cached) recorded exports.
_PROCESS_SEED = secrets.randbits(64)


def shared_seed(prop: Callable[[], None]) -> Callable[[], None]:
    """``prop`` seeded with :data:`_PROCESS_SEED`, unless derandomized or ``--hypothesis-seed``."""
    if settings().derandomize or getattr(hypothesis.core, "global_force_seed", None) is not None:
        return prop
    seeded: Callable[[], None] = seed(_PROCESS_SEED)(prop)
    return seeded


def run(prop: Callable[[], None]) -> GeneratedFailure | None:
    """Run a Hypothesis property; the (shrunk) failure, or ``None`` when it holds."""
    try:
        prop()
    except GeneratedFailure as failure:
        return failure
    return None


def _safe(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)


def repro_command(
    target: str,
    spec_file: Path,
    out: Path,
    *,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    shapes: Sequence[tuple[int, int]] = (),
) -> str:
    """``exportlm export --target T --model FILE.json --out OUT --verify`` (with ``-o`` /
    ``--seed``, and a ``--verify-shape BxS`` per shape the failure was compared at)."""
    parts = ["exportlm", "export", "--target", target, "--model", str(spec_file)]
    parts += ["--out", str(out)]
    if seed:
        parts += ["--seed", str(seed)]
    for key, value in sorted((options or {}).items()):
        parts += ["-o", f"{key}={value!r}"]
    parts.append("--verify")
    for batch, seq in shapes:
        parts += ["--verify-shape", f"{batch}x{seq}"]
    return shlex.join(parts)


def write_spec(case_workdir: Path, stem: str, spec: ModelSpec) -> Path:
    """Write ``spec`` as JSON to ``<case_workdir>/<stem>.json`` (the name made file-safe)."""
    path = case_workdir / f"{_safe(stem)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def failure_result(
    failure: GeneratedFailure,
    headline: str,
    spec_file: Path,
    command: str | None,
    note: str = "",
) -> CheckResult:
    """The failed result: headline, the failure, the shrunk structure as JSON, the command."""
    lines = [
        headline,
        failure.message,
        f"smallest failing structure (Hypothesis shrank it), written to {spec_file}:",
        failure.spec.to_json().rstrip(),
    ]
    if command is not None:
        lines += ["reproduce outside pytest:", f"  {command}"]
    if note:
        lines.append(note)
    return CheckResult.failed(
        "\n".join(lines),
        spec=failure.spec.to_dict(),
        spec_file=str(spec_file),
        repro=command,
        exception=failure.exception,
        shape=None if failure.shape is None else list(failure.shape),
        **failure.details,
    )
