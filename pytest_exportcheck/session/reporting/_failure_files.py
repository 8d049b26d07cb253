"""Shrunk failures kept where the next run finds them: ``.exportcheck/failures/<item>.json``.

A generated-structure check (``roundtrip_generated``, ``quantized_generated``) that
fails reports the structure Hypothesis shrank to and an ``exportlm export`` command
reproducing it; the check writes the structure into the item's scratch directory,
which pytest rotates away after three runs. The session copies it, atomically, to
``.exportcheck/failures/<item id>.json`` under the rootdir (``docs/checks.md``: add
``.exportcheck/`` to ``.gitignore``) and adds the command, rewritten to read that
copy, to the item's report.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

__all__ = ["FAILURES_DIR", "keep_failure"]

#: Under the rootdir: one JSON file of the shrunk structure per failing item.
FAILURES_DIR = Path(".exportcheck") / "failures"


def _stem(item_id: str) -> str:
    """``roundtrip_generated[torchscript:trace-cpu]`` -> ``roundtrip_generated.torchscript_trace-cpu``."""
    return re.sub(r"[^\w.-]", "_", item_id.replace("[", ".", 1).removesuffix("]"))


def keep_failure(rootpath: Path, item_id: str, result: Any) -> list[str]:
    """Copy a failed result's shrunk structure under ``rootpath``; the lines to report.

    ``result`` is the item's JSON result (``{"status", "message", "details"}``); a
    result without a ``spec_file`` detail (every check but the generated ones) is
    left alone and gives no lines. A structure file that cannot be read or written
    gives a line saying so, never an error of its own.
    """
    from exportlm.atomic import write_bytes_atomic

    details = result.get("details") if isinstance(result, dict) else None
    if result.get("status") != "fail" or not isinstance(details, dict):
        return []
    source = details.get("spec_file")
    if not isinstance(source, str):
        return []
    kept = rootpath / FAILURES_DIR / f"{_stem(item_id)}.json"
    try:
        write_bytes_atomic(kept, Path(source).read_bytes())
    except OSError as err:
        return [f"could not keep the shrunk structure {source} in {kept.parent}: {err}"]
    lines = [f"shrunk structure kept in {kept}"]
    command = details.get("repro")
    if isinstance(command, str):
        out = kept.parent / "repro" / _stem(item_id)
        lines += ["reproduce outside pytest:", "  " + _reading(command, source, kept, out)]
    return lines


def _reading(command: str, source: str, kept: Path, out: Path) -> str:
    """``command`` reading ``kept`` instead of ``source`` and writing under ``out``.

    Both paths of the check's command lie in pytest's scratch directory, which a
    later run deletes; the rewritten command lasts as long as ``.exportcheck/``.
    """
    parts = shlex.split(command)
    for index, part in enumerate(parts):
        if part == source:
            parts[index] = str(kept)
        elif index and parts[index - 1] == "--out":
            parts[index] = str(out / Path(part).name)
    return shlex.join(parts)
