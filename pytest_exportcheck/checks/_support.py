"""Shared steps of the target checks: toy models, inputs, eager logits, artifacts, runtimes.

Internal to :mod:`pytest_exportcheck.checks` (a documented internal module);
every target check goes through these so that "the eager reference", "the
deterministic inputs", "the shared artifact" and "a roundtrip" mean the same
thing in every check. Failures of the code under test (the export factory, the
runtime loader, the runtime) stop the check through
:func:`~pytest_exportcheck.checks._common.attempt`, carrying the exception.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.errors import RuntimeOutputError
from exportlm.export import (
    LogitsComparison,
    TargetInfo,
    accepted_kwargs,
    infer_vocab_size,
    make_input_ids,
)
from exportlm.export import roundtrip as verifier
from pytest_exportcheck.checks._api import CheckResult, TargetCase
from pytest_exportcheck.checks._common import CheckAbort, attempt
from pytest_exportcheck.checks._registries import Registries

__all__ = [
    "DEFAULT_MODELS",
    "IDS_SEED",
    "TRACED_SHAPE",
    "accepts_reason",
    "artifact_name",
    "build_case_model",
    "default_model_name",
    "eager_logits",
    "export_fresh",
    "export_instance",
    "input_ids_for",
    "listing",
    "load_runtime",
    "load_shared_runtime",
    "cuda_capability_problem",
    "require_cuda_capability",
    "require_device",
    "roundtrip",
    "one_layer_model",
    "smallest_case_model",
    "run_runtime",
    "shared_artifact",
    "target_info",
    "verify",
]

#: Families tried, in order, for checks that need one model and are not per model.
DEFAULT_MODELS = ("decoder", "llama")
#: ``(batch, seq)`` of the example inputs every built-in target traces with (the verifier's).
TRACED_SHAPE = verifier.TRACED_SHAPE
#: Seed of the input ids of roundtrips (not the traced ids, which use seed 0).
IDS_SEED = verifier.IDS_SEED


def target_info(case: TargetCase) -> TargetInfo:
    """The declaration of ``case.target`` (a lookup failure fails the check).

    For a family that declares a ``tolerance_scale`` (a user's model directory,
    ``--export-model``), ``atol`` / ``rtol`` are the declared ones times that scale.
    """
    registries = case.services.registries
    info = attempt(f"looking up target {case.target!r}", registries.target_info, case.target)
    scale = registries.tolerance_scale(case.model_name) if case.model_name else 1.0
    if scale == 1.0:
        return info
    return dataclasses.replace(info, atol=info.atol * scale, rtol=info.rtol * scale)


def require_device(case: TargetCase, info: TargetInfo) -> None:
    """Skip when the case runs on a device the target does not declare (``cuda``)."""
    if case.device != "cpu" and not info.has("cuda"):
        raise CheckAbort(
            CheckResult.skipped(
                f"target {case.target_id!r} does not declare the 'cuda' capability; "
                f"it is not run on {case.device}"
            )
        )
    if case.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckAbort(CheckResult.skipped(f"{case.device} requested but CUDA is not available"))


def cuda_capability_problem(device: str, minimum: tuple[int, int]) -> str | None:
    """Why ``device`` cannot run a kernel that needs compute capability ``minimum``, or ``None``."""
    need = f"{minimum[0]}.{minimum[1]}"
    if not device.startswith("cuda"):
        return f"needs a CUDA device of compute capability >= {need}; this item runs on {device}"
    if not torch.cuda.is_available():
        return (
            f"needs a CUDA device of compute capability >= {need}, but CUDA is not available "
            f"(torch.cuda.is_available() is False; torch.version.cuda is {torch.version.cuda})"
        )
    index = torch.device(device).index or 0
    found = tuple(torch.cuda.get_device_capability(index))
    if found < minimum:
        name = torch.cuda.get_device_name(index)
        return (
            f"needs compute capability >= {need} (Ada, Hopper or newer); {device} is {name}, "
            f"capability {found[0]}.{found[1]}"
        )
    return None


def require_cuda_capability(
    device: str, minimum: tuple[int, int], *, what: str, require: bool
) -> None:
    """Stop the check unless ``device`` is a CUDA device of compute capability ``minimum``.

    A counted skip with the reason; a failure instead when ``require``
    (``--export-require-device``) is set and the item runs on a CUDA device that
    is missing or too old. A CPU item always skips: it is not a device item.
    """
    problem = cuda_capability_problem(device, minimum)
    if problem is None:
        return
    if require and device.startswith("cuda"):
        raise CheckAbort(
            CheckResult.failed(f"{what}: {problem}, and --export-require-device is set")
        )
    raise CheckAbort(CheckResult.skipped(f"{what}: {problem}"))


def build_case_model(case: TargetCase, name: str) -> nn.Module:
    """Family ``name`` with ``case.seed``, on ``case.device``; skips when the target refuses it.

    The family is built once per process (``case.services``); each call returns a
    copy of its own, which the check may change.
    """
    built = attempt(f"building toy model {name!r}", case.services.model, name, case.seed)
    model: nn.Module = built.eval().to(case.device)
    reason = family_refusal(case, name)
    if reason:
        raise CheckAbort(
            CheckResult.skipped(f"target {case.target_id!r} does not take {name!r}: {reason}")
        )
    return model


#: Config overrides that give a family one decoder layer (ours, then transformers' name).
_ONE_LAYER = ({"num_layers": 1}, {"num_hidden_layers": 1})


def smallest_case_model(case: TargetCase, name: str) -> nn.Module:
    """Family ``name`` with one decoder layer, for checks whose point does not depend on depth.

    The failure-injection checks (``atomic_failure``) export afresh on every run by
    design; one layer keeps every module kind of the family and costs about a
    quarter less per export. Built directly with the layer override (not through
    ``case.services``, whose models are the families as registered), once per
    process, then copied. A family without such an override, one the process builds
    as another class (a test's own builder) or a one-layer model the target refuses
    falls back to :func:`build_case_model`, the family itself.
    """
    smaller = one_layer_model(case, name)
    return build_case_model(case, name) if smaller is None else smaller


def one_layer_model(case: TargetCase, name: str) -> nn.Module | None:
    """A copy of family ``name`` with one decoder layer, on ``case.device``; ``None`` when
    :func:`smallest_case_model` falls back to the family itself (see there why)."""
    registries = case.services.registries
    built = case.services.memo(
        ("one_layer", name, case.seed, registries.families),
        lambda: _one_layer(registries, name, case.seed),
    )
    family = attempt(f"building toy model {name!r}", case.services.pristine_model, name, case.seed)
    if built is None or type(built) is not type(family):
        return None
    accepts = case.services.registries.target_info(case.target).accepts
    key = ("one_layer_accepts", case.target, accepts, name, case.seed)
    if case.services.memo(key, lambda: accepts_reason(case, built)):
        return None
    model: nn.Module = copy.deepcopy(built).to(case.device)
    return model


def _one_layer(registries: Registries, name: str, seed: int) -> nn.Module | None:
    for override in _ONE_LAYER:
        try:
            model: nn.Module = registries.build_model(name, seed, **override)
        except Exception:  # not this family's option name, or not a registered family
            continue
        return model.eval()
    return None


def family_refusal(case: TargetCase, name: str) -> str | None:
    """Why the case's target refuses toy family ``name``, or ``None``: its ``accepts`` asked
    once per process and target (``case.services``; the runner's gate asked the same)."""
    accepts = case.services.registries.target_info(case.target).accepts
    return case.services.refusal(case.target, accepts, name, case.seed)


def accepts_reason(case: TargetCase, model: nn.Module) -> str | None:
    """The declared reason of the case's target for refusing ``model``, or ``None``."""
    info = case.services.registries.target_info(case.target)
    return info.accepts(model) if info.accepts is not None else None


def default_model_name(case: TargetCase) -> str:
    """``case.model_name``, else the first of :data:`DEFAULT_MODELS` (then any family) the target takes."""
    if case.model_name:
        return case.model_name
    available = case.services.registries.family_names()
    candidates = [n for n in DEFAULT_MODELS if n in available] + [
        n for n in available if n not in DEFAULT_MODELS
    ]
    for name in candidates:
        try:
            case.services.pristine_model(name, case.seed)
        except Exception:  # a broken third-party family must not hide the others
            continue
        if not family_refusal(case, name):
            return name
    raise CheckAbort(
        CheckResult.skipped(f"target {case.target_id!r} accepts none of the toy models {available}")
    )


def input_ids_for(model: nn.Module, batch: int, seq: int, seed: int, device: str) -> torch.Tensor:
    """Deterministic ids ``[batch, seq]`` from the model's vocabulary (numpy PCG64)."""
    return make_input_ids(infer_vocab_size(model), batch, seq, seed=seed, device=device)


def eager_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The reference: the model under :class:`ExportCacheWrapper` (``use_cache=False``, logits)."""
    return verifier.eager_logits(model, input_ids, call=attempt)


def artifact_name(info: TargetInfo) -> str:
    """File (or directory) name the checks export to: ``model`` + the declared suffix."""
    return "model" if info.artifact == "directory" else f"model{info.suffix}"


def listing(directory: Path) -> list[str]:
    """The sorted names in ``directory`` (empty when it does not exist)."""
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def export_fresh(case: TargetCase, model: nn.Module, directory: Path, **extra: Any) -> Path:
    """Export ``model`` with the case's target and variant kwargs into ``directory`` (not cached)."""
    info = case.services.registries.target_info(case.target)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {**dict(case.export_kwargs), **extra}
    output = directory / artifact_name(info)
    with case.services.phase("export"):
        case.services.profile.count("exports")
        return attempt(
            f"export with target {case.target_id!r}",
            case.services.registries.export,
            case.target,
            model,
            output,
            **kwargs,
        )


def shared_artifact(case: TargetCase, model_name: str, **extra: Any) -> Path:
    """The artifact of family ``model_name``, cached by the plugin when ``case.export`` is set."""
    if case.export is not None:
        what = f"export of {model_name!r} with target {case.target_id!r}"
        return Path(attempt(what, case.export, model_name, **extra))
    model = build_case_model(case, model_name)
    return export_fresh(case, model, case.workdir / "shared" / model_name, **extra)


def export_instance(case: TargetCase, model: nn.Module, directory: Path, **extra: Any) -> Path:
    """``model`` (built by the check) exported with the case's target: cached by the plugin
    when ``case.export_instance`` is set, else afresh into ``directory``."""
    if case.export_instance is not None:
        what = f"export of {type(model).__name__} with target {case.target_id!r}"
        return Path(attempt(what, case.export_instance, model, **extra))
    return export_fresh(case, model, directory, **extra)


def runtime_kwargs(case: TargetCase) -> dict[str, Any]:
    """``device=...`` for the runtime loader when it takes one (always off the CPU)."""
    names, var_kw = accepted_kwargs(case.services.registries.runtime_loader(case.target), skip=1)
    if case.device != "cpu" or "device" in names or var_kw:
        return {"device": case.device}
    return {}


def load_runtime(case: TargetCase, artifact: Path) -> Callable[[torch.Tensor], Any]:
    """The artifact loaded in the target's own runtime."""
    what = f"loading {artifact.name} in the runtime of {case.target_id!r}"
    with case.services.phase("load"):
        return attempt(
            what, case.services.registries.load, case.target, artifact, **runtime_kwargs(case)
        )


def load_shared_runtime(case: TargetCase, artifact: Path) -> Callable[[torch.Tensor], Any]:
    """:func:`load_runtime` of a shared artifact, reused by the next checks of this process.

    Only for artifacts from ``case.export`` (the plugin's read-only cache): the
    per-model checks of one artifact (``roundtrip_logits``, ``dynamic_shapes``)
    then load it once (``case.services`` keeps the last few); anything else loads
    afresh.
    """
    if case.export is None:
        return load_runtime(case, artifact)
    kwargs = runtime_kwargs(case)
    stat = artifact.stat()
    key = (case.target, str(artifact), stat.st_mtime_ns, stat.st_size, repr(sorted(kwargs.items())))
    runtime: Callable[[torch.Tensor], Any] = case.services.shared_runtime(
        key, lambda: load_runtime(case, artifact)
    )
    return runtime


def run_runtime(runtime: Callable[[torch.Tensor], Any], input_ids: torch.Tensor) -> torch.Tensor:
    """Call the runtime; it must return one logits tensor (torch or numpy), nothing else."""
    try:
        return verifier.runtime_logits(runtime, input_ids, call=attempt)
    except RuntimeOutputError as err:  # the message says what it returned and what is expected
        raise CheckAbort(CheckResult.failed(str(err))) from err


def verify(
    model: nn.Module | None,
    runtime: Callable[[torch.Tensor], Any],
    ids: torch.Tensor,
    tolerance: verifier.Tolerance,
    expected: torch.Tensor | None = None,
) -> LogitsComparison:
    """:func:`exportlm.export.roundtrip.verify_roundtrip`, a failure of the code under test
    (the eager model, the runtime, its output) stopping the check with what failed."""
    try:
        return verifier.verify_roundtrip(
            model, runtime, ids, tolerance, call=attempt, expected=expected
        )
    except RuntimeOutputError as err:
        raise CheckAbort(CheckResult.failed(str(err))) from err


def roundtrip(
    case: TargetCase,
    info: TargetInfo,
    model: nn.Module,
    runtime: Callable[[torch.Tensor], Any],
    shape: tuple[int, int],
) -> CheckResult:
    """Runtime vs eager logits on deterministic ids of ``shape``, within the target's tolerance.

    :func:`exportlm.export.roundtrip.verify_roundtrip` with the target's declared
    ``atol`` / ``rtol``: ``|actual - expected| <= atol + rtol * |expected|`` elementwise;
    NaN / inf anywhere fails.
    """
    ids = verifier.roundtrip_ids(model, shape, seed=case.seed, device=case.device)
    with case.services.phase("compare"):
        result = verify(model, runtime, ids, verifier.Tolerance.of(info))
    where = f"input_ids {list(shape)}"
    if not result.passed:
        return CheckResult.failed(
            f"{case.target_id} logits differ from the eager model at {where}: {result.summary()}",
            **result.details(),
        )
    return CheckResult.passed(f"{where}: {result.summary()}", **result.details())
