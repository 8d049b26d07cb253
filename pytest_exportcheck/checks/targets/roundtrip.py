"""Target checks of what the artifact computes: logits against the eager model.

``roundtrip_logits`` and ``dynamic_shapes`` share the cached artifact of each toy
model family; ``cache_wrapper`` and ``deterministic`` export a model of their own.
Every comparison goes through :func:`~pytest_exportcheck.checks._support.roundtrip`
(within the target's declared tolerance) except ``deterministic``, which is exact
on purpose: two runs of the same artifact code on the same inputs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exportlm.export.roundtrip import EXACT, roundtrip_ids
from exportlm.models import DecoderModel, seeded_init_
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import aborts_to_result
from pytest_exportcheck.checks._support import (
    TRACED_SHAPE,
    accepts_reason,
    build_case_model,
    default_model_name,
    export_fresh,
    export_instance,
    input_ids_for,
    load_runtime,
    load_shared_runtime,
    one_layer_model,
    require_device,
    roundtrip,
    run_runtime,
    shared_artifact,
    target_info,
    verify,
)

__all__ = [
    "DYNAMIC_SHAPES",
    "cache_wrapper",
    "deterministic",
    "dynamic_shapes",
    "roundtrip_logits",
]

#: ``(batch, seq)`` shapes other than the traced one, for ``dynamic_shapes``.
DYNAMIC_SHAPES = ((1, 5), (3, 11))


@check("roundtrip_logits")
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
    return roundtrip(case, info, model, runtime, TRACED_SHAPE)


@check("dynamic_shapes")
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
        result = roundtrip(case, info, model, runtime, shape)
        if not result.ok:
            return result
        passed.append(result.message)
    return CheckResult.passed("; ".join(passed), shapes=[list(s) for s in DYNAMIC_SHAPES])


class CacheByDefaultDecoder(nn.Module):
    """A decoder whose plain call returns ``(logits, kv_cache)``: ``use_cache`` defaults to True.

    Not underscored: a target's ``accepts`` may name the model's class, and that
    reason reaches the user as ``cache_wrapper``'s skip reason.
    """

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


@check("cache_wrapper")
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
    model = CacheByDefaultDecoder(decoder).eval().to(case.device)
    reason = accepts_reason(case, model)
    if reason:
        return CheckResult.skipped(
            f"target {case.target_id!r} does not take a plain torch decoder "
            f"(this check's model returns (logits, kv_cache)): {reason}"
        )
    with torch.no_grad():
        raw = model(input_ids_for(model, 1, 2, seed=0, device=case.device))
    if not (isinstance(raw, tuple) and len(raw) == 2):  # the premise of the check
        return CheckResult.failed(
            f"the test model returned {type(raw).__name__}, not (logits, cache)"
        )
    runtime = load_runtime(case, export_instance(case, model, case.workdir / "cache_wrapper"))
    return roundtrip(case, info, model, runtime, TRACED_SHAPE)


@check("deterministic")
@aborts_to_result
def deterministic(case: TargetCase) -> CheckResult:
    """Two exports of the same model give bit-identical runtime outputs.

    Compares an export of the default family with a second, fresh export of it
    (``atol = rtol = 0``). The family is built with one decoder layer where it takes
    that override (:func:`~pytest_exportcheck.checks._support.one_layer_model`: depth
    changes nothing about determinism, and the fresh export runs on every run), else
    as registered. The first export comes from the plugin's artifact cache when there
    is one, so a rerun exports only the second. Whether the artifact bytes are
    identical too is reported in the details (``same_bytes``), not required.
    """
    info = target_info(case)
    require_device(case, info)
    name = default_model_name(case)
    smaller = one_layer_model(case, name)
    if smaller is None:
        model = build_case_model(case, name)
        first = shared_artifact(case, name)
        reference = load_shared_runtime(case, first)
    else:
        model = smaller
        first = export_instance(case, model, case.workdir / "deterministic-first")
        reference = load_runtime(case, first)
    second = export_fresh(case, model, case.workdir / "deterministic")
    ids = roundtrip_ids(model, TRACED_SHAPE, seed=case.seed, device=case.device)
    again = load_runtime(case, second)
    with case.services.phase("compare"):
        result = verify(None, again, ids, EXACT, expected=run_runtime(reference, ids))
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
