"""``artifact_contract`` looks inside a directory artifact: only files its manifest lists.

A third-party checkpoint target that leaves a ``tmpXXXX.partial`` in its directory
fails, named, whether it wrote the file before the manifest was written (so the
manifest lists it: a leftover all the same) or after (a file the manifest does not
list). Called directly and through the plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exportlm.export import (
    atomic_output,
    get_target_info,
)
from exportlm.export.hf_checkpoint import export_hf_checkpoint
from exportlm.export.manifest import read_manifest
from pytest_exportcheck.checks import CHECKS, CheckResult, TargetCase
from pytest_exportcheck.checks.targets.artifact import temporary_files
from tests._faulty_target import checkpoint_target, faulty_checkpoint_target

LEFTOVER = "tmp3k9x_q2.partial"


def _write_leftover(directory: Path) -> None:
    (directory / LEFTOVER).write_bytes(b"half a shard")


def run(target: str, tmp_path: Path) -> CheckResult:
    case = TargetCase(target, None, {}, "llama", "cpu", workdir=tmp_path)
    return CHECKS["artifact_contract"].fn(case)


@pytest.fixture
def staged_leftover_target() -> Iterator[str]:
    """A checkpoint target that stages its directory and leaves a temporary inside it."""
    name = "leaves_a_partial"

    def export(model: Any, output_path: Path, *, example_inputs: Any = None) -> Path:
        with atomic_output(output_path, directory=True) as staged:
            export_hf_checkpoint(model, staged, overwrite=True)
            _write_leftover(staged)  # before exportlm writes the manifest: it gets listed
        return Path(output_path)

    accepts = get_target_info("hf_checkpoint").accepts
    with checkpoint_target(name, export, accepts=accepts) as registered:
        yield registered


def test_the_real_checkpoint_target_passes(tmp_path: Path) -> None:
    result = run("hf_checkpoint", tmp_path)
    assert result.status == "pass", result.message


def test_a_file_written_after_the_manifest_fails_naming_it(tmp_path: Path) -> None:
    with faulty_checkpoint_target("late_partial", _write_leftover) as target:
        result = run(target, tmp_path)
    assert result.status == "fail"
    assert LEFTOVER in result.message
    assert "not listed in the manifest" in result.message


def test_a_temporary_the_manifest_lists_still_fails_naming_it(
    tmp_path: Path, staged_leftover_target: str
) -> None:
    result = run(staged_leftover_target, tmp_path)
    assert result.status == "fail"
    assert f"temporary files left inside the artifact directory: ['{LEFTOVER}']" in result.message
    manifest = read_manifest(next((tmp_path / "artifact_contract").iterdir()))
    assert manifest is not None
    assert LEFTOVER in manifest.files  # listed, and still a leftover


@pytest.mark.parametrize(
    ("name", "temporary"),
    [
        ("tmpab12cd", True),
        ("shards/tmpab12cd/model.safetensors", True),
        ("model-00001-of-00002.safetensors.part", True),
        ("config.json~", True),
        ("model.safetensors", False),
        ("model.safetensors.index.json", False),
        ("template.json", False),
    ],
)
def test_temporary_names(name: str, temporary: bool) -> None:
    assert bool(temporary_files([name])) is temporary


CONFTEST = """
from pathlib import Path

from exportlm.export import (
    EXPORT_REGISTRY, ensure_exporters_registered, export_target, get_target_info,
)
from exportlm.export.hf_checkpoint import export_hf_checkpoint


@export_target("leaves_a_partial", runtime="hf_checkpoint", artifact="directory",
               capabilities={"quantized", "multi_file"},
               accepts=get_target_info("hf_checkpoint").accepts)
def leaves_a_partial(model, output_path, *, example_inputs=None):
    out = Path(export_hf_checkpoint(model, output_path))
    (out / "tmp3k9x_q2.partial").write_bytes(b"half a shard")
    return out


ensure_exporters_registered()
EXPORT_REGISTRY.register("leaves_a_partial", leaves_a_partial)


def pytest_unconfigure(config):
    EXPORT_REGISTRY.unregister("leaves_a_partial")
"""


def test_through_the_plugin_the_leftover_fails_artifact_contract(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest(
        "--export-targets=hf_checkpoint,leaves_a_partial",
        "--export-checks=artifact_contract",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=3, failed=1)  # plugin_loads of both, hf_checkpoint's check
    result.stdout.fnmatch_lines(
        [
            "*artifact_contract[[]leaves_a_partial-cpu[]]*",
            f"*leaves_a_partial exporting *{LEFTOVER}*",
        ]
    )
