"""The worked examples of docs/architecture.md ("How to add a target or an engine") as
a reader would follow them: the blocks marked ``docs-test: file PKG/NAME`` saved, PKG
installed as a distribution with the entry points of its ``pyproject.toml`` block, and
the ``pytest`` command of the section's shell block."""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests._distinfo import make_distribution
from tests._docblocks import ROOT, parse_blocks

__all__ = ["WorkedExample", "worked_example"]

PAGE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class WorkedExample:
    """One section's package: its files (name -> source) and the pytest arguments shown."""

    package: str
    files: dict[str, str]
    pytest_args: list[str]

    def install(self, root: Path, extra: dict[str, str] | None = None) -> Path:
        """Write the package under ``root`` as an installed distribution; returns ``root``.

        ``extra``: files the section names without showing (the engine's worker).
        """
        project = tomllib.loads(self.files["pyproject.toml"])["project"]
        modules = {n: s for n, s in self.files.items() if n.endswith(".py")}
        make_distribution(
            root,
            project["name"],
            project["entry-points"],
            {**modules, **(extra or {})},
            version=project["version"],
        )
        return root


def worked_example(heading: str) -> WorkedExample:
    """The files and the ``pytest`` command of the section under ``### {heading}``."""
    text = PAGE.read_text(encoding="utf-8").splitlines()
    start = text.index(f"### {heading}") + 1
    end = next((i for i in range(start, len(text)) if text[i].startswith("#")), len(text))
    files: dict[str, str] = {}
    command: list[str] = []
    package = ""
    for block in parse_blocks(PAGE):
        if not start < block.line <= end:
            continue
        saved = block.directives().file
        if saved is not None:
            package, name = saved.split("/", 1)
            files[name] = block.source
        elif block.language == "bash":
            command = next(
                shlex.split(line) for line in block.source.splitlines() if line.startswith("pytest")
            )
    if not files or not command:
        raise AssertionError(f"{PAGE.name}, '### {heading}': no files or no pytest command")
    return WorkedExample(package, files, command[1:])
