"""``served``: the artifact, loaded by one real serving engine that takes it, gives the eager tokens.

One item per target x engine x model family (``served[hf_checkpoint-vllm-llama-cpu]``;
the planner's engines are those whose support table has a row for what the target
declares it writes, ``TargetInfo.artifact_kind`` and ``scheme``:
:func:`exportlm.engines.engines_taking`), for :data:`SERVED_FAMILIES` (a dense
and an MoE family; each engine run starts a fresh engine process, 10-60 s).

Before anything is exported the item resolves its engine
(:func:`exportlm.engines.resolve_engine`: interpreter and installed version, ~50 ms):
no interpreter is a skip, another version than the support table's is an
``unverified`` skip, both failures under ``--export-require-engines``. Then only the
artifacts the engine's table has a row for are exported (from the plugin's artifact
cache):

* a checkpoint directory: the plain export, and for a target declaring ``quantized``
  each of :data:`QUANTIZED` (format, recipe, scheme), exported from the fake-quantized
  model; on ``--export-device=cuda`` :data:`QUANTIZED_CUDA` instead, vLLM's GPU-only
  FP8 / NVFP4 / FP8-block / MX paths, in bfloat16 (``benchmarks/gpu/check.sh``);
* an ``.onnx`` file: the plain graph (OpenVINO), and for a target declaring
  ``kv_cache`` the ``kv_cache=True`` graph in Optimum's folder with
  ``genai_config.json`` (``layout="optimum", genai_config=True``: Optimum ONNX Runtime,
  onnxruntime-genai).

Each (artifact, engine) pair is compared by :func:`exportlm.engines.serve_and_compare`:
three left-padded prompts of 3, 7 and 12 tokens without near-ties, 8 greedy tokens
equal to the eager (or fake-quant) model's, teacher-forced logprobs and each decode
step's logprobs (the engine's cache path, where its worker reports them) within the
engine's stated tolerance (its record's, for the compute dtype and the artifact's scheme).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from exportlm.engines import (
    ArtifactKind,
    Engine,
    Outcome,
    Resolved,
    Served,
    Support,
    artifact_kind,
    parse_engine_options,
    resolve_engine,
    serve_and_compare,
)
from exportlm.errors import ExportLMError, UnsupportedFormatError
from pytest_exportcheck.checks import catalogue
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
from pytest_exportcheck.checks.targets._served_artifacts import (
    QUANTIZED,
    QUANTIZED_CUDA,
    Quantized,
    require_capability,
)
from pytest_exportcheck.checks.targets.checkpoint import quantized_toy

__all__ = [
    "CUDA_DTYPE",
    "KV_SERVING",
    "QUANTIZED",
    "QUANTIZED_CUDA",
    "SERVED_FAMILIES",
    "Quantized",
    "served",
    "served_dtype",
]

#: The families served: a dense one and an MoE one (both in every engine's measured rows),
#: declared in the catalogue (``CheckSpec.models``: other families get no item).
SERVED_FAMILIES: tuple[str, ...] = tuple(sorted(catalogue.SERVED_FAMILIES))


#: The dtype every artifact is exported in (served so where the engine's row takes it).
OWN_DTYPE = "float32"
#: The compute dtype the quantized checkpoints are served in on a CUDA device.
CUDA_DTYPE = "bfloat16"
#: ``initializer_range`` of the models served in bfloat16: the default init gives top-2
#: margins of ~1e-3, which bfloat16 rounding can swap; 0.3 gives clear winners.
SHARP_INIT = 0.3
#: The export options of the kv_cache graph the ONNX Runtime engines load.
KV_SERVING = {"kv_cache": True, "layout": "optimum", "genai_config": True}


@dataclass(frozen=True)
class _Artifact:
    """One artifact to serve, exported only when its engine's table has a row for it.

    ``make(dtype)`` exports it for serving in ``dtype`` (``None``: the artifact's own)
    and returns it with its eager reference model.
    """

    label: str
    layout: str | None
    scheme: str | None
    make: Callable[[str | None], tuple[Path, nn.Module]]
    dtype: str | None = None  # None: the engine's table row decides (served_dtype)


def _rows(
    engine: Engine,
    target: str,
    layout: str | None,
    scheme: str | None,
    model_type: str | None = None,
) -> list[Support]:
    """The engine's table rows about that artifact (any dtype, any device; any model type
    unless ``model_type`` is given, :meth:`Support.about`)."""
    return [r for r in engine.table if r.about(target, layout, scheme, model_type)]


def served_dtype(
    engine: Engine, target: str, layout: str | None, scheme: str | None, model_type: str
) -> str | None:
    """The dtype an artifact is served in: ``None`` (its own, :data:`OWN_DTYPE`) where the
    engine's first row for it and that model type takes it, else that row's first dtype
    (vLLM computes integer weights in bfloat16 / float16 only)."""
    rows = _rows(engine, target, layout, scheme, model_type)
    if not rows or OWN_DTYPE in rows[0].dtypes:
        return None
    return rows[0].dtypes[0]


def _sharp(case: TargetCase, name: str, recipe: str, exclude: tuple[str, ...] = ()) -> nn.Module:
    """The family with :data:`SHARP_INIT` weights, fake-quantized with ``recipe``."""
    from exportlm.models import tiny_hf_model
    from exportlm.quant import quantize

    model: nn.Module = tiny_hf_model(name, seed=case.seed, initializer_range=SHARP_INIT)
    model = model.to(case.device)
    try:
        quantized: nn.Module = quantize(model, recipe, exclude=list(exclude) or None)
    except UnsupportedFormatError as err:
        raise CheckAbort(CheckResult.skipped(f"{recipe} does not fit {name!r}: {err}")) from err
    return quantized


def _export_quantized(case: TargetCase, model: nn.Module, where: Path, layout: str) -> Path:
    """The checkpoint in ``layout``; a skip naming the exporter's reason where the layout
    cannot store that recipe for this family (an AWQ scale no norm takes)."""
    try:
        return export_instance(case, model, where, format=layout)
    except CheckAbort as abort:
        if isinstance(abort.result.exception, UnsupportedFormatError):
            err = abort.result.exception
            raise CheckAbort(CheckResult.skipped(f"{layout}: {error_text(err)}")) from err
        raise


def _quantized(case: TargetCase, name: str) -> Iterator[_Artifact]:
    cuda = case.device.startswith("cuda")
    for q in QUANTIZED_CUDA if cuda else QUANTIZED:

        def make(dtype: str | None, q: Quantized = q) -> tuple[Path, nn.Module]:
            require_capability(case.device, q)
            # a reduced-precision engine needs clear top-2 winners (SHARP_INIT)
            sharp = cuda or dtype not in (None, OWN_DTYPE)
            if sharp:
                model = _sharp(case, name, q.recipe, q.exclude)
            else:
                model = quantized_toy(case, name, q.recipe, exclude=q.exclude)
            tag = q.recipe.replace(":", "-").replace("=", "")  # fp8_block-group_size32
            where = case.workdir / "served" / f"{q.layout}-{tag}{'-sharp' if sharp else ''}"
            return _export_quantized(case, model, where, q.layout), model

        label = f"{q.layout} {q.recipe}"
        yield _Artifact(label, q.layout, q.scheme, make, CUDA_DTYPE if cuda else None)


def _artifacts(case: TargetCase, name: str) -> Iterator[_Artifact]:
    info = target_info(case)

    def plain(**options: Any) -> Callable[[str | None], tuple[Path, nn.Module]]:
        return lambda _: (shared_artifact(case, name, **options), build_case_model(case, name))

    if info.artifact_kind == "hf_checkpoint":
        yield _Artifact("plain", None, info.scheme, plain())
        if info.has("quantized") and info.scheme is None:
            yield from _quantized(case, name)
    elif info.artifact_kind == "onnx":
        yield _Artifact("plain", "plain", info.scheme, plain())
        if info.has("kv_cache"):
            yield _Artifact("kv_cache", "kv_cache", info.scheme, plain(**KV_SERVING))
    elif info.artifact_kind:  # a kind only a third-party engine's table names
        yield _Artifact("plain", None, info.scheme, plain())


def _kind(target: str, artifact: _Artifact, path: Path, family: str) -> ArtifactKind:
    """The artifact as the tables name it: the target's declaration (its kind and scheme)
    over what the file says (a checkpoint's config: its layout, scheme and model type)."""
    try:
        read = artifact_kind(path)
    except ValueError:  # a kind the built-in reader does not know
        return ArtifactKind(target, artifact.layout, artifact.scheme, OWN_DTYPE, family)
    return ArtifactKind(
        target, read.layout, read.scheme or artifact.scheme, read.dtype, read.model_type
    )


def _overrides(case: TargetCase) -> dict[str, str]:
    """``--export-engine`` paths; those of an engine plugin that failed to load are left
    out (its own failing ``plugin_loads[engine:<name>]`` item carries its error)."""
    broken = case.services.registries.engines.failed()
    given = [
        v for v in case.options.get("engines") or () if v.partition("=")[0].strip() not in broken
    ]
    try:
        return parse_engine_options(given)
    except (ValueError, ExportLMError) as err:
        raise CheckAbort(CheckResult.failed(f"--export-engine: {error_text(err)}")) from err


def _resolve(case: TargetCase, overrides: dict[str, str]) -> list[Resolved]:
    """The item's engines that are ready; a skip (a failure when required) for any other.

    The item's one engine (a case built without one: every engine that takes the
    target's output, and only when none is ready is it a skip).
    """
    found: list[Resolved] = []
    for engine in _engines(case):
        try:
            found.append(resolve_engine(case.services.registries.engine(engine), overrides))
        except ExportLMError as err:  # a given path that is no interpreter
            raise CheckAbort(CheckResult.failed(f"{case.target_id}: {error_text(err)}")) from err
    ready = [f for f in found if f.status == "ready"]
    others = [f"[{f.engine} / {f.status}] {f.reason}" for f in found if f.status != "ready"]
    if others and case.options.get("require_engines"):
        text = "; ".join(others)
        raise CheckAbort(CheckResult.failed(f"{case.target_id}: {text} (--export-require-engines)"))
    if not ready:
        text = "; ".join(others) or "no engine takes what it writes"
        raise CheckAbort(CheckResult.skipped(f"{case.target_id}: {text}"))
    return ready


def _engines(case: TargetCase) -> list[str]:
    """The item's engine, or (a case built without one) every engine taking the target's output."""
    if case.engine is not None:
        return [case.engine]
    info = target_info(case)
    if not info.artifact_kind:
        return []
    return case.services.registries.engines_taking(info.artifact_kind, info.scheme)


@check("served")
@aborts_to_result
def served(case: TargetCase) -> CheckResult:
    """The artifact, loaded by the real serving engines that take it, gives the eager tokens.

    For :data:`SERVED_FAMILIES` (other families: a counted skip), one item per engine
    whose support table takes what the target writes. The engine is resolved first
    (``--export-engine NAME=PATH``, ``EXPORTLM_ENGINE_<NAME>``, or this interpreter where
    it imports): none is a skip, another version than its table's an ``unverified``
    skip, both failures under ``--export-require-engines``, and nothing is exported.
    Then every artifact the engine's table has a row for runs out of process. Fails when
    the engine refuses, crashes on, or diverges from an artifact its table says it runs
    (the engine's own message, the first diverging row and position, the largest
    logprob gap against the tolerance), or when the engine contradicts its table.
    Declared limits (``refused``, ``misreads``, ``engine_limit``) confirmed by the
    engine are named in the message and in ``details["served"]``, never counted as a
    match.
    """
    require_device(case, target_info(case))
    name = default_model_name(case)
    if name not in SERVED_FAMILIES:
        return CheckResult.skipped(
            f"served runs the families {list(SERVED_FAMILIES)} only (each engine run starts "
            f"an engine process); {name!r} is not one of them"
        )
    overrides = _overrides(case)
    info = target_info(case)
    target = info.artifact_kind
    results: list[tuple[str, Served]] = []
    unfit: list[str] = []
    for found in _resolve(case, overrides):
        engine = case.services.registries.engine(found.engine)
        for artifact in _artifacts(case, name):
            if not _rows(engine, target, artifact.layout, artifact.scheme):
                continue
            # the served families' names are their model types
            dtype = artifact.dtype or served_dtype(
                engine, target, artifact.layout, artifact.scheme, name
            )
            try:
                path, model = artifact.make(dtype)
            except CheckAbort as abort:
                if abort.result.status == "skip":  # the recipe does not fit this family
                    unfit.append(
                        f"[{found.engine} / {artifact.label} / not served] {abort.result.message}"
                    )
                    continue
                raise
            got = serve_and_compare(
                engine,
                path,
                model,
                dtype=dtype,
                kind=_kind(target, artifact, path, name),
                python=found.python,
                device="cuda" if case.device.startswith("cuda") else "cpu",
            )
            results.append((artifact.label, got))
    if not results:
        return CheckResult.skipped(
            f"{case.target_id}: no artifact of this family that "
            f"{' / '.join(_engines(case)) or 'any engine'} takes"
            + "".join(f"; {line}" for line in unfit)
        )
    return _verdict(case, results, unfit)


def _line(label: str, got: Served) -> str:
    outcome = got.outcome.value
    if got.off_table and got.outcome is Outcome.FAILED:
        outcome = (
            f"unverified: {got.engine} {got.engine_version}, table read from {got.table_version}"
        )
    return f"[{got.engine} / {label} / {outcome}] {got.message}"


def _verdict(case: TargetCase, results: list[tuple[str, Served]], unfit: list[str]) -> CheckResult:
    """Fail on any failure (or a missing engine under --export-require-engines), else say all."""
    require = bool(case.options.get("require_engines"))
    rows = [{"artifact_label": label, **got.row()} for label, got in results]
    failed = [(lbl, g) for lbl, g in results if g.outcome is Outcome.FAILED and not g.off_table]
    missing = [(lbl, g) for lbl, g in results if g.outcome is Outcome.UNAVAILABLE]
    matched = [(lbl, g) for lbl, g in results if g.outcome is Outcome.PASSED]
    # A version another than the table's (seen only when it changed under us), declared
    # limits, near-ties: named, never held against the artifact, never a match.
    others = [(lbl, g) for lbl, g in results if (lbl, g) not in failed + missing + matched]
    details: dict[str, Any] = {"served": rows, "not_served": unfit}
    if failed or (require and missing):
        lines = [_line(*r) for r in failed]
        lines += [f"{_line(*r)} (--export-require-engines)" for r in missing if require]
        lines += [_line(*r) for r in matched + others] + unfit
        return CheckResult.failed(f"{case.target_id}: " + "\n".join(lines), **details)
    if not matched:
        return CheckResult.skipped(
            f"{case.target_id}: no engine served a match here: "
            + "; ".join([_line(*r) for r in missing + others] + unfit),
            **details,
        )
    text = "; ".join([_line(*r) for r in matched + others + missing] + unfit)
    return CheckResult.passed(f"{case.target_id}: {text}", **details)
