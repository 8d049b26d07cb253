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
    "exportlm._version": set(),
    "exportlm._libraries": set(),  # the libraries whose versions matter: stdlib only
    "exportlm.atomic": {"exportlm.errors"},
    "exportlm.registry": {"exportlm.errors"},
    "exportlm.inputs": {"exportlm.errors"},
    "exportlm._progress": set(),
    "exportlm._matrix": {"exportlm._report_schema"},  # the report matrix and merge: stdlib only
    "exportlm._report_schema": set(),  # what a report must hold to be merged: stdlib only
    "exportlm._report_html": {"exportlm._matrix"},  # the report as HTML / SVG: stdlib only
    "exportlm._transformers_model": set(),  # is this a transformers model? stdlib only
    "exportlm.safeio": {"exportlm.errors"},
    "exportlm.hfdir": {"exportlm.errors", "exportlm.safeio"},
    "exportlm.tokenizer_checks": set(),  # a tokenizer's JSON files, its chat templates
    # a model directory from elsewhere held to its config before anything is built
    "exportlm.source_config": {
        "exportlm.errors",
        "exportlm.hfdir",
        "exportlm.checkpoint",
        "exportlm.inspection",
    },
    # the one reader of a checkpoint's quantization configs: standard library + the floor
    "exportlm.checkpoint": {"exportlm.errors", "exportlm.hfdir"},
    "exportlm.calibration": {
        "exportlm.errors",
        "exportlm._progress",
        "exportlm.safeio",
        "exportlm.hfdir",
    },
    "exportlm.quant": {"exportlm.errors", "exportlm.registry", "exportlm.inputs"},
    "exportlm.models": {
        "exportlm.errors",
        "exportlm.registry",
        "exportlm._transformers_model",
        "exportlm.hfdir",  # a user's model directory as a family (models/directory.py) is vetted
        "exportlm.checkpoint",  # ... and refused when it holds a quantized checkpoint
        "exportlm.source_config",  # ... or a config its weights do not back
    },
    "exportlm.module_exporters": {"exportlm.errors", "exportlm.registry", "exportlm.quant"},
    "exportlm.modules": {"exportlm.module_exporters"},  # deprecated alias, removed in 0.3
    "exportlm.export": {
        "exportlm._libraries",  # the versions a manifest records
        "exportlm._version",  # __version__ for the producer field of checkpoint configs
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
        "exportlm._transformers_model",
        "exportlm.checkpoint",  # the loader reads the quantization configs through it
        "exportlm.tokenizer_checks",  # a tokenizer that would not load or chat
        "exportlm.source_config",  # a model directory's config, before it is built
    },
    "exportlm.inspection": {
        "exportlm.errors",
        "exportlm.quant",
        "exportlm.safeio",
        "exportlm.hfdir",
        "exportlm.checkpoint",  # inspect's rules judge the declaration the reader builds
        "exportlm.tokenizer_checks",  # chat-template-invalid, a tokenizer's unreadable JSON
    },
    "exportlm.engines": {
        "exportlm.errors",
        "exportlm.registry",
        "exportlm.hfdir",
        "exportlm.checkpoint",  # a checkpoint's layout and scheme, for the support tables
    },
    "exportlm.stream": {  # layer-by-layer export: the export core's public pieces, driven per layer
        "exportlm._progress",
        "exportlm._version",
        "exportlm.atomic",
        "exportlm.errors",
        "exportlm.export",
        "exportlm.hfdir",
        "exportlm.inputs",
        "exportlm.inspection",  # the shards' headers, validated as the loader does
        "exportlm.module_exporters",
        "exportlm.quant",
        "exportlm.safeio",  # the work area's files opened without following links or blocking
    },
    "exportlm.inventory": {
        "exportlm.registry",
        "exportlm.export",
        "exportlm.models",
        "exportlm.module_exporters",
        "exportlm.engines",  # the engine registry: engines are in the inventory
        "exportlm.quant",  # the quantization formats (and the recipes they hold)
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


# ----------------------------------------------------------------------------- file cycles

#: Import circles between files that are known and owned elsewhere; each is one strongly
#: connected component of the file graph, by module name. The test fails when one is
#: gone or has changed (update or remove it here), so this list only ever shrinks.
KNOWN_LIBRARY_CYCLES: list[frozenset[str]] = []

#: The same for the plugin (none left).
KNOWN_PLUGIN_CYCLES: list[frozenset[str]] = []


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, in functions too; ``if TYPE_CHECKING:`` bodies skipped."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _runtime_imports_of(other)
            continue
        yield from _runtime_imports_of(child)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _runtime_imports(node)


def _imported_files(
    module: str, node: ast.Import | ast.ImportFrom, files: set[str], packages: set[str]
) -> Iterator[str]:
    """The files (module names in ``files``) an import statement in ``module`` reads.

    Relative imports are resolved; ``from pkg import name`` is ``pkg.name`` when that is
    a module, else ``pkg`` itself; a module outside ``files`` counts as its nearest
    enclosing one in ``files`` (none for another distribution).
    """
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if module in packages else module.split(".")[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    for name in names:
        while name and name not in files:
            name = name.rpartition(".")[0]
        if name and name != module:
            yield name


def _file_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in _python_files()}
    files = set(paths)
    packages = {m for m, p in paths.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[module] = {
            f
            for node in _runtime_imports(tree)
            for f in _imported_files(module, node, files, packages)
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _one_circle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest circle through the first file of ``component``, for the message."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return [start]  # pragma: no cover - a component always closes


def _describe(graph: dict[str, set[str]], cycles: list[frozenset[str]]) -> str:
    return "\n".join(
        f"  {len(c)} files {sorted(c)}\n    e.g. {' -> '.join(_one_circle(graph, c))}"
        for c in sorted(cycles, key=sorted)
    )


def test_the_file_cycle_finder_finds_circles_and_ignores_type_checking() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]
    assert _one_circle(graph, frozenset({"a", "b", "c"})) == ["a", "b", "c", "a"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import hidden\n"
        "def f():\n    from . import sub, name\n"
    )
    imported = {
        f
        for node in _runtime_imports(tree)
        for f in _imported_files(
            "pkg.mod", node, {"pkg", "pkg.mod", "pkg.sub", "pkg.hidden"}, {"pkg"}
        )
    }
    assert imported == {"pkg", "pkg.sub"}  # the function's import counts, TYPE_CHECKING's not


@pytest.mark.parametrize(
    ("package", "known"),
    [("exportlm", KNOWN_LIBRARY_CYCLES), ("pytest_exportcheck", KNOWN_PLUGIN_CYCLES)],
)
def test_no_import_circle_between_files(package: str, known: list[frozenset[str]]) -> None:
    graph = _file_graph()
    found = [c for c in _cycles(graph) if min(c).split(".")[0] == package]
    new = [c for c in found if c not in known]
    stale = [c for c in known if c not in found]
    assert not new, (
        f"import circles between files of {package} (imports inside functions count; "
        f"only `if TYPE_CHECKING:` blocks are exempt):\n{_describe(graph, new)}"
    )
    assert not stale, (
        f"known circles of {package} that are gone or changed; update the allowlist:\n"
        + "\n".join(f"  {sorted(c)}" for c in stale)
    )


# ----------------------------------------------------------------------------- the plugin's layers

#: part of the plugin -> the parts of it that it must not import (anywhere, lazily too).
#: ``pytest_exportcheck`` is the package face (``__init__``), not the whole package.
PLUGIN_FORBIDDEN: dict[str, set[str]] = {
    "pytest_exportcheck.plan": {
        "pytest_exportcheck.run",
        "pytest_exportcheck.session",
        "pytest_exportcheck.plugin",
    },
    "pytest_exportcheck.run": {"pytest_exportcheck.session", "pytest_exportcheck.plugin"},
    "pytest_exportcheck.checks": {
        "pytest_exportcheck",
        "pytest_exportcheck.plan",
        "pytest_exportcheck.session",
        "pytest_exportcheck.plugin",
    },
    "pytest_exportcheck.goldens": {
        "pytest_exportcheck",
        "pytest_exportcheck.plan",
        "pytest_exportcheck.session",
        "pytest_exportcheck.plugin",
    },
}
#: What the plan package must not import when it is imported (function bodies and
#: ``if TYPE_CHECKING:`` blocks aside): it is pure, so the plugin stays light while passive.
PLAN_HEAVY = ("torch", "exportlm", "hypothesis", "numpy", "transformers")


def _forbidden_part(imported: str, forbidden: set[str]) -> str | None:
    for part in forbidden:
        if part == "pytest_exportcheck":
            if imported == part:
                return part
        elif imported == part or imported.startswith(part + "."):
            return part
    return None


@pytest.mark.parametrize("part", sorted(PLUGIN_FORBIDDEN))
def test_the_plugin_keeps_its_layers(part: str) -> None:
    found: dict[str, set[str]] = {}
    for path in _python_files():
        module = _module_name(path)
        if module != part and not module.startswith(part + "."):
            continue
        for imported in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if _forbidden_part(imported, PLUGIN_FORBIDDEN[part]):
                found.setdefault(module, set()).add(imported)
    assert not found, f"{part} must not import {sorted(PLUGIN_FORBIDDEN[part])}; found {found}"


def _module_level_imports(tree: ast.Module) -> Iterator[str]:
    """Imports run when the module is imported: not in functions, not under TYPE_CHECKING."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _imports(node)
            continue
        stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))


def test_the_plan_package_is_pure_at_import() -> None:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "pytest_exportcheck" / "plan").glob("*.py")):
        for imported in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if imported.split(".")[0] in PLAN_HEAVY:
                found.setdefault(path.name, set()).add(imported)
    assert not found, f"pytest_exportcheck.plan imports at import time: {found}"


def _keys_naming(node: ast.Dict, names: set[str]) -> list[str]:
    """The keys of a dict literal that are one of ``names`` or a tuple starting with one."""
    found = []
    for key in node.keys:
        first = key.elts[0] if isinstance(key, ast.Tuple) and key.elts else key
        if isinstance(first, ast.Constant) and first.value in names:
            found.append(ast.unparse(key))
    return found


def test_no_side_table_keyed_by_an_engine_name_or_a_file_suffix() -> None:
    """Engine facts live on the Engine record (tolerances included), and engine tables
    match on what a target declares its artifact is, never on a suffix (issue 40)."""
    from exportlm.engines import builtin_engines

    names = {e.name for e in builtin_engines()} | {".onnx", "directory"}
    offenders: dict[str, list[str]] = {}
    for folder in (ROOT / "src" / "exportlm" / "engines", ROOT / "pytest_exportcheck"):
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Dict) and (keys := _keys_naming(node, names)):
                    offenders.setdefault(str(path.relative_to(ROOT)), []).extend(keys)
    assert not offenders, f"side tables keyed by engine name or suffix: {offenders}"


#: The one verifier of logits roundtrips (docs/architecture.md, "Rules the tree keeps").
VERIFIER = "exportlm.export.roundtrip"


def _verifier_calls(tree: ast.AST) -> list[str]:
    """What in ``tree`` only the verifier does: calling the comparison primitive
    (``compare_logits``) or running the eager reference (``ExportCacheWrapper(model)(ids)``,
    through any ``.eval()`` / ``.to()`` chain)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "compare_logits") or (
            isinstance(func, ast.Attribute) and func.attr == "compare_logits"
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
            continue
        while (
            isinstance(func, ast.Call)
            and isinstance(func.func, ast.Attribute)
            and func.func.attr in {"eval", "to"}
        ):
            func = func.func.value
        if (
            isinstance(func, ast.Call)
            and isinstance(func.func, ast.Name | ast.Attribute)
            and ast.unparse(func.func).endswith("ExportCacheWrapper")
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_verifier_scan_finds_a_comparison_and_an_eager_run() -> None:
    planted = ast.parse(
        "r = compare_logits(a, b, 1e-4, 1e-4)\n"
        "r = exportlm.export.compare_logits(a, b, 0, 0)\n"
        "e = ExportCacheWrapper(model).eval()(ids)\n"
        "e = ExportCacheWrapper(model)(ids)\n"
        "w = ExportCacheWrapper(model).eval()\n"  # building the wrapper to trace is fine
    )
    assert len(_verifier_calls(planted)) == 4


def test_one_roundtrip_verifier() -> None:
    """Only ``exportlm.export.roundtrip`` compares logits or runs the eager reference: the
    CLI's ``--verify``, ``verify_onnx`` and every check call it, so a fourth verifier fails."""
    offenders = {
        _module_name(path): calls
        for path in _python_files()
        if _module_name(path) != VERIFIER
        and (calls := _verifier_calls(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert not offenders, (
        f"logits compared outside {VERIFIER} (call verify_roundtrip / compare_within): {offenders}"
    )


#: The files that may read a format's deprecated ``recipe`` field (``WeightRecipe``): where
#: it is declared and checked, and the one reader that turns it into a ``Recipe`` record.
FORMAT_RECIPE_READERS = {
    "src/exportlm/quant/formats/__init__.py",
    "src/exportlm/quant/formats/_parts.py",
    "src/exportlm/quant/formats/_registry.py",
    "src/exportlm/quant/formats/_spec.py",
    "src/exportlm/quant/_recipes.py",
}
_WEIGHT_RECIPE_FIELDS = {
    "block_size",
    "axis",
    "quantize_inputs",
    "awq",
    "input_format",
    "smoothquant_alpha",
    "smoothquant_fold",
    "group_sizes",
}
_FORMAT_LOOKUPS = {"get_format", "format_for_quant_algo", "format_for_kv_cache_algo"}


def _reads_a_format_recipe(node: ast.AST) -> bool:
    """``WeightRecipe``, ``<...spec>.recipe``, ``get_format(...).recipe`` or ``<x>.recipe.<field>``."""
    if isinstance(node, ast.Name | ast.alias):
        return (node.id if isinstance(node, ast.Name) else node.name) == "WeightRecipe"
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "WeightRecipe":
        return True
    value = node.value
    if node.attr in _WEIGHT_RECIPE_FIELDS and isinstance(value, ast.Attribute):
        return value.attr == "recipe"
    if node.attr != "recipe":
        return False
    if isinstance(value, ast.Call):
        func = value.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) in (
            _FORMAT_LOOKUPS
        )
    last = value.id if isinstance(value, ast.Name) else getattr(value, "attr", "")
    return "spec" in last.lower()


def _format_recipe_readers() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in FORMAT_RECIPE_READERS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if _reads_a_format_recipe(node):
                line = getattr(node, "lineno", 0)
                found.setdefault(rel, []).append(f"{line}: {ast.unparse(node)[:60]}")
    return found


def test_the_recipe_scan_finds_a_recipe_read_off_a_format() -> None:
    sources = [
        "spec.recipe.name",
        "module.weight_quantizer.spec.recipe",
        "get_format(fmt).recipe",
        "x.recipe.quantize_inputs",
        "from exportlm.quant.formats import WeightRecipe",
    ]
    for source in sources:
        assert any(_reads_a_format_recipe(n) for n in ast.walk(ast.parse(source))), source
    for source in ("plan.recipe", "scheme.recipe", "job.recipe.algo", "recipe.weight_block"):
        assert not any(_reads_a_format_recipe(n) for n in ast.walk(ast.parse(source))), source


def test_recipe_facts_are_read_off_recipe_records_not_formats() -> None:
    """Recipes are records of their own (issue 40): quantization, the exporters, the
    checkpoint writer and loader, the inspector and the CLI read a ``Recipe`` from the
    recipe registry, or a format's numerics and layouts, never a format's recipe."""
    offenders = _format_recipe_readers()
    assert not offenders, f"a recipe read off a FormatSpec outside quant/_recipes.py: {offenders}"


#: The keys of a checkpoint's quantization configs (``config.json``'s ``quantization_config``,
#: ``hf_quant_config.json``): reading one is parsing the declaration.
QUANT_CONFIG_KEYS = frozenset(
    {
        "quantization_config", "quantization", "quant_method", "quant_algo",
        "quantized_layers", "kv_cache_quant_algo", "kv_cache_scheme", "config_groups",
        "exclude_modules", "ignore", "input_activations", "output_activations", "actorder",
        "producer", "hf_quant_config.json",
    }
)  # fmt: skip
#: Where those keys may be read: the one reader, and what may not go through it (with why).
QUANT_CONFIG_READERS = {
    "exportlm.checkpoint": "the checkpoint room: the one reader and its declaration model",
    "exportlm.export.hf_checkpoint.configs": "the writer, reading back the sections it builds",
    "pytest_exportcheck.checks.exporters.golden": "records the written JSON verbatim as a golden",
}


def _config_key_reads(tree: ast.AST, file_name: bool = True) -> Iterator[tuple[int, str]]:
    """``(line, key)`` of every read of a quantization-config key: ``x.get(KEY)``,
    ``x.pop(KEY)``, ``x[KEY]``, ``KEY in x``, and (``file_name``) the
    ``hf_quant_config.json`` file name."""
    for node in ast.walk(tree):
        key: object = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            key = node.left.value if isinstance(node.ops[0], (ast.In, ast.NotIn)) else None
        elif file_name and isinstance(node, ast.Constant) and node.value == "hf_quant_config.json":
            key = node.value
        if isinstance(key, str) and key in QUANT_CONFIG_KEYS:
            yield node.lineno, key


def test_the_config_key_scan_finds_a_parser() -> None:
    parser = ast.parse(
        'quant = config.get("quantization_config") or {}\n'
        'algo = quant["quant_algo"]\n'
        'mixed = "quantized_layers" in quant\n'
        'path = directory / "hf_quant_config.json"\n'
        'quant["quant_algo"] = "FP8"\n'  # a write: the writer builds configs
    )
    found = sorted(key for _, key in _config_key_reads(parser))
    assert found == [
        "hf_quant_config.json",
        "quant_algo",
        "quantization_config",
        "quantized_layers",
    ]


def test_one_reader_parses_the_quantization_configs() -> None:
    """Only the checkpoint room reads a checkpoint's quantization configs (issue 40): the
    loader, ``exportlm inspect`` and the engines read its declaration model."""
    offenders: dict[str, list[str]] = {}
    for path in _python_files():
        module = _module_name(path)
        if any(module == m or module.startswith(m + ".") for m in QUANT_CONFIG_READERS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # the library names the file by exportlm.checkpoint.HF_QUANT_CONFIG_NAME; the
        # plugin's checks may name it in their messages
        for line, key in _config_key_reads(tree, file_name=module.startswith("exportlm")):
            offenders.setdefault(str(path.relative_to(ROOT)), []).append(f"{line}: {key}")
    assert not offenders, (
        "quantization-config keys read outside exportlm.checkpoint (read the declaration "
        f"from exportlm.checkpoint.read_declaration / declaration_of instead): {offenders}"
    )


def _calls_by_file(folders: list[Path], names: set[str]) -> dict[str, set[str]]:
    """``{called name: files}`` of the calls to ``names`` (a bare name or an attribute)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name in names:
                    found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_one_export_pipeline_for_hf_checkpoint() -> None:
    """One manifest, one atomic publish, one shard writer (issue 40): the stream is a source
    of the hf_checkpoint target, published by the export job like every other export."""
    export = ROOT / "src" / "exportlm" / "export"
    folders = [export, ROOT / "src" / "exportlm" / "stream"]
    names = {"PendingManifest", "atomic_output", "_write_manifest", "write_safetensors"}
    calls = _calls_by_file(folders, names)
    job, shards = "src/exportlm/export/job.py", "src/exportlm/export/hf_checkpoint/shards.py"
    assert calls["PendingManifest"] == {job}, "only the export job makes a manifest"
    assert calls["atomic_output"] == {job}, "only the export job publishes"
    assert calls["_write_manifest"] == {"src/exportlm/export/guard.py"}
    # the stream's activations between layers are work files, never checkpoint files
    activations = "src/exportlm/export/hf_checkpoint/stream/_work.py"
    assert calls["write_safetensors"] == {shards, activations}, "one shard writer"
    writers = [
        f"{path.relative_to(ROOT).as_posix()}:{node.name}"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and {"add", "finish"} <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    ]
    assert writers == [f"{shards}:ShardedSafetensorsWriter"]


#: Files that may name two or more built-in check ids in one literal, each with why.
CHECK_ID_LISTS_ALLOWED = {
    # the catalogue is where checks are declared; versions.py its dated history
    "pytest_exportcheck/checks/catalogue.py": "the records themselves",
    "pytest_exportcheck/checks/versions.py": "the catalogue's history: which version added which",
    # a family's failure declarations name the checks a failure defeats (data on the family)
    "src/exportlm/models/causes.py": "the checks a family's failure cause covers by default",
    "src/exportlm/models/registry.py": "the model-free checks a family's failures extend to",
}


def _literal_names(node: ast.AST) -> list[str]:
    """The string constants a dict literal's keys, or a set / list / tuple literal, hold."""
    if isinstance(node, ast.Dict):
        items: list[ast.expr | None] = list(node.keys)
    elif isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        items = list(node.elts)
    else:
        return []
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _is_all(tree: ast.AST) -> set[int]:
    """Ids of the ``__all__ = [...]`` literals (a module's exported names are no table)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    }


def test_no_side_table_keyed_by_a_target_or_check_name() -> None:
    """Facts of a target (its runtime library) and of a check (whether it is a value check)
    live on its record, so a third party's counts the same: no literal lists two or more
    built-in target names, or built-in check ids, outside the records (issue 40)."""
    from exportlm.export.builtins import BUILTIN_TARGETS
    from exportlm.export.declaration import declared_info
    from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS

    targets = {info.name for factory, _ in BUILTIN_TARGETS if (info := declared_info(factory))}
    checks = {spec.id for spec in BUILTIN_CHECKS}
    assert len(targets) == 4
    offenders: dict[str, list[str]] = {}
    for path in _python_files():
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported = _is_all(tree)
        for node in ast.walk(tree):
            if id(node) in exported:
                continue
            found = _literal_names(node)
            keyed = isinstance(node, ast.Dict) and len(set(found) & targets) >= 2
            listed = len(set(found) & checks) >= 2 and where not in CHECK_ID_LISTS_ALLOWED
            if keyed or listed:
                offenders.setdefault(where, []).append(f"line {node.lineno}: {found[:4]}")
    assert not offenders, f"side tables naming targets or checks: {offenders}"


def test_the_plugin_declares_its_options_in_one_table() -> None:
    """``addoption`` / ``addini`` are called in one place only: the loop over the option table
    (``add_options``); every option, its help and its ini twin are rows of that table."""
    calls: dict[str, list[str]] = {}
    for path in sorted((ROOT / "pytest_exportcheck").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("addoption", "addini")
                ):
                    calls.setdefault(fn.name, []).append(path.relative_to(ROOT).as_posix())
    assert set(calls) == {"add_options"}, calls
    assert {len(found) for found in calls.values()} == {2}  # one addoption, one addini


#: The concerns of the plugin's pytest layer, one folder each (docs/architecture.md).
SESSION_CONCERNS = {"nodes", "options", "coverage", "reporting", "environment"}


def test_the_session_room_is_grouped_by_concern() -> None:
    """Only the session (its hooks) and its runner sit at the top of ``session/``; every
    other module is in the folder of its concern, so the listing shows the concerns."""
    room = ROOT / "pytest_exportcheck" / "session"
    modules = {p.name for p in room.glob("*.py")}
    folders = {p.name for p in room.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == {"__init__.py", "_session.py", "_item_runner.py"}
    assert folders == SESSION_CONCERNS
    assert all((room / folder / "__init__.py").is_file() for folder in folders)


# ----------------------------------------------------------------------------- services, not globals

#: exportlm's registries and the functions that look a name up in them (or load them).
#: Checks and the run read ``case.services.registries`` instead (issue 40, item 5).
REGISTRY_LOOKUPS = frozenset(
    {
        "EXPORT_REGISTRY",
        "RUNTIME_REGISTRY",
        "EXPORT_MODULE_REGISTRY",
        "MODEL_REGISTRY",
        "ENGINE_REGISTRY",
        "get_target_info",
        "runtime_loader",
        "export_model",
        "load_exported",
        "ensure_exporters_registered",
        "ensure_module_exporters_registered",
        "ensure_models_registered",
        "ensure_engines_registered",
        "model_names",
        "build_model",
        "model_tolerance_scale",
        "model_expected_failures",
        "model_failure_causes",
        "model_since",
        "get_engine",
        "engine_names",
        "engines_taking",
        "plugin_inventory",
        "registries",
    }
)
#: The parts of the plugin that read services only.
SERVICE_READERS = ("pytest_exportcheck.run", "pytest_exportcheck.checks")
#: module -> why it may read exportlm's registries. Keep it to this one.
REGISTRY_READERS = {
    "pytest_exportcheck.checks._registries": (
        "the one reader: Registries.installed() builds the record of the process's "
        "registries that discovery hands to the run (and a services built without one uses)"
    ),
}
#: Where ``Registries.installed()`` may be called besides its own module: the default of
#: a services built without registries (a case a script makes itself).
INSTALLED_CALLERS = frozenset({"pytest_exportcheck.checks._services"})


def _registry_lookups(tree: ast.AST) -> Iterator[str]:
    """Each registry lookup ``tree`` imports from exportlm or reads as an attribute of an
    exportlm module, and each ``Registries.installed`` it reads."""
    modules: set[str] = set()  # local names bound to exportlm modules (or their members)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "exportlm":
                    modules.add(alias.asname or "exportlm")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("exportlm"):
            for alias in node.names:
                if alias.name in REGISTRY_LOOKUPS:
                    yield f"from {node.module} import {alias.name}"
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            continue
        if node.attr in REGISTRY_LOOKUPS and root.id in modules:
            yield ast.unparse(node)
        if node.attr == "installed" and root.id == "Registries":
            yield ast.unparse(node)


def test_the_registry_lookup_scan_finds_imports_and_attributes() -> None:
    source = (
        "import exportlm.export as ex\n"
        "import exportlm.models\n"
        "from exportlm.engines import get_engine, Engine\n"
        "def f(case):\n"
        "    from exportlm.export import EXPORT_REGISTRY\n"
        "    ex.get_target_info('onnx'); exportlm.models.build_model('decoder')\n"
        "    case.services.registries.build_model('decoder'); Engine.name\n"
        "    Registries.installed()\n"
    )
    found = sorted(_registry_lookups(ast.parse(source)))
    assert found == [
        "Registries.installed",
        "ex.get_target_info",
        "exportlm.models.build_model",
        "from exportlm.engines import get_engine",
        "from exportlm.export import EXPORT_REGISTRY",
    ]


def test_checks_and_the_run_read_services_never_the_global_registries() -> None:
    """Every lookup of a check or of the run goes to ``case.services.registries`` (the
    record discovery built once), so a run handed other registries sees only those."""
    found: dict[str, list[str]] = {}
    for path in _python_files():
        module = _module_name(path)
        if not module.startswith(SERVICE_READERS) or module in REGISTRY_READERS:
            continue
        uses = list(_registry_lookups(ast.parse(path.read_text(encoding="utf-8"))))
        if module in INSTALLED_CALLERS:
            uses = [u for u in uses if u != "Registries.installed"]
        if uses:
            found[module] = uses
    assert not found, f"read case.services.registries instead: {found}"
    assert set(REGISTRY_READERS) | INSTALLED_CALLERS <= {_module_name(p) for p in _python_files()}
