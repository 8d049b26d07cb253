"""Streaming export of a model larger than its memory budget: peak RSS, seconds, the bound.

    python benchmarks/bench_stream.py build            # a 3.2B Llama, bf16, 1 GB shards (~6.4 GB)
    python benchmarks/bench_stream.py build --small --model /work/bench-models/llama-0.5b
                                                       # 0.49B, 8 layers, 250 MB shards (0.98 GB)
    python benchmarks/bench_stream.py build --small --layers 22 \
        --model /work/bench-models/llama-1.1b          # TinyLlama-1.1B's shape (2.2 GB)
    python benchmarks/bench_stream.py build --moe --model /work/bench-models/mixtral-0.5b
                                                       # Mixtral's layout, 0.49B, 8 experts (0.98 GB)
    python benchmarks/bench_stream.py run --max-memory 3GB [--in-memory]
    python benchmarks/bench_stream.py compare          # sequential vs whole-model calibration
    python benchmarks/bench_stream.py logits --model /work/bench-models/llama-0.5b \
        --max-memory 450MB --shard-size 150MB          # streamed vs in-memory logits, peaks
    python benchmarks/bench_stream.py peak --model /work/bench-models/llama-0.5b \
        --max-memory 450MB --shard-size 150MB --recipes fp8   # where one stream peaks
    python benchmarks/bench_stream.py modelopt --model /work/bench-models/llama-0.5b \
        --max-memory 450MB --shard-size 150MB  # FP8: our stream, in memory, ModelOpt
    python benchmarks/bench_stream.py modelopt --model /work/bench-models/llama-0.5b \
        --max-memory 450MB --shard-size 150MB --llmcompressor   # and llm-compressor's FP8
    python benchmarks/bench_stream.py llmcompressor --model /work/bench-models/llama-0.5b \
        --shard-size 150MB                     # llm-compressor's row alone
    python benchmarks/bench_stream.py outputs --recipes fp8   # logits of run --in-memory's outputs

``build`` writes random bf16 weights (seeded) layer by layer straight into safetensors shards
under ``--model`` (default ``/work/bench-models/llama-3b``; never the whole model in memory);
``--layers N`` overrides the number of decoder layers of either config. ``run`` exports FP8
and INT4 AWQ with ``exportlm export --max-memory`` in a child process each and reads the
child's peak RSS (``ru_maxrss``) and CPU seconds (user + system) from ``os.wait4``;
``--in-memory`` adds the in-memory path (no budget; it needs about twice the model in RAM).
Under each streamed peak it prints the bound the stream computed and logged: its own RSS
before the first weight (interpreter, torch, the meta model; measured) + the largest modules
loaded at once + one output shard (``--shard-size``) + the calibration activations + one
linear's weight in float32 (quantizing it).
``compare`` measures, on a model that fits, how far sequential calibration (each layer on
the outputs of the already quantized layers) moves the FP8 activation scales and the logits
from whole-model calibration (docs/streaming.md quotes it).
``logits`` exports each recipe in memory (no budget) and streamed under ``--max-memory``
(with ``--stream-inputs float`` and with the default sequential calibration), loads every
checkpoint in the hf_checkpoint runtime and prints, per export, the peak RSS, the stream's
bound, the seconds and CPU seconds, whether the shards are the in-memory ones byte for
byte, and the max / mean absolute difference of the logits from the in-memory export's.
``modelopt`` exports FP8 with our stream, our in-memory path and ModelOpt in one run, each in
a child process (peak RSS from ``wait4``, seconds with imports); ``--llmcompressor`` adds
llm-compressor's ``oneshot`` FP8 (``llmcompressor``: that row alone), in a child of the
python ``--llmc-python`` names (llm-compressor is not in our venv;
benchmarks/llmcompressor_env.md). ``outputs`` compares the logits
of ``run --in-memory``'s two exports in the hf_checkpoint runtime.
``peak`` streams one recipe in the benchmark's own process under a 10 ms RSS sampler and
prints the peak and the frames it was reached in; ``llmcompressor-child --sample``, run by
llm-compressor's python, does the same for its export (docs/streaming.md gives the command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path("/work/bench-models")
CONFIG: dict[str, Any] = {  # Llama 3.2 3B's shape
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "hidden_act": "silu",
}
#: The 0.98 GB model of docs/streaming.md (``build --small``): 0.49B parameters, 8 layers of
#: hidden 2048 (intermediate 5632, 16 heads of 128, 4 KV heads), untied, 250 MB shards.
SMALL: dict[str, Any] = CONFIG | {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
#: The MoE model (``build --moe``): Mixtral's layout (8 experts, 2 per token), 0.49B
#: parameters (0.98 GB, the size of ``SMALL``): 8 layers of hidden 1024, experts of
#: intermediate 2048 (100 MB of experts a layer), untied, 250 MB shards, saved as
#: Mixtral checkpoints are (one tensor per expert, which transformers 5 fuses on load).
MOE: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "hidden_act": "silu",
}
SHARD = 10**9
SMALL_SHARD = 250 * 10**6


def _layer_shapes(c: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    h, m, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (m, h),
        p + "mlp.up_proj.weight": (m, h),
        p + "mlp.down_proj.weight": (h, m),
    }


def _saved_layer_shapes(config: dict[str, Any]) -> Any:
    """Layer ``i``'s tensor names and shapes as transformers saves this architecture.

    Taken from a one-layer model (vocabulary 256) saved with ``save_pretrained``, so the
    names are the checkpoint's (Mixtral: ``block_sparse_moe.experts.3.w1.weight``), not
    the fused parameters transformers 5 holds in memory."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    small = AutoConfig.for_model(**(config | {"num_hidden_layers": 1, "vocab_size": 256}))
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(small).save_pretrained(tmp)
        names: dict[str, tuple[int, ...]] = {}
        for shard in Path(tmp).glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    names[name] = tuple(f.get_slice(name).get_shape())
    layer = {n.removeprefix("model.layers.0."): v for n, v in names.items() if ".layers.0." in n}

    def shapes(i: int) -> dict[str, tuple[int, ...]]:
        return {f"model.layers.{i}.{n}": shape for n, shape in sorted(layer.items())}

    return shapes


def build(directory: Path, config: dict[str, Any], shard_bytes: int = SHARD) -> None:
    """Write the model shard by shard (random bf16, seeded), then the index and config."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    layer_shapes = (
        _saved_layer_shapes(config)
        if config["model_type"] != "llama"
        else lambda i: _layer_shapes(config, i)
    )
    for i in range(config["num_hidden_layers"]):
        shapes |= layer_shapes(i)
    shapes["model.norm.weight"] = (config["hidden_size"],)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, Any]] = [{}]
    size, files, weight_map = 0, [], {}
    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 1.0)).to(
            torch.bfloat16
        )
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        nbytes = tensor.numel() * 2
        if shards[-1] and size + nbytes > shard_bytes:
            files.append(_flush(directory, shards[-1], len(files), save_file))
            shards, size = [{}], 0
        shards[-1][name] = tensor
        size += nbytes
    files.append(_flush(directory, shards[-1], len(files), save_file))
    total = 0
    for i, (tmp, names, nbytes) in enumerate(files, 1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (directory / tmp).rename(directory / final)
        weight_map |= dict.fromkeys(names, final)
        total += nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    print(f"built {directory}: {total / 1e9:.2f} GB in {len(files)} shards")


def _flush(
    directory: Path, tensors: dict[str, Any], index: int, save_file: Any
) -> tuple[str, list[str], int]:
    name = f"part-{index}.safetensors"
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    return name, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _child(
    argv: list[str],
    timeout: float | None,
    command: list[str] | None = None,
    marker: re.Pattern[str] = re.compile("memory bound of"),
) -> tuple[float, int, int, str, float]:
    """(seconds, peak RSS bytes, exit code, the stream's bound line, CPU seconds) of
    ``python -m exportlm ARGV`` (or of ``command``) alone; killed (SIGKILL, exit -9) after
    ``timeout`` seconds, when given: its work area stays, resumable. The bound is the one
    the stream computes and logs: the first stderr line that ``marker`` matches."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            command or [sys.executable, "-m", "exportlm", *argv],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.perf_counter() - start > timeout:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(1)
        log.seek(0)
        bound = next((line.strip() for line in log if marker.search(line)), "")
    seconds = time.perf_counter() - start
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), bound, cpu


def _layers_done(out: Path) -> str:
    progress = out.parent / f".{out.name}.stream" / "progress.json"
    if not progress.is_file():
        return ""
    done = json.loads(progress.read_text())["layers_done"]
    return f"  (killed after {done} layers, resumable)"


def run(
    directory: Path,
    budget: str,
    shard: str,
    in_memory: bool,
    recipes: list[str],
    timeout: float | None,
) -> None:
    model = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"model {model / 1e9:.2f} GB on disk; budget {budget}; output shards {shard}")
    print(f"{'path':<10} {'recipe':<9} {'seconds':>8} {'CPU s':>8} {'peak RSS GB':>12} "
          f"{'peak/model':>11}  exit")  # fmt: skip
    modes = [("stream", ["--max-memory", budget, "-o", f"max_shard_size={shard}"])]
    if in_memory:
        modes.append(("in-memory", ["-o", f"max_shard_size={shard}"]))
    for recipe in recipes:
        for mode, extra in modes:
            if mode == "in-memory" and _available() < 2.3 * model:
                print(f"{mode:<10} {recipe:<9} skipped: {_available() / 1e9:.1f} GB available")
                continue
            out = ROOT / f"out-{directory.name}-{mode}-{recipe}"  # one per model: see outputs
            argv = [
                "export",
                "--target",
                "hf_checkpoint",
                "--model",
                str(directory),
                "--out",
                str(out),
            ]
            argv += ["--quantize", recipe, "-o", "overwrite=true", *extra, "-v"]  # the bound line
            seconds, peak, code, bound, cpu = _child(argv, timeout)
            row = (f"{mode:<10} {recipe:<9} {seconds:8.1f} {cpu:8.1f} {peak / 1e9:12.2f} "
                   f"{peak / model:11.2f}")  # fmt: skip
            print(f"{row}  {code}{_layers_done(out) if code else ''}", flush=True)
            if bound:
                print(f"    {bound[bound.index('memory bound of') :]}", flush=True)


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def compare() -> None:
    """Sequential vs whole-model ("float") calibration inputs on an 8-layer model that fits."""
    import tempfile

    import torch
    from safetensors.torch import load_file

    from exportlm.export import load_exported, make_input_ids
    from exportlm.stream import export_streaming

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests._stream_models import llama_directory

    with tempfile.TemporaryDirectory(dir="/work/bench-models" if ROOT.is_dir() else None) as tmp:
        root = Path(tmp)
        src = llama_directory(
            root, tied=False, layers=8, hidden_size=256, intermediate_size=512, vocab_size=512
        )
        ids = make_input_ids(512, batch=4, seq=32, seed=3)
        batches = [make_input_ids(512, batch=4, seq=32, seed=s) for s in range(4)]
        outs = {
            m: export_streaming(
                src, root / m, recipe="fp8", calibration=batches, calibration_inputs=m
            )
            for m in ("float", "quantized")
        }  # type: ignore[arg-type]
        a, b = (load_file(outs[m] / "model.safetensors") for m in ("float", "quantized"))
        scales = [k for k in a if k.endswith("input_scale")]
        rel = torch.stack([((b[k] - a[k]).abs() / a[k]).float() for k in scales])
        logits = {m: load_exported("hf_checkpoint", outs[m])(ids).float() for m in outs}
        diff = (logits["quantized"] - logits["float"]).abs()
        print(
            f"input_scale: {len(scales)} scales, relative change max {rel.max():.4f}, mean {rel.mean():.4f}"
        )
        print(
            f"logits: max |seq - whole| {diff.max():.4e}, mean {diff.mean():.4e}, max |whole| {logits['float'].abs().max():.3f}"
        )


def _export_argv(model: Path, out: Path, recipe: str, shard: str, extra: list[str]) -> list[str]:
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model), "--out", str(out)]
    return [*argv, "--quantize", recipe, "-o", f"max_shard_size={shard}", "-o", "overwrite=true",
            *extra, "-v"]  # fmt: skip


def logits(directory: Path, budget: str, shard: str, recipes: list[str]) -> None:
    """Stream each recipe under ``budget`` (whole-model and sequential calibration inputs)
    and export it in memory without a budget; load every checkpoint in the hf_checkpoint
    runtime and compare its logits with the in-memory export's.

    The quantization error of the in-memory export (its logits against the unquantized
    model's) is the tolerance for the sequential calibration: streaming may move the
    logits, but by less than quantizing does. With ``--stream-inputs float`` the shards
    must be the in-memory ones byte for byte, so the logits must not differ at all.

    Every export runs before this process imports torch: a child's ``ru_maxrss`` starts
    at its parent's RSS when it is spawned (Linux keeps the high-water mark across exec).
    """
    model_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    modes = [
        ("in memory", "none", []),
        ("stream, float", budget, ["--max-memory", budget, "--stream-inputs", "float"]),
        ("stream, sequential", budget, ["--max-memory", budget]),
    ]
    rows = []
    for recipe in recipes:
        for mode, limit, extra in modes:
            out = ROOT / f"logits-{recipe}-{mode.replace(', ', '-').replace(' ', '-')}"
            seconds, peak, code, bound, cpu = _child(
                _export_argv(directory, out, recipe, shard, extra), None
            )
            bound_mb = bound.split("memory bound of ")[-1].split(" MB")[0] if bound else "-"
            rows.append((recipe, mode, limit, out, seconds, peak, code, bound_mb, cpu))
            print(f"exported {recipe} {mode}: exit {code}, {seconds:.1f} s, {cpu:.1f} CPU s, "
                  f"peak {peak / 1e6:.0f} MB, bound {bound_mb} MB", file=sys.stderr, flush=True)  # fmt: skip
    _compare_logits(directory, model_bytes, config, budget, shard, rows)


def _compare_logits(
    directory: Path,
    model_bytes: int,
    config: dict[str, Any],
    budget: str,
    shard: str,
    rows: list[tuple[Any, ...]],
) -> None:
    import torch

    from exportlm.cli._model import resolve_model
    from exportlm.export import load_exported, make_input_ids

    ids = make_input_ids(int(config["vocab_size"]), batch=2, seq=32, seed=5)
    with torch.no_grad():
        reference = resolve_model(str(directory)).build()(ids).logits.float()
    print(f"model {model_bytes / 1e9:.2f} GB on disk, {config['num_hidden_layers']} layers; "
          f"stream budget {budget}; output shards {shard}; logits of {tuple(ids.shape)} ids; "
          f"max |logit| of the unquantized model {reference.abs().max():.3f}")  # fmt: skip
    print(f"{'recipe':<9} {'path':<18} {'limit':>6} {'peak MB':>8} {'bound MB':>9} "
          f"{'s':>7} {'CPU s':>7}  {'shards':<9} {'max|d|':>9} {'mean|d|':>9}")  # fmt: skip
    memory: dict[str, Any] = {}
    for recipe, mode, limit, out, seconds, peak, code, bound_mb, cpu in rows:
        if code:
            print(f"{recipe:<9} {mode:<18} failed with exit code {code}")
            continue
        with torch.no_grad():
            got = load_exported("hf_checkpoint", out)(ids).float()
        if mode == "in memory":
            memory[recipe] = (out, got)
            expected, same = reference, "-"
        elif recipe not in memory:
            print(f"{recipe:<9} {mode:<18} no in-memory export to compare with")
            continue
        else:
            expected = memory[recipe][1]
            same = "identical" if _same_shards(memory[recipe][0], out) else "differ"
        diff = (got - expected).abs()
        print(f"{recipe:<9} {mode:<18} {limit:>6} {peak / 1e6:8.0f} {bound_mb:>9} "
              f"{seconds:7.1f} {cpu:7.1f}  {same:<9} {diff.max():9.4f} {diff.mean():9.4f}",
              flush=True)  # fmt: skip
    print("max|d| / mean|d|: logits against the in-memory export's (for the in-memory row: "
          "against the unquantized model's, the quantization error)")  # fmt: skip


def peak(directory: Path, budget: str, shard: str, recipe: str, inputs: str) -> None:
    """One streamed export in this process, with a 10 ms RSS sampler that keeps the peak and
    the main thread's innermost frames at it (where the peak is), and the highest RSS seen
    per innermost frame (the sampler's own cost is in the CPU seconds)."""
    import logging
    import resource
    import threading
    import traceback

    from exportlm.export.hf_checkpoint.stream._memory import resident_bytes
    from exportlm.stream import export_streaming

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("exportlm.quant").setLevel(logging.ERROR)  # AWQ's per-group lines
    main, best, per_frame, done = threading.main_thread().ident, [0, ""], {}, threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            rss, frame = resident_bytes(), sys._current_frames().get(main or 0)
            stack = traceback.extract_stack(frame)[-6:] if frame else []
            where = [
                f"{f.filename.split('/site-packages/')[-1]}:{f.lineno} {f.name}" for f in stack
            ]
            key = where[-1] if where else ""
            per_frame[key] = max(per_frame.get(key, 0), rss)
            if rss > best[0]:
                best[:] = [rss, "\n    ".join(where)]

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    cpu, wall = time.process_time(), time.perf_counter()
    out = ROOT / f"peak-{recipe}-{inputs}"
    export_streaming(directory, out, recipe=recipe, max_memory=budget, max_shard_size=shard,
                     calibration_inputs=inputs, overwrite=True)  # type: ignore[arg-type]  # fmt: skip
    done.set()
    thread.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{time.perf_counter() - wall:.1f} s, {time.process_time() - cpu:.1f} CPU s; sampled "
          f"peak {best[0] / 1e6:.0f} MB (ru_maxrss {maxrss / 1e6:.0f} MB), at\n    {best[1]}")  # fmt: skip
    for key, rss in sorted(per_frame.items(), key=lambda kv: -kv[1])[:6]:
        print(f"{rss / 1e6:6.0f} MB  {key}")


def modelopt(directory: Path, budget: str, shard: str, llmc: Path | None = None) -> None:
    """FP8 of ``directory`` three ways in one run, each in a child process (peak RSS from
    ``wait4``, seconds and CPU seconds with imports included): our stream under ``budget``,
    our in-memory export, and ModelOpt (``from_pretrained`` in bf16, ``mtq.quantize`` with
    ``FP8_DEFAULT_CFG`` on the same calibration ids as ours, ``export_hf_checkpoint`` with
    the same ``max_shard_size``); with ``llmc`` (the python of llm-compressor's venv) a
    fourth: :func:`llmcompressor_child`.
    Like ``logits``, nothing here imports torch before the children run."""
    runs = [
        ("exportlm stream", budget, ["--max-memory", budget], None),
        ("exportlm in memory", "none", [], None),
        ("modelopt 0.47", "none", [], [sys.executable, __file__, "modelopt-child",
                                       "--model", str(directory)]),
    ]  # fmt: skip
    if llmc is not None:
        runs.append(("llm-compressor", "none", [], _llmc_command(llmc, directory)))
    _exporter_rows(directory, budget, shard, runs)


def llmcompressor(directory: Path, shard: str, llmc: Path) -> None:
    """llm-compressor's row of :func:`modelopt` alone: its FP8 export of ``directory`` in a
    child process of ``llmc`` (its venv's python; it is not in ours)."""
    runs = [("llm-compressor", "none", [], _llmc_command(llmc, directory))]
    _exporter_rows(directory, "-", shard, runs)


def _exporter_rows(
    directory: Path, budget: str, shard: str, runs: list[tuple[str, str, list[str], Any]]
) -> None:
    """Run each ``(name, limit, extra exportlm args, command or None)`` in a child and print
    its row; under it, for llm-compressor, the calibration pipeline it logged."""
    model_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"model {model_bytes / 1e9:.2f} GB on disk; stream budget {budget}; shards {shard}")
    print(
        f"{'exporter':<22} {'limit':>6} {'peak MB':>8} {'bound MB':>9} {'s':>7} {'CPU s':>7}  exit"
    )
    for name, limit, extra, command in runs:
        out = ROOT / f"modelopt-row-{name.replace(' ', '-').replace('.', '')}"
        argv = _export_argv(directory, out, "fp8", shard, extra)
        if command is not None:
            command = [*command, "--out", str(out), "--shard-size", shard]
        seconds, peak, code, line, cpu = _child(argv, None, command, marker=_MARKER)
        bound_mb = line.split("memory bound of ")[-1].split(" MB")[0] if _BOUND in line else "-"
        print(f"{name:<22} {limit:>6} {peak / 1e6:8.0f} {bound_mb:>9} {seconds:7.1f} "
              f"{cpu:7.1f}  {code}", flush=True)  # fmt: skip
        if _PIPELINE in line:
            print(f"    {line[line.index(_PIPELINE) :]}", flush=True)


_BOUND = "memory bound of"  # the line our stream logs with its bound
_PIPELINE = "Inferred `"  # the line llm-compressor logs with the pipeline it chose
_MARKER = re.compile(f"{_BOUND}|{_PIPELINE}")
LLMC_PYTHON = Path("/work/main/.venv-engines/llmc/bin/python")


def _llmc_command(python: Path, directory: Path) -> list[str]:
    if not python.is_file():
        raise SystemExit(
            f"no python at {python}: install llm-compressor in a venv of its own "
            "(benchmarks/llmcompressor_env.md) and pass its python with --llmc-python"
        )
    return [str(python), __file__, "llmcompressor-child", "--model", str(directory)]


def modelopt_child(directory: Path, out: Path, shard: str) -> None:
    """ModelOpt's FP8 export of ``directory`` (run by :func:`modelopt` in a child process)."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from exportlm.inputs import make_input_ids

    torch.set_num_threads(1)  # as our exports run here (OMP_NUM_THREADS=1)
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    ids = make_input_ids(int(model.config.vocab_size))  # our default calibration batch

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            m(ids)

    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=out, max_shard_size=shard)


def llmcompressor_child(directory: Path, out: Path, shard: str) -> None:
    """llm-compressor's FP8 export of ``directory`` (run by :func:`modelopt` in a
    child process of llm-compressor's venv): ``from_pretrained`` in bf16, ``oneshot`` with
    ``QuantizationModifier(scheme="FP8")`` (static per-tensor activation scales) calibrated
    on our default calibration ids, ``save_pretrained(save_compressed=True)``."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from loguru import logger
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    try:
        from exportlm.inputs import make_input_ids
    except ImportError:  # llm-compressor's venv has no exportlm: use this checkout's
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from exportlm.inputs import make_input_ids

    logger.add(sys.stderr, level="INFO")  # its log goes to stdout, which _child drops
    torch.set_num_threads(1)  # as our exports run here (OMP_NUM_THREADS=1)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    ids = make_input_ids(int(model.config.vocab_size))  # our default calibration batch
    # oneshot refuses a dataset without a processor, and the model directory has no
    # tokenizer; the ids are tokenized already, so this one is never called.
    unused = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    )
    oneshot(
        model=model,
        processor=unused,
        dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        recipe=QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"]),
        batch_size=ids.shape[0],  # the batch in one forward, as ModelOpt's and ours
        num_calibration_samples=ids.shape[0],
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(out, save_compressed=True, max_shard_size=shard)


def _sampled(call: Any) -> None:
    """``call()`` under a 20 ms RSS sampler (standard library only, so that it runs in any
    venv): prints the sampled peak, the main thread's innermost frames at it, and the
    highest RSS per line of this file that was running (which step of a child peaks)."""
    import resource
    import threading
    import traceback

    page, main, done = os.sysconf("SC_PAGE_SIZE"), threading.main_thread().ident, threading.Event()
    best, per_line = [0, ""], {}

    def sample() -> None:
        while not done.wait(0.02):
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * page
            frame = sys._current_frames().get(main or 0)
            stack = traceback.extract_stack(frame) if frame else []
            line = next(
                (f"line {f.lineno}" for f in reversed(stack) if f.filename == __file__), "?"
            )
            per_line[line] = max(per_line.get(line, 0), rss)
            if rss > best[0]:
                where = [f"{f.filename.split('/site-packages/')[-1]}:{f.lineno} {f.name}"
                         for f in stack[-8:]]  # fmt: skip
                best[:] = [rss, "\n    ".join(where)]

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    call()
    done.set()
    thread.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"sampled peak {best[0] / 1e6:.0f} MB (ru_maxrss {maxrss / 1e6:.0f} MB), at\n    {best[1]}"
    )
    for line, rss in sorted(per_line.items(), key=lambda kv: -kv[1]):
        print(f"{rss / 1e6:6.0f} MB  bench_stream.py {line}")


def outputs(directory: Path, recipes: list[str]) -> None:
    """Logits of ``run --in-memory``'s outputs: the stream's against the in-memory export's,
    and the in-memory export's against the unquantized model (the quantization error, the
    tolerance of the sequential calibration, as in ``logits``)."""
    import torch

    from exportlm.cli._model import resolve_model
    from exportlm.export import load_exported, make_input_ids

    config = json.loads((directory / "config.json").read_text())
    ids = make_input_ids(int(config["vocab_size"]), batch=2, seq=32, seed=5)
    with torch.no_grad():
        reference = resolve_model(str(directory)).build()(ids).logits.float()
    print(f"logits of {tuple(ids.shape)} ids; max |logit| unquantized {reference.abs().max():.3f}")
    for recipe in recipes:
        memory = ROOT / f"out-{directory.name}-in-memory-{recipe}"
        stream = ROOT / f"out-{directory.name}-stream-{recipe}"
        with torch.no_grad():
            ours = load_exported("hf_checkpoint", memory)(ids).float()
            quant = (ours - reference).abs()
            streamed = load_exported("hf_checkpoint", stream)(ids).float()
        diff = (streamed - ours).abs()
        same = "identical" if _same_shards(memory, stream) else "differ"
        print(f"{recipe}: in memory vs unquantized max {quant.max():.4f} mean {quant.mean():.4f}; "
              f"stream vs in memory max {diff.max():.4f} mean {diff.mean():.4f}; shards {same}")  # fmt: skip


def _same_shards(a: Path, b: Path) -> bool:
    """The same ``.safetensors`` files and index, byte for byte (the manifests differ:
    a streamed one has no model hash)."""
    names = sorted(p.name for p in a.iterdir() if p.name != "exportlm-manifest.json")
    other = sorted(p.name for p in b.iterdir() if p.name != "exportlm-manifest.json")
    return names == other and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command",
        choices=(
            "build",
            "run",
            "compare",
            "logits",
            "peak",
            "modelopt",
            "modelopt-child",
            "llmcompressor",
            "llmcompressor-child",
            "outputs",
        ),
    )
    parser.add_argument("--out", type=Path, help="*-child: the output directory")
    parser.add_argument(
        "--llmcompressor", action="store_true", help="modelopt: add llm-compressor's row"
    )
    parser.add_argument(
        "--llmc-python", type=Path, default=LLMC_PYTHON, help="the python of llm-compressor's venv"
    )
    parser.add_argument("--model", type=Path, default=ROOT / "llama-3b")
    parser.add_argument(
        "--small", action="store_true", help="build: the 0.98 GB 8-layer model (give --model)"
    )
    parser.add_argument(
        "--moe", action="store_true", help="build: the 0.98 GB Mixtral-layout MoE (give --model)"
    )
    parser.add_argument(
        "--layers", type=int, help="build: num_hidden_layers instead of the config's (28 or 8)"
    )
    parser.add_argument("--max-memory", default="3GB")
    parser.add_argument("--shard-size", default="200MB", help="the exports' max_shard_size")
    parser.add_argument("--in-memory", action="store_true")
    parser.add_argument("--recipes", default="fp8,int4_awq", help="peak: one recipe")
    parser.add_argument("--stream-inputs", default="quantized", choices=("quantized", "float"))
    parser.add_argument(
        "--sample", action="store_true", help="llmcompressor-child: where its RSS peaks"
    )
    parser.add_argument("--timeout", type=float, help="kill each export after this many seconds")
    args = parser.parse_args()
    if args.command == "build":
        config = MOE if args.moe else SMALL if args.small else CONFIG
        if args.layers is not None:
            if args.layers < 1:
                parser.error(f"--layers must be at least 1, got {args.layers}")
            config = config | {"num_hidden_layers": args.layers}
        build(args.model, config, SMALL_SHARD if args.small or args.moe else SHARD)
    elif args.command == "run":
        run(
            args.model,
            args.max_memory,
            args.shard_size,
            args.in_memory,
            args.recipes.split(","),
            args.timeout,
        )
    elif args.command == "peak":
        peak(args.model, args.max_memory, args.shard_size, args.recipes, args.stream_inputs)
    elif args.command == "modelopt":
        llmc = args.llmc_python if args.llmcompressor else None
        modelopt(args.model, args.max_memory, args.shard_size, llmc)
    elif args.command == "llmcompressor":
        llmcompressor(args.model, args.shard_size, args.llmc_python)
    elif args.command == "modelopt-child":
        modelopt_child(args.model, args.out, args.shard_size)
    elif args.command == "llmcompressor-child" and args.sample:
        _sampled(lambda: llmcompressor_child(args.model, args.out, args.shard_size))
    elif args.command == "llmcompressor-child":
        llmcompressor_child(args.model, args.out, args.shard_size)
    elif args.command == "outputs":
        outputs(args.model, args.recipes.split(","))
    elif args.command == "logits":
        logits(args.model, args.max_memory, args.shard_size, args.recipes.split(","))
    else:
        compare()


if __name__ == "__main__":
    main()
