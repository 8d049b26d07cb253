"""Benchmark: FP8 export of the 170M-parameter Llama on tmpfs against a raw write of the same bytes.

Issue 21 point 3 ("export at the speed of the disk"). In one process, on one seeded
model (``bench_hf_export.CONFIG``: hidden 1024, 8 layers, vocab 32000, float32), each
repeat runs, in turn:

* ``raw``: ``safetensors.torch.save_file`` of the final tensors (what our export
  writes, read back once before timing), the obvious way to write those bytes;
* ``exportlm``: ``exportlm.export_model("hf_checkpoint", ...)``, manifest included
  (schema 3: every file's BLAKE3 digest, the signature; the model's BLAKE3 hash only
  with ``EXPORTLM_MODEL_HASH=1``, which ``--model-hash`` adds as the step ``exportlm+hash``);
* ``modelopt``: ModelOpt's ``export_hf_checkpoint`` on the same weights quantized with
  ``mtq.FP8_DEFAULT_CFG`` (skipped, with the reason, when ModelOpt does not import).

Prints the median seconds (wall and CPU of the process, all threads), the peak RSS
each step adds (sampled every 2 ms), and the ratios against ``raw`` and ModelOpt.
Goals: exportlm within 1.25x of ``raw``, at least 2x faster than ModelOpt.

Usage: ``python benchmarks/bench_export_disk.py [--repeat 5] [--dir /dev/shm] [--json out.json]
[--model-hash]``;
``--parts`` prints instead the CPU seconds of the export's parts, each on its own, and
the two digests (BLAKE3, sha256 of schema 2) of the same bytes; "conversion, then a plain
write" is the serial chain of a one-shard checkpoint with no digest at all (its header
needs every tensor, so the write cannot start before the conversion ends): the floor.
Timings on a machine shared with other work are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_hf_export import _build_and_calibrate, _PeakSampler, _rss_mb


def _modelopt_or_reason() -> str | None:
    try:
        import modelopt.torch.export
        import modelopt.torch.quantization  # noqa: F401
    except Exception as err:  # any import failure: report it, measure the rest
        return f"{type(err).__name__}: {err}"
    return None


def _final_tensors(directory: Path) -> dict[str, Any]:
    """What our export wrote, as tensors in memory (the bytes a raw write writes)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update({k: v.clone() for k, v in load_file(shard).items()})
    return tensors


#: One step: ``prepare()`` (untimed) returns what ``run(prepared, out)`` (timed) takes.
Step = tuple[Callable[[], Any], Callable[[Any, Path], None]]


def _timed(step: Step, out: Path) -> dict[str, float]:
    prepare, run = step
    prepared = prepare()
    gc.collect()
    before = _rss_mb()
    with _PeakSampler() as sampler:
        start, cpu = time.perf_counter(), time.process_time()
        run(prepared, out)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    shutil.rmtree(out, ignore_errors=True)
    del prepared
    return {"seconds": seconds, "cpu_seconds": cpu, "added_rss_mb": sampler.peak - before}


def _with_model_hash(model: Any, out: Path) -> None:
    import os

    import exportlm

    os.environ["EXPORTLM_MODEL_HASH"] = "1"
    try:
        exportlm.export_model("hf_checkpoint", model, out)
    finally:
        del os.environ["EXPORTLM_MODEL_HASH"]


def _steps(skip_modelopt: str | None, tmp: Path, model_hash: bool = False) -> dict[str, Step]:
    import copy

    from safetensors.torch import save_file

    import exportlm

    theirs = None if skip_modelopt else _build_and_calibrate("modelopt")
    ours = _build_and_calibrate("exportlm")
    probe = tmp / "probe"
    exportlm.export_model("hf_checkpoint", ours, probe)
    tensors = _final_tensors(probe)
    shutil.rmtree(probe)

    def raw(_: None, out: Path) -> None:
        out.mkdir()
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    steps: dict[str, Step] = {
        "raw": (lambda: None, raw),
        "exportlm": (lambda: ours, lambda m, out: exportlm.export_model("hf_checkpoint", m, out)),
    }
    if model_hash:
        steps["exportlm+hash"] = (lambda: ours, _with_model_hash)
    if theirs is not None:
        from modelopt.torch.export import export_hf_checkpoint

        # it converts the model's weights in place: each run gets a fresh copy (untimed)
        steps["modelopt"] = (
            lambda: copy.deepcopy(theirs),
            lambda m, out: export_hf_checkpoint(m, export_dir=out),
        )
    return steps


def _parts(tmp: Path, repeat: int) -> None:
    """CPU seconds of the export's parts, one at a time, on one torch thread (``--parts``),
    medians of ``repeat``; each writes a new file, removed after its timing (as ``raw``)."""
    import blake3
    import torch
    from safetensors.torch import save_file

    import exportlm
    from exportlm.export._digest import digest_bytes
    from exportlm.export.hf_checkpoint.sink import write_safetensors
    from exportlm.export.manifest import model_hash
    from exportlm.module_exporters import export_quantized_state

    model = _build_and_calibrate("exportlm")
    exportlm.export_model("hf_checkpoint", model, tmp / "probe")
    tensors = _final_tensors(tmp / "probe")
    torch.set_num_threads(1)

    class _Keep(dict[str, Any]):
        def add(self, name: str, tensor: Any) -> None:
            self[name] = tensor

    def chain(out: Path) -> None:  # what one shard cannot overlap: its header needs every tensor
        kept = _Keep()
        export_quantized_state(model, kept)
        with open(out, "wb") as f:
            f.writelines(t.reshape(-1).view(torch.uint8).numpy().data for t in kept.values())

    shard = (tmp / "probe" / "model.safetensors").read_bytes()
    parts: dict[str, Callable[[Path], object]] = {
        "model hash (BLAKE3, 1 thread)": lambda _: model_hash(model),
        "conversion (to a sink that drops)": lambda _: export_quantized_state(model, _Keep()),
        "write + BLAKE3 of the shard": lambda out: write_safetensors(out, tensors, {}),
        "raw save_file": lambda out: save_file(tensors, out),
        "conversion, then a plain write": chain,
    }
    digests: dict[str, Callable[[Path], object]] = {  # the same bytes: GB/s comparable
        "BLAKE3 of the shard, 1 thread": lambda _: blake3.blake3(shard, max_threads=1),
        "BLAKE3 of the shard, AUTO threads": lambda _: digest_bytes(shard),
        "sha256 of the shard (schema 2)": lambda _: digest_bytes(shard, "sha256"),
    }
    for name, (cpu, wall) in _median_parts({**parts, **digests}, tmp / "part", repeat).items():
        rate = f"  {len(shard) / wall / 1e9:.2f} GB/s" if name in digests else ""
        print(f"{name:36s} {cpu:6.3f} CPU s {wall:6.3f} s{rate}   median of {repeat}")


def _median_parts(
    parts: dict[str, Callable[[Path], object]], out: Path, repeat: int
) -> dict[str, tuple[float, float]]:
    """Median (CPU s, wall s) of each part, interleaved; ``out`` is removed untimed."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeat):
        for name, part in parts.items():
            gc.collect()
            cpu, wall = time.process_time(), time.perf_counter()
            part(out)
            runs.setdefault(name, []).append(
                (time.process_time() - cpu, time.perf_counter() - wall)
            )
            out.unlink(missing_ok=True)
    return {
        name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for name, rs in runs.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where to write")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--parts", action="store_true", help="CPU seconds of each part instead")
    parser.add_argument(
        "--model-hash", action="store_true", help="also time exportlm with EXPORTLM_MODEL_HASH=1"
    )
    args = parser.parse_args()
    if args.parts:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-export-disk-") as tmp:
            _parts(Path(tmp), args.repeat)
        return 0
    skip = _modelopt_or_reason()
    if skip:
        print(f"modelopt: skipped ({skip})")
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-export-disk-") as tmp:
        steps = _steps(skip, Path(tmp), args.model_hash)
        for i in range(args.repeat):
            for name, step in steps.items():  # interleaved: load drifts hit every step alike
                runs.setdefault(name, []).append(_timed(step, Path(tmp) / f"{name}-{i}"))
    results = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    for name, r in results.items():
        print(
            f"{name:13s} {r['seconds']:7.3f} s  (cpu {r['cpu_seconds']:6.3f} s)  "
            f"+{r['added_rss_mb']:7.1f} MB RSS   median of {args.repeat}"
        )
    ours = results["exportlm"]["seconds"]
    ratios = {"vs_raw": ours / results["raw"]["seconds"]}
    print(f"exportlm / raw write: {ratios['vs_raw']:.2f}x (goal <= 1.25x)")
    if "exportlm+hash" in results:
        ratios["hash_vs_raw"] = results["exportlm+hash"]["seconds"] / results["raw"]["seconds"]
        print(f"exportlm+hash / raw write: {ratios['hash_vs_raw']:.2f}x")
    if "modelopt" in results:
        ratios["modelopt_over_ours"] = results["modelopt"]["seconds"] / ours
        print(f"modelopt / exportlm: {ratios['modelopt_over_ours']:.2f}x (goal >= 2x)")
    if args.json:
        args.json.write_text(
            json.dumps({"runs": runs, "median": results, "ratios": ratios}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
