"""``served``: the artifact, loaded by the real serving engines that take it, gives the eager tokens.

Per target x model family (:data:`SERVED_FAMILIES`: a dense and an MoE family; each
engine run starts a fresh engine process, 10-60 s). What the target writes decides
the engines (every registered engine whose support table has a row for that kind of
artifact, :func:`exportlm.engines.artifact_kind`):

* a checkpoint directory: the plain export, and for a target declaring ``quantized``
  each of :data:`QUANTIZED` (format, recipe), exported from the fake-quantized model
  (transformers, vLLM);
* an ``.onnx`` file: the plain graph (OpenVINO), and for a target declaring
  ``kv_cache`` the ``kv_cache=True`` graph in Optimum's folder with
  ``genai_config.json`` (``layout="optimum", genai_config=True``: Optimum ONNX Runtime,
  onnxruntime-genai).

Artifacts come from the plugin's artifact cache. Each (artifact, engine) pair is
compared by :func:`exportlm.engines.serve_and_compare`: three left-padded prompts of
3, 7 and 12 tokens without near-ties, 8 greedy tokens equal to the eager (or
fake-quant) model's, teacher-forced logprobs within the engine's stated tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.engines import (
    Engine,
    Outcome,
    Served,
    artifact_kind,
    engine_names,
    get_engine,
    parse_engine_options,
    serve_and_compare,
)
from exportlm.errors import ExportLMError
from pytest_exportcheck.checks._api import CheckResult, TargetCase, check
from pytest_exportcheck.checks._common import CheckAbort, aborts_to_result, error_text
from pytest_exportcheck.checks._support import (
    build_case_model,
    default_model_name,
    export_instance,
    require_device,
    shared_artifact,
    target_info,
)
from pytest_exportcheck.checks.targets.checkpoint import quantized_toy

__all__ = ["KV_SERVING", "QUANTIZED", "SERVED_FAMILIES", "served"]

#: The families served: a dense one and an MoE one (both in every engine's measured rows).
SERVED_FAMILIES = ("llama", "qwen3_moe")
#: (checkpoint format, recipe) of the quantized checkpoints served besides the plain one.
QUANTIZED: tuple[tuple[str, str], ...] = (("compressed-tensors", "fp8"), ("modelopt", "int8_wo"))
#: The export options of the kv_cache graph the ONNX Runtime engines load.
KV_SERVING = {"kv_cache": True, "layout": "optimum", "genai_config": True}


@dataclass(frozen=True)
class _Artifact:
    label: str
    path: Path
    model: nn.Module


def _engines_for(path: Path) -> list[Engine]:
    """Every registered engine whose support table has a row for this kind of artifact."""
    kind = artifact_kind(path)
    return [
        engine
        for engine in map(get_engine, engine_names())
        if any(
            (row.target, row.layout, row.scheme) == (kind.target, kind.layout, kind.scheme)
            for row in engine.table
        )
    ]


def _quantized(case: TargetCase, name: str) -> Iterator[_Artifact]:
    for layout, recipe in QUANTIZED:
        try:
            model = quantized_toy(case, name, recipe)
        except CheckAbort as abort:
            if abort.result.status == "skip":
                continue  # the recipe does not fit this family
            raise
        where = case.workdir / "served" / f"{layout}-{recipe}"
        path = export_instance(case, model, where, format=layout)
        yield _Artifact(f"{layout} {recipe}", path, model)


def _artifacts(case: TargetCase, name: str) -> Iterator[_Artifact]:
    info = target_info(case)
    model = build_case_model(case, name)
    if info.artifact == "directory":
        yield _Artifact("plain", shared_artifact(case, name), model)
        if info.has("quantized"):
            yield from _quantized(case, name)
    elif info.suffix == ".onnx":
        yield _Artifact("plain", shared_artifact(case, name), model)
        if info.has("kv_cache"):
            yield _Artifact("kv_cache", shared_artifact(case, name, **KV_SERVING), model)


def _overrides(case: TargetCase) -> dict[str, str]:
    try:
        return parse_engine_options(case.options.get("engines") or ())
    except (ValueError, ExportLMError) as err:
        raise CheckAbort(CheckResult.failed(f"--export-engine: {error_text(err)}")) from err


@check("served")
@aborts_to_result
def served(case: TargetCase) -> CheckResult:
    """The artifact, loaded by the real serving engines that take it, gives the eager tokens.

    For :data:`SERVED_FAMILIES` (other families: a counted skip). Every engine whose
    support table takes what the target writes runs it out of process (its interpreter:
    ``--export-engine NAME=PATH``, ``EXPORTLM_ENGINE_<NAME>``, or this one where it
    imports). Fails when an engine refuses, crashes on, or diverges from an artifact its
    table says it runs (the engine's own message, the first diverging row and position,
    the largest logprob gap against the tolerance), or when the engine contradicts its
    table. Declared limits (``refused``, ``misreads``, ``engine_limit``) confirmed by the
    engine are named in the message and in ``details["served"]``, never counted as a
    match. An engine without an interpreter is a skip, a failure under
    ``--export-require-engines``.
    """
    require_device(case, target_info(case))
    name = default_model_name(case)
    if name not in SERVED_FAMILIES:
        return CheckResult.skipped(
            f"served runs the families {list(SERVED_FAMILIES)} only (each engine run starts "
            f"an engine process); {name!r} is not one of them"
        )
    overrides = _overrides(case)
    results: list[tuple[str, Served]] = []
    for artifact in _artifacts(case, name):
        for engine in _engines_for(artifact.path):
            got = serve_and_compare(
                engine, artifact.path, artifact.model, overrides=overrides, device=case.device
            )
            results.append((artifact.label, got))
    if not results:
        return CheckResult.skipped(
            f"no registered engine serves what target {case.target_id!r} writes "
            f"(engines: {', '.join(engine_names())})"
        )
    return _verdict(case, results)


def _line(label: str, got: Served) -> str:
    outcome = got.outcome.value
    if got.off_table and got.outcome is Outcome.FAILED:
        outcome = (
            f"unverified: {got.engine} {got.engine_version}, table read from {got.table_version}"
        )
    return f"[{got.engine} / {label} / {outcome}] {got.message}"


def _verdict(case: TargetCase, results: list[tuple[str, Served]]) -> CheckResult:
    """Fail on any failure (or a missing engine under --export-require-engines), else say all."""
    require = bool(case.options.get("require_engines"))
    rows = [{"artifact_label": label, **got.row()} for label, got in results]
    failed = [(lbl, g) for lbl, g in results if g.outcome is Outcome.FAILED and not g.off_table]
    missing = [(lbl, g) for lbl, g in results if g.outcome is Outcome.UNAVAILABLE]
    matched = [(lbl, g) for lbl, g in results if g.outcome is Outcome.PASSED]
    # Another engine version than the table's (a failure there is named, not held
    # against the artifact), declared limits, near-ties.
    others = [(lbl, g) for lbl, g in results if (lbl, g) not in failed + missing + matched]
    details: dict[str, Any] = {"served": rows}
    if failed or (require and missing):
        lines = [_line(*r) for r in failed]
        lines += [f"{_line(*r)} (--export-require-engines)" for r in missing if require]
        lines += [_line(*r) for r in matched + others]
        return CheckResult.failed(f"{case.target_id}: " + "\n".join(lines), **details)
    if not matched:
        return CheckResult.skipped(
            f"{case.target_id}: no engine served a match here: "
            + "; ".join(_line(*r) for r in missing + others),
            **details,
        )
    text = "; ".join(_line(*r) for r in matched + others + missing)
    return CheckResult.passed(f"{case.target_id}: {text}", **details)
