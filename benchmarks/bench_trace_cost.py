"""CPU seconds of a toy's ``torch.export`` traces and ``.pt2`` loads, with and without the speed-ups.

Measures, in one process with one torch thread (as each xdist worker of the main job
runs), alternating the two variants ``--repeats`` times and printing the median CPU
seconds (``time.process_time``, so other load on the machine matters less):

* ``load``: ``torch.export.load(file).module()`` against the ``torch_export`` runtime's
  load (:mod:`exportlm.export._pt2_load`), for the plain and the ``kv_cache=True`` program;
* ``export``: the ``onnx`` and ``torch_export`` exports with torch's FakeTensor cache on
  (torch's default) against off (:mod:`exportlm.export._fake_cache`, what the targets use);
* ``registry``: the ``onnx`` export building torchlib's function table afresh (torch's
  default) against reusing the process's first build (:mod:`exportlm.export.onnx._registry`,
  what the target uses).

Usage: ``python benchmarks/bench_trace_cost.py [--family llama] [--repeats 4]
[--only load,export,registry]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

import torch


def _median_cpu(variants: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for run in variants.values():  # warm-up: imports and first-call caches
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def _replaced(module: object, value: object, name: str = "fake_tensor_cache_off") -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _export(export: Callable[..., object], model: object, out: Path, kv: bool, on: bool) -> object:
    """One export; ``on``: torch's default cache (the targets' switch replaced by a no-op)."""
    import exportlm.export.onnx._past as onnx_past
    import exportlm.export.torch_export as torch_export

    with contextlib.ExitStack() as stack:
        if on:
            for module in (torch_export, onnx_past):
                stack.enter_context(_replaced(module, contextlib.nullcontext))
        return export(model, out, kv_cache=kv)


def _export_registry(model: object, out: Path, kv: bool, reused: bool) -> object:
    """One ``onnx`` export; ``reused=False``: torchlib's table built afresh (the memo a no-op)."""
    import exportlm.export.onnx._past as onnx_past
    from exportlm.export.onnx.export import export_onnx_target

    with contextlib.ExitStack() as stack:
        if not reused:
            stack.enter_context(
                _replaced(onnx_past, contextlib.nullcontext, "torchlib_registry_reused")
            )
        return export_onnx_target(model, out, kv_cache=kv)


def _load(path: Path, fast: bool) -> object:
    from exportlm.export._pt2_load import load_program

    with open(path, "rb") as file:
        return (load_program(file) if fast else torch.export.load(file)).module()


def _line(label: str, result: dict[str, float]) -> str:
    return f"{label}: " + ", ".join(f"{name} {cpu:.2f} s" for name, cpu in result.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--only", default="load,export,registry", help="comma-separated parts")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    torch.set_num_threads(1)
    from exportlm.export.onnx.export import export_onnx_target
    from exportlm.export.torch_export import export_torch_export
    from exportlm.models import build_model

    model = build_model(args.family, seed=0)
    targets = {"onnx": export_onnx_target, "torch_export": export_torch_export}
    with tempfile.TemporaryDirectory() as tmp:
        for kv in (False, True):
            if "load" in parts:
                pt2 = Path(tmp) / f"model{kv}.pt2"
                export_torch_export(model, pt2, kv_cache=kv)
                loads = {"torch": partial(_load, pt2, False), "runtime": partial(_load, pt2, True)}
                print(_line(f"load kv_cache={kv}", _median_cpu(loads, args.repeats)))
            for name, export in targets.items() if "export" in parts else ():
                out = Path(tmp) / f"out{kv}.{name}"
                variants = {
                    f"cache {state}": partial(_export, export, model, out, kv, state == "on")
                    for state in ("on", "off")
                }
                print(_line(f"export {name} kv_cache={kv}", _median_cpu(variants, args.repeats)))
            if "registry" in parts:
                out = Path(tmp) / f"registry{kv}.onnx"
                variants = {
                    f"table {state}": partial(_export_registry, model, out, kv, state == "reused")
                    for state in ("afresh", "reused")
                }
                print(_line(f"export onnx kv_cache={kv}", _median_cpu(variants, args.repeats)))


if __name__ == "__main__":
    main()
