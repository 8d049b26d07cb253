"""``exportlm export``: check every argument, then load, quantize, export and verify.

Every argument is checked before any work starts (target, options, model,
recipe, calibration data, output), so a typo costs a second, not an export.
Progress lines go to standard error; the result (one line, or one JSON object
with ``--json``) goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exportlm._progress import phase
from exportlm.cli._calib import CalibrationRequest, calibration_request, quantize_model
from exportlm.cli._errors import EXIT_FAILURE, EXIT_OK, UsageError
from exportlm.cli._model import ModelSource, resolve_model
from exportlm.cli._options import parse_target_options
from exportlm.cli._recipe import check_model_layout, check_model_recipe, checked_recipe
from exportlm.cli._roundtrip import verify_export

__all__ = ["ExportPlan", "cmd_export", "plan_export"]

logger = logging.getLogger("exportlm.cli")


@dataclass
class ExportPlan:
    """A checked ``export`` command line."""

    target: str
    options: dict[str, Any]
    source: ModelSource
    model_argument: str
    out: Path
    seed: int
    recipe: str | None  # as spelled on the command line
    calibration: CalibrationRequest | None
    verify: bool
    as_json: bool
    verify_shapes: tuple[tuple[int, int], ...] = ()  # none given: the traced shape
    trust: bool = False
    stream: bool = False  # the model directory layer by layer (stream=True), cli/_stream.py
    max_memory: str | None = None
    stream_inputs: str = "quantized"
    quant_recipe: Any = None  # the checked QuantRecipe (--quantize with --exclude)
    skeleton: Any = None  # a directory's meta model the recipe was checked on (streamed into)


@dataclass
class _Result:
    path: Path
    files: list[tuple[Path, int]]
    seconds: float
    calibration: dict[str, Any] | None = None
    verification: Any = None  # LogitsComparison
    timings: dict[str, float] = field(default_factory=dict)


def plan_export(args: argparse.Namespace) -> ExportPlan:
    """Check the ``export`` arguments without building anything.

    Raises:
        UnknownNameError: an unknown target or quantization recipe.
        UnknownOptionError, UsageError: a bad ``-o``, ``--model``, calibration
            flag, ``--verify`` without a runtime, or an output that cannot be replaced.
        CalibrationDataError: unreadable calibration data.
    """
    from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered

    ensure_exporters_registered()
    factory = EXPORT_REGISTRY.get(args.target)
    options = parse_target_options(args.target, factory, args.option)
    recipe = checked_recipe(args, options)
    source = resolve_model(args.model)
    # shapes, before loading or reading any data
    skeleton = check_model_recipe(source, recipe) if recipe is not None else None
    check_model_layout(args.target, options, source, None)  # a directory's model type
    plan = ExportPlan(
        target=args.target,
        options=options,
        source=source,
        model_argument=args.model,
        out=args.out,
        seed=args.seed,
        recipe=args.quantize,
        calibration=calibration_request(args, recipe),
        verify=args.verify,
        as_json=args.json,
        verify_shapes=tuple(getattr(args, "verify_shape", None) or ()),
        trust=getattr(args, "trust", False),
        quant_recipe=recipe,
        skeleton=skeleton,
    )
    _check_output(plan, factory)
    from exportlm.cli._stream import wants_streaming

    plan.stream = wants_streaming(args, plan.target, plan.source, plan.options)
    plan.max_memory = getattr(args, "max_memory", None)
    plan.stream_inputs = getattr(args, "stream_inputs", None) or "quantized"
    if plan.verify and not plan.stream:
        _check_runtime(plan.target)
    _default_tokenizer(plan, factory)
    return plan


def _default_tokenizer(plan: ExportPlan, factory: Any) -> None:
    """A model directory's tokenizer files go into the checkpoint (``tokenizer=`` the directory)."""
    import inspect

    if plan.source.kind != "directory" or plan.stream or "tokenizer" in plan.options:
        return  # the streamed export copies the directory's own itself
    try:
        takes_tokenizer = "tokenizer" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: nothing to pass
        return
    if takes_tokenizer:
        plan.options["tokenizer"] = plan.source.path


def _check_output(plan: ExportPlan, factory: Any) -> None:
    import inspect

    from exportlm.export import get_target_info

    out, info = plan.out, get_target_info(plan.target)
    if plan.target == "hf_checkpoint" and "max_shard_size" in plan.options:
        # checked before the model is quantized: a bad size would surface only after it
        from exportlm.errors import InvalidInputError
        from exportlm.export.hf_checkpoint.shards import parse_size

        try:
            parse_size(plan.options["max_shard_size"])
        except InvalidInputError as err:
            raise UsageError(f"-o max_shard_size={plan.options['max_shard_size']}: {err}") from None
    if out.is_file() and info.artifact == "directory":
        raise UsageError(f"--out {out} is a file; target {plan.target!r} writes a directory")
    if out.is_dir() and info.artifact == "file":
        raise UsageError(
            f"--out {out} is a directory; target {plan.target!r} writes a file: "
            f"pass a file path such as {out / ('model' + info.suffix)}"
        )
    try:
        takes_overwrite = "overwrite" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: the factory decides
        takes_overwrite = False
    if (
        takes_overwrite
        and not plan.options.get("overwrite")
        and out.is_dir()
        and any(out.iterdir())
    ):
        raise UsageError(
            f"--out {out} exists and is not empty; pass -o overwrite=true to replace it "
            "(atomically: it stays untouched if the export fails)"
        )


def _check_runtime(target: str) -> None:
    from exportlm.export import RUNTIME_REGISTRY, get_target_info

    runtime = get_target_info(target).runtime
    if runtime not in RUNTIME_REGISTRY:
        raise UsageError(
            f"--verify: target {target!r} runs in runtime {runtime!r}, which is not registered "
            "(see `exportlm list`); install the package that provides it, or drop --verify"
        )


def cmd_export(args: argparse.Namespace) -> int:
    """Run ``exportlm export``; the exit code is 1 when verification fails.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calibrates on its share of the
    batches and rank 0 alone writes (``cli/_distributed.py``).
    """
    from exportlm.cli._distributed import data_parallel_group

    with data_parallel_group() as group:
        plan = plan_export(args)
        group.barrier()  # every rank checked --out before rank 0 writes into it
        if group.world > 1 and plan.stream:
            raise UsageError(
                "streaming export (--max-memory, or a model over the memory budget) runs in one "
                f"process, not under torchrun's {group.world}; run it without torchrun"
            )
        if not group.writes:
            _quantize(plan, plan.source.build(plan.seed), {})
            logger.info("rank %d: calibrated; rank 0 writes %s", group.rank, plan.out)
            group.barrier()
            return EXIT_OK
        # No barrier on an exception: the others are stopped by torchrun, not left waiting.
        code = _streamed(plan) if plan.stream else _export_in_memory(plan)
        group.barrier()
        return code


def _streamed(plan: ExportPlan) -> int:
    _print_result(plan, _export_streamed(plan))
    return EXIT_OK


def _quantize(
    plan: ExportPlan, model: Any, timings: dict[str, float]
) -> tuple[Any, dict[str, Any] | None]:
    """The model quantized by the plan's recipe (as it is without one), and its calibration report."""
    if plan.quant_recipe is None or plan.calibration is None:
        return model, None
    check_model_layout(plan.target, plan.options, plan.source, model)  # before quantizing
    start = time.perf_counter()
    model, calibration = quantize_model(model, plan.quant_recipe, plan.calibration, plan.source)
    timings["quantize"] = time.perf_counter() - start
    return model, calibration


def _export_in_memory(plan: ExportPlan) -> int:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    with phase(f"loading model {plan.model_argument}"):
        model = plan.source.build(plan.seed)
    timings["load"] = time.perf_counter() - start
    model, calibration = _quantize(plan, model, timings)
    result = _export(plan, model)
    result.calibration, result.timings = calibration, timings
    if plan.verify:
        start = time.perf_counter()
        result.verification = verify_export(plan, model, result.path)
        timings["verify"] = time.perf_counter() - start
    _print_result(plan, result)
    if result.verification is not None and not result.verification.passed:
        logger.error(
            "verification failed: the %s artifact's logits differ from the eager model's "
            "beyond the target's tolerance",
            plan.target,
        )
        return EXIT_FAILURE
    return EXIT_OK


def _export(plan: ExportPlan, model: Any) -> _Result:
    from exportlm.export import export_model

    before = _snapshot(plan.out.parent)
    start = time.perf_counter()
    with phase(f"exporting to {plan.target}"):
        path = export_model(plan.target, model, plan.out, **plan.options)
    seconds = time.perf_counter() - start
    return _Result(path=path, files=_artifact_files(path, before), seconds=seconds)


def _export_streamed(plan: ExportPlan) -> _Result:
    from exportlm.cli._stream import source_options
    from exportlm.export import export_model
    from exportlm.export.hf_checkpoint.directory import ModelDirectory

    before = _snapshot(plan.out.parent)
    start = time.perf_counter()
    directory: Any = plan.source.path
    if directory is not None and plan.skeleton is not None:  # checked already: not built again
        directory = ModelDirectory(directory, plan.skeleton)
    with phase(f"exporting {plan.model_argument} layer by layer to {plan.target}"):
        # the target's streamed source: the model directory, layer by layer (stream=True)
        path = export_model(plan.target, directory, plan.out, **source_options(plan))
    seconds = time.perf_counter() - start
    result = _Result(path=path, files=_artifact_files(path, before), seconds=seconds)
    result.calibration = {
        "source": "synthetic"
        if plan.calibration is None or plan.calibration.texts is None
        else str(plan.calibration.data),
        "streamed": True,
    }
    return result


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """``{name: (size, mtime_ns)}`` of the files in ``directory``."""
    if not directory.is_dir():
        return {}
    stats = {}
    for entry in directory.iterdir():
        if entry.is_file():
            stat = entry.stat()
            stats[entry.name] = (stat.st_size, stat.st_mtime_ns)
    return stats


def _artifact_files(path: Path, before: dict[str, tuple[int, int]]) -> list[tuple[Path, int]]:
    """Every file of the artifact with its size: a directory's files, or the file and the
    files written beside it (e.g. ONNX external data), found as new or changed siblings."""
    if path.is_dir():
        return [(p, p.stat().st_size) for p in sorted(path.rglob("*")) if p.is_file()]
    files = [(path, path.stat().st_size)]
    for name, stat in sorted(_snapshot(path.parent).items()):
        sibling = path.parent / name
        if sibling != path and before.get(name) != stat and name.startswith(path.stem):
            files.append((sibling, stat[0]))
    return files


def _print_result(plan: ExportPlan, result: _Result) -> None:
    size = sum(size for _, size in result.files)
    if plan.as_json:
        print(json.dumps(_result_json(plan, result, size), indent=2))
        return
    quantized = result.timings.get("quantize")
    seconds = f"export {result.seconds:.2f} s" + (
        "" if quantized is None else f", quantization (calibration) {quantized:.2f} s"
    )
    print(
        f"exported {plan.model_argument} with {plan.target} -> {result.path} "
        f"({size / 1e6:.2f} MB, {seconds})"
    )
    if result.verification is not None:
        verdict = "OK" if result.verification.passed else "MISMATCH"
        print(f"verify: {result.verification.summary()}: {verdict}")


def _result_json(plan: ExportPlan, result: _Result, size: int) -> dict[str, Any]:
    verification = result.verification
    return {
        "model": plan.model_argument,
        "target": plan.target,
        "options": {key: _jsonable(value) for key, value in plan.options.items()},
        "path": str(result.path),
        "files": [{"path": str(p), "bytes": n} for p, n in result.files],
        "bytes": size,
        "seconds": round(result.seconds, 3),  # the export itself; timings has the rest
        "export_seconds": round(result.seconds, 3),
        "quantize_seconds": None
        if "quantize" not in result.timings
        else round(result.timings["quantize"], 3),
        "timings": {key: round(value, 3) for key, value in result.timings.items()},
        "quantize": plan.recipe,
        "calibration": result.calibration,
        "verify": None
        if verification is None
        else {
            **{key: _jsonable(value) for key, value in verification.details().items()},
            "summary": verification.summary(),
        },
    }


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON: dtypes as names, NaN / inf as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value).removeprefix("torch.")
