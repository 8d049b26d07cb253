"""How far vLLM's bfloat16 answers move from the float32 eager model, beside torch's own bfloat16.

The served comparison (``exportlm.engines.serve_and_compare``) states, per engine and
compute dtype, a tolerance on teacher-forced log-probabilities and the largest eager
top-2 margin that the engine's rounding may swap (the engine record's ``tolerances``, ``Engine.tolerance``).
This measures both for a bfloat16 checkpoint on this CPU, so the stated numbers rest on
a measurement anyone can repeat:

- the toy Llama of the engine tests (``initializer_range=0.3``, seed 0) is exported as a
  bfloat16 checkpoint; the reference is the float32 model on the same bf16-rounded
  weights, each sequence alone and unpadded;
- ``--prompts`` seeded prompts (lengths 3, 7, 12 in turn), each followed by the eager
  model's 8 greedy tokens, are scored by vLLM teacher-forced over the whole vocabulary
  (``prompt_logprobs``), and by torch computing the same model in bfloat16 on this CPU
  (an independent bf16 computation: what bf16 rounding alone does here);
- printed for each: the largest |logprob error| of the given prompt tokens (what the
  comparison's tolerance bounds), the largest move of the eager top-2 margin at the
  greedy steps (what decides whether a greedy token may swap), and how many greedy steps
  vLLM's own decoding swapped, with the largest eager margin it swapped.

With ``--real-model`` the model is SmolLM2-135M-Instruct (``tests/_real_model.py``),
exported as ``tests/test_served_real_model.py`` exports it (``--recipe w8a8``: its
compressed-tensors W8A8, calibrated on that file's lines), and the prompts are that
file's chat questions; the reference is the checkpoint read back in float32
(``load_exported``), torch's bf16 the same read back in bfloat16. vLLM then scores the
top 20 of each position (not the whole vocabulary), so a margin's move is counted
where both of eager's top-2 are among them.

Nothing is timed; the numbers depend on the CPU's kernels (they are measured, not
derived), so run it on the machine whose numbers you want::

    EXPORTLM_ENGINE_VLLM=$PWD/.venv-engines/vllm/bin/python \\
        .venv/bin/python benchmarks/engine_bf16_error.py [--prompts 30] [--json out.json]
    EXPORTLM_ENGINE_VLLM=$PWD/.venv-engines/vllm/bin/python \\
        .venv/bin/python benchmarks/engine_bf16_error.py --real-model --recipe w8a8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import exportlm
from exportlm.engines import find_interpreter, get_engine
from exportlm.engines.reference import FIRST_ID, NEW_TOKENS, PROMPT_LENGTHS, eager_reference
from exportlm.models import tiny_hf_model

#: What the vLLM interpreter runs: teacher-forced logprobs over the whole vocabulary,
#: then its own greedy decoding of the prompts. Reads and writes JSON on stdin/stdout.
_VLLM = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
req = json.load(sys.stdin)
llm = LLM(model=req["artifact"], skip_tokenizer_init=True, dtype="bfloat16",
          enforce_eager=True, seed=0, max_logprobs=-1, trust_remote_code=False)
scored = llm.generate([{"prompt_token_ids": s} for s in req["seqs"]],
                      SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                     prompt_logprobs=req["vocab"]), use_tqdm=False)
decoded = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=req["new_tokens"],
                                      ignore_eos=True, detokenize=False), use_tqdm=False)
out = {
    "version": __import__("vllm").__version__,
    "logprobs": [[{int(k): float(v.logprob) for k, v in step.items()}
                  for step in o.prompt_logprobs[1:]] for o in scored],
    "tokens": [list(o.outputs[0].token_ids) for o in decoded],
}
sys.stdout.write("\n@@RESULT@@" + json.dumps(out))
"""


def _model() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0, initializer_range=0.3).eval()


def _log_softmax(model: torch.nn.Module, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([seq]))
        logits = getattr(out, "logits", out)[0].double()  # a module's output, or a runtime's
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()  # row i: p(token i+1 | ..i)


def _stats(
    eager: list[np.ndarray],
    other: list[np.ndarray],
    seqs: list[list[int]],
    prompts: list[list[int]],
) -> dict[str, float]:
    given, shift = [], []
    for e, o, seq, prompt in zip(eager, other, seqs, prompts):
        n = len(prompt) - 1  # rows 0..n-1 score prompt tokens 1..n
        tokens = np.array(seq[1:])
        err = np.abs(o[np.arange(len(tokens)), tokens] - e[np.arange(len(tokens)), tokens])
        given.extend(err[:n].tolist())
        for i in range(n, len(tokens)):  # greedy steps: the top-2 margin's move
            a, b = np.argsort(-e[i])[:2]
            moved = abs((e[i, a] - e[i, b]) - (o[i, a] - o[i, b]))
            if moved == moved:  # NaN: one of the two is not among the engine's scored top-k
                shift.append(moved)
    g, s = np.array(given), np.array(shift or [float("nan")])
    return {
        "given_max": float(g.max()),
        "given_p99": float(np.percentile(g, 99)),
        "margin_shift_max": float(s.max()),
        "margin_shift_p99": float(np.percentile(s, 99)),
        "positions": float(len(g)),
        "steps": float(len(s)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument(
        "--recipe",
        help="quantize first (e.g. w8a8) and export compressed-tensors; the reference is the "
        "fake-quantized model in float32 (no torch bf16 comparison then)",
    )
    parser.add_argument(
        "--real-model",
        action="store_true",
        help="SmolLM2-135M-Instruct on tests/test_served_real_model.py's chat prompts",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    found = find_interpreter("vllm")
    if found.path is None:
        print(f"vLLM not found: {found.reason} (run `make engines`)", file=sys.stderr)
        return 2

    if args.real_model:
        return _real_model(args, found.path)
    model = _model()
    if args.recipe:
        from exportlm.quant import quantize

        model = quantize(model, args.recipe)
        eager_model, bf16_model = model, None
    else:
        eager_model = _model()
        with torch.no_grad():
            for p in eager_model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        bf16_model = _model().to(torch.bfloat16)
    vocab = int(model.config.vocab_size)

    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(FIRST_ID, vocab, size=PROMPT_LENGTHS[i % 3])]
        for i in range(args.prompts)
    ]
    ref = eager_reference(eager_model, prompts)
    seqs = [p + t for p, t in zip(prompts, ref.tokens)]
    eager = [_log_softmax(eager_model, s) for s in seqs]
    torch_bf16 = None if bf16_model is None else [_log_softmax(bf16_model, s) for s in seqs]

    with tempfile.TemporaryDirectory() as tmp:
        options: dict[str, Any] = (
            {"format": "compressed-tensors"} if args.recipe else {"dtype": "bfloat16"}
        )
        artifact = exportlm.export_model("hf_checkpoint", model, Path(tmp) / "ckpt", **options)
        request = {
            "artifact": str(artifact),
            "seqs": seqs,
            "prompts": prompts,
            "vocab": vocab,
            "new_tokens": NEW_TOKENS,
        }
        got = _run_vllm(found.path, request)
    if got is None:
        return 1
    vllm = _matrices(got, vocab)
    what = f"{args.recipe} compressed-tensors" if args.recipe else "plain bfloat16 checkpoint"
    return _report(args, what, ref, got, eager, vllm, torch_bf16, seqs, prompts)


def _run_vllm(python: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(get_engine("vllm").env)  # as the served comparison runs it
    proc = subprocess.run(
        [str(python), "-E", "-s", "-c", _VLLM],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0 or "@@RESULT@@" not in proc.stdout:
        print(proc.stderr[-4000:], file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.rsplit("@@RESULT@@", 1)[1])
    return result


def _matrices(got: dict[str, Any], vocab: int) -> list[np.ndarray]:
    out = []
    for rows in got["logprobs"]:
        m = np.full((len(rows), vocab), np.nan)
        for i, step in enumerate(rows):
            for k, v in step.items():
                m[i, int(k)] = v
        out.append(m)
    return out


def _real_model(args: argparse.Namespace, python: Path) -> int:
    """SmolLM2 exported as the real-model served tests export it, on their chat prompts."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exportlm.cli import main as cli
    from tests._real_model import real_model_dir
    from tests.test_served_real_model import CALIBRATION, QUESTIONS, chat_ids, export_argv

    directory = real_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = [chat_ids(tokenizer, question) for question in QUESTIONS]
    kind = {None: "bf16", "w8a8": "w8a8"}.get(args.recipe)
    if kind is None:
        print(f"--real-model takes --recipe w8a8 or none, not {args.recipe!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "calib.txt"
        data.write_text("\n".join(CALIBRATION) + "\n")
        artifact = Path(tmp) / "ckpt"
        if cli([*export_argv(kind, directory, data), "--out", str(artifact)]) != 0:
            return 1
        if args.recipe:
            eager_model = exportlm.load_exported("hf_checkpoint", artifact, dtype="float32")
            bf16_model = exportlm.load_exported("hf_checkpoint", artifact, dtype="bfloat16")
        else:
            load = AutoModelForCausalLM.from_pretrained
            eager_model = load(directory, dtype=torch.float32, attn_implementation="eager")
            bf16_model = load(directory, dtype=torch.bfloat16, attn_implementation="eager")
        ref = eager_reference(eager_model, prompts)
        seqs = [p + t for p, t in zip(prompts, ref.tokens)]
        eager = [_log_softmax(eager_model, s) for s in seqs]
        torch_bf16 = [_log_softmax(bf16_model, s) for s in seqs]
        request = {
            "artifact": str(artifact),
            "seqs": seqs,
            "prompts": prompts,
            "vocab": 20,
            "new_tokens": NEW_TOKENS,
        }
        got = _run_vllm(python, request)
    if got is None:
        return 1
    vocab = eager[0].shape[-1]
    what = f"SmolLM2-135M-Instruct, {args.recipe or 'plain bfloat16'} checkpoint"
    return _report(args, what, ref, got, eager, _matrices(got, vocab), torch_bf16, seqs, prompts)


def _report(
    args: argparse.Namespace,
    what: str,
    ref: Any,
    got: dict[str, Any],
    eager: list[np.ndarray],
    vllm: list[np.ndarray],
    torch_bf16: list[np.ndarray] | None,
    seqs: list[list[int]],
    prompts: list[list[int]],
) -> int:
    swaps = [
        (ref.margins[r][i], r, i)
        for r, (g, w) in enumerate(zip(got["tokens"], ref.tokens))
        for i, (a, b) in enumerate(zip(g, w))
        if a != b and all(x == y for x, y in zip(g[:i], w[:i]))  # the first divergence of the row
    ]
    result: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "vllm": got["version"],
        "model": what,
        "prompts": len(prompts),
        "eager_min_margin": ref.min_margin,
        "vllm_bf16": _stats(eager, vllm, seqs, prompts),
        "recipe": args.recipe,
        "torch_bf16": None if torch_bf16 is None else _stats(eager, torch_bf16, seqs, prompts),
        "vllm_rows_diverged": len(swaps),
        "vllm_largest_swapped_margin": max((s[0] for s in swaps), default=0.0),
    }
    print(f"{what}: {len(prompts)} prompts x {NEW_TOKENS} greedy tokens; vLLM {got['version']}")
    print(f"{'':12} {'given max':>10} {'given p99':>10} {'shift max':>10} {'shift p99':>10}")
    for name in ("vllm_bf16", "torch_bf16"):
        s = result[name]
        if s is None:
            continue
        print(
            f"{name:12} {s['given_max']:10.3f} {s['given_p99']:10.3f} "
            f"{s['margin_shift_max']:10.3f} {s['margin_shift_p99']:10.3f}"
        )
    print(
        f"vLLM's greedy rows that diverged: {len(swaps)} of {len(prompts)}; largest eager "
        f"margin swapped {result['vllm_largest_swapped_margin']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
