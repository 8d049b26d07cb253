"""Checks of export targets (scope ``"target"``), run for every target and variant.

Each check is a plain function ``(TargetCase) -> CheckResult``. Per-model checks
use the artifact shared through ``case.export`` (cached by the plugin); checks
that need an artifact of their own export with ``export_model`` into
``case.workdir``.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    TargetInfo,
    check_kwargs,
    ensure_exporters_registered,
    export_model,
    get_target_info,
    load_exported,
)
from exportlm.export._base import accepted_kwargs
from exportlm.export._compare import compare_logits
from exportlm.models import DecoderModel, seeded_init_
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._support import (
    TRACED_SHAPE,
    CheckAbort,
    aborts_to_result,
    accepts_reason,
    artifact_name,
    attempt,
    build_case_model,
    default_model_name,
    eager_logits,
    error_text,
    export_fresh,
    export_instance,
    input_ids_for,
    load_runtime,
    load_shared_runtime,
    require_device,
    run_runtime,
    shared_artifact,
    target_info,
)

__all__ = [
    "DYNAMIC_SHAPES",
    "MISSPELLED_KWARG",
    "SENTINEL_BYTES",
    "InjectedExportFailure",
    "PoisonedParameter",
    "artifact_contract",
    "atomic_failure",
    "cache_wrapper",
    "deterministic",
    "dynamic_shapes",
    "plugin_loads",
    "poison_last_parameter",
    "registered",
    "roundtrip_logits",
    "unknown_kwargs",
]

#: ``(batch, seq)`` shapes other than the traced one, for ``dynamic_shapes``.
DYNAMIC_SHAPES = ((1, 5), (3, 11))
#: Written at the output path before ``atomic_failure`` runs a failing export.
SENTINEL_BYTES = b"exportcheck sentinel: a failed export must leave this file untouched\n"
#: The misspelled option ``unknown_kwargs`` passes (``example_inputs`` is the real one).
MISSPELLED_KWARG = "example_input"
#: Seed of the input ids of roundtrips (not the traced ids, which use seed 0).
_IDS_SEED = 1


# ----------------------------------------------------------------------------- plugin_loads


@check("plugin_loads", scope="target")
def plugin_loads(case: TargetCase) -> CheckResult:
    """The target's entry point (and its runtime's) loaded, and claims no taken name.

    Fails with the :class:`~exportlm.errors.PluginLoadError` (entry point,
    distribution, cause) of a plugin that failed to import or validate, or with
    the :class:`~exportlm.errors.RegistryConflictError` of an entry point that
    claims a name already registered (e.g. ``onnx``). The plugin also reports
    every broken plugin as a failing ``plugin_loads`` item of its own.
    """
    ensure_exporters_registered()
    errors: list[str] = []
    for registry in (EXPORT_REGISTRY, RUNTIME_REGISTRY):
        failed = registry.failed().get(case.target)
        if failed is not None:
            errors.append(f"{registry.kind}: {failed}")
        for err in registry.plugin_errors:
            if getattr(err, "name", None) == case.target and err is not failed:
                errors.append(f"{registry.kind}: {err}")
    if errors:
        return CheckResult.failed("; ".join(errors), errors=errors)
    return CheckResult.passed(f"target {case.target!r} and its runtime loaded")


# ----------------------------------------------------------------------------- registered


def _binds(fn: Callable[..., Any], *args: Any) -> str | None:
    """``None`` if ``fn`` can be called with ``args`` positionally, else why not."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as err:
        return f"{err} (signature {inspect.signature(fn)})"
    except ValueError:  # a builtin without a signature: accept, it will be called anyway
        return None
    return None


def _info_problems(case: TargetCase, info: TargetInfo) -> Iterable[str]:
    for name in ("atol", "rtol"):
        value = getattr(info, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            yield f"{name}={value!r} is not a finite number >= 0"
    if info.accepts is not None and not callable(info.accepts):
        yield f"accepts={info.accepts!r} is not callable"
    if case.variant is not None and case.variant not in info.variants:
        yield f"variant {case.variant!r} is not declared; declared: {sorted(info.variants)}"
    factory = EXPORT_REGISTRY.get(case.target)
    for variant, kwargs in info.variants.items():
        try:
            check_kwargs(f"variant {variant!r}", factory, kwargs)
        except TypeError as err:
            yield f"variant {variant!r} passes options the factory refuses: {err}"


@check("registered", scope="target")
@aborts_to_result
def registered(case: TargetCase) -> CheckResult:
    """The name resolves; factory and runtime are callable with the contract's signatures.

    The factory must take ``(model, output_path, **kwargs)`` and the runtime loader
    ``(artifact, **kwargs)``; the declared runtime must be registered; the
    :class:`~exportlm.export.TargetInfo` must be sane (finite ``atol``/``rtol``
    >= 0, a callable ``accepts``, the case's variant declared, and every variant's
    kwargs accepted by the factory).
    """
    ensure_exporters_registered()
    factory = attempt(f"EXPORT_REGISTRY.get({case.target!r})", EXPORT_REGISTRY.get, case.target)
    info = attempt(f"get_target_info({case.target!r})", get_target_info, case.target)
    problems: list[str] = []
    if not callable(factory):
        problems.append(f"the factory {factory!r} is not callable")
    else:
        why = _binds(factory, object(), Path("model"))
        if why:
            problems.append(f"the factory cannot be called as (model, output_path): {why}")
    if info.runtime not in RUNTIME_REGISTRY:
        failed = RUNTIME_REGISTRY.failed().get(info.runtime)
        problems.append(
            f"runtime {info.runtime!r} is not registered"
            + (f" (its plugin failed: {failed})" if failed else "")
        )
    else:
        loader = RUNTIME_REGISTRY.get(info.runtime)
        why = _binds(loader, Path("model")) if callable(loader) else "not callable"
        if why:
            problems.append(f"runtime {info.runtime!r} cannot be called as (artifact): {why}")
    problems.extend(_info_problems(case, info))
    if problems:
        return CheckResult.failed(f"target {case.target_id!r}: " + "; ".join(problems))
    return CheckResult.passed(
        f"{case.target_id}: runtime {info.runtime!r}, artifact {info.artifact}, "
        f"capabilities {sorted(info.capabilities)}",
        runtime=info.runtime,
        capabilities=sorted(info.capabilities),
    )


# ----------------------------------------------------------------------------- artifact_contract


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def _companions(
    artifact: Path, names: Iterable[str], info: TargetInfo
) -> tuple[list[str], list[str]]:
    """(allowed companion files, unexpected files) among ``names`` besides the artifact."""
    allowed: list[str] = []
    stray: list[str] = []
    for name in names:
        if name == artifact.name:
            continue
        if info.has("multi_file") and name.startswith(artifact.name + "."):
            allowed.append(name)
        else:
            stray.append(name)
    return allowed, stray


@check("artifact_contract", scope="target")
@aborts_to_result
def artifact_contract(case: TargetCase) -> CheckResult:
    """The export returns an existing path of the declared kind, and writes nothing else.

    Exports one toy model into an empty directory. The returned path must exist
    inside it, be a non-empty file (``artifact="file"``) or a non-empty directory
    (``artifact="directory"``), and be the only entry there, except companion files
    of a ``multi_file`` target named ``<artifact>.<something>`` (``model.onnx.data``).
    Leftover temporaries (``.model.onnx.*.tmp``) fail. Under the plugin this is the
    shared (cached) export, which the cache runs into an empty directory of its own
    and refuses when the returned path does not exist or lies elsewhere.
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
    problems: list[str] = []
    if not path.exists():
        return CheckResult.failed(f"export returned {path}, which does not exist")
    if path.resolve().parent != out_dir.resolve():
        problems.append(f"export returned {path}, not a path in the output directory {out_dir}")
    if info.artifact == "file" and not (path.is_file() and path.stat().st_size > 0):
        problems.append(f"declared artifact='file' but {path.name} is not a non-empty file")
    if info.artifact == "directory" and not (path.is_dir() and any(path.iterdir())):
        problems.append(
            f"declared artifact='directory' but {path.name} is not a non-empty directory"
        )
    companions, stray = _companions(path, _listing(out_dir), info)
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


# ----------------------------------------------------------------------------- roundtrips


def _roundtrip(
    case: TargetCase,
    info: TargetInfo,
    model: nn.Module,
    runtime: Callable[[torch.Tensor], Any],
    shape: tuple[int, int],
) -> CheckResult:
    ids = input_ids_for(model, shape[0], shape[1], seed=case.seed + _IDS_SEED, device=case.device)
    expected = eager_logits(model, ids)
    actual = run_runtime(runtime, ids)
    result = compare_logits(actual, expected, info.atol, info.rtol)
    where = f"input_ids {list(shape)}"
    if not result.passed:
        return CheckResult.failed(
            f"{case.target_id} logits differ from the eager model at {where}: {result.summary()}",
            **result.details(),
        )
    return CheckResult.passed(f"{where}: {result.summary()}", **result.details())


@check("roundtrip_logits", scope="target", per_model=True)
@aborts_to_result
def roundtrip_logits(case: TargetCase) -> CheckResult:
    """The artifact, run in the target's own runtime, gives the eager model's logits.

    Reference: the toy model under ``ExportCacheWrapper`` (``use_cache=False``,
    logits only) on deterministic ``input_ids`` of the traced shape ``[2, 8]``
    (numpy PCG64, not the traced values). Fails (never warns) when any element
    is beyond ``atol + rtol * |expected|`` of the target's declaration, or is NaN
    / inf; the message gives max abs, max rel and mismatch %.
    """
    info = target_info(case)
    require_device(case, info)
    name = default_model_name(case)
    model = build_case_model(case, name)
    runtime = load_shared_runtime(case, shared_artifact(case, name))
    return _roundtrip(case, info, model, runtime, TRACED_SHAPE)


@check("dynamic_shapes", scope="target", per_model=True, needs=("dynamic_shapes",))
@aborts_to_result
def dynamic_shapes(case: TargetCase) -> CheckResult:
    """The same artifact runs at other batch sizes and sequence lengths than it was traced with.

    Only for targets declaring ``dynamic_shapes``. Runs ``input_ids`` of shapes
    ``[1, 5]`` and ``[3, 11]`` (the trace used ``[2, 8]``) and compares with the
    eager model as ``roundtrip_logits`` does.
    """
    info = target_info(case)
    if not info.has("dynamic_shapes"):
        return CheckResult.skipped(f"target {case.target_id!r} does not declare 'dynamic_shapes'")
    require_device(case, info)
    name = default_model_name(case)
    model = build_case_model(case, name)
    runtime = load_shared_runtime(case, shared_artifact(case, name))
    passed: list[str] = []
    for shape in DYNAMIC_SHAPES:
        result = _roundtrip(case, info, model, runtime, shape)
        if not result.ok:
            return result
        passed.append(result.message)
    return CheckResult.passed("; ".join(passed), shapes=[list(s) for s in DYNAMIC_SHAPES])


class _CacheByDefault(nn.Module):
    """A decoder whose plain call returns ``(logits, kv_cache)``: ``use_cache`` defaults to True."""

    def __init__(self, decoder: DecoderModel) -> None:
        super().__init__()
        self.decoder = decoder
        self.config = decoder.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
    ) -> Any:
        return self.decoder(input_ids, attention_mask=attention_mask, use_cache=use_cache)


@check("cache_wrapper", scope="target")
@aborts_to_result
def cache_wrapper(case: TargetCase) -> CheckResult:
    """A model returning ``(logits, kv_cache)`` exports as logits only.

    Wraps the ``decoder`` toy model so that its plain call returns
    ``(logits, kv_cache)`` (``use_cache`` defaults to ``True``, as in transformers).
    A target must export it through ``ExportCacheWrapper``: its runtime returns one
    logits tensor, equal within tolerance to the model with ``use_cache=False``.
    Targets that refuse a plain ``nn.Module`` (their ``accepts``) skip.
    """
    info = target_info(case)
    require_device(case, info)
    decoder = DecoderModel()
    seeded_init_(decoder, case.seed)
    model = _CacheByDefault(decoder).eval().to(case.device)
    reason = accepts_reason(case.target, model)
    if reason:
        return CheckResult.skipped(
            f"target {case.target_id!r} does not take a plain decoder: {reason}"
        )
    with torch.no_grad():
        raw = model(input_ids_for(model, 1, 2, seed=0, device=case.device))
    if not (isinstance(raw, tuple) and len(raw) == 2):  # the premise of the check
        return CheckResult.failed(
            f"the test model returned {type(raw).__name__}, not (logits, cache)"
        )
    runtime = load_runtime(case, export_instance(case, model, case.workdir / "cache_wrapper"))
    return _roundtrip(case, info, model, runtime, TRACED_SHAPE)


@check("deterministic", scope="target")
@aborts_to_result
def deterministic(case: TargetCase) -> CheckResult:
    """Two exports of the same model give bit-identical runtime outputs.

    Compares the shared artifact with a second, fresh export (``atol = rtol = 0``).
    Whether the artifact bytes are identical too is reported in the details
    (``same_bytes``), not required.
    """
    info = target_info(case)
    require_device(case, info)
    name = default_model_name(case)
    model = build_case_model(case, name)
    first = shared_artifact(case, name)
    second = export_fresh(case, model, case.workdir / "deterministic")
    ids = input_ids_for(model, *TRACED_SHAPE, seed=case.seed + _IDS_SEED, device=case.device)
    a = run_runtime(load_shared_runtime(case, first), ids)
    b = run_runtime(load_runtime(case, second), ids)
    result = compare_logits(b, a, 0.0, 0.0)
    same_bytes = _digest(first) == _digest(second)
    if not result.passed:
        return CheckResult.failed(
            f"two exports of {name!r} with {case.target_id} give different outputs: {result.summary()}",
            same_bytes=same_bytes,
            **result.details(),
        )
    return CheckResult.passed(
        f"identical outputs (artifact bytes {'identical' if same_bytes else 'differ'})",
        same_bytes=same_bytes,
    )


def _digest(path: Path) -> str:
    """sha256 over the artifact (and, for a directory, every file's relative name and bytes)."""
    sha = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        sha.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        sha.update(file.read_bytes())
    return sha.hexdigest()


# ----------------------------------------------------------------------------- failure behaviour


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
    names, _ = accepted_kwargs(EXPORT_REGISTRY.get(case.target))
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
    try:
        export_model(case.target, model, output, **kwargs)
    except Exception as err:
        return err
    return None


@check("atomic_failure", scope="target")
@aborts_to_result
def atomic_failure(case: TargetCase) -> CheckResult:
    """A failing export leaves no artifact, and an existing artifact untouched.

    The last weight of a toy model is replaced by a :class:`PoisonedParameter`
    (metadata reads fine, any use of its values raises), so the export fails part
    way through, whether the target traces the model or copies its weights.
    Twice: into an empty directory, which must stay empty (no partial file, no
    temporary); and over a pre-created artifact (sentinel bytes at the output
    path; ``overwrite=True`` is passed to factories that accept it), which must be
    byte-identical afterwards with nothing else in the directory. An export that
    does not raise fails the check.
    """
    info = target_info(case)
    name = default_model_name(case)
    outcomes: list[str] = []
    for phase in ("fresh", "existing"):
        model = build_case_model(case, name)
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
        left = _listing(directory)
        if sentinel is None and left:
            return CheckResult.failed(
                f"a failed export ({type(err).__name__}) left {left} in the empty output directory; "
                "write into a temporary sibling and os.replace it at the end (exportlm.export.atomic_output)"
            )
        if sentinel is not None:
            problems = _sentinel_problems(output, sentinel, left, info)
            if problems:
                return CheckResult.failed(
                    f"a failed export ({type(err).__name__}) over an existing artifact: {problems}"
                )
        outcomes.append(f"{phase}: {_cause_chain(err)}")
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
    if info.artifact == "directory" and _listing(output) != [sentinel.name]:
        return f"the existing directory now holds {_listing(output)}, expected only {sentinel.name}"
    if not sentinel.is_file() or sentinel.read_bytes() != SENTINEL_BYTES:
        return f"the existing artifact {sentinel} was modified"
    return ""


@check("unknown_kwargs", scope="target")
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
    bad = {MISSPELLED_KWARG: None}
    problems: list[str] = []
    try:
        export_model(
            case.target, model, directory / artifact_name(info), **case.export_kwargs, **bad
        )
    except Exception as err:
        problems.extend(_refusal_problems("export", err))
    else:
        problems.append(f"export accepted the unknown option {MISSPELLED_KWARG!r}")
    if _listing(directory):
        problems.append(f"the refused export wrote {_listing(directory)}")
    try:
        artifact: Path | None = shared_artifact(case, name)
    except CheckAbort as abort:  # the runtime half needs an artifact; report the export half
        artifact = None
        note = f" (runtime loader not checked: {abort.result.message.splitlines()[0]})"
    if artifact is not None:
        note = ""
        try:
            load_exported(case.target, artifact, **bad)
        except Exception as err:
            problems.extend(_refusal_problems("runtime loader", err))
        else:
            problems.append(f"the runtime loader accepted the unknown option {MISSPELLED_KWARG!r}")
    if problems:
        return CheckResult.failed(f"{case.target_id}: " + "; ".join(problems) + note)
    where = "export" if artifact is None else "export and runtime"
    return CheckResult.passed(f"{MISSPELLED_KWARG!r} refused by {where}{note}")


def _refusal_problems(where: str, err: BaseException) -> list[str]:
    if not isinstance(err, TypeError):
        return [
            f"{where} raised {type(err).__name__} for the unknown option {MISSPELLED_KWARG!r}, "
            f"expected a TypeError: {error_text(err).splitlines()[0]}"
        ]
    if MISSPELLED_KWARG not in str(err):
        return [f"{where}'s TypeError does not name the option {MISSPELLED_KWARG!r}: {err}"]
    return []
