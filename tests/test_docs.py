"""Every command and Python snippet in the user documentation runs as written.

Collected: the fenced code blocks of ``README.md``, ``docs/*.md`` and
``examples/*/README.md``. ``docs/decisions/`` is not collected: it records past
decisions, it gives no instructions. One test item per block, named ``page:line``.

Each page gets one working directory for the session, a fresh temporary directory,
as a reader has one terminal per page. A page inside a project of its own
(``examples/<name>/README.md``) gets a temporary copy of that project instead,
installed for the test as ``pip install -e .`` would (its ``src/`` on ``PYTHONPATH``
and a dist-info with its entry points).

- ```` ```python ````: the Python blocks of one page run in order, in one process and
  one namespace, as a reader who pastes them one after another would: a block may use
  names an earlier block of the same page defined (a skipped block is not run, so
  later blocks must not need it). A block after a failed one fails as "not run",
  naming the failed one. Tracebacks point at the page's own lines.
- ```` ```bash ```` / ```` ```sh ````: every line is a command (a trailing ``\\``
  continues it). ```` ```console ````: lines starting with ``$ `` are commands; the
  lines after a command are its sample output. Commands run with bash, with the test
  interpreter's ``bin`` (``.venv/bin``) first on ``PATH``; one that exits non-zero
  fails the item.
- Other blocks (toml, json, yaml, text, none) are not run.

Directives, in HTML comments on the lines right before a block:

- ``<!-- docs-test: skip (reason) -->`` skips the block; the reason is mandatory.
- ``<!-- docs-test: file PATH -->``: the block is a file the page tells the reader to
  save; it is written to ``PATH`` in the page's working directory before any block
  of the page runs, and is not run itself.
- ``<!-- docs-test: output -->`` checks the sample output: the sample lines of each
  command of a console block (a command shown without output is not compared), or for
  a python / bash / sh block, the ```` ```text ```` block that follows it (what the
  Python block prints, or what the last command prints). Output is stdout and stderr
  together, as a terminal shows it. Both sides are normalised: colours and trailing
  spaces dropped, the working directory written ``<tmp>``, durations (``0.53s``,
  ``12 ms``) written ``<t>``. In the sample, ``...`` matches any text within a line and
  a line holding only ``...`` matches any number of lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._distinfo import make_distribution
from tests._docblocks import (
    ROOT,
    Block,
    matches,
    normalise,
    pages,
    parse_blocks,
    shell_commands,
)

TIMEOUT_S = 300


def check_output(block: Block, sample: str, actual: str, workdir: Path, what: str) -> None:
    """Fail with both texts when ``actual`` does not fit ``sample``."""
    want, got = normalise(sample, workdir), normalise(actual, workdir)
    if not matches(want, got):
        pytest.fail(
            f"{block.id}: the output of {what} differs from the sample in the docs.\n"
            "--- sample (normalised) ---\n" + "\n".join(want) + "\n"
            "--- actual (normalised) ---\n" + "\n".join(got),
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------
# where and how a page runs


@dataclass(frozen=True)
class Workspace:
    """A page's working directory and the environment its code runs with."""

    cwd: Path
    env: dict[str, str]


def _environment(extra_path: list[Path]) -> dict[str, str]:
    """This environment with the interpreter's bin first on PATH and no pytest state."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "COV_CORE_")) and key != "PYTHONPATH"
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(str(path) for path in extra_path)
    return env


def make_workspace(page: Path, tmp: Path) -> Workspace:
    """The page's directory (a copy of its project, if it has one) with its files saved."""
    cwd, extra = tmp, []
    project = page.parent
    if project != ROOT and (project / "pyproject.toml").is_file():
        cwd = tmp / project.name
        ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "report.json")
        shutil.copytree(project, cwd, ignore=ignore)
        meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        site = tmp / "site"
        make_distribution(site, meta["name"], meta.get("entry-points", {}), version=meta["version"])
        extra = [site, cwd / "src"]
    for block in parse_blocks(page):
        with contextlib.suppress(ValueError):  # a bad directive fails the block's own item
            target = block.directives().file
            if target is not None and block.directives().skip is None:
                (cwd / target).parent.mkdir(parents=True, exist_ok=True)
                (cwd / target).write_text(block.source, encoding="utf-8")
    return Workspace(cwd, _environment(extra))


_DRIVER = """
import contextlib, io, json, sys, traceback
spec = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
results, failed = [], None
for block in spec["blocks"]:
    if failed is not None:
        results.append({"ok": False, "output": "", "error": f"not run: the block at line {failed} failed"})
        continue
    out = io.StringIO()
    try:
        code = compile("\\n" * (block["line"] - 1) + block["source"], spec["page"], "exec")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(code, namespace)
        results.append({"ok": True, "output": out.getvalue(), "error": ""})
    except BaseException:
        failed = block["line"]
        results.append({"ok": False, "output": out.getvalue(), "error": traceback.format_exc()})
json.dump(results, open(sys.argv[2], "w", encoding="utf-8"))
"""


def _runs_as_python(block: Block) -> bool:
    try:
        directives = block.directives()
    except ValueError:
        return False
    return block.language == "python" and directives.skip is None and directives.file is None


class Pages:
    """Per page and session: its workspace, and the results of its Python blocks."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._workspaces: dict[Path, Workspace] = {}
        self._python: dict[Path, dict[int, dict[str, Any]]] = {}

    def workspace(self, page: Path) -> Workspace:
        if page not in self._workspaces:
            tmp = self._factory.mktemp(re.sub(r"\W+", "-", page.relative_to(ROOT).as_posix()))
            self._workspaces[page] = make_workspace(page, tmp)
        return self._workspaces[page]

    def python_result(self, block: Block) -> dict[str, Any]:
        if block.page not in self._python:
            self._python[block.page] = self._run_python(block.page)
        return self._python[block.page][block.line]

    def _run_python(self, page: Path) -> dict[int, dict[str, Any]]:
        workspace = self.workspace(page)
        blocks = [block for block in parse_blocks(page) if _runs_as_python(block)]
        spec_dir = self._factory.mktemp("docs-python-spec")
        spec = {"page": str(page), "blocks": [{"line": b.line, "source": b.source} for b in blocks]}
        (spec_dir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _DRIVER,
                str(spec_dir / "spec.json"),
                str(spec_dir / "out.json"),
            ],
            cwd=workspace.cwd,
            env=workspace.env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the snippet runner for {page} crashed:\n{done.stderr}")
        results = json.loads((spec_dir / "out.json").read_text(encoding="utf-8"))
        return {block.line: result for block, result in zip(blocks, results, strict=True)}


def run_shell(block: Block, workspace: Workspace, check: bool) -> None:
    """Run a shell block's commands in order; fail on an exit code or an output mismatch."""
    commands = shell_commands(block)
    for position, (command, sample) in enumerate(commands, start=1):
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=workspace.cwd,
            env=workspace.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(
                f"{block.id}: `{command}` exited with {done.returncode}:\n{done.stdout}",
                pytrace=False,
            )
        what = f"`{command}`"
        if check and block.language == "console" and sample.strip():
            check_output(block, sample, done.stdout, workspace.cwd, what)
        elif check and block.language != "console" and position == len(commands):
            check_output(block, block.expected or "", done.stdout, workspace.cwd, what)


# ---------------------------------------------------------------------------------------
# the test


@pytest.fixture(scope="session")
def doc_pages(tmp_path_factory: pytest.TempPathFactory) -> Pages:
    return Pages(tmp_path_factory)


def _params() -> Iterator[Any]:
    for page in pages():
        # a page's blocks share a workspace and a Python process: keep them on one worker
        group = pytest.mark.xdist_group(f"docs:{page.relative_to(ROOT).as_posix()}")
        for block in parse_blocks(page):
            if block.is_item():
                yield pytest.param(block, id=f"{block.id}-{block.language}", marks=group)


@pytest.mark.parametrize("block", list(_params()))
def test_documented_block_runs_as_written(block: Block, doc_pages: Pages) -> None:
    """The block runs (and prints its sample output, where the page says so)."""
    directives = block.directives()
    if directives.skip is not None:
        pytest.skip(directives.skip)
    if directives.output and block.language != "console" and block.expected is None:
        pytest.fail(f"{block.id}: 'docs-test: output' but no ```text block follows", pytrace=False)
    workspace = doc_pages.workspace(block.page)
    if block.language != "python":
        run_shell(block, workspace, directives.output)
        return
    result = doc_pages.python_result(block)
    if not result["ok"]:
        pytest.fail(f"{block.id}: the snippet failed:\n{result['error']}", pytrace=False)
    if directives.output:
        check_output(block, block.expected or "", result["output"], workspace.cwd, "the snippet")


# ---------------------------------------------------------------------------------------
# the rules above, on small pages


def _page(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    return parse_blocks(path)


def test_directives_are_read_from_the_comments_right_above_a_block(tmp_path: Path) -> None:
    blocks = _page(
        tmp_path,
        "<!-- docs-test: skip (needs a GPU) -->\n```bash\nnvidia-smi\n```\n\n"
        "<!-- docs-test: skip (stale) -->\nprose in between\n```python\nx = 1\n```\n"
        "<!-- docs-test: output -->\n```python\nprint(2)\n```\n\n```text\n2\n```\n",
    )
    assert [block.directives().skip for block in blocks] == ["needs a GPU", None, None, None]
    assert blocks[2].directives().output
    assert blocks[2].expected == "2\n"
    assert [block.is_item() for block in blocks] == [True, True, True, False]


@pytest.mark.parametrize("comment", ["skip", "skip ()", "skip (  )", "sikp (typo)"])
def test_a_skip_without_a_reason_or_an_unknown_directive_is_an_error(
    tmp_path: Path, comment: str
) -> None:
    (block,) = _page(tmp_path, f"<!-- docs-test: {comment} -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="docs-test: "):
        block.directives()


def test_console_blocks_split_into_commands_and_their_sample_output(tmp_path: Path) -> None:
    (block,) = _page(
        tmp_path,
        "```console\n$ exportlm list   # note\nonnx\ntorchscript\n$ make \\\n  test\n```\n",
    )
    assert shell_commands(block) == [
        ("exportlm list   # note", "onnx\ntorchscript"),
        ("make \\\n  test", ""),
    ]


@pytest.mark.parametrize(
    ("sample", "actual", "fits"),
    [
        ("exported in 1.5s", "exported in 0.25 s", True),
        ("max abs ..., OK", "max abs 4.77e-07, OK", True),
        ("a\n...\nz", "a\nb\nc\nz", True),
        ("a\n...\nz", "a\nz", True),
        ("a\nz", "a\nb\nz", False),
        ("max abs ..., OK", "max abs 4.77e-07, FAILED", False),
        ("wrote <tmp>/out.pt", "wrote {tmp}/out.pt", True),
    ],
)
def test_sample_output_tolerates_durations_paths_and_ellipses(
    tmp_path: Path, sample: str, actual: str, fits: bool
) -> None:
    got = normalise(actual.format(tmp=tmp_path), tmp_path)
    assert matches(normalise(sample, tmp_path), got) is fits


def test_a_file_block_is_saved_for_the_commands_of_its_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: file pkg/hello.py -->\n```python\nprint('hello from a saved file')\n```\n"
        "<!-- docs-test: output -->\n```bash\npython pkg/hello.py\n```\n"
        "```text\nhello from a ... file\n```\n",
        encoding="utf-8",
    )
    saved, command = parse_blocks(page)[:2]
    assert not saved.is_item()
    (tmp_path / "work").mkdir()
    workspace = make_workspace(page, tmp_path / "work")
    run_shell(command, workspace, check=True)
    command.expected = "something else\n"
    with pytest.raises(pytest.fail.Exception, match="differs from the sample"):
        run_shell(command, workspace, check=True)
