"""Expected failures: rules from target declarations, module exporters, family causes and an xfails file.

A model family's ``FailureCause`` records (what in its forward defeats which
captures) are crossed with every target row's ``TargetInfo.capture``: a row that
captures the model a way a cause names gets that family's items of the cause's
checks as expected failures, with the family's reason (:func:`cause_rules`).

A rule is ``pattern -> reason``. A pattern is either a bare check id
(``"roundtrip_logits"``: every item of that check) or a pattern over the full item
id (``"roundtrip_logits[torchscript:script-*]"``), where ``*`` and ``?`` are the only
wildcards and brackets are literal. Rules declared by a target or exporter apply
to that target's or exporter's items only; rules of the xfails file apply to all.

The xfails file (``--export-xfails-file``) takes either of two formats:

- pytest node ids, one per line, as printed on a FAILED line, with an optional
  reason after ``#``; blank lines and lines starting with ``#`` are ignored::

      # known gaps of our runtime
      exportcheck::roundtrip_logits::roundtrip_logits[mytarget-llama-cpu]  # fp16 drift
      exportcheck::dynamic_shapes[mytarget-*]
      exportcheck::cache_wrapper                                           # every item

  (a line may also be a bare pattern as above, e.g. ``roundtrip_logits[mytarget-*]``);
- JSON: one object ``{pattern: reason}`` (reasons are non-empty strings).

The file must be a regular file of at most :data:`MAX_XFAILS_BYTES`: a FIFO, a
device or a directory is a usage error before anything is read (a FIFO would
block the run), and so is JSON nested too deeply to parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck.plan._nodeids import ROOT, item_id_of

__all__ = [
    "MAX_XFAILS_BYTES",
    "XfailBook",
    "XfailRule",
    "cause_rules",
    "declared_book",
    "load_xfails_file",
]

#: The largest xfails file read (a list of every item of a large matrix is far smaller).
MAX_XFAILS_BYTES = 16 * 1024 * 1024

_OPTION = "--export-xfails-file"
_PATTERN = re.compile(r"[\w*?]+(\[[^\[\]\s]+\])?\Z")


@dataclass(frozen=True)
class XfailRule:
    """One expected failure: a pattern, its reason, who declared it and its scope.

    ``scope`` is the matrix row (target id, ``target`` for every variant of it,
    or exporter name) the rule is limited to, or ``None`` for every item.
    """

    pattern: str
    reason: str
    source: str
    scope: str | None = None

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        body = re.escape(self.pattern).replace(r"\*", ".*").replace(r"\?", ".")
        return re.compile(body + r"\Z")

    def matches(self, item_id: str, check: str, row: str) -> bool:
        """Whether this rule covers the item ``item_id`` (of ``check``, in matrix row ``row``)."""
        if self.scope is not None and self.scope != row and self.scope != row.split(":", 1)[0]:
            return False
        if "[" not in self.pattern:
            return self._regex.match(check) is not None
        return self._regex.match(item_id) is not None


class XfailBook:
    """All rules of a run; tracks which ones matched an item."""

    def __init__(self, rules: Iterable[XfailRule] = ()) -> None:
        self.rules = list(rules)

    def add(self, declared: Mapping[str, str], *, source: str, scope: str | None) -> None:
        """Add ``{pattern: reason}`` rules from ``source`` limited to ``scope``."""
        for pattern, reason in sorted(declared.items()):
            self.rules.append(XfailRule(str(pattern), str(reason), source, scope))

    def extend(self, rules: Iterable[XfailRule]) -> None:
        """Add rules as they are (e.g. those of :func:`load_xfails_file`)."""
        self.rules.extend(rules)

    def match(self, item_id: str, check: str, row: str) -> list[XfailRule]:
        """Every rule covering the item."""
        return [r for r in self.rules if r.matches(item_id, check, row)]

    def unmatched(self, universe: Iterable[tuple[str, str, str]]) -> list[XfailRule]:
        """Rules matching none of ``universe`` (``(item_id, check, row)`` triples)."""
        candidates = list(universe)
        return [r for r in self.rules if not any(r.matches(*c) for c in candidates)]


def declared_book(
    targets: Mapping[str, Any],
    exporters: Mapping[str, Any],
    models: Mapping[str, Mapping[str, str]],
    causes: Mapping[str, Iterable[Any]] | None = None,
    checks: Collection[str] | None = None,
) -> XfailBook:
    """The expected failures the code under test declares about itself.

    ``targets``: name -> ``TargetInfo`` (its ``expected_failures`` apply to that
    target's rows); ``exporters``: name -> module exporter (its optional
    ``expected_failures`` attribute applies to that exporter's rows); ``models``:
    family name -> the family's declared ``{pattern: reason}`` (the patterns name
    the family, so they apply to every row); ``causes``: family name -> its
    ``FailureCause`` records, crossed with each target row's capture
    (:func:`cause_rules`, limited to the check ids ``checks`` when given). The
    suite's planner and :func:`pytest_exportcheck.parametrize_with_checks` both
    build their book here.

    Raises:
        TypeError: an exporter's ``expected_failures`` is not a mapping.
    """
    book = XfailBook()
    for name, info in targets.items():
        book.add(info.expected_failures, source=f"TargetInfo of {name!r}", scope=name)
    for name, exporter in exporters.items():
        declared = getattr(exporter, "expected_failures", None) or {}
        if not isinstance(declared, Mapping):
            raise TypeError(
                f"module exporter {name!r}: expected_failures must be a mapping "
                f"{{check id or item id pattern: reason}}, got {type(declared).__name__}"
            )
        book.add(declared, source=f"module exporter {name!r}", scope=name)
    for name, declared in models.items():
        book.add(declared, source=f"model family {name!r}", scope=None)
    book.extend(cause_rules(targets, causes or {}, checks))
    return book


def cause_rules(
    targets: Mapping[str, Any],
    causes: Mapping[str, Iterable[Any]],
    checks: Collection[str] | None = None,
) -> list[XfailRule]:
    """Expected failures of (family cause x target capture), one rule per row, check and family.

    For each row (``target`` or ``target:variant``) whose ``TargetInfo.capture_of``
    is one of a cause's ``captures``: ``check[<row>-<family>-*]`` for the cause's
    per-model ``checks`` and ``check[<row>-*]`` for its ``shared_checks``. The
    reason names the cause and the capture; a row with no declared capture
    inherits nothing.
    """
    rules: list[XfailRule] = []
    for name, info in sorted(targets.items()):
        for variant in sorted(getattr(info, "variants", None) or {}) or [None]:
            capture_of = getattr(info, "capture_of", None)
            capture = capture_of(variant) if capture_of is not None else ""
            if not capture:
                continue
            row = f"{name}:{variant}" if variant else name
            for family, declared in sorted(causes.items()):
                for cause in declared:
                    if capture in cause.captures:
                        rules += _rules_of(cause, family, row, capture, checks)
    return rules


def _rules_of(
    cause: Any, family: str, row: str, capture: str, checks: Collection[str] | None
) -> list[XfailRule]:
    reason = f"{cause.cause} (fails under {capture} capture): {cause.reason}"
    source = f"model family {family!r}, cause x capture of {row!r}"
    patterns = [f"{c}[{row}-{family}-*]" for c in cause.checks]
    patterns += [f"{c}[{row}-*]" for c in cause.shared_checks]
    return [
        XfailRule(p, reason, source, scope=row)
        for p in patterns
        if checks is None or p.partition("[")[0] in checks
    ]


def load_xfails_file(path: Path) -> list[XfailRule]:
    """The rules of an xfails file (node-id lines or JSON); a bad file is a usage error."""
    from exportlm.safeio import read_regular_bytes

    try:
        raw = read_regular_bytes(path, what="xfails file", max_bytes=MAX_XFAILS_BYTES)
    except FileNotFoundError as err:
        raise pytest.UsageError(f"{_OPTION}: {path} does not exist") from err
    except (OSError, ValueError) as err:  # a FIFO, device or directory; too large; unreadable
        raise pytest.UsageError(f"{_OPTION}: cannot read {path}: {err}") from err
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise pytest.UsageError(
            f"{_OPTION}: {path}, line {line}: not UTF-8 text ({err.reason} at byte "
            f"{err.start}); save the file as UTF-8"
        ) from err
    if text.lstrip()[:1] in ("{", "["):
        return _json_rules(path, text)
    return _line_rules(path, text)


def _json_rules(path: Path, text: str) -> list[XfailRule]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise pytest.UsageError(
            f"{_OPTION}: {path}, line {err.lineno}: not valid JSON ({err.msg}, column "
            f'{err.colno}); expected an object {{"<check id or item id pattern>": "<reason>"}} '
            "or one node id per line"
        ) from err
    except RecursionError as err:
        raise pytest.UsageError(
            f"{_OPTION}: {path} holds JSON nested too deeply to parse; expected one flat "
            'object {"<check id or item id pattern>": "<reason>"} or one node id per line'
        ) from err
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in data.items()
    ):
        raise pytest.UsageError(
            f"{_OPTION}: {path} must hold one JSON object mapping patterns to "
            'non-empty reason strings, e.g. {"roundtrip_logits[mytarget-*]": "known fp16 drift"}'
        )
    return [XfailRule(k, v, str(path)) for k, v in sorted(data.items())]


def _line_rules(path: Path, text: str) -> list[XfailRule]:
    rules: list[XfailRule] = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry, _, comment = line.partition("#")
        entry = entry.strip()
        if not entry:
            continue
        where = f"{path}:{number}"
        pattern = _pattern_of(entry)
        if pattern is None:
            raise pytest.UsageError(
                f"{_OPTION}: {path}, line {number}: {entry!r} is not an exportcheck node id; "
                f"expected one per line, as printed on a FAILED line (e.g. "
                f"{ROOT}::roundtrip_logits::roundtrip_logits[mytarget-llama-cpu]  # reason), "
                f"{ROOT}::<check>, or a pattern such as roundtrip_logits[mytarget-*]"
            )
        rules.append(XfailRule(pattern, comment.strip() or "listed without a reason", where))
    return rules


def _pattern_of(entry: str) -> str | None:
    """The rule pattern a line names: an item id (pattern) or a bare check id."""
    if entry.startswith(f"{ROOT}::"):
        parts = entry.split("::")
        if len(parts) == 2 and parts[1].isidentifier():
            return parts[1]
        return item_id_of(entry)
    return entry if _PATTERN.match(entry) else None
