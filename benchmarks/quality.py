"""What quantization costs on a real model: exportlm beside ModelOpt and llm-compressor.

One run, for each recipe: exportlm exports the real model (``tests/_real_model.py``:
bf16 SmolLM2-135M-Instruct) from its directory with the CLI exactly as a user does
(``python -m exportlm export --target hf_checkpoint --model DIR --quantize RECIPE
--calib-data FILE --calib-samples N --calib-seq-len L --out OUT``); ModelOpt 0.47 (this
venv) and llm-compressor 0.14 (its own venv, ``--llmc-python``) quantize and export the
same model on the very ``input_ids`` rows our CLI calibrates on (computed here with
exportlm's ``calibration_batches``, saved for the children). Each producer's export is a
child process of its own: its wall seconds (imports and loading included) and its peak
RSS are its own. Then each model is measured with one set of functions
(``_quality_metrics``): the fake-quantized model in memory (ours: the library's
``quantize`` on the same batches, in a child of its own) and the checkpoint read back by
exportlm's ``hf_checkpoint`` runtime (ours, and ModelOpt's).

Texts (``benchmarks/data/README.md``): perplexity on ``eval.txt`` (chapters I-IV of
*Alice's Adventures in Wonderland*), calibration on ``calibration.txt`` (*Pride and
Prejudice*, one 511-token sample a line, so N samples are N rows of 512 tokens).

``--memory-row`` adds the FP8 export at ``--memory-samples`` x ``--memory-seq-len``
(128 x 512) by each producer, export only: seconds and peak RSS.
``--float32-matmuls`` runs every producer's calibration and every evaluation with
exportlm's float32 matmuls forced (``EXPORTLM_FLOAT32_GEMM=1``): each CPU bfloat16 matmul
on float32 copies, rounded to bfloat16. On a CPU without AVX512-BF16 or AMX, where a
bfloat16 GEMM is about 9x slower than a float32 one, ModelOpt's calibration otherwise takes
hours; with it, every producer computes with the same arithmetic (not llm-compressor,
whose venv has no exportlm: refused).
``--markdown results.json`` prints the table of docs/quality.md from a finished run.

Usage::

    python benchmarks/quality.py --samples 32 --seq-len 512 --out results.json --memory-row
    python benchmarks/quality.py --samples 4 --seq-len 128 --recipes fp8 --peers exportlm
    python benchmarks/quality.py --markdown results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _quality_metrics import (  # noqa: E402
    FLOAT32_MATMULS,
    float32_matmuls,
    hf_logits,
    load_data,
    measure,
    write_result,
)
from _quality_peers import supports  # noqa: E402
from _quality_report import markdown  # noqa: E402

RECIPES = (
    "fp8",
    "fp8+fp8_kv",
    "fp8_dynamic",
    "int8_sq",
    "w8a8",
    "int8_wo",
    "int4_awq:group_size=64",
    "nvfp4",
    "int4_gptq:group_size=64",
    "int8_gptq",
    "w4a8_awq:group_size=64",
    "fp8_block:group_size=64",
    "mxfp8",
    "mxfp4",
    "w4afp8:group_size=64",
)
PEERS = ("exportlm", "modelopt", "llmcompressor")
LLMC_PYTHON = Path(
    os.environ.get("EXPORTLM_ENGINE_LLMCOMPRESSOR")
    or ROOT / ".venv-engines" / "llmcompressor" / "bin" / "python"
)
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "Give me three tips for staying healthy.",
)
NEW_TOKENS = 32
#: Export options a recipe needs, as the CLI's refusal tells a user: ``w8a8`` exists in
#: compressed-tensors' layout only (the default layout is ModelOpt's); ``int4_gptq`` and
#: ``int8_gptq`` in that layout, the one vLLM loads, keep bf16 scales as llm-compressor's;
#: ``fp8_block`` in compressed-tensors' layout (ModelOpt's FP8_PB_WO holds blocks of 128 only).
RECIPE_OPTIONS = {
    "w8a8": ["-o", "format=compressed-tensors"],
    "int4_gptq": ["-o", "format=compressed-tensors"],
    "int8_gptq": ["-o", "format=compressed-tensors"],
    "fp8_block": ["-o", "format=compressed-tensors"],
    "w4afp8": ["-o", "format=compressed-tensors"],
}
#: Every child runs with the same threads (the machine's cores are shared).
CHILD_ENV = {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def prepare(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    """Calibration batches as our CLI builds them, evaluation ids, prompts, the bf16 row."""
    from transformers import AutoModelForCausalLM

    from exportlm.calibration import calibration_batches, load_calibration_texts
    from exportlm.calibration._tokenizer import load_local_tokenizer

    tokenizer = load_local_tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def batches(samples: int, seq_len: int) -> list[torch.Tensor]:
        texts = load_calibration_texts(args.calib_data, samples)
        return [b.clone() for b in calibration_batches(texts, tokenizer, vocab, seq_len)]

    eval_ids = torch.tensor(tokenizer(args.eval_data.read_text(encoding="utf-8"))["input_ids"])
    prompts = [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
        )
        for p in PROMPTS[: args.prompts]
    ]  # fmt: skip
    data: dict[str, Any] = {
        "eval_ids": eval_ids[: args.eval_tokens] if args.eval_tokens else eval_ids,
        "window": args.window,
        "prompts": prompts,
        "batches": batches(args.samples, args.seq_len),
    }
    baseline = None
    if args.recipes:  # the bf16 reference answers and row (not needed by the memory row)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        with float32_matmuls():
            data["answers"] = [_greedy_answer(model, p) for p in prompts]
        baseline = measure(hf_logits(model), data)
    torch.save(data, work / "run.pt")
    if args.memory_row:
        torch.save(
            {**data, "batches": batches(args.memory_samples, args.memory_seq_len)},
            work / "memory.pt",
        )
    return {
        "bf16": baseline,
        "calibration": _shape(data["batches"]),
        "eval_tokens": len(data["eval_ids"]),
    }


def _greedy_answer(model: Any, prompt: torch.Tensor) -> list[int]:
    """The bf16 model's greedy answer (``generate`` with its KV cache: the reference only)."""
    with torch.no_grad():
        out = model.generate(
            prompt.unsqueeze(0), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


def _shape(batches: list[torch.Tensor]) -> dict[str, int]:
    return {"rows": sum(len(b) for b in batches), "tokens": sum(b.numel() for b in batches)}


def _child(command: list[str], log: Path) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of ``command`` alone (``wait4``)."""
    start = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **CHILD_ENV}
        )
        _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1].strip()[:300]


def run_ours(
    args: argparse.Namespace, model_dir: Path, recipe: str, data: Path, out: Path, evaluate: bool
) -> dict[str, Any]:
    """Our CLI's export (timed alone), then our in-memory model and checkpoint measured."""
    batches = torch.load(data, weights_only=True)["batches"]
    samples = args.memory_samples if data.name == "memory.pt" else args.samples
    seq_len = int(batches[0].shape[1])
    command = [
        sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint",
        "--model", str(model_dir), "--quantize", recipe, "--calib-data", str(args.calib_data),
        "--calib-samples", str(samples), "--calib-seq-len", str(seq_len), "--out", str(out), "-q",
        *RECIPE_OPTIONS.get(recipe.split(":")[0].split("+")[0], []),
    ]  # fmt: skip
    log = out.with_suffix(".log")
    seconds, rss, code = _child(command, log)
    result: dict[str, Any] = {"export_s": seconds, "peak_rss": rss, "command": _spell(command)}
    if code:
        return {**result, "error": f"exit {code}: {_tail(log)}"}
    if evaluate:
        extra = () if args.ours_memory else ("--skip-memory",)
        result.update(_run_child("ours-eval", model_dir, recipe, data, out, *extra))
    return result


def _spell(command: list[str]) -> str:
    return " ".join(["python", *command[1:]])


def _run_child(
    peer: str, model_dir: Path, recipe: str, data: Path, out: Path, *extra: str
) -> dict[str, Any]:
    """Run a child that writes its own result JSON; its failure becomes the cell's error."""
    result_file = out.with_suffix(f".{peer}.json")
    log = out.with_suffix(f".{peer}.log")
    if peer == "ours-eval":
        command = [sys.executable, __file__, "_ours-eval"]
    elif peer == "modelopt":
        command = [sys.executable, str(HERE / "_quality_peers.py"), peer]
    else:
        command = [str(LLMC_PYTHON), str(HERE / "_quality_peers.py"), peer]
    command += ["--model", str(model_dir), "--recipe", recipe, "--data", str(data)]
    command += [
        "--out",
        str(out),
        "--result",
        str(result_file),
        "--spawned",
        str(time.time()),
        *extra,
    ]
    _, rss, code = _child(command, log)
    result: dict[str, Any] = json.loads(result_file.read_text()) if result_file.exists() else {}
    result["child_peak_rss"] = rss  # the whole child's, its evaluations included
    if code:
        result["error"] = f"exit {code}: {_tail(log)}"
    return result


def ours_eval(args: argparse.Namespace) -> None:
    """Child: the library's ``quantize`` on the same batches, measured; then our checkpoint."""
    from _quality_metrics import guarded
    from transformers import AutoModelForCausalLM

    import exportlm
    from exportlm.calibration import calibrate_with
    from exportlm.quant import quantize

    data = load_data(args.data)
    result: dict[str, Any] = {}
    try:
        if not args.skip_memory:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
            quantize(model, args.recipe, calibrate=calibrate_with(data["batches"]))
            result["mem"] = guarded(result, "mem_error", lambda: measure(hf_logits(model), data))
        run = guarded(
            result, "ckpt_error", lambda: exportlm.load_exported("hf_checkpoint", args.out)
        )
        if run is not None:
            result["ckpt"] = guarded(result, "ckpt_error", lambda: measure(run, data))
    finally:
        write_result(args.result, result)


def cell(
    args: argparse.Namespace,
    model_dir: Path,
    peer: str,
    recipe: str,
    data: Path,
    work: Path,
    evaluate: bool,
) -> dict[str, Any]:
    if peer != "exportlm" and not supports(peer, recipe):
        return {"absent": True}
    slug = recipe.replace(":", "_").replace("=", "").replace("+", "_").replace(".", "")
    out = work / f"{peer}-{slug}-{data.stem}"
    print(f"[{time.strftime('%H:%M:%S')}] {recipe} / {peer} ...", flush=True)
    if peer == "exportlm":
        return run_ours(args, model_dir, recipe, data, out, evaluate)
    if peer == "llmcompressor" and not LLMC_PYTHON.exists():
        return {"error": f"no llm-compressor venv at {LLMC_PYTHON} (make engines)"}
    extra = () if evaluate else ("--no-eval",)
    return _run_child(peer, model_dir, recipe, data, out, *extra)


def run(args: argparse.Namespace) -> None:
    from tests._real_model import real_model_dir

    model_dir = Path(real_model_dir())
    started = time.time()
    if args.float32_matmuls:  # this process's evaluations, and every child's (inherited)
        os.environ.update({FLOAT32_MATMULS: "1", "EXPORTLM_FLOAT32_GEMM": "1"})
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # a fresh path: made, not a traceback
    with tempfile.TemporaryDirectory(prefix="quality-", dir=args.workdir) as tmp:
        work = Path(tmp)
        results: dict[str, Any] = {"meta": _meta(args, model_dir), "rows": []}
        if args.data_from:  # another run's evaluation data, answers and bf16 row
            shutil.copy(args.data_from, work / "run.pt")
            previous = json.loads(args.data_from.with_suffix(".json").read_text())["meta"]
            results["meta"].update({k: previous[k] for k in ("bf16", "calibration", "eval_tokens")})
        else:
            results["meta"].update(prepare(args, model_dir, work))
        print(f"bf16: {results['meta']['bf16']}", flush=True)
        plan = [(r, work / "run.pt", True) for r in args.recipes]
        if args.memory_row:
            plan.append(("fp8", work / "memory.pt", False))
        for recipe, data, evaluate in plan:
            for peer in args.peers:
                row = cell(args, model_dir, peer, recipe, data, work, evaluate)
                row.update(recipe=recipe, producer=peer, memory_row=not evaluate)
                results["rows"].append(row)
                print(f"    {json.dumps(row)[:400]}", flush=True)
                results["meta"]["wall_s"] = time.time() - started
                args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")


def _meta(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "transformers", "nvidia-modelopt"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "command": " ".join(["python", "benchmarks/quality.py", *sys.argv[1:]]),
        "model": model_dir.name,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "memory_samples": args.memory_samples if args.memory_row else None,
        "memory_seq_len": args.memory_seq_len if args.memory_row else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "load_at_start": os.getloadavg()[0],
        "float32_matmuls": args.float32_matmuls,
        "versions": versions,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def split_recipes(text: str) -> list[str]:
    """The recipes of ``--recipes``: split at commas, where a ``KEY=VALUE`` part with no
    ``:`` before its ``=`` continues the recipe before it (``a:x=1,y=2,b`` is two)."""
    recipes: list[str] = []
    for part in text.split(","):
        key, eq, _ = part.partition("=")
        if recipes and eq and ":" not in key:
            recipes[-1] += "," + part
        elif part and part != "none":
            recipes.append(part)
    return recipes


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32, help="calibration samples (lines)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument(
        "--recipes",
        type=split_recipes,
        default=list(RECIPES),
        help="comma-separated recipes ('none' with --memory-row: the memory row alone); a "
        "KEY=VALUE after a comma is one more option of the recipe before it "
        "('int4_awq:group_size=64,clip=true' is one recipe)",
    )
    p.add_argument("--peers", type=lambda s: s.split(","), default=list(PEERS))
    p.add_argument("--out", type=Path, default=Path("quality-results.json"))
    p.add_argument("--markdown", type=Path, metavar="RESULTS", help="print the table of RESULTS")
    p.add_argument("--memory-row", action="store_true", help="add the FP8 memory row")
    p.add_argument("--memory-samples", type=int, default=128)
    p.add_argument("--memory-seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=0, help="first N eval tokens (0: all)")
    p.add_argument("--window", type=int, default=512, help="perplexity window")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts used")
    p.add_argument("--calib-data", type=Path, default=HERE / "data" / "calibration.txt")
    p.add_argument("--eval-data", type=Path, default=HERE / "data" / "eval.txt")
    p.add_argument(
        "--no-ours-memory",
        dest="ours_memory",
        action="store_false",
        help="measure our checkpoint only, not the library's in-memory model (slow)",
    )
    p.add_argument(
        "--data-from",
        type=Path,
        metavar="RUN.pt",
        help="reuse another run's data (RUN.json beside it: its results, for the bf16 row)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (a temp dir)")
    p.add_argument(
        "--float32-matmuls",
        action="store_true",
        help="every producer's calibration and every evaluation multiplies bf16 matrices on "
        "float32 copies rounded to bf16 (exportlm's float32 matmuls, forced): on a CPU "
        "without AVX512-BF16 or AMX the peers' bf16 calibrations take hours without it",
    )
    args = p.parse_args()
    if args.float32_matmuls and "llmcompressor" in args.peers:
        p.error(
            "--float32-matmuls runs exportlm's float32 matmuls inside each producer, and "
            "llm-compressor's venv has no exportlm: pass --peers exportlm,modelopt"
        )
    return args


def _child_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--data", "--out", "--result"):
        p.add_argument(flag, type=Path, required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--spawned", type=float)
    p.add_argument("--skip-memory", action="store_true")
    return p.parse_args(sys.argv[2:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["_ours-eval"]:
        ours_eval(_child_args())
    else:
        parsed = _args()
        if parsed.markdown:
            print(markdown(json.loads(parsed.markdown.read_text())))
        else:
            run(parsed)
