"""The fenced blocks of the documentation and the rules tests/test_docs.py runs them by.

See tests/test_docs.py for the rules; this module only reads pages and compares text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = frozenset({"python", "bash", "sh", "console"})
_FENCE = re.compile(r"^ {0,3}(```+)\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s)\b")


@dataclass(frozen=True)
class Directives:
    """What the ``docs-test`` comments above a block ask for."""

    skip: str | None = None
    output: bool = False
    file: str | None = None

    @classmethod
    def parse(cls, bodies: list[str], where: str) -> Directives:
        """Read ``skip (reason)``, ``output`` and ``file PATH``; ``ValueError`` otherwise."""
        found = cls()
        for body in bodies:
            skip = re.fullmatch(r"skip\s*(?:\((?P<reason>.*)\))?", body)
            file = re.fullmatch(r"file\s+(?P<path>\S+)", body)
            if body == "output":
                found = cls(found.skip, True, found.file)
            elif skip and (skip["reason"] or "").strip():
                found = cls(skip["reason"].strip(), found.output, found.file)
            elif skip:
                raise ValueError(
                    f"{where}: 'docs-test: {body}' gives no reason; write "
                    "'<!-- docs-test: skip (why this block cannot run here) -->'"
                )
            elif file:
                found = cls(found.skip, found.output, file["path"])
            else:
                raise ValueError(
                    f"{where}: unknown directive 'docs-test: {body}'; "
                    "expected 'skip (reason)', 'output' or 'file PATH'"
                )
        return found


@dataclass
class Block:
    """One fenced block of a page: where it is, what it holds and its directives."""

    page: Path
    line: int  # line of the first code line, 1-based
    language: str
    source: str
    comments: list[str] = field(default_factory=list)
    expected: str | None = None  # the ```text block right after it, if any

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page.as_posix()}:{self.line}"

    def directives(self) -> Directives:
        return Directives.parse(self.comments, self.id)

    def is_item(self) -> bool:
        """A block of a language that runs, unless it is only a file to save."""
        try:
            saved = self.directives().file is not None
        except ValueError:
            saved = False  # its item reports the bad directive
        return self.language in RUN_LANGUAGES and not saved


def pages() -> list[Path]:
    """The documentation pages whose blocks are run, in a stable order."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += sorted((ROOT / "examples").glob("*/README.md"))
    return [page for page in found if page.is_file()]


def parse_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` with the ``docs-test`` comments right above it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: list[str] = []
    previous_close = -2  # index of the closing fence of the previous block
    index = 0
    while index < len(lines):
        directive = _DIRECTIVE.match(lines[index])
        fence = _FENCE.match(lines[index])
        if directive:
            pending.append(directive["body"])
        elif fence:
            end = index + 1
            while end < len(lines) and not lines[end].strip().startswith(fence[1]):
                end += 1
            body = "\n".join(lines[index + 1 : end]) + "\n"
            adjacent = all(not line.strip() for line in lines[previous_close + 1 : index])
            if fence[2] == "text" and blocks and adjacent:
                blocks[-1].expected = body
            blocks.append(Block(page, index + 2, fence[2].lower(), body, pending))
            pending, previous_close, index = [], end, end
        elif lines[index].strip():
            pending = []
        index += 1
    return blocks


# ---------------------------------------------------------------------------------------
# sample output


def normalise(text: str, workdir: Path) -> list[str]:
    """Lines of ``text`` without colours, trailing spaces, the workdir or durations."""
    text = _ANSI.sub("", text).replace(str(workdir), "<tmp>")
    lines = [_DURATION.sub("<t>", line.rstrip()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` fits ``expected``, where ``...`` is a wildcard (see module doc)."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(matches(rest, actual[start:]) for start in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(part) for part in head.split("..."))
    return re.fullmatch(pattern, actual[0]) is not None and matches(rest, actual[1:])


def shell_commands(block: Block) -> list[tuple[str, str]]:
    """``(command, sample output)`` pairs of a shell or console block."""
    commands: list[tuple[str, list[str]]] = []
    continued = False
    for line in block.source.splitlines():
        if continued:
            commands[-1] = (commands[-1][0] + "\n" + line, commands[-1][1])
        elif block.language == "console" and not line.startswith("$ "):
            if commands:
                commands[-1][1].append(line)
            continue
        elif line.strip() and not line.lstrip().startswith("#"):
            commands.append((line.removeprefix("$ "), []))
        continued = line.rstrip().endswith("\\")
    return [(command, "\n".join(sample)) for command, sample in commands]
