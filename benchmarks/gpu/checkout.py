"""Make this checkout usable by a python it is not installed in, without installing anything.

``python checkout.py ROOT DIR``: when this python already finds the ``exportlm``
distribution (``pip install -e .``, e.g. ``.venv``), prints nothing. Otherwise it
writes ``DIR/exportlm-<version>.dist-info`` (``METADATA`` and the entry points of
``ROOT/pyproject.toml``: the ``pytest11`` plugin is registered
through them) and prints the ``PYTHONPATH`` that makes the checkout
importable: ``ROOT/src``, ``ROOT`` (for ``pytest_exportcheck``) and ``DIR``.
The python's own packages (its CUDA torch) stay first on the path. Writes
nothing outside ``DIR``.
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path


def main(root: Path, directory: Path) -> int:
    """Write the metadata when needed; print the PYTHONPATH entries (or nothing)."""
    try:
        importlib.metadata.distribution("exportlm")
        return 0
    except importlib.metadata.PackageNotFoundError:
        pass
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = directory / f"exportlm-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: exportlm\nVersion: {project['version']}\n"
    )
    lines: list[str] = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "top_level.txt").write_text("exportlm\npytest_exportcheck\n")
    print(":".join(str(p) for p in (root / "src", root, directory)))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
