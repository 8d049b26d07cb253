"""The tree keeps the rules docs/architecture.md states: sizes, import layering, one room per concern."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "src" / "exportlm", ROOT / "pytest_exportcheck")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
#: A function longer than MAX_FUNCTION_LINES starts its body with this comment, and a reason.
SIZE_WAIVER = "# size:"

#: room -> the exportlm rooms it may import (besides itself). A room is
#: ``exportlm.<first component>``; ``exportlm`` is the facade (``__init__``).
ALLOWED: dict[str, set[str]] = {
    "exportlm.errors": set(),
    "exportlm.atomic": {"exportlm.errors"},
    "exportlm.registry": {"exportlm.errors"},
    "exportlm.inputs": {"exportlm.errors"},
    "exportlm._progress": set(),
    "exportlm.safeio": {"exportlm.errors"},
    "exportlm.hfdir": {"exportlm.errors", "exportlm.safeio"},
    "exportlm.calibration": {
        "exportlm.errors",
        "exportlm._progress",
        "exportlm.safeio",
        "exportlm.hfdir",
    },
    "exportlm.quant": {"exportlm.errors", "exportlm.registry", "exportlm.inputs"},
    "exportlm.models": {"exportlm.errors", "exportlm.registry"},
    "exportlm.module_exporters": {"exportlm.errors", "exportlm.registry", "exportlm.quant"},
    "exportlm.modules": {"exportlm.module_exporters"},  # deprecated alias, removed in 0.3
    "exportlm.export": {
        "exportlm",  # __version__ for the producer field of checkpoint configs
        "exportlm.atomic",
        "exportlm.errors",
        "exportlm.safeio",
        "exportlm.registry",
        "exportlm.inputs",
        "exportlm.quant",
        "exportlm.module_exporters",
        "exportlm._progress",
        "exportlm.hfdir",  # the hf_checkpoint loader reads untrusted configs through it
        "exportlm.inspection",  # ... and validates headers with the inspector's own rules
    },
    "exportlm.inspection": {
        "exportlm.errors",
        "exportlm.quant",
        "exportlm.safeio",
        "exportlm.hfdir",
    },
    "exportlm.engines": {"exportlm.errors", "exportlm.registry", "exportlm.hfdir"},
    "exportlm.inventory": {
        "exportlm.registry",
        "exportlm.export",
        "exportlm.models",
        "exportlm.module_exporters",
    },
}


def _python_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "src" if path.is_relative_to(ROOT / "src") else ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _imports(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_scan_sees_the_whole_tree() -> None:
    names = {_module_name(p) for p in _python_files()}
    assert {"exportlm.export.targets", "pytest_exportcheck.plugin"} <= names
    assert len(names) > 80


def test_no_module_exceeds_the_size_limit() -> None:
    offenders = {
        str(p.relative_to(ROOT)): n
        for p in _python_files()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them): {offenders}"


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]  # the docstring does not count
    assert fn.end_lineno is not None
    return fn.end_lineno - body[0].lineno + 1


def test_no_function_exceeds_the_size_limit_without_a_stated_reason() -> None:
    offenders: dict[str, int] = {}
    for path in _python_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (n := _body_lines(node)) <= MAX_FUNCTION_LINES:
                continue
            head = lines[node.lineno : node.body[0].lineno + 2]
            if not any(line.strip().startswith(SIZE_WAIVER) for line in head):
                offenders[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not offenders, (
        f"functions over {MAX_FUNCTION_LINES} lines without a '{SIZE_WAIVER} <reason>' "
        f"comment at the top of their body: {offenders}"
    )


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    found: dict[str, set[str]] = {}
    for path in _python_files():
        module = _module_name(path)
        if _room(module) != room:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for imported in _imports(tree):
            if imported.split(".")[0] not in {"exportlm", "pytest_exportcheck"}:
                continue
            target = _room(imported)
            if target != room and target not in ALLOWED[room]:
                found.setdefault(module, set()).add(imported)
    assert not found, f"{room} may import only {sorted(ALLOWED[room])}; found {found}"


def test_the_library_never_imports_the_plugin() -> None:
    offenders = [
        _module_name(p)
        for p in _python_files()
        if _module_name(p).startswith("exportlm")
        and any(i.startswith("pytest_exportcheck") for i in _imports(ast.parse(p.read_text())))
    ]
    assert not offenders


def test_every_room_is_described_in_the_architecture_doc() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rooms = {p.name for p in (ROOT / "src" / "exportlm").iterdir() if not p.name.startswith("__")}
    rooms |= {p.name for p in (ROOT / "src" / "exportlm" / "export").iterdir()}
    rooms = {r for r in rooms if (r.endswith(".py") or "." not in r) and r != "__pycache__"}
    rooms -= {"py.typed", "__init__.py"}
    rooms = {r for r in rooms if not r.startswith("_")}
    missing = sorted(r for r in rooms if r.removesuffix(".py") not in text)
    assert not missing, f"docs/architecture.md does not mention {missing}"
