"""Benchmark: FP8 Llama (hidden 1024, 8 layers, vocab 32000) to an HF checkpoint.

Exports the same calibrated model with exportlm's ``hf_checkpoint`` target and,
when ``nvidia-modelopt`` is installed, with ModelOpt's ``export_hf_checkpoint``;
each exporter runs in its own subprocess so its peak RSS is clean. Reports wall
time, peak RSS added during the export (sampled peak minus RSS before),
MB/s of checkpoint bytes, and the same bytes written raw (``write`` + ``fsync``
excluded, as both exporters leave data in the page cache).

Usage: ``python benchmarks/bench_hf_export.py [--repeat 3] [--json out.json]``.
CPU seconds (``time.process_time``, all threads) are reported beside wall time:
on a loaded machine they vary less; ``OMP_NUM_THREADS=1`` steadies both.
Goals (issue 3): exportlm ≥ 2x ModelOpt's speed, ≤ 0.5x the RSS ModelOpt adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


class _PeakSampler:
    """Peak RSS while a block runs, sampled every 2 ms (``ru_maxrss`` is a lifetime high-water mark)."""

    def __enter__(self) -> _PeakSampler:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _build_and_calibrate(exporter: str) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    batch = torch.randint(
        0, CONFIG["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0)
    )

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    if exporter == "modelopt":
        import modelopt.torch.quantization as mtq

        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=calibrate)
    else:
        from exportlm.quant import quantize

        quantize(model, "fp8", calibrate=calibrate)
    return model


def _export(exporter: str, model: Any, out: Path) -> None:
    if exporter == "modelopt":
        from modelopt.torch.export import export_hf_checkpoint

        export_hf_checkpoint(model, export_dir=out)
    else:
        import exportlm

        exportlm.export_model("hf_checkpoint", model, out)


def child(exporter: str, out: Path) -> dict[str, float]:
    """Run in a fresh process: build, calibrate, then time one export."""
    import gc

    model = _build_and_calibrate(exporter)
    gc.collect()
    before = _rss_mb()
    with _PeakSampler() as sampler:
        start, cpu_start = time.perf_counter(), time.process_time()
        _export(exporter, model, out)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "added_rss_mb": sampler.peak - before,
        "bytes": size,
    }


def raw_write(nbytes: int, path: Path) -> float:
    """Seconds to write ``nbytes`` from memory to a new file (page cache, like the exporters).

    A new file each time: overwriting one already in the page cache reuses its
    pages and is several times faster than what an exporter's fresh file gets.
    """
    buf = bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) + 1)
    view = memoryview(buf)[:nbytes]
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
    return time.perf_counter() - start


def _run_child(exporter: str, out: Path) -> dict[str, float] | None:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", exporter, str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print(f"{exporter}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("EXPORTER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return 0

    try:
        import modelopt.torch.export  # noqa: F401

        exporters = ["exportlm", "modelopt"]
    except ImportError:
        exporters = ["exportlm"]
        print("nvidia-modelopt not installed: measuring exportlm only")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for exporter in exporters:
            runs = []
            for i in range(args.repeat):
                run = _run_child(exporter, Path(tmp) / f"{exporter}-{i}")
                if run:
                    runs.append(run)
            if runs:
                best = min(runs, key=lambda r: r["seconds"])
                best["added_rss_mb"] = min(r["added_rss_mb"] for r in runs)
                best["cpu_seconds"] = min(r["cpu_seconds"] for r in runs)
                results[exporter] = best
        if "exportlm" in results:
            nbytes = int(results["exportlm"]["bytes"])
            raw = min(raw_write(nbytes, Path(tmp) / f"raw-{i}.bin") for i in range(args.repeat))
            results["raw_write"] = {
                "seconds": raw,
                "cpu_seconds": raw,
                "bytes": nbytes,
                "added_rss_mb": 0.0,
            }

    for name, r in results.items():
        r["mb_per_s"] = r["bytes"] / 1e6 / r["seconds"]
        print(
            f"{name:10s} {r['seconds']:7.3f} s  (cpu {r['cpu_seconds']:6.3f} s)  "
            f"{r['mb_per_s']:8.0f} MB/s  +{r['added_rss_mb']:7.1f} MB RSS  "
            f"({r['bytes'] / 1e6:.0f} MB)"
        )
    if "modelopt" in results and "exportlm" in results:
        ours, theirs = results["exportlm"], results["modelopt"]
        speedup = theirs["seconds"] / ours["seconds"]
        cpu_speedup = theirs["cpu_seconds"] / ours["cpu_seconds"]
        mem = ours["added_rss_mb"] / max(theirs["added_rss_mb"], 1e-9)
        print(
            f"speed vs ModelOpt: {speedup:.2f}x wall, {cpu_speedup:.2f}x cpu (goal >= 2x); "
            f"added RSS vs ModelOpt: {mem:.2f}x (goal <= 0.5x)"
        )
        results["ratios"] = {"speedup": speedup, "cpu_speedup": cpu_speedup, "added_rss_ratio": mem}
    if "raw_write" in results and "exportlm" in results:
        print(
            f"exportlm at {results['exportlm']['mb_per_s'] / results['raw_write']['mb_per_s']:.0%} of raw write speed"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
