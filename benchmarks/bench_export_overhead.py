"""Overhead of ``exportlm.export_model`` over the raw torch export call, per target.

For each target the same model is exported, in one process, alternately by
``export_model`` and by the raw torch calls with the same settings:

* ``onnx``: ``torch.onnx.export(ExportCacheWrapper(model), ..., dynamo=True,
  dynamic_shapes=..., opset_version=20, external_data=False, verbose=False)``
* ``torchscript``: ``torch.jit.trace(ExportCacheWrapper(model), ids, check_trace=False)``
  + ``torch.jit.save``
* ``torch_export``: ``torch.export.export(ExportCacheWrapper(model), (ids,),
  dynamic_shapes=Dim.DYNAMIC x2)`` + ``torch.export.save``

The raw side gets the traceable MoE experts (``batched_mm``) and eval mode set
once up front, so it measures only the exporter; ``export_model`` pays for
switching and restoring them on every call, plus validation, atomic staging and
noise capture. Runs are interleaved (raw, ours, raw, ours, ...) after one warm-up
of each, and the ratio of medians is reported; the goal is <= 1.05.

    python benchmarks/bench_export_overhead.py [--model llama] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import exportlm
from exportlm.export import ExportCacheWrapper, resolve_example_inputs
from exportlm.export._moe import traceable_model
from exportlm.export.onnx import DEFAULT_OPSET
from exportlm.models import build_model

TARGETS = ("onnx", "torchscript", "torch_export")
SUFFIX = {"onnx": ".onnx", "torchscript": ".pt", "torch_export": ".pt2"}


def _raw_onnx(model: torch.nn.Module, ids: torch.Tensor, out: Path) -> None:
    names = ["input_ids"]
    args: tuple[torch.Tensor, ...] = (ids,)
    shapes: dict[str, Any] = {"input_ids": {0: "batch", 1: "sequence"}}
    if hasattr(model, "config") and hasattr(model, "get_experts_implementation"):
        # transformers model: the target adds an attention_mask input; do the same
        names.append("attention_mask")
        args = (ids, torch.ones_like(ids))
        shapes["attention_mask"] = {0: "batch", 1: torch.export.Dim.DYNAMIC}
    torch.onnx.export(
        ExportCacheWrapper(model),
        args,
        str(out),
        input_names=names,
        output_names=["logits"],
        opset_version=DEFAULT_OPSET,
        dynamo=True,
        external_data=False,
        dynamic_shapes=shapes,
        verbose=False,
    )


def _raw_torchscript(model: torch.nn.Module, ids: torch.Tensor, out: Path) -> None:
    with torch.no_grad():
        traced = torch.jit.trace(ExportCacheWrapper(model).eval(), (ids,), check_trace=False)
    torch.jit.save(traced, str(out))


def _raw_torch_export(model: torch.nn.Module, ids: torch.Tensor, out: Path) -> None:
    dim = torch.export.Dim.DYNAMIC
    program = torch.export.export(
        ExportCacheWrapper(model).eval(),
        (ids,),
        dynamic_shapes={"input_ids": {0: dim, 1: dim}},
        strict=False,
    )
    with open(out, "wb") as file:
        torch.export.save(program, file)


RAW: dict[str, Callable[[torch.nn.Module, torch.Tensor, Path], None]] = {
    "onnx": _raw_onnx,
    "torchscript": _raw_torchscript,
    "torch_export": _raw_torch_export,
}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_target(target: str, model_name: str, repeats: int, workdir: Path) -> dict[str, Any]:
    """Median seconds of the raw call and of ``export_model``, interleaved, and their ratio."""
    model = build_model(model_name)
    ids = resolve_example_inputs(model)[0]
    raw_out = workdir / f"raw{SUFFIX[target]}"
    ours_out = workdir / f"ours{SUFFIX[target]}"

    def raw() -> None:
        # Same noise handling as ours would cost nothing extra: the raw call prints freely
        # into a buffer so terminal I/O does not skew either side.
        with (
            traceable_model(model),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            RAW[target](model, ids, raw_out)

    def ours() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exportlm.export_model(target, model, ours_out)

    raw()
    ours()  # warm-up: imports, registries, kernels
    raw_times, our_times = [], []
    for _ in range(repeats):
        raw_times.append(_timed(raw))
        our_times.append(_timed(ours))
    raw_median, our_median = statistics.median(raw_times), statistics.median(our_times)
    return {
        "target": target,
        "model": model_name,
        "repeats": repeats,
        "raw_median_s": raw_median,
        "export_model_median_s": our_median,
        "ratio": our_median / raw_median,
        "raw_s": raw_times,
        "export_model_s": our_times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", help="toy model family (default: llama)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs per target")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets.split(","):
            results.append(bench_target(target, args.model, args.repeats, Path(tmp)))
    header = f"{'target':<14}{'model':<10}{'raw median s':>14}{'export_model s':>16}{'ratio':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['target']:<14}{r['model']:<10}{r['raw_median_s']:>14.3f}"
            f"{r['export_model_median_s']:>16.3f}{r['ratio']:>8.3f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
