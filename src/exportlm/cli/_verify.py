"""``exportlm verify PATH --engine NAME``: serve an artifact in a real engine and compare it
with the eager model (:func:`exportlm.engines.serve_and_compare`, the ``served`` check's
comparison).

The eager reference is ``--model`` (a toy family with ``--seed``, a model spec or a
local Hugging Face directory), fake-quantized with ``--quantize`` for a quantized
artifact. Without ``--model`` a checkpoint directory is its own reference: an
unquantized one as transformers loads it, a quantized one exportlm wrote (its manifest
verified first) as exportlm's own loader reads it (``load_exported("hf_checkpoint",
PATH)``: the fake-quantized model with the stored scales), with no calibration.
The engine's interpreter is ``--python``, else ``EXPORTLM_ENGINE_<NAME>``, else this one
where the engine imports.

Exit codes: 0 the engine gave the eager tokens within its stated tolerance; 1 anything
else (a difference, a refusal, a declared limit: the table says which); 2 a usage error:
an unknown engine, an engine with no interpreter, a path that is no artifact, an ONNX
file that does not parse, a bad ``--model``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from exportlm.cli._errors import EXIT_FAILURE, EXIT_OK, UsageError
from exportlm.cli._list import print_table
from exportlm.errors import EngineInterpreterError, InvalidConfigError, InvalidInputError

__all__ = ["add_verify_arguments", "cmd_verify"]

logger = logging.getLogger("exportlm.cli")


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    """The ``verify`` subcommand's own arguments (the quantization group is added beside)."""
    p.add_argument("path", type=Path, help="a checkpoint directory, an .onnx file or its folder")
    p.add_argument(
        "--engine", required=True, help="engine name (vllm, transformers, openvino, ...)"
    )
    p.add_argument(
        "--model",
        help="the eager reference: a toy family, a model spec FILE.json or a local Hugging Face "
        "directory (default: PATH itself for a checkpoint directory; a quantized one "
        "exportlm wrote as exportlm's loader reads it, with its stored scales)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a toy family's weights (default 0)")
    p.add_argument(
        "--dtype",
        type=_compute_dtype,
        help="compute dtype to ask the engine for: bfloat16, float16 or float32 (default: the "
        "artifact's)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="the engine's interpreter or venv (default: EXPORTLM_ENGINE_<NAME>, else this one)",
    )
    p.add_argument(
        "--timeout", type=_seconds, help="seconds the engine may take (default: its own)"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _engine(args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    from exportlm.engines import find_interpreter, get_engine

    engine = get_engine(args.engine)  # UnknownNameError: exit 2, listing the engines
    overrides = {engine.name: args.python} if args.python else {}
    try:
        found = find_interpreter(engine, overrides, option="--python")
    except EngineInterpreterError as err:
        raise UsageError(str(err)) from err
    if found.path is None:
        raise UsageError(f"--engine {engine.name}: {found.reason}")
    return engine, overrides


def _kind(path: Path) -> Any:
    from exportlm.engines import artifact_kind

    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    try:
        kind = artifact_kind(path)
    except (ValueError, InvalidConfigError, InvalidInputError, OSError) as err:
        raise UsageError(f"{path} is not an artifact an engine serves: {err}") from err
    graph = path if path.suffix == ".onnx" else next(iter(sorted(path.glob("*.onnx"))), None)
    if kind.target == "onnx" and graph is not None:
        _parses(graph)
    return kind


def _parses(graph: Path) -> None:
    from exportlm.inspection import check_onnx_size, read_onnx_model

    try:
        check_onnx_size(graph)  # before any engine opens it: a sparse 16 GiB file is read whole
    except (ValueError, OSError) as err:  # InputTooLargeError, NotRegularFileError
        raise UsageError(f"{graph}: {err}") from err
    try:
        import onnx  # noqa: F401 - only whether it is installed
    except ImportError:  # nothing to check with; the engine says what it thinks
        return
    try:
        read_onnx_model(graph)
    except Exception as err:  # a DecodeError, a truncated file: not a model
        raise UsageError(f"{graph} is not an ONNX model: {type(err).__name__}: {err}") from err


def _check_manifests(path: Path) -> None:
    """Hold the artifact to its manifest where it has one, before any engine reads it.

    ``path`` itself (a directory's ``exportlm-manifest.json``, a file's sibling manifest)
    and, for a folder, its one ``.onnx`` graph (whose manifest lists the serving files
    beside it, ``genai_config.json`` included). A file that differs from its manifest
    raises :class:`~exportlm.errors.ArtifactIntegrityError` (exit 1). No manifest:
    served unverified (the engine check still refuses anything that would run).
    """
    from exportlm.export.manifest import read_manifest, verify_artifact

    graphs = sorted(path.glob("*.onnx")) if path.is_dir() else []
    for candidate in [path, *graphs[:1]] if len(graphs) == 1 else [path]:
        manifest = read_manifest(candidate)
        if manifest is not None:
            verify_artifact(candidate, manifest=manifest)


def _reference(args: argparse.Namespace, path: Path, kind: Any) -> Any:
    from exportlm.cli._calib import calibration_request, quantize_model
    from exportlm.cli._model import resolve_model

    if args.model is None:
        if args.quantize:
            raise UsageError(
                f"--quantize {args.quantize}: give the model to quantize with --model FAMILY|DIR"
            )
        if kind.target == "hf_checkpoint" and kind.layout is not None:
            return _stored_reference(path, kind)
        if kind.target != "hf_checkpoint":
            raise UsageError(
                f"{path} ({kind.target}, {kind.layout or 'plain'}): give its eager reference "
                "with --model FAMILY|DIR [--seed N] [--quantize RECIPE] (the model it was "
                "exported from; a checkpoint directory is its own reference)"
            )
        source = resolve_model(str(path))
    else:
        source = resolve_model(args.model)
    calibration = calibration_request(args)
    model = source.build(args.seed)
    if args.quantize is not None and calibration is not None:
        model, _ = quantize_model(model, args.quantize, calibration, source)
    return model.eval()


def _stored_reference(path: Path, kind: Any) -> Any:
    """A quantized checkpoint exportlm wrote, read back by exportlm's own loader: the
    fake-quantized model with the stored scales (what its calibration computed), so the
    reference costs no calibration; computed in the checkpoint's own dtype, the one its
    model was calibrated in: the compressed-tensors convention of a bfloat16 model divides
    its activations by their scale in bfloat16, so a float32 reading would quantize them to
    other codes (on the real model 1.4 logprob apart from transformers' reading, where the
    checkpoint's own dtype is what transformers computes). Only with a manifest: without one the checkpoint is not known to be ours, and its
    reading is no reference."""
    from exportlm import load_exported
    from exportlm.export.manifest import read_manifest

    if read_manifest(path) is None:
        raise UsageError(
            f"{path} ({kind.layout} {kind.scheme or ''}) has no exportlm manifest, so it is "
            "not known to be exportlm's: give its eager reference with --model DIR "
            "--quantize RECIPE [--calib-data ...] (the model and recipe it was exported with)"
        )
    logger.info(
        "eager reference: %s as exportlm's hf_checkpoint runtime reads it, in its own dtype "
        "(its stored scales; no calibration)",
        path,
    )
    return load_exported("hf_checkpoint", path)


def cmd_verify(args: argparse.Namespace) -> int:
    """Run ``exportlm verify``; returns the exit code."""
    from exportlm.cli._recipe import parsed_recipe
    from exportlm.engines import Outcome, serve_and_compare

    parsed_recipe(args)  # a recipe that does not parse: before the reference is built
    engine, overrides = _engine(args)
    path = Path(os.path.abspath(args.path))
    kind = _kind(path)
    _check_manifests(path)
    model = _reference(args, path, kind)
    got = serve_and_compare(
        engine, path, model, dtype=args.dtype, overrides=overrides, timeout=args.timeout
    )
    if got.outcome is Outcome.UNAVAILABLE:
        raise UsageError(got.message)
    if args.json:
        print(json.dumps(got.row(), indent=2))
    else:
        _print(got)
    return EXIT_OK if got.outcome is Outcome.PASSED else EXIT_FAILURE


def _print(got: Any) -> None:
    kind = got.kind
    gap = "-" if got.max_gap is None else f"{got.max_gap:.3g}"
    atol = "-" if got.atol is None else f"{got.atol:g}"
    where = "-" if got.diverges is None else f"row {got.diverges[0]}, token {got.diverges[1]}"
    rows = [
        (
            f"{got.engine} {got.engine_version or '?'}",
            f"{kind.target} {kind.layout or 'plain'} {kind.scheme or ''}".strip(),
            got.dtype,
            got.outcome.value,
            gap,
            atol,
            {True: "yes", False: "no", None: "-"}[got.tokens_equal],
            where,
        )
    ]
    headers = ("engine", "artifact", "dtype", "outcome", "max gap", "tolerance", "tokens equal")
    print_table((*headers, "first divergence"), rows)
    print(got.message)


def _compute_dtype(text: str) -> str:
    """``--dtype``: a spelling of bfloat16, float16 or float32 (``bf16``, ``fp16``...), canonical.

    Checked when the command is parsed: an unknown one was taken, the eager reference
    computed (seconds to minutes), and only then the engine's tolerance found missing.
    """
    from exportlm.cli._options import DTYPE_NAMES

    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise argparse.ArgumentTypeError(
            f"expected bfloat16, float16 or float32 ({', '.join(DTYPE_NAMES)}), got {text!r}"
        )
    return name


def _seconds(text: str) -> float:
    """``--timeout``: a positive, finite number of seconds (``0`` or ``-1`` timed out at once)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value
