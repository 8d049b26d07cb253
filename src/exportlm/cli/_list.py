"""``exportlm list``: every registered target, runtime, module exporter and model family."""

from __future__ import annotations

import json
from collections.abc import Sequence

from exportlm.cli._inventory import collect_inventory

__all__ = ["cmd_list", "print_table"]


def cmd_list(as_json: bool) -> int:
    """Print the inventory as tables, or as one JSON object with ``--json``."""
    inventory = collect_inventory()
    if as_json:
        print(json.dumps(inventory.to_json(), indent=2))
        return 0
    print("Export targets:")
    rows = [
        (
            t["name"],
            t["runtime"] + ("" if t["runtime_available"] else " (missing!)"),
            t["artifact"],
            ",".join(t["capabilities"]) or "-",
            f"atol={t['atol']:g} rtol={t['rtol']:g}",
            t["provider"],
        )
        for t in inventory.targets
    ]
    print_table(("name", "runtime", "artifact", "capabilities", "tolerance", "provided by"), rows)
    print("\nRuntimes:")
    print_table(("name", "provided by"), [(r["name"], r["provider"]) for r in inventory.runtimes])
    if inventory.module_exporters:
        print("\nModule exporters (match order):")
        print_table(
            ("name", "keys", "provided by"),
            [(e["name"], e["keys"], e["provider"]) for e in inventory.module_exporters],
        )
    if inventory.models:
        print("\nModel families:")
        print_table(("name", "provided by"), [(m["name"], m["provider"]) for m in inventory.models])
    if inventory.failed_plugins:
        print("\nPlugins that failed to load:")
        for failure in inventory.failed_plugins:
            print(f"  {failure['registry']}: {failure['error']}")
    return 0


def print_table(header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (under ``header``, if any) in left-aligned columns, indented by two spaces."""
    lines = [header, *rows] if header is not None else list(rows)
    if not lines:
        return
    widths = [max(len(str(c)) for c in col) for col in zip(*lines)]
    for row in lines:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
