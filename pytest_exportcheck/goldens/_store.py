"""Golden files on disk: the store and its outcomes (missing / written / match / mismatch).

Internal to :mod:`pytest_exportcheck.goldens`. The store knows nothing of checks:
it returns a :class:`GoldenOutcome`, which the golden checks turn into their
``CheckResult``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from exportlm.atomic import write_text_atomic
from pytest_exportcheck.goldens._diff import golden_diff

__all__ = [
    "GOLDEN_SUFFIX",
    "OBTAINED_SUFFIX",
    "UPDATE_HINT",
    "GoldenOutcome",
    "GoldenStore",
    "dump_golden",
    "write_text_atomic",
]

GOLDEN_SUFFIX = ".json"
OBTAINED_SUFFIX = ".obtained"
UPDATE_HINT = (
    "if the change is intended, run `pytest --export-exporters=<exporter> "
    "--export-update-goldens` and review the diff of the golden before committing it"
)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_MAX_DIFF_LINES = 60


#: What comparing with (or writing) a golden came to.
OutcomeKind = Literal["match", "written", "updated", "missing", "mismatch"]


@dataclass(frozen=True)
class GoldenOutcome:
    """The outcome of :meth:`GoldenStore.check`: its kind, a message and details.

    ``details`` always holds ``goldens`` (the golden paths involved) and, for a
    failed outcome, ``golden`` (and ``obtained``, ``differences`` for a mismatch).
    """

    kind: OutcomeKind
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the data matches its golden, or the golden was written."""
        return self.kind in ("match", "written", "updated")


def dump_golden(data: Mapping[str, Any]) -> str:
    """The canonical text of a golden: JSON, sorted keys, 2-space indent, final newline."""
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


class GoldenStore:
    """Golden files under ``directory``; ``update=True`` rewrites instead of comparing.

    Args:
        directory: where ``<name>.json`` files live (``goldens/`` of the repo, or
            ``--export-goldens-dir``); updates are written here.
        update: ``--export-update-goldens``: write every compared golden and pass.
        fallbacks: read-only directories consulted, in order, for a golden that
            ``directory`` does not have (the goldens of the built-in exporters
            shipped with the package, :data:`BUILTIN_GOLDENS`), so a third-party
            repo with its own ``goldens/`` still checks the built-ins.
        may_update: ``may_update(owner) -> reason or None``: whether an update may
            write a golden of something provided by ``owner`` (a distribution
            name). A reason keeps the golden as it is: it is compared instead,
            and the reason is part of the result. Default: always allowed.

    ``used`` holds every golden path compared or written through this store.
    """

    def __init__(
        self,
        directory: str | Path,
        update: bool = False,
        fallbacks: Sequence[str | Path] = (),
        may_update: Callable[[str | None], str | None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.update = update
        self.fallbacks = tuple(Path(f) for f in fallbacks if Path(f) != Path(directory))
        self.may_update = may_update
        self.used: set[str] = set()

    def __repr__(self) -> str:
        return f"GoldenStore({str(self.directory)!r}, update={self.update})"

    def path(self, name: str) -> Path:
        """The golden file of ``name`` (``a/b`` names live in subdirectories)."""
        if not _NAME.match(name) or ".." in name.split("/"):
            raise ValueError(
                f"invalid golden name {name!r}: use letters, digits, '_', '-', '.' and '/' "
                "separators, without '..' or a leading '/'"
            )
        return self.directory / f"{name}{GOLDEN_SUFFIX}"

    def obtained_path(self, name: str) -> Path:
        """Where a mismatching result of ``name`` is written (``<name>.obtained``)."""
        return self.directory / f"{name}{OBTAINED_SUFFIX}"

    def _existing(self, name: str) -> Path:
        """The golden file to compare with: ``directory``'s, else the first fallback's."""
        golden = self.path(name)
        if golden.exists():
            return golden
        for directory in self.fallbacks:
            candidate = directory / golden.relative_to(self.directory)
            if candidate.exists():
                return candidate
        return golden

    def check(self, name: str, data: Mapping[str, Any], owner: str | None = None) -> GoldenOutcome:
        """Compare ``data`` with the golden ``name``; see the module docstring for outcomes.

        ``owner`` is the distribution that provides what the golden describes
        (for ``may_update``).
        """
        refused = self.may_update(owner) if self.update and self.may_update else None
        if self.update and refused is None:
            return self._write(name, data)
        golden = self._existing(name)
        self.used.add(str(golden))
        obtained = self.obtained_path(name)
        note = f" (not updated: {refused})" if refused else ""
        if not golden.exists():
            return GoldenOutcome(
                "missing",
                f"golden {golden} is missing{note}; to create it, run `pytest "
                "--export-exporters=<exporter> --export-update-goldens` and commit the file",
                {"golden": str(golden), "goldens": [str(golden)]},
            )
        expected = json.loads(golden.read_text(encoding="utf-8"))
        lines = golden_diff(expected, data)
        if not lines:
            if obtained.exists():
                obtained.unlink(missing_ok=True)
            return GoldenOutcome(
                "match", f"matches golden {golden}{note}", {"goldens": [str(golden)]}
            )
        write_text_atomic(obtained, dump_golden(data))
        shown = lines[:_MAX_DIFF_LINES]
        if len(lines) > _MAX_DIFF_LINES:
            shown.append(f"... ({len(lines) - _MAX_DIFF_LINES} more differences)")
        return GoldenOutcome(
            "mismatch",
            f"result differs from golden {golden} in {len(lines)} place(s){note}; obtained "
            f"written to {obtained}; {UPDATE_HINT}\n" + "\n".join(f"  {line}" for line in shown),
            {
                "golden": str(golden),
                "obtained": str(obtained),
                "goldens": [str(golden)],
                "differences": lines[:_MAX_DIFF_LINES],
            },
        )

    def _write(self, name: str, data: Mapping[str, Any]) -> GoldenOutcome:
        golden = self.path(name)
        self.used.add(str(golden))
        existed = golden.exists()
        text = dump_golden(data)
        if not existed or golden.read_text(encoding="utf-8") != text:
            write_text_atomic(golden, text)
        self.obtained_path(name).unlink(missing_ok=True)
        kind: OutcomeKind = "updated" if existed else "written"
        return GoldenOutcome(kind, f"golden {golden} {kind}", {"goldens": [str(golden)]})

    def unused(self, used: Iterable[str]) -> list[Path]:
        """Golden files under ``directory`` that are not in ``used`` (paths), sorted."""
        seen = {str(Path(p)) for p in used}
        return sorted(p for p in self.directory.rglob(f"*{GOLDEN_SUFFIX}") if str(p) not in seen)
