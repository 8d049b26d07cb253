"""Target check of the trust boundary: ``trust``.

A format whose loader can run code (a pickle stream that imports and calls
arbitrary callables, a TorchScript archive with its ``code/``) must be declared
with ``executes_code=True``, so that :func:`exportlm.export.load_exported` refuses
such an artifact unless its manifest proves it was written on this machine or the
caller passes ``trust=True``. This check finds what the declaration should say by
scanning the exported files, and checks the refusal on a copy whose manifest is
signed by nobody.
"""

from __future__ import annotations

import io
import json
import pickletools
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

from exportlm.errors import UntrustedArtifactError
from exportlm.export.manifest import manifest_path
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import aborts_to_result, error_text
from pytest_exportcheck.checks._support import (
    default_model_name,
    runtime_kwargs,
    shared_artifact,
    target_info,
)

__all__ = ["SAFE_PICKLE_GLOBALS", "code_in", "trust"]

#: Callables a pickle of plain tensors and containers imports (what
#: ``torch.load(weights_only=True)`` rebuilds); any other import executes code.
SAFE_PICKLE_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.tuple",
        "builtins.list",
        "builtins.dict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch.device",
        "torch.Size",
    }
)
_SAFE_TORCH_SUFFIXES = ("Storage", "float32", "float16", "bfloat16", "float64", "int64", "int32")
#: Larger zip members are not read in full (weights, not pickles).
_MAX_PICKLE_BYTES = 64 << 20


def _is_safe(name: str) -> bool:
    if name in SAFE_PICKLE_GLOBALS:
        return True
    module, _, attr = name.rpartition(".")
    return module == "torch" and attr.endswith(_SAFE_TORCH_SUFFIXES)


def _pickle_imports(data: bytes) -> list[str] | None:
    """The ``module.name`` callables a pickle stream imports; ``None`` if it is no pickle."""
    if len(data) < 2 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        return None
    imports: list[str] = []
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            if opcode.name in ("GLOBAL", "INST"):
                imports.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                imports.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # not a pickle after all (raw weights that start like one)
        return None
    return imports


def _zip_findings(path: Path) -> Iterator[str]:
    with zipfile.ZipFile(path) as archive:
        for member in archive.infolist():
            parts = member.filename.split("/")
            if "code" in parts[:-1] and member.filename.endswith(".py"):
                yield f"{path.name}: a TorchScript archive ({member.filename}), run on load"
                return
            if member.file_size > _MAX_PICKLE_BYTES:
                continue
            with archive.open(member) as handle:
                head = handle.read(2)
            if len(head) == 2 and head[0] == 0x80:
                yield from _pickle_findings(f"{path.name}:{member.filename}", archive.read(member))


def _pickle_findings(where: str, data: bytes) -> Iterator[str]:
    imports = _pickle_imports(data)
    unsafe = sorted({name for name in imports or () if not _is_safe(name)})
    if unsafe:
        shown = ", ".join(unsafe[:4]) + (f" and {len(unsafe) - 4} more" if len(unsafe) > 4 else "")
        yield f"{where}: a pickle that imports and calls {shown}"


def code_in(files: list[Path]) -> list[str]:
    """What in ``files`` would execute code when loaded (empty when nothing would)."""
    found: list[str] = []
    for path in files:
        if zipfile.is_zipfile(path):
            found.extend(_zip_findings(path))
        elif path.stat().st_size <= _MAX_PICKLE_BYTES:
            found.extend(_pickle_findings(path.name, path.read_bytes()))
    return found


def _artifact_files(artifact: Path) -> list[Path]:
    if artifact.is_dir():
        return sorted(p for p in artifact.rglob("*") if p.is_file())
    manifest = manifest_path(artifact)
    siblings = artifact.parent.glob(artifact.name + ".*")
    return [artifact, *sorted(p for p in siblings if p != manifest and p.is_file())]


def _unsigned_copy(artifact: Path, directory: Path) -> Path:
    """A copy of ``artifact`` (with companions) whose manifest carries no signature."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    copy = directory / artifact.name
    if artifact.is_dir():
        shutil.copytree(artifact, copy)
    else:
        for path in artifact.parent.glob(artifact.name + "*"):
            shutil.copy(path, directory / path.name)
    manifest = manifest_path(copy)
    if manifest.is_file():
        manifest.chmod(0o644)
        data = json.loads(manifest.read_text())
        data.pop("hmac", None)  # re-signed by nobody: hashes still match, origin unproven
        manifest.write_text(json.dumps(data, indent=2, sort_keys=True))
    for path in [copy, *copy.rglob("*")] if copy.is_dir() else directory.iterdir():
        path.chmod(path.stat().st_mode | 0o200)
    return copy


@check("trust")
@aborts_to_result
def trust(case: TargetCase) -> CheckResult:
    """A target whose artifacts can execute code when loaded declares ``executes_code=True``.

    Scans every file of the toy model's artifact (and its companions) for what a
    loader would run: a TorchScript archive (a zip with a ``code/`` directory), or a
    pickle stream (raw, or a member of a zip archive such as a ``.pt2``) that
    imports a callable outside the tensor-rebuilding ones
    (:data:`SAFE_PICKLE_GLOBALS`). Finding one in a target that does not declare
    ``executes_code`` fails. A target that declares it must refuse a copy of the
    artifact whose manifest is signed by nobody: ``load_exported(target, copy)``
    without ``trust=True`` must raise ``UntrustedArtifactError`` naming the file.
    """
    info = target_info(case)
    name = default_model_name(case)
    artifact = shared_artifact(case, name)
    found = code_in(_artifact_files(artifact))
    declared = bool(getattr(info, "executes_code", False))
    if found and not declared:
        return CheckResult.failed(
            f"{case.target_id}: loading its artifact can execute code ({'; '.join(found)}), "
            "but the target does not declare it; declare executes_code=True in its "
            "export_target(...) so that load_exported refuses foreign artifacts"
        )
    if not declared:
        return CheckResult.passed("nothing in the artifact executes code when loaded")
    copy = _unsigned_copy(artifact, case.workdir / "trust")
    try:
        case.services.registries.load(case.target, copy, **runtime_kwargs(case))
    except UntrustedArtifactError as err:
        if copy.name not in str(err):
            return CheckResult.failed(f"the refusal does not name the file {copy.name}: {err}")
        return CheckResult.passed(
            "declares executes_code; refuses a copy signed by nobody without trust=True",
            found=found,
        )
    except Exception as err:
        return CheckResult.failed(
            f"loading a copy whose manifest is signed by nobody raised {error_text(err)}; "
            "expected UntrustedArtifactError (the target declares executes_code)",
            exception=err,
        )
    return CheckResult.failed(
        f"{case.target_id} declares executes_code, but a copy of its artifact whose manifest "
        "is signed by nobody loaded without trust=True"
    )
