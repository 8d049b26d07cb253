"""Target check of what an export writes: ``artifact_contract``."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from exportlm.errors import ArtifactIntegrityError
from exportlm.export import TargetInfo
from exportlm.export.manifest import manifest_path, verify_artifact
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import aborts_to_result
from pytest_exportcheck.checks._support import (
    build_case_model,
    default_model_name,
    export_fresh,
    listing,
    require_device,
    shared_artifact,
    target_info,
)

__all__ = ["TEMPORARY_NAMES", "artifact_contract", "temporary_files"]

#: Names (``fnmatch`` patterns, matched against every part of a file's path inside the
#: output) of what an interrupted or careless writer leaves behind: ``tempfile``'s
#: ``tmpXXXXXXXX``, ``*.tmp`` / ``*.partial`` downloads and staging files, locks, editor
#: backups. None of them belongs in a published artifact.
TEMPORARY_NAMES = (
    "tmp*",
    "*.tmp",
    "*.temp",
    "*.part",
    "*.partial",
    "*.incomplete",
    "*.lock",
    "*.swp",
    "*~",
    ".nfs*",
)


def temporary_files(names: Iterable[str]) -> list[str]:
    """The relative paths among ``names`` that look like leftovers (:data:`TEMPORARY_NAMES`)."""
    return sorted(
        name
        for name in names
        if any(
            fnmatchcase(part, pattern) for part in name.split("/") for pattern in TEMPORARY_NAMES
        )
    )


def _inside_problems(path: Path) -> list[str]:
    """What is wrong inside a directory artifact: a leftover, or a file its manifest omits."""
    if not path.is_dir():
        return []
    names = [p.relative_to(path).as_posix() for p in sorted(path.rglob("*")) if p.is_file()]
    problems = []
    leftovers = temporary_files(names)
    if leftovers:
        problems.append(f"temporary files left inside the artifact directory: {leftovers}")
    if not manifest_path(path).is_file():
        return [*problems, f"{path.name} has no exportlm manifest ({manifest_path(path).name})"]
    try:
        verify_artifact(path)  # every file inside must be one the manifest lists, unchanged
    except ArtifactIntegrityError as err:  # ManifestSchemaError included
        problems.append(str(err))
    return problems


def _companions(
    artifact: Path, names: Iterable[str], info: TargetInfo
) -> tuple[list[str], list[str]]:
    """(allowed companion files, unexpected files) among ``names`` besides the artifact."""
    allowed: list[str] = []
    stray: list[str] = []
    manifest = manifest_path(artifact).name  # exportlm writes it for every target
    for name in names:
        if name in (artifact.name, manifest):
            continue
        if (
            info.has("multi_file")
            and name.startswith(artifact.name + ".")
            and not temporary_files([name])
        ):
            allowed.append(name)
        else:
            stray.append(name)
    return allowed, stray


def _kind_problems(path: Path, out_dir: Path, info: TargetInfo) -> list[str]:
    """Where the returned path is and what it is, against the declaration."""
    problems: list[str] = []
    if path.resolve().parent != out_dir.resolve():
        problems.append(f"export returned {path}, not a path in the output directory {out_dir}")
    if info.artifact == "file" and not (path.is_file() and path.stat().st_size > 0):
        problems.append(f"declared artifact='file' but {path.name} is not a non-empty file")
    if info.artifact == "directory" and not (path.is_dir() and any(path.iterdir())):
        problems.append(
            f"declared artifact='directory' but {path.name} is not a non-empty directory"
        )
    return problems


@check("artifact_contract")
@aborts_to_result
def artifact_contract(case: TargetCase) -> CheckResult:
    """The export returns an existing path of the declared kind, and writes nothing else.

    Exports one toy model into an empty directory. The returned path must exist
    inside it, be a non-empty file (``artifact="file"``) or a non-empty directory
    (``artifact="directory"``), and be the only entry there, except companion files
    of a ``multi_file`` target named ``<artifact>.<something>`` (``model.onnx.data``)
    and the artifact's exportlm manifest (``<artifact>.manifest.json``).
    Leftover temporaries (``.model.onnx.*.tmp``) fail. Inside a directory artifact
    every file must be one its manifest lists, unchanged
    (:func:`exportlm.export.manifest.verify_artifact`), and none may be named like a
    temporary (:data:`TEMPORARY_NAMES`, e.g. ``tmpab12cd.partial``), listed or not.
    Under the plugin this is the shared (cached) export, which the cache runs into
    an empty directory of its own and refuses when the returned path does not exist
    or lies elsewhere.
    """
    info = target_info(case)
    require_device(case, info)
    name = default_model_name(case)
    if case.export is not None:
        path = shared_artifact(case, name)
        out_dir = path.parent  # the export's own directory (TargetCase.export)
    else:
        out_dir = case.workdir / "artifact_contract"
        path = export_fresh(case, build_case_model(case, name), out_dir)
    if not path.exists():
        return CheckResult.failed(f"export returned {path}, which does not exist")
    problems = _kind_problems(path, out_dir, info) + _inside_problems(path)
    companions, stray = _companions(path, listing(out_dir), info)
    if stray:
        problems.append(
            f"files written next to the artifact: {stray}"
            + ("" if info.has("multi_file") else " (the target does not declare 'multi_file')")
        )
    if problems:
        return CheckResult.failed(f"{case.target_id} exporting {name!r}: " + "; ".join(problems))
    return CheckResult.passed(
        f"{path.name} ({info.artifact}) with companions {companions}", companions=companions
    )
