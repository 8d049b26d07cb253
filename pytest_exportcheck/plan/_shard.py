"""``--export-shard=K/N``: a deterministic split of the planned items into N shards.

Pure (standard library only). Items are split by *group*, never one by one: a
target's items of one model family (its per-family checks share one exported
artifact per family, so a group keeps its cache hits in one job), a target's
items without a family, and each module exporter's items. Groups are balanced by
a stable weight, the sum of a static cost per item (its check's ``CheckSpec.cost``,
carried as ``ItemSpec.cost``; 0 for an item skipped at collection), never by measured time, so every
job (and every xdist worker of a job) computes the same split from the plan
alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_exportcheck.plan._items import ItemSpec

__all__ = ["Group", "Shard", "assign", "group_of", "in_shard"]

#: ``(scope, target or exporter, model family or "")``.
Group = tuple[str, str, str]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"K/N"`` with ``1 <= K <= N``; anything else raises :class:`ValueError`."""
        index, sep, count = str(text).strip().partition("/")
        try:
            shard = cls(int(index), int(count)) if sep else None
        except ValueError:
            shard = None
        if shard is None or not 1 <= shard.index <= shard.count:
            raise ValueError(
                f"--export-shard: expected K/N with 1 <= K <= N (e.g. 1/2), got {text!r}"
            )
        return shard

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def group_of(spec: ItemSpec) -> Group:
    """The group of an item: target and family, target alone, or the exporter."""
    if spec.scope == "exporter":
        return ("exporter", spec.exporter or spec.column, "")
    return (spec.scope, spec.target or spec.column, spec.model or "")


def _cost(spec: ItemSpec) -> int:
    return 0 if spec.skip else spec.cost


def assign(specs: Iterable[ItemSpec], count: int) -> dict[Group, int]:
    """Every group -> its shard (1-based): heaviest group first onto the lightest shard."""
    weights: dict[Group, int] = {}
    for spec in specs:
        group = group_of(spec)
        weights[group] = weights.get(group, 0) + _cost(spec)
    loads = [0] * count
    out: dict[Group, int] = {}
    for group in sorted(weights, key=lambda g: (-weights[g], g)):
        shard = min(range(count), key=lambda i: (loads[i], i))
        loads[shard] += weights[group]
        out[group] = shard + 1
    return out


def in_shard(specs: Sequence[ItemSpec], shard: Shard) -> list[ItemSpec]:
    """The items of ``specs`` that shard ``shard`` runs, in their order."""
    groups = assign(specs, shard.count)
    return [s for s in specs if groups[group_of(s)] == shard.index]
