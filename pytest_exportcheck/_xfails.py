"""Expected failures: rules from target declarations, module exporters and an xfails file.

A rule is ``pattern -> reason``. A pattern is either a bare check id
(``"roundtrip_logits"``: every item of that check) or a pattern over the full item
id (``"roundtrip_logits[torchscript:script-*]"``), where ``*`` and ``?`` are the only
wildcards and brackets are literal. Rules declared by a target or exporter apply
to that target's or exporter's items only; rules of the xfails file apply to all.

The xfails file is JSON: one object ``{pattern: reason}`` (reasons are non-empty
strings). JSON keeps the plugin free of a YAML/TOML dependency on Python 3.10.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

__all__ = ["XfailBook", "XfailRule", "load_xfails_file"]


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

    def match(self, item_id: str, check: str, row: str) -> list[XfailRule]:
        """Every rule covering the item."""
        return [r for r in self.rules if r.matches(item_id, check, row)]

    def unmatched(self, universe: Iterable[tuple[str, str, str]]) -> list[XfailRule]:
        """Rules matching none of ``universe`` (``(item_id, check, row)`` triples)."""
        candidates = list(universe)
        return [r for r in self.rules if not any(r.matches(*c) for c in candidates)]


def load_xfails_file(path: Path) -> dict[str, str]:
    """Read a JSON xfails file ``{pattern: reason}``; a malformed file is a usage error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise pytest.UsageError(f"--export-xfails-file: {path} does not exist") from err
    except (OSError, json.JSONDecodeError) as err:
        raise pytest.UsageError(
            f"--export-xfails-file: cannot read {path} as JSON ({err}); expected an object "
            '{"<check id or item id pattern>": "<reason>"}'
        ) from err
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in data.items()
    ):
        raise pytest.UsageError(
            f"--export-xfails-file: {path} must hold one JSON object mapping patterns to "
            'non-empty reason strings, e.g. {"roundtrip_logits[mytarget-*]": "known fp16 drift"}'
        )
    return {str(k): str(v) for k, v in data.items()}
