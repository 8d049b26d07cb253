"""Target checks of the declaration: the plugin loaded, and the target is callable as declared."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from exportlm.export import TargetInfo, check_kwargs
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import aborts_to_result, attempt

__all__ = ["plugin_loads", "registered"]


@check("plugin_loads")
def plugin_loads(case: TargetCase) -> CheckResult:
    """The target's entry point (and its runtime's) loaded, and claims no taken name.

    Fails with the :class:`~exportlm.errors.PluginLoadError` (entry point,
    distribution, cause) of a plugin that failed to import or validate, or with
    the :class:`~exportlm.errors.RegistryConflictError` of an entry point that
    claims a name already registered (e.g. ``onnx``). The plugin also reports
    every broken plugin as a failing ``plugin_loads`` item of its own.
    """
    registries = case.services.registries
    errors = [
        r
        for r in registries.records()
        if r.status != "loaded"
        and r.name == case.target
        and r.kind in (registries.targets.kind, registries.runtimes.kind)
    ]
    if errors:
        texts = [f"{r.kind}: {r.message}" for r in errors]
        return CheckResult.failed("; ".join(texts), exception=errors[0].error, errors=texts)
    return CheckResult.passed(f"target {case.target!r} and its runtime loaded")


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
    factory = case.services.registries.target_factory(case.target)
    for variant, kwargs in info.variants.items():
        try:
            check_kwargs(f"variant {variant!r}", factory, kwargs)
        except TypeError as err:
            yield f"variant {variant!r} passes options the factory refuses: {err}"


def _callable_problems(runtimes: Any, factory: Any, info: TargetInfo) -> Iterable[str]:
    """The factory and the declared runtime loader, against the contract's signatures."""
    if not callable(factory):
        yield f"the factory {factory!r} is not callable"
    else:
        why = _binds(factory, object(), Path("model"))
        if why:
            yield f"the factory cannot be called as (model, output_path): {why}"
    if info.runtime not in runtimes:
        failed = runtimes.failed().get(info.runtime)
        yield f"runtime {info.runtime!r} is not registered" + (
            f" (its plugin failed: {failed})" if failed else ""
        )
        return
    loader = runtimes.get(info.runtime)
    why = _binds(loader, Path("model")) if callable(loader) else "not callable"
    if why:
        yield f"runtime {info.runtime!r} cannot be called as (artifact): {why}"


@check("registered")
@aborts_to_result
def registered(case: TargetCase) -> CheckResult:
    """The name resolves; factory and runtime are callable with the contract's signatures.

    The factory must take ``(model, output_path, **kwargs)`` and the runtime loader
    ``(artifact, **kwargs)``; the declared runtime must be registered; the
    :class:`~exportlm.export.TargetInfo` must be sane (finite ``atol``/``rtol``
    >= 0, a callable ``accepts``, the case's variant declared, and every variant's
    kwargs accepted by the factory).
    """
    registries = case.services.registries
    factory = attempt(
        f"EXPORT_REGISTRY.get({case.target!r})", registries.target_factory, case.target
    )
    info = attempt(f"get_target_info({case.target!r})", registries.target_info, case.target)
    problems = [
        *_callable_problems(registries.runtimes, factory, info),
        *_info_problems(case, info),
    ]
    if problems:
        return CheckResult.failed(f"target {case.target_id!r}: " + "; ".join(problems))
    return CheckResult.passed(
        f"{case.target_id}: runtime {info.runtime!r}, artifact {info.artifact}, "
        f"capabilities {sorted(info.capabilities)}",
        runtime=info.runtime,
        capabilities=sorted(info.capabilities),
    )
