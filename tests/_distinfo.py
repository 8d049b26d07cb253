"""Build real ``*.dist-info`` plugin distributions on disk for entry-point tests."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path


def make_distribution(
    root: Path,
    name: str,
    entry_points: Mapping[str, Mapping[str, str]],
    modules: Mapping[str, str] | None = None,
    version: str = "1.0",
) -> Path:
    """Write a distribution ``name`` (METADATA + entry_points.txt) and its modules under ``root``.

    ``entry_points`` maps group -> {name: "module:attr"}; ``modules`` maps a module
    file name (``"plug.py"``) to its source. Put ``root`` on ``sys.path`` (or
    PYTHONPATH) and ``importlib.metadata`` finds it like an installed package.
    """
    root.mkdir(parents=True, exist_ok=True)
    dist = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines: list[str] = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines.extend(f"{ep} = {value}" for ep, value in eps.items())
        lines.append("")
    (dist / "entry_points.txt").write_text("\n".join(lines))
    for filename, source in (modules or {}).items():
        (root / filename).write_text(textwrap.dedent(source))
    return dist
