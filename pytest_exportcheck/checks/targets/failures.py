"""Target checks of how a target fails: atomically, and loudly on an unknown option."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.export import (
    TargetInfo,
    accepted_kwargs,
)
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import (
    CheckAbort,
    aborts_to_result,
    error_text,
)
from pytest_exportcheck.checks._support import (
    artifact_name,
    build_case_model,
    default_model_name,
    listing,
    shared_artifact,
    smallest_case_model,
    target_info,
)
from pytest_exportcheck.checks.targets._publish import multi_file_problems

__all__ = [
    "MISSPELLED_KWARG",
    "SENTINEL_BYTES",
    "InjectedExportFailure",
    "PoisonedParameter",
    "atomic_failure",
    "poison_last_parameter",
    "unknown_kwargs",
]

#: Written at the output path before ``atomic_failure`` runs a failing export.
SENTINEL_BYTES = b"exportcheck sentinel: a failed export must leave this file untouched\n"
#: The misspelled option ``unknown_kwargs`` passes (``example_inputs`` is the real one).
MISSPELLED_KWARG = "example_input"


class InjectedExportFailure(RuntimeError):
    """Raised by a :class:`PoisonedParameter` when an exporter reads or computes with it."""


_METADATA_OPS = frozenset(
    {
        "__get__",
        "__repr__",
        "__format__",
        "__hash__",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "is_contiguous",
        "is_floating_point",
        "data_ptr",
    }
)


class PoisonedParameter(nn.Parameter):
    """A parameter whose metadata (shape, dtype, ...) reads fine but whose values raise.

    Any torch operation on it other than metadata access raises
    :class:`InjectedExportFailure`: tracing a forward through it, ``detach()`` in
    ``state_dict()``, ``.to()``, ``.contiguous()``, serialization. It makes any
    export target fail part way through, whether it traces or copies weights.
    """

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = getattr(func, "__name__", repr(func))
        if name in _METADATA_OPS:
            return super().__torch_function__(func, types, args, kwargs or {})
        raise InjectedExportFailure(
            f"exportcheck atomic_failure: the poisoned weight was used by {name}"
        )


def poison_last_parameter(model: nn.Module) -> str:
    """Replace the last parameter of ``model`` by a :class:`PoisonedParameter`; returns its name."""
    name, param = list(model.named_parameters())[-1]
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, leaf, PoisonedParameter(param.detach().clone(), requires_grad=False))
    return name


def _overwrite_kwargs(case: TargetCase) -> dict[str, Any]:
    """``overwrite=True`` for factories that take it, so the replace path is exercised."""
    names, _ = accepted_kwargs(case.services.registries.target_factory(case.target), skip=2)
    return {"overwrite": True} if "overwrite" in names else {}


def _write_sentinel(path: Path, info: TargetInfo) -> Path:
    """Pre-create an artifact at ``path``: the sentinel file itself, or a directory holding it."""
    if info.artifact == "directory":
        path.mkdir(parents=True)
        (path / "sentinel.bin").write_bytes(SENTINEL_BYTES)
        return path / "sentinel.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SENTINEL_BYTES)
    return path


def _failing_export(case: TargetCase, model: nn.Module, output: Path) -> BaseException | None:
    kwargs = {**dict(case.export_kwargs), **_overwrite_kwargs(case)}
    with case.services.phase("export"):
        case.services.profile.count("exports")
        try:
            case.services.registries.export(case.target, model, output, **kwargs)
        except Exception as err:
            return err
    return None


@check("atomic_failure")
@aborts_to_result
def atomic_failure(case: TargetCase) -> CheckResult:
    """A failing export leaves no artifact, and an existing artifact untouched.

    The last weight of a toy model is replaced by a :class:`PoisonedParameter`
    (metadata reads fine, any use of its values raises), so the export fails part
    way through, whether the target traces the model or copies its weights. The
    model is the default family with one decoder layer where the family takes that
    override (:func:`~._support.smallest_case_model`): these exports run afresh on
    every run, and depth changes nothing about how a target writes or fails.
    Twice: into an empty directory, which must stay empty (no partial file, no
    temporary); and over a pre-created artifact (sentinel bytes at the output
    path; ``overwrite=True`` is passed to factories that accept it), which must be
    byte-identical afterwards with nothing else in the directory. An export that
    does not raise fails the check.

    Multi-file targets (``multi_file``, or ``artifact="directory"``) are also failed
    part way through publishing: the second rename into the output directory (after
    the first file of the new artifact is in place) raises. Into an empty directory,
    no artifact may appear at the path; over an artifact exported just before (with
    other weights), every file of the old artifact must be byte-identical and the
    path must still load. A target that publishes in one rename passes trivially.
    """
    info = target_info(case)
    name = default_model_name(case)
    outcomes: list[str] = []
    for phase in ("fresh", "existing"):
        model = smallest_case_model(case, name)
        poisoned = poison_last_parameter(model)
        directory = case.workdir / f"atomic_{phase}"
        directory.mkdir(parents=True, exist_ok=True)
        output = directory / artifact_name(info)
        sentinel = _write_sentinel(output, info) if phase == "existing" else None
        err = _failing_export(case, model, output)
        if err is None:
            return CheckResult.failed(
                f"exporting {name!r} with {poisoned!r} poisoned (every use of its values raises) "
                f"succeeded with {case.target_id}; the export must fail when a weight cannot be read"
            )
        left = listing(directory)
        if sentinel is None and left:
            return CheckResult.failed(
                f"a failed export ({type(err).__name__}) left {left} in the empty output directory; "
                "write into a temporary sibling and os.replace it at the end (exportlm.export.atomic_output)",
                exception=err,
            )
        if sentinel is not None:
            problems = _sentinel_problems(output, sentinel, left, info)
            if problems:
                return CheckResult.failed(
                    f"a failed export ({type(err).__name__}) over an existing artifact: {problems}",
                    exception=err,
                )
        outcomes.append(f"{phase}: {_cause_chain(err)}")
    if info.has("multi_file") or info.artifact == "directory":
        kwargs = {**dict(case.export_kwargs), **_overwrite_kwargs(case)}
        problem, passed = multi_file_problems(case, info, name, kwargs)
        if problem:
            return CheckResult.failed(
                f"a multi-file export of {name!r} with {case.target_id} that failed part way "
                f"through publishing left a mixed artifact ({problem}); publish companions "
                "under new names and the artifact last, or swap a staged directory in one "
                "rename (exportlm.atomic.atomic_output)"
            )
        outcomes.append(f"multi-file: {passed}")
    return CheckResult.passed("; ".join(outcomes))


def _cause_chain(err: BaseException) -> str:
    """``Outer <- Inner <- Root`` exception type names along the cause/context chain."""
    names: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names.append(type(current).__name__)
        current = current.__cause__ or current.__context__
    return " <- ".join(names)


def _sentinel_problems(output: Path, sentinel: Path, left: list[str], info: TargetInfo) -> str:
    if left != [output.name]:
        return f"the directory holds {left}, expected only {output.name}"
    if info.artifact == "directory" and listing(output) != [sentinel.name]:
        return f"the existing directory now holds {listing(output)}, expected only {sentinel.name}"
    if not sentinel.is_file() or sentinel.read_bytes() != SENTINEL_BYTES:
        return f"the existing artifact {sentinel} was modified"
    return ""


@check("unknown_kwargs")
@aborts_to_result
def unknown_kwargs(case: TargetCase) -> CheckResult:
    """A misspelled option is refused with a ``TypeError`` naming it, never swallowed.

    Exports with ``example_input=`` (for ``example_inputs``) and loads the shared
    artifact with the same misspelled option. Both must raise ``TypeError``
    (``UnknownOptionError`` is one) whose message names the option, and the
    export must write nothing.
    """
    name = default_model_name(case)
    model = build_case_model(case, name)
    info = target_info(case)
    directory = case.workdir / "unknown_kwargs"
    directory.mkdir(parents=True, exist_ok=True)
    bad: dict[str, Any] = {MISSPELLED_KWARG: None}
    output = directory / artifact_name(info)
    problems, cause = _refusal(
        "export",
        "export",
        lambda: case.services.registries.export(
            case.target, model, output, **case.export_kwargs, **bad
        ),
    )
    if listing(directory):
        problems.append(f"the refused export wrote {listing(directory)}")
    try:
        artifact: Path | None = shared_artifact(case, name)
    except CheckAbort as abort:  # the runtime half needs an artifact; report the export half
        artifact = None
        note = f" (runtime loader not checked: {abort.result.message.splitlines()[0]})"
    if artifact is not None:
        note = ""
        found, raised = _refusal(
            "runtime loader",
            "the runtime loader",
            lambda: case.services.registries.load(case.target, artifact, **bad),
        )
        problems += found
        cause = cause or raised
    if problems:
        return CheckResult.failed(
            f"{case.target_id}: " + "; ".join(problems) + note, exception=cause
        )
    where = "export" if artifact is None else "export and runtime"
    return CheckResult.passed(f"{MISSPELLED_KWARG!r} refused by {where}{note}")


def _refusal(
    where: str, subject: str, call: Callable[[], Any]
) -> tuple[list[str], BaseException | None]:
    """Run ``call`` (it passes the misspelled option): its problems, and the exception behind them."""
    try:
        call()
    except Exception as err:
        problems = _refusal_problems(where, err)
        return problems, (err if problems else None)
    return [f"{subject} accepted the unknown option {MISSPELLED_KWARG!r}"], None


def _refusal_problems(where: str, err: BaseException) -> list[str]:
    if not isinstance(err, TypeError):
        return [
            f"{where} raised {type(err).__name__} for the unknown option {MISSPELLED_KWARG!r}, "
            f"expected a TypeError: {error_text(err).splitlines()[0]}"
        ]
    if MISSPELLED_KWARG not in str(err):
        return [f"{where}'s TypeError does not name the option {MISSPELLED_KWARG!r}: {err}"]
    return []
