"""Running one item: the one engine behind the suite and ``parametrize_with_checks``.

:func:`run_item` takes a planned :class:`~pytest_exportcheck.plan.ItemSpec`, the
process's :class:`RunServices` and the item's typed
:class:`~pytest_exportcheck.plan.CaseOptions`, and returns the check's
:class:`~pytest_exportcheck.checks.CheckResult`: a plugin that failed to load
fails, a missing device skips (fails under ``require_device``), a target that
does not accept the toy model skips, anything else builds the case
(:func:`build_case`) and calls the check under an exportcheck Hypothesis profile.
The suite's items and the API's :class:`~pytest_exportcheck.ExportCheck` both call
it; they differ only in the services they pass (the suite's cached exports and
shared scratch, the API's fresh directory and no cache). Imports no pytest layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_exportcheck.checks import CHECKS, CheckResult, CheckSpec, ExporterCase, TargetCase
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.plan import CaseOptions, Discovery, ItemSpec
from pytest_exportcheck.run._gc import fewer_collections
from pytest_exportcheck.run._hypothesis import hypothesis_profile

if TYPE_CHECKING:
    from pytest_exportcheck.run._exports import CachedExports

__all__ = ["NO_CUDA", "SEED", "RunServices", "build_case", "check_services", "run_item"]

#: Seed of every toy model the suite builds.
SEED = 0
#: Why a CUDA item does not run here.
NO_CUDA = "CUDA is not available on this machine (torch.cuda.is_available() is False)"


def check_services(discovery: Discovery) -> CheckServices:
    """The checks' services over the registries ``discovery`` read: every lookup of a
    check and of the run goes to them, and a toy family is built by its factory there."""
    registries = discovery.registries
    if registries is None:  # a record built by hand: the process's registries, on first use
        return CheckServices()
    return CheckServices(registries.build_model, registries)


@dataclass
class RunServices:
    """What running items needs besides the items; one per process (suite) or per call (API).

    Attributes:
        discovery: the installed targets (their ``accepts``).
        workdir: ``(item name) -> an empty directory`` for the case.
        goldens: the golden store handed to every case.
        checks: what the checks share (the registries, toy models, runtimes, item
            profiles); a target's ``accepts``, the artifact cache's key and its export
            all use its one build of each toy model. Default: :func:`check_services`
            of ``discovery``.
        exports: the suite's cached exports, or ``None`` (checks export afresh).
        seed: the toy models' seed.
    """

    discovery: Discovery
    workdir: Callable[[str], Path]
    goldens: Any
    checks: CheckServices = None  # type: ignore[assignment]  # None: set in __post_init__
    exports: CachedExports | None = None
    seed: int = SEED

    def __post_init__(self) -> None:
        if self.checks is None:
            self.checks = check_services(self.discovery)

    def refusal(self, target: str, model: str) -> str | None:
        """Why ``target`` does not accept toy family ``model`` (its ``accepts``), or ``None``;
        asked once per process (:meth:`CheckServices.refusal`, shared with the checks)."""
        accepts = self.discovery.targets[target].accepts
        return self.checks.refusal(target, accepts, model, self.seed)


def run_item(spec: ItemSpec, services: RunServices, options: CaseOptions) -> CheckResult:
    """Run one item and return its result (see the module docstring)."""
    if spec.failure is not None:  # a plugin_loads item of a plugin that failed to load
        return CheckResult.failed(spec.failure)
    check = CHECKS.get(spec.check)
    if check is None:  # plugin_loads without a catalogue function: discovery said fine
        return CheckResult.passed(f"{spec.column} loaded")
    if spec.skip:
        return CheckResult.skipped(spec.skip)
    gated = _device_gate(spec.device, options.require_device)
    if gated is not None:
        return gated
    with fewer_collections():  # see _gc.py: exports allocate in bursts
        case = build_case(spec, check, services, options)
        if isinstance(case, CheckResult):
            return case
        with hypothesis_profile():
            result = check.fn(case)
    if not isinstance(result, CheckResult):
        raise TypeError(
            f"check {spec.check!r} returned {type(result).__name__}; "
            "a check must return a CheckResult"
        )
    return result


def _device_gate(device: str | None, require: bool) -> CheckResult | None:
    """A skip (a failure when ``require``) for a CUDA item without CUDA, else ``None``."""
    if device != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if require:
        return CheckResult.failed(f"{NO_CUDA}, and --export-require-device is set")
    return CheckResult.skipped(NO_CUDA)


def build_case(
    spec: ItemSpec, check: CheckSpec, services: RunServices, options: CaseOptions
) -> TargetCase | ExporterCase | CheckResult:
    """The item's case, or a skip result when its target does not accept its toy model."""
    common: dict[str, Any] = {
        "workdir": services.workdir(spec.name),
        "seed": services.seed,
        "goldens": services.goldens,
        "options": options,
        "services": services.checks,
    }
    device = spec.device or "cpu"
    if check.scope == "exporter":
        if spec.exporter is None:  # pragma: no cover - plan() sets it
            raise RuntimeError(f"exporter item {spec.name} has no exporter")
        return ExporterCase(name=spec.exporter, device=device, model_name=spec.model, **common)
    if spec.target is None:  # pragma: no cover - plan() sets it
        raise RuntimeError(f"target item {spec.name} has no target")
    if spec.model is not None:
        reason = services.refusal(spec.target, spec.model)
        if reason:
            return CheckResult.skipped(
                f"target {spec.target!r} does not accept model {spec.model!r}: {reason}"
            )
    export = None
    if services.exports is not None:
        export = functools.partial(services.exports.export, spec)
    return TargetCase(
        target=spec.target,
        variant=spec.variant,
        export_kwargs=dict(spec.export_kwargs),
        model_name=spec.model,
        device=device,
        export=export,
        export_instance=export,
        engine=spec.engine,
        **common,
    )
