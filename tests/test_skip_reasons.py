"""Skip reasons are written for users: no internal (leading-underscore) identifier in them.

A refused model is a counted skip whose reason the matrix lists, a capability the
target does not declare a not-applicable cell whose reason the report lists; a
reason that names a private helper class (``_CacheByDefault``) tells the user
nothing. Checked over the JSON report of a small conformance run with each kind of
reason: a target's ``accepts`` refusing the check's own model (a skip), a
capability the target does not declare (not applicable).
"""

from __future__ import annotations

import json
import re

import pytest

#: An identifier that starts with one underscore (``_CacheByDefault``, ``_hf_accepts``),
#: not a dunder and not an underscore inside a word (``kv_cache``).
PRIVATE_NAME = re.compile(r"(?<![\w.])_(?!_)[A-Za-z]\w*")


def test_private_name_pattern() -> None:
    assert PRIVATE_NAME.search("_CacheByDefault is not a transformers PreTrainedModel")
    assert PRIVATE_NAME.search("raised in _hf_accepts")
    assert not PRIVATE_NAME.search("declares 'kv_cache', dynamic_shapes, torch_export")
    assert not PRIVATE_NAME.search("see __init__ and model.onnx_data")


def test_no_skip_reason_of_a_conformance_run_names_a_private_identifier(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest(
        "--export-targets=hf_checkpoint,torchscript",
        "--export-exporters=none",
        "--export-models=decoder",
        "--export-checks=cache_wrapper,loadable,generation_parity",
        "--export-report=report.json",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
    )
    report = json.loads((pytester.path / "report.json").read_text(encoding="utf-8"))
    skips = {item["id"]: item["message"] for item in report["items"] if item["outcome"] == "skip"}
    assert "cache_wrapper[hf_checkpoint-cpu]" in skips, result.stdout.str()
    cells = {
        f"{cell['check']}[{cell['column']}]": cell["reason"] for cell in report["not_applicable"]
    }
    assert "generation_parity[hf_checkpoint]" in cells, result.stdout.str()
    assert "loadable[torchscript:trace]" in cells
    reasons = {**skips, **cells}
    leaks = {key: msg for key, msg in reasons.items() if PRIVATE_NAME.search(msg or "")}
    assert not leaks
