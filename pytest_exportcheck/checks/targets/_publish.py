"""``atomic_failure`` for multi-file artifacts: fail the export after its first file is published.

A multi-file artifact (ONNX graph + external data, a checkpoint directory) is
published by several renames into the output directory. A target that renames
the new data over the old data and then the new graph over the old graph leaves,
if it fails or crashes in between, the old graph reading the new weights. This
module makes the second such rename fail and checks that the path still holds the
old artifact, byte for byte and loadable (or, without one, no artifact at all).

exportlm's own manifest (published by ``export_model`` after the target's files,
for every target) is not counted: the check holds the target to the rule, not
exportlm's manifest step.

Renames are observed by wrapping ``os.replace`` and ``os.rename`` (``Path.replace``,
``Path.rename`` and ``shutil.move`` go through them) for the duration of one
export. Python has no public hook to observe a process's renames, and
``exportlm.atomic.publish_steps`` sees exportlm's own writer only, while third-party
targets are held to the same rule. The wrapping is process-wide and not
thread-safe: the check runs one export at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.export import (
    TargetInfo,
    accepted_kwargs,
)
from exportlm.export.manifest import DIRECTORY_MANIFEST_NAME, MANIFEST_SUFFIX
from pytest_exportcheck.checks._api import TargetCase
from pytest_exportcheck.checks._support import (
    artifact_name,
    runtime_kwargs,
    smallest_case_model,
)

__all__ = ["InjectedPublishFailure", "fail_nth_publish", "multi_file_problems"]

#: Which publishing rename fails: the one after the first file is in place.
FAILING_STEP = 2


class InjectedPublishFailure(OSError):
    """Raised by :func:`fail_nth_publish` in place of a rename into the output directory."""


def _publishes(destination: Any, output: Path) -> bool:
    """Whether a rename to ``destination`` makes something visible at or beside ``output``."""
    try:
        path = Path(os.fsdecode(destination)).absolute()
    except TypeError:  # an fd or something else: not a path we can place
        return False
    if _is_manifest(path.name, output):
        return False  # exportlm's manifest, published by export_model for every target
    return path == output or path.parent == output.parent or output in path.parents


@contextlib.contextmanager
def fail_nth_publish(output: Path, nth: int) -> Iterator[list[str]]:
    """Make the ``nth`` rename into ``output``'s directory raise; yields the renames seen."""
    output = output.absolute()
    seen: list[str] = []
    originals = {"replace": os.replace, "rename": os.rename}

    def wrap(real: Callable[..., None]) -> Callable[..., None]:
        def renaming(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if not args and not kwargs and _publishes(dst, output):
                seen.append(os.fsdecode(dst))
                if len(seen) == nth:
                    raise InjectedPublishFailure(
                        f"exportcheck atomic_failure: publishing {os.fsdecode(dst)} (rename "
                        f"{nth} into the output directory) failed"
                    )
            real(src, dst, *args, **kwargs)

        return renaming

    os.replace = wrap(originals["replace"])  # type: ignore[assignment]
    os.rename = wrap(originals["rename"])  # type: ignore[assignment]
    try:
        yield seen
    finally:
        os.replace = originals["replace"]  # type: ignore[assignment]
        os.rename = originals["rename"]  # type: ignore[assignment]


def _tree(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory``."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _other_weights(model: nn.Module) -> nn.Module:
    """``model`` with every floating-point weight halved: a new artifact with other bytes."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.mul_(0.5)
    return model


def multi_file_problems(
    case: TargetCase, info: TargetInfo, name: str, kwargs: dict[str, Any]
) -> tuple[str, str]:
    """Run the multi-file phases on family ``name``; returns ``(problem, "")`` or
    ``("", what passed)``.

    A factory that takes ``external_data`` gets ``external_data=True``, so even the
    small toy model is written as several files. The model is family ``name`` with
    one decoder layer where it takes that override (``smallest_case_model``). The
    artifact the second phase fails over is the cached export of that model with
    these options, copied.
    """

    def build() -> nn.Module:
        return smallest_case_model(case, name)

    names, _ = accepted_kwargs(case.services.registries.target_factory(case.target), skip=2)
    external = {"external_data": True} if "external_data" in names else {}
    kwargs = {**kwargs, **external}
    notes: list[str] = []
    for phase in ("fresh", "existing"):
        directory = case.workdir / f"atomic_multi_{phase}"
        directory.mkdir(parents=True, exist_ok=True)
        output = directory / artifact_name(info)
        before: dict[str, str] = {}
        if phase == "existing":
            _existing_artifact(case, output, build(), kwargs, external)
            before = _tree(directory)
        err: BaseException | None = None
        with fail_nth_publish(output, FAILING_STEP) as seen, case.services.phase("export"):
            case.services.profile.count("exports")
            try:
                case.services.registries.export(
                    case.target, _other_weights(build()), output, **kwargs
                )
            except Exception as raised:
                err = raised
        if len(seen) < FAILING_STEP:
            notes.append(f"{phase}: published in {len(seen)} rename(s)")
            continue
        if err is None:
            return f"{phase}: the failed rename {seen[FAILING_STEP - 1]} was not reported", ""
        problem = _left_problem(case, output, directory, before)
        if problem:
            return f"{phase}: failing rename {FAILING_STEP} of {seen}: {problem}", ""
        notes.append(f"{phase}: rename {FAILING_STEP} of {len(seen)} failed, old artifact kept")
    return "", "; ".join(notes)


def _existing_artifact(
    case: TargetCase,
    output: Path,
    model: nn.Module,
    kwargs: dict[str, Any],
    external: dict[str, Any],
) -> None:
    """Put an artifact of ``model`` at ``output``: a writable copy of its cached export
    when the case has an artifact cache (then a rerun exports it no more), else a
    fresh export."""
    if case.export_instance is None:
        with case.services.phase("export"):
            case.services.profile.count("exports")
            case.services.registries.export(case.target, model, output, **kwargs)
        return
    artifact = Path(case.export_instance(model, **external))
    for source in sorted(artifact.parent.iterdir()):
        name = output.name if source.name == artifact.name else source.name
        target = output.parent / name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)
    for path in [output.parent, *output.parent.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _left_problem(case: TargetCase, output: Path, directory: Path, before: dict[str, str]) -> str:
    if not before:
        if output.exists():
            return f"{output.name} exists after a failed export into an empty directory"
        return ""
    after = _tree(directory)
    changed = sorted(
        name
        for name, digest in before.items()
        if after.get(name) != digest and not _is_manifest(name, output)
    )
    if changed:
        return f"files of the old artifact were changed or removed: {changed}"
    try:  # written by this check a moment ago: trusted, with or without its manifest
        case.services.registries.load(case.target, output, trust=True, **runtime_kwargs(case))
    except Exception as err:
        return f"the old artifact no longer loads: {type(err).__name__}: {err}".splitlines()[0]
    return ""


def _is_manifest(name: str, output: Path) -> bool:
    """Whether ``name`` (relative to the output directory) is exportlm's manifest."""
    leaf = name.rsplit("/", 1)[-1]
    return leaf in (output.name + MANIFEST_SUFFIX, DIRECTORY_MANIFEST_NAME)
