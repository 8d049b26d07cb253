"""A conformance run that meets a poisoned artifact cache rebuilds it, runs nothing, and passes."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from tests.test_cache_integrity import Poison

ARGS = [
    "--export-targets=torchscript",
    "--export-models=decoder",
    "--export-checks=roundtrip_logits,artifact_contract",
    "-p",
    "no:randomly",
]


def _entries(pytester: pytest.Pytester) -> list[Path]:
    root = pytester.path / ".pytest_cache" / "d" / "exportcheck" / "artifacts"
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _poison(entry: Path, marker: Path) -> None:
    """Replace every file of the entry by the payload and list the new hashes (unsigned)."""
    meta = json.loads((entry / "meta.json").read_text())
    files = {}
    for path in sorted((entry / "out").rglob("*")):
        if path.is_file():
            path.chmod(0o644)
            path.write_bytes(pickle.dumps(Poison(marker)))
            data = path.read_bytes()
            relative = path.relative_to(entry / "out").as_posix()
            files[relative] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    meta.pop("hmac", None)
    (entry / "meta.json").write_text(json.dumps({**meta, "files": files}))


def test_a_poisoned_cache_is_rebuilt_and_the_run_passes(pytester: pytest.Pytester) -> None:
    marker = pytester.path / "marker"
    first = pytester.runpytest(*ARGS)
    first.assert_outcomes(passed=4, xfailed=2)
    entries = _entries(pytester)
    assert entries, "the first run cached its artifact"
    for entry in entries:
        _poison(entry, marker)
    second = pytester.runpytest(*ARGS, "-W", "always::pytest_exportcheck.ExportCheckWarning")
    second.assert_outcomes(passed=4, xfailed=2)
    assert not marker.exists(), "a poisoned cache entry ran code"
    second.stdout.fnmatch_lines(
        ["*ExportCheckWarning: artifact cache entry * was not used and is rebuilt*"]
    )
    assert "not a failure of the target" in second.stdout.str()
    third = pytester.runpytest(*ARGS)  # the rebuilt entries are sound: no warning
    third.assert_outcomes(passed=4, xfailed=2)
    assert "was not used and is rebuilt" not in third.stdout.str()
    assert not marker.exists()


def test_a_truncated_cache_entry_does_not_fail_later_runs(pytester: pytest.Pytester) -> None:
    pytester.runpytest(*ARGS).assert_outcomes(passed=4, xfailed=2)
    for entry in _entries(pytester):
        artifact = entry / "out" / json.loads((entry / "meta.json").read_text())["artifact"]
        artifact.chmod(0o644)
        data = artifact.read_bytes()
        artifact.write_bytes(data[: len(data) // 3])
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=4, xfailed=2)
    result.stdout.fnmatch_lines(["*does not match its sha256 (truncated or changed)*"])


def test_a_dead_writers_staging_directory_is_cleaned_on_the_next_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.runpytest(*ARGS).assert_outcomes(passed=4, xfailed=2)
    entry = _entries(pytester)[0]
    staging = entry.parent / f".{entry.name}.abcd1234"
    (staging / "out").mkdir(parents=True)
    (staging / "out" / "model.pt").write_bytes(b"\0" * 4096)  # killed half way
    pytester.runpytest(*ARGS).assert_outcomes(passed=4, xfailed=2)
    assert not staging.exists()
