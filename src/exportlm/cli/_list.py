"""``exportlm list``: every registered target, runtime, module exporter, model family,
serving engine, quantization format and recipe."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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
    _print_engines_and_quant(inventory.engines, inventory.quant_formats, inventory.recipes)
    if inventory.failed_plugins:
        print("\nPlugins that failed to load:")
        for failure in inventory.failed_plugins:
            print(f"  {failure['registry']}: {failure['error']}")
    return 0


def _print_engines_and_quant(
    engines: list[dict[str, Any]], formats: list[dict[str, Any]], recipes: list[dict[str, str]]
) -> None:
    if engines:
        print("\nServing engines:")
        rows = [
            (
                e["name"],
                ",".join(e["takes"]) or "-",
                ", ".join(
                    f"{t['dtype']}{'/' + t['scheme'] if t['scheme'] else ''}={t['atol']:g}"
                    for t in e["tolerances"]
                )
                or "-",
                e["provider"],
            )
            for e in engines
        ]
        print_table(("name", "takes", "tolerances", "provided by"), rows)
    if formats:
        print("\nQuantization formats:")
        print_table(("name", "provided by"), [(f["name"], f["provider"]) for f in formats])
    if recipes:
        print("\nRecipes:")
        print_table(
            ("name", "format", "kind", "provided by"),
            [(r["name"], r["format"], r["kind"], r["provider"]) for r in recipes],
        )


def print_table(header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (under ``header``, if any) in left-aligned columns, indented by two spaces."""
    lines = [header, *rows] if header is not None else list(rows)
    if not lines:
        return
    widths = [max(len(str(c)) for c in col) for col in zip(*lines)]
    for row in lines:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
